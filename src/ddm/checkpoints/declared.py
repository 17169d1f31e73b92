"""What a stage checkpoint declares about itself: the ``"_ddm"`` block of its config.json.

Read without NumPy or any ML framework, so that ``ddm up`` can compare the stages' state
shapes before it starts a server, and the fetcher can verify a fetched stage checkpoint
(``ddm.checkpoints.verify``); ``ddm.models.stages`` loads and checks the whole block.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

# The role names, re-exported where the declaration is read; their home is the registry.
from ddm.checkpoints.roles import DECODER as DECODER
from ddm.checkpoints.roles import EXPERT as EXPERT
from ddm.checkpoints.roles import ROLE_REGISTRY, stage_roles
from ddm.checkpoints.roles import ROUTER as ROUTER
from ddm.checkpoints.roles import TEXT_ENCODER as TEXT_ENCODER
from ddm.fileio import open_regular

#: The key of a component's config.json under which we declare what the stage is;
#: diffusers and transformers ignore (or keep) keys that start with ``_``.
DDM_KEY = "_ddm"
#: The roles a stage checkpoint declares (``_ddm.role``), as the role registry
#: (:mod:`ddm.checkpoints.roles`) declares them.
ROLES = tuple(ROLE_REGISTRY)
#: A DDM's stages besides its experts (what ``ddm serve stage`` serves), by role.
STAGE_ROLES = tuple(role.name for role in stage_roles())
#: Their names in a deployment plan (``DDMSpec.stages``) and the objects it makes (DNS labels:
#: no ``_``), and their keys in router.yaml.
PLAN_NAMES = {role.name: role.plan_name for role in stage_roles()}
CONFIG_KEYS = {role.name: role.config_key for role in stage_roles()}
#: A component's config.json is a few kilobytes (a router's text prior, ~270 KB for the text2img
#: DDM's 64 x 128 projection); a larger one is refused unread.
MAX_CONFIG_BYTES = 1 << 20
#: ``_ddm.files``: name -> SHA-256 of every file of the stage besides config.json (what a
#: fetch of its directory downloads and verifies); names are plain file names, at most this
#: many (a tokenizer has six files).
FILES_KEY = "files"
MAX_DECLARED_FILES = 32
FILE_NAME_PATTERN = re.compile(r"[A-Za-z0-9_][-A-Za-z0-9_.]{0,127}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def load_config_json(path: Path, limit: int = MAX_CONFIG_BYTES) -> Any:
    """The JSON in ``path`` (a component's config.json, which a checkpoint store sent), read
    only when a regular file (:func:`ddm.fileio.open_regular`: no link followed) of at most
    ``limit`` bytes; ``ValueError`` naming the file and saying why it is unreadable (a link,
    too large, not UTF-8, not JSON, nested past the parser's recursion limit)."""
    with open_regular(path) as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is larger than {limit} bytes")
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{path} nests its JSON too deeply to read") from None


def read_declaration(directory: Path) -> dict[str, Any] | None:
    """The ``_ddm`` block of ``directory``'s config.json; None where it declares none (a
    label checkpoint) or config.json is missing or unreadable (:func:`load_config_json`;
    whoever loads the checkpoint refuses it then, saying why)."""
    path = directory / "config.json"
    if not path.is_file():
        return None
    try:
        config = load_config_json(path)
    except ValueError:
        return None
    block = config.get(DDM_KEY) if isinstance(config, dict) else None
    return block if isinstance(block, dict) else None


def declared_latent_shape(directory: Path) -> tuple[int, ...] | None:
    """The ``latent_shape`` the checkpoint in ``directory`` declares, or None where it declares
    none."""
    shape = (read_declaration(directory) or {}).get("latent_shape")
    if not isinstance(shape, list) or not all(isinstance(n, int) for n in shape):
        return None
    return tuple(shape)


def declared_files(directory: Path, declared: dict[str, Any]) -> dict[str, str]:
    """``_ddm.files`` checked: plain file names (not config.json) -> lower-case hex SHA-256;
    raises ``ValueError`` naming what is wrong."""
    files = declared.get(FILES_KEY)
    if not isinstance(files, dict) or not 1 <= len(files) <= MAX_DECLARED_FILES:
        raise ValueError(f"{directory}: config.json's {DDM_KEY}.{FILES_KEY} must map 1.."
                         f"{MAX_DECLARED_FILES} file names to their SHA-256 (ddm import "
                         "writes it)")
    for name, digest in files.items():
        if (not isinstance(name, str) or not FILE_NAME_PATTERN.fullmatch(name)
                or name == "config.json" or not isinstance(digest, str)
                or not SHA256_HEX.fullmatch(digest)):
            raise ValueError(f"{directory}: {DDM_KEY}.{FILES_KEY} has {name!r}: {digest!r}; "
                             "expected a plain file name and 64 lower-case hex digits")
    return dict(files)
