"""A DDM directory's root index (``ddm_index.json``, after diffusers' ``model_index.json``):
which subfolder holds each role (:mod:`ddm.checkpoints.roles`), so that a loader reads the
members by role instead of guessing directory names::

    {"ddm_index": 1, "expert": ["expert-0-4", "expert-5-9"], "router": "router"}

``expert`` lists the experts in the router network's output order; every other role names one
subfolder. A directory without an index keeps loading by today's names (the loaders' own
guesses). An entry must be a relative path inside the DDM directory (no ``..``, not absolute,
no link out) naming an existing subfolder (not the directory itself), each entry its own;
anything else is refused naming the file and the entry. Plain JSON: the plan, the fetcher and
the loaders all read it without a framework.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Mapping, Sequence

from ddm.checkpoints.declared import load_config_json
from ddm.checkpoints.format import CheckpointError
from ddm.checkpoints.roles import EXPERT, ROLE_REGISTRY
from ddm.fileio import atomic_path

INDEX_FILE = "ddm_index.json"
#: The key that marks (and versions) the index.
INDEX_KEY = "ddm_index"
INDEX_VERSION = 1
#: At most this many experts (a DDM has a few; a list past it is no index of ours).
MAX_INDEXED_EXPERTS = 1024


@dataclass(frozen=True)
class DDMIndex:
    """The members of a DDM directory ``root`` by role: ``experts`` in the router network's
    output order, ``stages`` role -> subfolder for the others."""

    root: Path
    experts: tuple[str, ...]
    stages: Mapping[str, str]

    def stage_path(self, role: str) -> Path | None:
        """The directory of ``role`` (a :data:`~ddm.checkpoints.roles.ROLE_REGISTRY` name
        besides ``expert``), None where the DDM has none."""
        assert role in ROLE_REGISTRY and role != EXPERT, f"not a stage role: {role!r}"
        name = self.stages.get(role)
        return None if name is None else self.root / name


def read_index(root: str | os.PathLike) -> DDMIndex | None:
    """``root``'s index, checked, or None where it has none (load by today's names)."""
    directory = Path(root)
    path = directory / INDEX_FILE
    if not path.exists() and not path.is_symlink():
        return None
    try:
        document = load_config_json(path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    return _checked(directory, path, document)


def _checked(directory: Path, path: Path, document: Any) -> DDMIndex:
    """``document`` as the index ``path`` of ``directory``, every entry checked; refused
    naming ``path`` and the entry (read back, or before it is written)."""
    if not isinstance(document, dict) or document.get(INDEX_KEY) != INDEX_VERSION:
        raise CheckpointError(f"{path}: not a DDM index (expected an object with "
                              f"\"{INDEX_KEY}\": {INDEX_VERSION})")
    unknown = sorted(set(document) - {INDEX_KEY, *ROLE_REGISTRY})
    if unknown:
        raise CheckpointError(f"{path}: unknown entries {unknown}; the roles are "
                              f"{', '.join(ROLE_REGISTRY)}")
    experts = document.get(EXPERT)
    if not (isinstance(experts, list) and 0 < len(experts) <= MAX_INDEXED_EXPERTS):
        raise CheckpointError(f"{path}: entry {EXPERT!r} must list 1..{MAX_INDEXED_EXPERTS} "
                              f"expert subfolders, got {str(experts)[:64]}")
    stages = {role: document[role] for role in ROLE_REGISTRY
              if role != EXPERT and role in document}
    named: dict[PurePosixPath, str] = {}  # each subfolder -> the entry that names it
    for role, name in [*((f"{EXPERT}[{k}]", e) for k, e in enumerate(experts)),
                       *stages.items()]:
        _check_entry(directory, path, role, name)
        first = named.setdefault(PurePosixPath(name), role)
        if first != role:
            raise CheckpointError(f"{path}: entries {first!r} and {role!r} both name "
                                  f"{name!r}; each member has a subfolder of its own")
    return DDMIndex(directory, tuple(experts), stages)


def index_document(experts: Sequence[str], stages: Mapping[str, str | None]) -> dict[str, Any]:
    """The index naming ``experts`` (in the router network's output order) and the other
    roles' subfolders (``stages``: role -> subfolder, None for a role the DDM lacks)."""
    unknown = sorted(set(stages) - set(ROLE_REGISTRY) | ({EXPERT} & set(stages)))
    assert not unknown, f"not stage roles: {unknown}"
    return {INDEX_KEY: INDEX_VERSION, EXPERT: list(experts),
            **{role: name for role, name in stages.items() if name is not None}}


def write_index(root: str | os.PathLike, experts: Sequence[str],
                stages: Mapping[str, str | None]) -> Path:
    """Check ``root``'s index (:func:`index_document`) as a reader would, then write it
    atomically (``fileio.atomic_path``): a reader, or a writer beside it, sees the old index
    or the whole new one, and nothing is written (or deleted) where a check fails. The path
    written."""
    path = Path(root) / INDEX_FILE
    document = index_document(experts, stages)
    _checked(Path(root), path, document)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(document, indent=2) + "\n")
    return path


def _check_entry(root: Path, path: Path, role: str, name: Any) -> None:
    """An entry is a relative POSIX path inside ``root`` to a subfolder (not ``root``
    itself), through no link."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{path}: entry {role!r} must be a subfolder name, got {name!r}")
    parts = PurePosixPath(name).parts
    if name.startswith("/") or "\\" in name or ".." in parts or Path(name).is_absolute():
        raise CheckpointError(f"{path}: entry {role!r} is {name!r}; it must be a relative "
                              "path inside the DDM directory (no '..', not absolute)")
    if not parts:
        raise CheckpointError(f"{path}: entry {role!r} is {name!r}, the DDM directory "
                              "itself; it must name a subfolder")
    target = root.joinpath(*parts)
    if any(root.joinpath(*parts[:k]).is_symlink() for k in range(1, len(parts) + 1)):
        raise CheckpointError(f"{path}: entry {role!r} ({name!r}) is a symbolic link; "
                              "the index names subfolders of the DDM directory only")
    if not target.is_dir():
        raise CheckpointError(f"{path}: entry {role!r} names {name!r}, which is not a "
                              f"subfolder of {root}")
