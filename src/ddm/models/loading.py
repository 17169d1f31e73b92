"""Format-1 checkpoint -> NumPy callables per framework: an expert's velocity (or its network's
raw output), the label router network's probabilities. The label families
(:mod:`ddm.models.label_stages`), and so the model server, build their networks here; a whole
DDM loads through :func:`ddm.models.ddm.load_ddm`.

Each UNet runs on the backend of its choice: ``native`` (the framework it was trained with),
``torch`` or ``jax``; the checkpoint format is the same for both. ML frameworks are imported
only when a backend needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ddm.checkpoints.format import Checkpoint, CheckpointError, CheckpointMeta
from ddm.deploy.limits import MAX_BATCH, MAX_IMAGE_CHANNELS, MAX_IMAGE_SIDE
from ddm.models.config import ConfigError, RouterNetworkConfig, UNetConfig
from ddm.objectives import as_velocity

if TYPE_CHECKING:
    import torch

#: In-process loading: ``native`` (the checkpoint's own framework) or either framework.
LOAD_BACKENDS = ("native", "torch", "jax")

#: ``velocity(x (B, C, H, W) f32, t (B,) f32, y (B,) int64) -> v (B, C, H, W) f32``.
ModelFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
#: ``router(x (B, C, H, W), t (B,), y (B,)) -> probabilities (B, K)``.
RouterFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def expert_image_shape(meta: CheckpointMeta) -> tuple[int, int, int]:
    """``(C, H, W)`` of the images an expert or monolith checkpoint generates."""
    if meta.kind not in ("expert", "monolith"):
        raise CheckpointError(f"{meta.name} is a {meta.kind} checkpoint, not a model that "
                              "generates")
    if meta.model.image_shape is not None:
        return meta.model.image_shape
    try:
        config = UNetConfig.from_dict(meta.architecture)
    except ConfigError as error:
        raise CheckpointError(f"{meta.name}: invalid architecture: {error}") from None
    return config.in_channels, config.image_size, config.image_size


def expert_velocity(ckpt: Checkpoint, backend: str = "native",
                    device: str | None = None) -> ModelFn:
    """Our velocity (``ddm.convention``) from a UNet checkpoint on the chosen framework, as a
    NumPy callable: an expert trained on another objective (epsilon, x0, a VP schedule...) has
    its network's output converted here, the one place every driver and server loads from."""
    return as_velocity(ckpt.meta.objective, expert_network(ckpt, backend, device))


def expert_network(ckpt: Checkpoint, backend: str = "native", device: str | None = None,
                   batch_sizes: Sequence[int] = (1, MAX_BATCH)) -> ModelFn:
    """The checkpoint's network as trained: its own inputs, its own prediction (what
    ``ddm expert check`` tests against the declared objective). Our UNet runs on either
    framework; a user's network (``ckpt.meta.model``) on its own only. An exported torch
    program is refused if one of ``batch_sizes`` (default: one row and the most any server
    takes) would make it compute an oversized tensor; call it with those sizes only."""
    framework, model = network_framework(ckpt, backend), ckpt.meta.model
    if framework == "torch":
        from ddm.models import torch_io

        module, torch_device = expert_torch_module(ckpt, device, batch_sizes)
        return torch_io.velocity_fn(module, torch_device)
    if framework == "jax" and model.kind == "import":
        from ddm.models import flax_unet
        from ddm.models.imports import flax_network

        return flax_network(ckpt, flax_unet.select_jax_device(device))
    if framework == "jax" and model.kind == "exported":
        from ddm.models import flax_unet
        from ddm.models.jax_export import exported_network

        return exported_network(ckpt, flax_unet.select_jax_device(device))
    if framework == "jax":
        import jax

        from ddm.models import flax_unet

        config = UNetConfig.from_dict(ckpt.meta.architecture)
        target = flax_unet.select_jax_device(device)
        with jax.default_device(target):  # parameters are placed on the default device
            velocity = flax_unet.make_velocity_fn(
                flax_unet.params_from_canonical(ckpt.weights, config, ckpt.path), config)

        def on_device(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
            with jax.default_device(target):  # inputs follow the parameters
                return velocity(x, t, y)

        return on_device
    raise ValueError(f"unknown framework {framework!r}")


def network_framework(ckpt: Checkpoint, backend: str = "native") -> str:
    """The framework the expert checkpoint's network runs on with ``backend`` (``native``:
    its own), refusing what cannot: a user's network on another framework than its own, or a
    declared image shape over the limits."""
    framework = ckpt.meta.framework if backend == "native" else backend
    model = ckpt.meta.model
    if model.image_shape is not None:
        channels, height, width = model.image_shape
        if channels > MAX_IMAGE_CHANNELS or max(height, width) > MAX_IMAGE_SIDE:
            # The shape sizes the memory bound a program is checked against: a checkpoint
            # must not raise its own bound.
            raise CheckpointError(
                f"expert {ckpt.meta.name}: model.image_shape {list(model.image_shape)} is over "
                f"the limits ({MAX_IMAGE_CHANNELS} channels, sides of {MAX_IMAGE_SIDE})")
    if model.kind != "unet" and framework != ckpt.meta.framework:
        raise CheckpointError(
            f"expert {ckpt.meta.name} is a {ckpt.meta.framework} network ({model.kind}: "
            f"{model.factory or 'an exported program'}); only our UNet runs on either framework:"
            f" serve it with backend {ckpt.meta.framework} or native")
    return framework


def expert_torch_module(ckpt: Checkpoint, device: str | None = None,
                        batch_sizes: Sequence[int] = (1, MAX_BATCH)
                        ) -> tuple[torch.nn.Module, torch.device]:
    """The expert's torch module on its torch device (``torch_io.select_torch_device``), for
    a server that compiles it in place; an exported program checked at ``batch_sizes``."""
    from ddm.models import torch_io

    network_framework(ckpt, "torch")
    torch_device = torch_io.select_torch_device(device)
    return torch_io.expert_module(ckpt, torch_device, batch_sizes), torch_device


def router_network_config(ckpt: Checkpoint) -> RouterNetworkConfig:
    """The architecture of a router checkpoint; anything else is a ``CheckpointError``."""
    if ckpt.meta.kind != "router":
        raise CheckpointError(f"{ckpt.path} is a {ckpt.meta.kind} checkpoint, not a router")
    try:
        return RouterNetworkConfig.from_dict(ckpt.meta.architecture)
    except ConfigError as error:
        raise CheckpointError(f"router {ckpt.path}: invalid architecture: {error}") from None


def router_probabilities(ckpt: Checkpoint, device: str | None = None) -> RouterFn:
    """The router network's ``p(k | x_t, t, y)`` (PyTorch) as a NumPy callable."""
    from ddm.models import torch_io

    torch_device = torch_io.select_torch_device(device)
    return torch_io.router_probs_fn(torch_io.router_from_checkpoint(ckpt, torch_device),
                                    torch_device)


def num_classes_of(meta: CheckpointMeta) -> int:
    """The size of the label space an expert was conditioned on: its architecture's
    ``num_classes`` (our UNet always records one), else one past its largest class."""
    recorded = meta.architecture.get("num_classes")
    return int(recorded) if isinstance(recorded, int) else max(meta.classes, default=0) + 1

