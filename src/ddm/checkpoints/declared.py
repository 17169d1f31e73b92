"""What a stage checkpoint declares about itself: the ``"_ddm"`` block of its config.json.

Read without NumPy or any ML framework, so that ``ddm up`` can compare the stages' state
shapes before it starts a server, and the fetcher can verify a fetched stage checkpoint
(``ddm.checkpoints.verify``); ``ddm.models.stages`` loads and checks the whole block.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The key of a component's config.json under which we declare what the stage is;
#: diffusers and transformers ignore (or keep) keys that start with ``_``.
DDM_KEY = "_ddm"
#: A stage's config.json is a few kilobytes; a larger one is not read here.
MAX_DECLARATION_BYTES = 1 << 20


def read_declaration(directory: Path) -> dict[str, Any] | None:
    """The ``_ddm`` block of ``directory``'s config.json; None where it declares none (a
    label checkpoint) or config.json is missing, too large or not JSON (whoever loads the
    checkpoint refuses it then, saying why)."""
    path = directory / "config.json"
    if not path.is_file() or path.stat().st_size > MAX_DECLARATION_BYTES:
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
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
