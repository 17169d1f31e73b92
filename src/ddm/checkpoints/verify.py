"""Check a fetched checkpoint without loading it: what the fetcher runs before installing one.

A fetched checkpoint is a peer's bytes, and its size is the peer's choice up to the fetch's
byte cap: a small archive of zeros expands to gigabytes of weights. Loading them to check
them (``format.load_checkpoint``) would cost their size in memory, so the fetcher checks
what loading relies on, in constant memory:

- ``config.json`` (``format.read_meta``: format, convention, objective, model);
- the SHA-256 of the weights (and of an exported program), streamed from disk, against the
  ones ``config.json`` records; for a stage checkpoint (its config.json declares ``_ddm``,
  ``ddm.checkpoints.declared``) every file against ``_ddm.files``, which a fetched one must
  record, nothing more or less (the role and family are checked where it is loaded);
- the safetensors header, parsed by safetensors itself over a memory map of the file (no
  tensor is read): every tensor's dtype known, its byte range matching its shape and dtype,
  the ranges tiling the file exactly.

The server loads the weights later, in its own pod, under its own memory limit.
"""

from __future__ import annotations

import os
from pathlib import Path

from ddm.checkpoints.declared import DDM_KEY, declared_files, read_declaration
from ddm.checkpoints.format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    CheckpointMeta,
    check_sha256,
    program_file_name,
    read_config,
    read_meta,
    safetensors_header,
)


def verify_checkpoint(directory: str | os.PathLike) -> CheckpointMeta | None:
    """The checkpoint's metadata once its files check out (None for a stage checkpoint,
    whose metadata is its library's); a ``CheckpointError`` naming the first problem
    otherwise."""
    path = Path(directory)
    declared = read_declaration(path)
    if declared is not None:
        _verify_stage(path, declared)
        return None
    meta = read_meta(path)
    config = read_config(path / CONFIG_FILE)
    check_sha256(path, WEIGHTS_FILE, config.get("weights_sha256"))
    if meta.model.kind == "exported":
        check_sha256(path, program_file_name(meta), config.get("program_sha256"))
    safetensors_header(path / WEIGHTS_FILE)
    return meta


def _verify_stage(path: Path, declared: dict) -> None:
    """A stage checkpoint: exactly the files ``_ddm.files`` lists, each with its SHA-256, one
    of them the safetensors file ``_ddm.weights_sha256`` names."""
    try:
        files = declared_files(path, declared)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    present = sorted(p.name for p in path.iterdir() if p.name != CONFIG_FILE)
    if present != sorted(files):
        raise CheckpointError(f"stage checkpoint {path} holds {present}; its config.json's "
                              f"{DDM_KEY} lists {sorted(files)}")
    weights = [name for name in files if name.endswith(".safetensors")]
    if len(weights) != 1 or declared.get("weights_sha256") != files[weights[0]]:
        raise CheckpointError(f"stage checkpoint {path}: {DDM_KEY} must list one .safetensors "
                              "file, the one weights_sha256 records")
    for name, digest in files.items():
        check_sha256(path, name, digest)
    safetensors_header(path / weights[0])
