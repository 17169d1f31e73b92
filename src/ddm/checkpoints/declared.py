"""What a stage checkpoint declares about itself: the ``"_ddm"`` block of its config.json.

Read without NumPy or any ML framework, so that ``ddm up`` can compare the stages' state
shapes before it starts a server (``ddm.models.stages`` loads and checks the whole block).
"""

from __future__ import annotations

import json
from pathlib import Path

#: The key of a component's config.json under which we declare what the stage is;
#: diffusers and transformers ignore (or keep) keys that start with ``_``.
DDM_KEY = "_ddm"
#: A stage's config.json is a few kilobytes; a larger one is not read here.
MAX_DECLARATION_BYTES = 1 << 20


def declared_latent_shape(directory: Path) -> tuple[int, ...] | None:
    """The ``latent_shape`` the checkpoint in ``directory`` declares, or None where it declares
    none (a label expert's checkpoint) or its config.json is unreadable (its server refuses it,
    saying why)."""
    path = directory / "config.json"
    if not path.is_file() or path.stat().st_size > MAX_DECLARATION_BYTES:
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    block = config.get(DDM_KEY) if isinstance(config, dict) else None
    shape = block.get("latent_shape") if isinstance(block, dict) else None
    if not isinstance(shape, list) or not all(isinstance(n, int) for n in shape):
        return None
    return tuple(shape)
