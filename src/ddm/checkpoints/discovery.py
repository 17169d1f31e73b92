"""Finding checkpoints: the shipped DDMs (the default one first), and a directory's by kind."""

from __future__ import annotations

import os
from pathlib import Path

from ddm.checkpoints.format import CheckpointError, read_meta
from ddm.checkpoints.shipped import DEFAULT_DDM, SHIPPED_ROOTS


def default_checkpoints() -> Path:
    """The default DDM's directory: ``$DDM_CHECKPOINTS``, else the shipped ``DEFAULT_DDM``."""
    override = os.environ.get("DDM_CHECKPOINTS")
    if override and Path(override).is_dir():
        return Path(override)
    return shipped_checkpoints(DEFAULT_DDM)


def shipped_checkpoints(name: str) -> Path:
    """The shipped DDM ``name`` (``mnist``, ``digits``, ...): the repository's or the image's."""
    for root in SHIPPED_ROOTS:
        if (root / name).is_dir():
            return root / name
    raise CheckpointError(
        f"no shipped checkpoints {name!r} found (looked in $DDM_CHECKPOINTS and "
        f"{' and '.join(str(root) for root in SHIPPED_ROOTS)}); pass --checkpoints DIR")


def shipped_ddms() -> list[Path]:
    """Every shipped DDM directory, the default one first (the first copy of each name)."""
    found: dict[str, Path] = {}
    for root in SHIPPED_ROOTS:
        if root.is_dir():
            for path in sorted(root.iterdir()):
                if path.is_dir() and not path.name.startswith("."):
                    found.setdefault(path.name, path)
    return sorted(found.values(), key=lambda path: path.name != DEFAULT_DDM)


def discover(directory: str | os.PathLike) -> dict[str, list[Path]]:
    """Checkpoint directories by kind: ``directory`` itself, or its immediate subdirectories."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    found: dict[str, list[Path]] = {}
    paths = [root] if (root / "config.json").exists() else sorted(
        p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    for path in paths:
        if (path / "config.json").exists():
            found.setdefault(read_meta(path).kind, []).append(path)
    if not found:
        raise CheckpointError(f"no checkpoints (directories with config.json) in {root}")
    return found
