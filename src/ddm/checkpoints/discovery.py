"""Finding checkpoints: the shipped digits DDM, and the checkpoints a directory holds by kind."""

from __future__ import annotations

import os
from pathlib import Path

from ddm.checkpoints.format import CheckpointError, read_meta


def default_checkpoints() -> Path:
    """The shipped digits DDM: ``$DDM_CHECKPOINTS``, the repo's copy, or the image's copy."""
    candidates = [os.environ.get("DDM_CHECKPOINTS"),
                  Path(__file__).resolve().parents[3] / "checkpoints" / "digits",
                  "/opt/ddm/checkpoints/digits"]
    for candidate in candidates:
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    raise CheckpointError(
        "no shipped checkpoints found (looked at $DDM_CHECKPOINTS, the repository's "
        "checkpoints/digits and /opt/ddm/checkpoints/digits); pass --checkpoints DIR")


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
