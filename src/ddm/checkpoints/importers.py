"""Write an imported DDM: one stage checkpoint directory per component, and its ddm.yaml.

An import source (Paris's release: ``ddm.models.paris_import``) checks its components and
describes each as a :class:`Component`; :func:`write_import` then lays them out as

    DST/expert_0 .. expert_{N-1}/  router/  text_encoder/  decoder/  ddm_index.json  ddm.yaml

each directory its library's ``config.json`` (with our declarations under ``"_ddm"``: role,
family, convention, shapes, ``weights_sha256``, and ``files``: the SHA-256 of every other file,
which a fetch of the directory downloads and verifies) beside the one safetensors file, copied
byte for byte (weights keep their dtype), and any other files the component needs (a
tokenizer's); ``ddm_index.json`` maps each role to its directory (:mod:`ddm.checkpoints.index`,
the experts in the router network's order). The write is atomic: everything goes to a hidden
directory beside DST, renamed into place only once complete, so a failed import leaves nothing
behind. An existing DST is never replaced.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ddm.checkpoints.declared import DDM_KEY, FILES_KEY
from ddm.checkpoints.format import CONFIG_FILE, CheckpointError
from ddm.checkpoints.index import INDEX_FILE, write_index
from ddm.checkpoints.roles import EXPERT, ROLE_REGISTRY
from ddm.fileio import open_regular, staging_directory

#: The deployment an import writes beside its components.
MANIFEST_FILE = "ddm.yaml"
WEIGHTS_SUFFIX = ".safetensors"
_COPY_CHUNK = 1 << 20


@dataclass(frozen=True)
class Component:
    """One stage directory of an import: ``name`` (its directory in DST), its library's
    ``config`` (written as config.json with ``ddm`` under ``"_ddm"``, ``weights_sha256``
    added), the ``weights`` file copied under its own name, and ``files`` copied as they are."""

    name: str
    config: Mapping[str, Any]
    ddm: Mapping[str, Any]
    weights: Path
    files: tuple[Path, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name or self.name.startswith("."):
            raise CheckpointError(f"component name {self.name!r} is not a directory name")
        if self.weights.suffix != WEIGHTS_SUFFIX:
            raise CheckpointError(f"component {self.name}: weights must be a safetensors file "
                                  f"(loading them runs no code), got {self.weights.name}")
        names = [p.name for p in (self.weights, *self.files)]
        if CONFIG_FILE in names or len(set(names)) != len(names):
            raise CheckpointError(f"component {self.name}: files {names} clash with each other "
                                  f"or with the {CONFIG_FILE} the import writes")


def write_import(out: str | Path, components: tuple[Component, ...], manifest: str,
                 experts: Sequence[str]) -> Path:
    """Write ``components``, their index (``experts``: the expert components in the router
    network's order; a component of another role is that role's) and ``manifest`` (ddm.yaml's
    text) to the new directory ``out``, atomically; refuses an existing ``out`` (nothing is
    replaced) and a missing parent."""
    target = Path(out).absolute()
    if target.exists():
        raise FileExistsError(f"{target} exists; an import writes a new directory")
    if not target.parent.is_dir():
        raise FileNotFoundError(f"cannot write {target}: directory {target.parent} does not "
                                "exist (create it first)")
    names = [c.name for c in components]
    if len(set(names)) != len(names) or {MANIFEST_FILE, INDEX_FILE} & set(names):
        raise CheckpointError(f"component names {names} must be unique and not "
                              f"{MANIFEST_FILE} or {INDEX_FILE}")
    staging = staging_directory(target)
    try:
        for component in components:
            _write_component(staging / component.name, component)
        write_index(staging, experts, {c.ddm["role"]: c.name for c in components
                                       if c.ddm.get("role") in ROLE_REGISTRY
                                       and c.ddm["role"] != EXPERT})
        (staging / MANIFEST_FILE).write_text(manifest, encoding="utf-8")
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _write_component(directory: Path, component: Component) -> None:
    directory.mkdir()
    digests = {path.name: copy_with_sha256(path, directory / path.name)
               for path in (component.weights, *component.files)}
    config = {**component.config,
              DDM_KEY: {**component.ddm, "weights_sha256": digests[component.weights.name],
                        FILES_KEY: digests}}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n",
                                         encoding="utf-8")


def copy_with_sha256(source: Path, destination: Path) -> str:
    """Copy ``source`` (a regular file itself, no link followed: ``fileio.open_regular``) to
    ``destination`` byte for byte in one pass; its SHA-256 (hex)."""
    digest = hashlib.sha256()
    try:
        reader = open_regular(source)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    with reader, open(destination, "xb") as writer:
        for chunk in iter(lambda: reader.read(_COPY_CHUNK), b""):
            digest.update(chunk)
            writer.write(chunk)
    return digest.hexdigest()
