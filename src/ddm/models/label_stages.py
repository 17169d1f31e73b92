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
from typing import Any, Callable, Sequence

import numpy as np

from ddm.checkpoints.declared import EXPERT, ROUTER
from ddm.checkpoints.format import (WEIGHTS_FILE, Checkpoint, CheckpointError, load_checkpoint,
                                    read_meta, stored_precision)
from ddm.conditioning import Conditioning
from ddm.deploy.limits import MAX_BATCH
from ddm.models.backends import (BackendUnavailable, Runtime, check_backend, jax_runtime,
                                 neuron_network, torch_runtime)
from ddm.models.loading import (LOAD_BACKENDS, ModelFn, expert_image_shape, expert_network,
                                expert_torch_module, network_framework, num_classes_of,
                                router_network_config, router_probabilities)
from ddm.objectives import as_velocity

#: Format 1's ``model.kind`` -> the family of its experts; a router checkpoint is one family.
EXPERT_FAMILIES = {"unet": "unet", "import": "label-import", "exported": "label-program"}
ROUTER_FAMILY = "label-router"
#: The roles format 1's checkpoint kinds play (a classifier only scores samples).
_ROLES = {"expert": EXPERT, "monolith": EXPERT, "router": ROUTER}


@dataclass(frozen=True)
class LabelHeader:
    """What a format-1 checkpoint says of itself, read without its weights: its role and
    family, the shape an expert makes (C, H, W; a router's comes with its network), its
    partition index (``cluster``), labels and label space, its name and the framework it was
    written for."""

    role: str
    family: str
    latent_shape: tuple[int, int, int] | None
    cluster: int | None
    classes: tuple[int, ...]
    num_classes: int
    name: str
    framework: str


@dataclass(frozen=True)
class LabelNetwork:
    """A loaded format-1 checkpoint, what :func:`ddm.models.stages.load_stage` makes a
    :class:`~ddm.models.stages.Stage` of: its header, the shape it makes or routes (C, H, W),
    the dtype its weights run in, its NumPy callable and what runs it, a router's number of
    experts (``clusters``), an expert's network as trained (:attr:`ddm.models.stages.Stage.
    prediction`), its torch module (which a server may compile) and the batch sizes it may be
    called with (None: any)."""

    header: LabelHeader
    latent_shape: tuple[int, int, int]
    dtype: str
    forward: Callable[..., np.ndarray]
    runtime: Runtime
    clusters: int | None = None
    prediction: Callable[..., np.ndarray] | None = None
    network: Any = None
    batch_sizes: tuple[int, ...] | None = None


def read_label_header(path: Path) -> LabelHeader:
    """The header of the format-1 checkpoint at ``path`` (its config.json alone); a kind
    that is no stage of a DDM (a classifier) is a ``CheckpointError``."""
    meta = read_meta(path)  # refuses another format_version
    role = _ROLES.get(meta.kind)
    if role is None:
        raise CheckpointError(f"{meta.name} is a {meta.kind} checkpoint, not a stage of a DDM "
                              f"(expected one of {', '.join(_ROLES)})")
    index = (meta.partition or {}).get("index")
    expert = role == EXPERT
    return LabelHeader(role, EXPERT_FAMILIES[meta.model.kind] if expert else ROUTER_FAMILY,
                       expert_image_shape(meta) if expert else None,
                       index if expert and isinstance(index, int) else None, meta.classes,
                       num_classes_of(meta), meta.name, meta.framework)


def load_label_network(path: Path, dtype: str | None = None, device: str | None = "cpu",
                       backend: str | None = None, batch_sizes: Sequence[int] | None = None,
                       compile_cache: Path | None = None) -> LabelNetwork:
    """The format-1 checkpoint at ``path``: an expert's ``forward(x, t, cond) -> v`` reads
    ``cond.labels`` (B,) int64; a router's ``forward(x, t, labels) -> probabilities (B, K)``.
    Its role comes from its ``kind``, its family from ``model.kind``. ``backend``: ``native``
    or None (the checkpoint's framework), ``torch`` or ``jax`` (our UNet runs on either), or
    ``neuron`` (torch-neuronx traces an expert: :mod:`ddm.models.backends`). ``dtype`` may
    only name the stored one. ``batch_sizes``: the sizes a server calls an expert at; a
    network that runs at fixed sizes only (an exported program, JAX, a Neuron trace) is built
    for them and says so in :attr:`LabelNetwork.batch_sizes`."""
    backend = backend or "native"
    if backend not in (*LOAD_BACKENDS, "neuron"):
        raise CheckpointError(f"unknown backend {backend!r}; expected one of "
                              f"{', '.join(LOAD_BACKENDS)} or neuron")
    header = read_label_header(path)
    ckpt = load_checkpoint(path)  # the weights' checksum first: a cut file is named corrupt
    stored = label_precision(path, dtype)
    if header.role == ROUTER:
        if backend not in ("native", "torch"):
            raise CheckpointError(f"{path}: the label router network runs on torch only")
        config = router_network_config(ckpt)
        from ddm.models.torch_io import select_torch_device

        return LabelNetwork(header, (config.in_channels, config.image_size, config.image_size),
                            stored, router_probabilities(ckpt, device),
                            torch_runtime(select_torch_device(device)),
                            clusters=config.num_experts)
    network, runtime, module, fixed = _expert(ckpt, backend, device, batch_sizes,
                                              compile_cache)
    assert header.latent_shape is not None, "an expert's header has its image shape"
    return LabelNetwork(header, header.latent_shape, stored,
                        _labelled(header.name, as_velocity(ckpt.meta.objective, network)),
                        runtime, prediction=_labelled(header.name, network), network=module,
                        batch_sizes=fixed)


def _expert(ckpt: Checkpoint, backend: str, device: str | None,
            batch_sizes: Sequence[int] | None, compile_cache: Path | None
            ) -> tuple[ModelFn, Runtime, Any, tuple[int, ...] | None]:
    """An expert's network as trained on ``backend``, what runs it, its torch module (None
    on JAX and Neuron) and the only batch sizes it may be called with (None: any)."""
    sizes = tuple(batch_sizes or (1, MAX_BATCH))
    if backend == "neuron":
        check_backend(backend)
        return (*neuron_network(ckpt, sizes, compile_cache), None, sizes)
    framework = network_framework(ckpt, backend)
    if framework == "torch":
        from ddm.models.torch_io import velocity_fn

        module, target = expert_torch_module(ckpt, device, sizes)
        # An exported program is checked at, so run at, these sizes only.
        fixed = sizes if ckpt.meta.model.kind == "exported" and batch_sizes else None
        return velocity_fn(module, target), torch_runtime(target), module, fixed
    from ddm.models.flax_unet import select_jax_device

    try:
        target = select_jax_device(device)
    except ValueError as exc:
        raise BackendUnavailable(str(exc)) from None
    # JAX compiles one program per batch size: a server pads to its few.
    return (expert_network(ckpt, "jax", device), jax_runtime(target), None,
            tuple(batch_sizes) if batch_sizes else None)


def _labelled(name: str, run: ModelFn) -> Callable[[np.ndarray, np.ndarray, Conditioning],
                                                   np.ndarray]:
    """``run(x, t, y)`` reading the rows' labels from their :class:`Conditioning`."""
    def on_labels(x: np.ndarray, t: np.ndarray, cond: Conditioning) -> np.ndarray:
        if cond.labels is None:
            raise ValueError(f"{name} is conditioned on labels, not text embeddings")
        return run(x, t, cond.labels)

    return on_labels


def label_precision(path: Path, dtype: str | None) -> str:
    """The precision the label checkpoint at ``path`` runs in: the one its floating weights
    are stored in (float32 where it holds none), which ``dtype`` may only name."""
    stored = stored_precision(path / WEIGHTS_FILE) or "float32"
    if dtype is not None and dtype != stored:
        raise CheckpointError(f"{path}: a label checkpoint runs in its stored dtype "
                              f"({stored}), not {dtype}")
    return stored
