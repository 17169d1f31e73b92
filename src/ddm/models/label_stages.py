"""Label-conditioned model families behind :func:`ddm.models.stages.load_stage`: a format-1
checkpoint directory (``ddm.checkpoints.format``: our UNet on torch or Flax, a user's network,
an exported torch or JAX program, or the label router network) loads here, and ``load_stage``
makes it a :class:`~ddm.models.stages.Stage` like a text stage, its velocity taking a
:class:`~ddm.conditioning.Conditioning` of labels.

Format 1 has no ``_ddm`` block: the declaration is derived from the checkpoint's own fields
(``kind`` -> role, ``model.kind`` -> family). Weights run in the dtype they were saved in;
the network is built by :mod:`ddm.models.loading`, which converts each expert's objective to
our velocity.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ddm.checkpoints.declared import EXPERT, ROUTER
from ddm.checkpoints.format import (WEIGHTS_FILE, CheckpointError, load_checkpoint,
                                    stored_precision)
from ddm.conditioning import Conditioning
from ddm.models.loading import (LOAD_BACKENDS, ModelFn, expert_image_shape, expert_network,
                                num_classes_of, router_network_config, router_probabilities)
from ddm.objectives import as_velocity

#: Format 1's ``model.kind`` -> the family of its experts; a router checkpoint is one family.
EXPERT_FAMILIES = {"unet": "unet", "import": "label-import", "exported": "label-program"}
ROUTER_FAMILY = "label-router"
#: The roles format 1's checkpoint kinds play (a classifier only scores samples).
_ROLES = {"expert": EXPERT, "monolith": EXPERT, "router": ROUTER}


@dataclass(frozen=True)
class LabelNetwork:
    """A loaded format-1 checkpoint, what :func:`ddm.models.stages.load_stage` makes a
    :class:`~ddm.models.stages.Stage` of: its role and family, the shape it makes or routes
    (C, H, W), its partition index (``cluster``), labels and label space, the dtype its
    weights run in, its NumPy callable, its name, a router's number of experts
    (``clusters``), and an expert's network as trained (:attr:`ddm.models.stages.Stage.
    prediction`)."""

    role: str
    family: str
    latent_shape: tuple[int, int, int]
    cluster: int | None
    classes: tuple[int, ...]
    num_classes: int
    dtype: str
    forward: Callable[..., np.ndarray]
    name: str
    clusters: int | None = None
    prediction: Callable[..., np.ndarray] | None = None


def load_label_network(path: Path, dtype: str | None = None, device: str | None = "cpu",
                       backend: str | None = None) -> LabelNetwork:
    """The format-1 checkpoint at ``path``: an expert's ``forward(x, t, cond) -> v`` reads
    ``cond.labels`` (B,) int64; a router's ``forward(x, t, labels) -> probabilities (B, K)``.
    Its role comes from its ``kind``, its family from ``model.kind``. ``backend``: ``native``
    or None (the checkpoint's framework), ``torch`` or ``jax`` (our UNet runs on either).
    ``dtype`` may only name the stored one."""
    backend = backend or "native"
    if backend not in LOAD_BACKENDS:
        raise CheckpointError(f"unknown backend {backend!r}; expected one of "
                              f"{', '.join(LOAD_BACKENDS)}")
    ckpt = load_checkpoint(path)  # refuses another format_version
    meta = ckpt.meta
    role = _ROLES.get(meta.kind)
    if role is None:
        raise CheckpointError(f"{meta.name} is a {meta.kind} checkpoint, not a stage of a DDM "
                              f"(expected one of {', '.join(_ROLES)})")
    stored = _stored_precision(path)
    if dtype is not None and dtype != stored:
        raise CheckpointError(f"{path}: a label checkpoint runs in its stored dtype "
                              f"({stored}), not {dtype}")
    if role == ROUTER:
        if backend == "jax":
            raise CheckpointError(f"{path}: the label router network runs on torch only")
        config = router_network_config(ckpt)
        return LabelNetwork(ROUTER, ROUTER_FAMILY,
                            (config.in_channels, config.image_size, config.image_size), None,
                            meta.classes, num_classes_of(meta), stored,
                            router_probabilities(ckpt, device), meta.name,
                            clusters=config.num_experts)
    network = expert_network(ckpt, backend, device)
    index = (meta.partition or {}).get("index")
    return LabelNetwork(EXPERT, EXPERT_FAMILIES[meta.model.kind], expert_image_shape(meta),
                        index if isinstance(index, int) else None, meta.classes,
                        num_classes_of(meta), stored,
                        _labelled(meta.name, as_velocity(meta.objective, network)), meta.name,
                        prediction=_labelled(meta.name, network))


def _labelled(name: str, run: ModelFn) -> Callable[[np.ndarray, np.ndarray, Conditioning],
                                                   np.ndarray]:
    """``run(x, t, y)`` reading the rows' labels from their :class:`Conditioning`."""
    def on_labels(x: np.ndarray, t: np.ndarray, cond: Conditioning) -> np.ndarray:
        if cond.labels is None:
            raise ValueError(f"{name} is conditioned on labels, not text embeddings")
        return run(x, t, cond.labels)

    return on_labels


def _stored_precision(path: Path) -> str:
    """The precision of a checkpoint's floating weights (float32 where it holds none)."""
    return stored_precision(path / WEIGHTS_FILE) or "float32"
