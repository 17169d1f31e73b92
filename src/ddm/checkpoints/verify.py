"""Check a fetched checkpoint without loading it: what the fetcher runs before installing one.

A fetched checkpoint is a peer's bytes, and its size is the peer's choice up to the fetch's
byte cap: a small archive of zeros expands to gigabytes of weights. Loading them to check
them (``format.load_checkpoint``) would cost their size in memory, so the fetcher checks
what loading relies on, in constant memory:

- ``config.json`` (``format.read_meta``: format, convention, objective, model);
- the SHA-256 of the weights (and of an exported program), streamed from disk, against the
  ones ``config.json`` records;
- the safetensors header, parsed by safetensors itself over a memory map of the file (no
  tensor is read): every tensor's dtype known, its byte range matching its shape and dtype,
  the ranges tiling the file exactly.

The server loads the weights later, in its own pod, under its own memory limit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ddm.checkpoints.format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    CheckpointMeta,
    check_sha256,
    program_file_name,
    read_meta,
)


def verify_checkpoint(directory: str | os.PathLike) -> CheckpointMeta:
    """The checkpoint's metadata once its files check out; a ``CheckpointError`` naming the
    first problem otherwise."""
    from safetensors import SafetensorError, safe_open

    path = Path(directory)
    meta = read_meta(path)
    config = json.loads((path / CONFIG_FILE).read_text())
    check_sha256(path, WEIGHTS_FILE, config.get("weights_sha256"))
    if meta.model.kind == "exported":
        check_sha256(path, program_file_name(meta), config.get("program_sha256"))
    try:
        with safe_open(str(path / WEIGHTS_FILE), framework="numpy") as weights:
            weights.keys()
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: {WEIGHTS_FILE} is not a valid safetensors "
                              f"file ({exc})") from None
    return meta
