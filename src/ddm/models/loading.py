"""Checkpoint -> NumPy callables per framework: an expert's velocity, the router's
probabilities, and a whole DDM directory (experts in partition order + router, or one model).

Each UNet runs on the backend of its choice: ``native`` (the framework it was trained with),
``torch`` or ``jax``; the checkpoint format is the same for both. ML frameworks are imported
only when a backend needs them. The servers and the in-process sampler load models here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ddm.checkpoints.discovery import discover
from ddm.checkpoints.index import read_index
from ddm.checkpoints.roles import ROUTER
from ddm.checkpoints.format import Checkpoint, CheckpointError, CheckpointMeta, load_checkpoint
from ddm.deploy.limits import MAX_BATCH, MAX_IMAGE_CHANNELS, MAX_IMAGE_SIDE
from ddm.models.config import ConfigError, RouterNetworkConfig, UNetConfig
from ddm.objectives import as_velocity

#: In-process loading: ``native`` (the checkpoint's own framework) or either framework.
LOAD_BACKENDS = ("native", "torch", "jax")

#: ``velocity(x (B, C, H, W) f32, t (B,) f32, y (B,) int64) -> v (B, C, H, W) f32``.
ModelFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
#: ``router(x (B, C, H, W), t (B,), y (B,)) -> probabilities (B, K)``.
RouterFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class LoadedExpert:
    """One UNet: its name, the labels it was trained on, its velocity."""

    name: str
    classes: tuple[int, ...]
    velocity: ModelFn


@dataclass(frozen=True)
class LoadedDDM:
    """Either a mixture (``experts`` in the router's output order + optional ``router``) or a
    single model (one expert, ``is_mixture`` False)."""

    experts: tuple[LoadedExpert, ...]
    router: RouterFn | None
    image_shape: tuple[int, int, int]
    num_classes: int
    is_mixture: bool
    source: Path


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
                   batch_sizes: Sequence[int] = (1, MAX_BATCH),
                   compile_mode: str = "none") -> ModelFn:
    """The checkpoint's network as trained: its own inputs, its own prediction (what
    ``ddm expert check`` tests against the declared objective). Our UNet runs on either
    framework; a user's network (``ckpt.meta.model``) on its own only. An exported torch
    program is refused if one of ``batch_sizes`` (default: one row and the most any server
    takes) would make it compute an oversized tensor; call it with those sizes only. A torch
    network is compiled in ``compile_mode`` unless ``none`` (:func:`~ddm.models.torch_io.
    compile_network`), for ``batch_sizes``."""
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
    if framework == "torch":
        from ddm.models import torch_io

        torch_device = torch_io.select_torch_device(device)
        module = torch_io.expert_module(ckpt, torch_device, batch_sizes)
        if compile_mode != "none":
            torch_io.compile_network(module, compile_mode, len(batch_sizes))
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


def load_ddm(directory: str | os.PathLike, backend: str = "native",
             device: str | None = None) -> LoadedDDM:
    """Load what ``directory`` holds: a DDM of experts (+ router), or one model alone."""
    if backend not in LOAD_BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(LOAD_BACKENDS)}")
    root = Path(directory)
    members, router_path = ddm_members(root)
    if router_path is None and members == [root]:
        ckpt = load_checkpoint(root)
        if ckpt.meta.kind not in ("expert", "monolith"):
            raise CheckpointError(f"{root} is a {ckpt.meta.kind} checkpoint; it cannot generate")
        return _assemble([ckpt], None, backend, device, root, is_mixture=False)
    return load_ddm_members(members, router_path, backend, device, root)


def load_ddm_members(experts: Sequence[str | os.PathLike], router: str | os.PathLike | None,
                     backend: str = "native", device: str | None = None,
                     source: str | os.PathLike | None = None) -> LoadedDDM:
    """A DDM of the expert checkpoints ``experts`` (any order: they are put in their
    partition's) and ``router`` (None: without one), wherever each lies (a DDMDeployment's
    checkpoints); ``source`` names the DDM in messages (default: the first expert's parent)."""
    loaded = sorted((load_checkpoint(p) for p in experts), key=_partition_index)
    network = load_checkpoint(router) if router is not None else None
    where = Path(source) if source is not None else Path(experts[0]).parent
    return _assemble(loaded, network, backend, device, where, is_mixture=True)


def ddm_members(directory: str | os.PathLike) -> tuple[list[Path], Path | None]:
    """The checkpoints :func:`load_ddm` assembles from ``directory``: ``([directory], None)``
    for one model, else its experts and its router (None without one), as its root index
    (:mod:`ddm.checkpoints.index`) names them, or, without one, every expert and router
    checkpoint in it by kind; a classifier or a monolith beside the experts is not part of
    the DDM."""
    root = Path(directory)
    if (root / "config.json").exists():
        return [root], None
    index = read_index(root)
    if index is not None:
        return index.expert_paths(), index.stage_path(ROUTER)
    found = discover(root)
    experts = found.get("expert", [])
    if not experts:
        raise CheckpointError(f"{root} holds no expert checkpoints (found: {', '.join(found)})")
    routers = found.get("router", [])
    if len(routers) > 1:
        raise CheckpointError(f"{root} holds {len(routers)} routers; keep exactly one")
    return experts, (routers[0] if routers else None)


def _assemble(unets: list[Checkpoint], router: Checkpoint | None, backend: str,
              device: str | None, source: Path, is_mixture: bool) -> LoadedDDM:
    archs = {(expert_image_shape(c.meta), num_classes_of(c.meta)) for c in unets}
    if len(archs) != 1:
        raise CheckpointError(f"experts in {source} disagree on image shape or number of "
                              f"classes: {archs}")
    image_shape, num_classes = archs.pop()
    if router is not None:
        k = router_network_config(router).num_experts
        if k != len(unets):
            raise CheckpointError(
                f"router {router.path} was trained for {k} experts, "
                f"but {source} holds {len(unets)}")
    experts = tuple(LoadedExpert(name=c.meta.name, classes=c.meta.classes,
                                 velocity=expert_velocity(c, backend, device)) for c in unets)
    return LoadedDDM(experts=experts,
                     router=router_probabilities(router, device) if router else None,
                     image_shape=image_shape, num_classes=num_classes,
                     is_mixture=is_mixture, source=source)


def num_classes_of(meta: CheckpointMeta) -> int:
    """The size of the label space an expert was conditioned on: its architecture's
    ``num_classes`` (our UNet always records one), else one past its largest class."""
    recorded = meta.architecture.get("num_classes")
    return int(recorded) if isinstance(recorded, int) else max(meta.classes, default=0) + 1


def _partition_index(ckpt: Checkpoint) -> int:
    partition = ckpt.meta.partition or {}
    if "index" not in partition:
        raise CheckpointError(f"expert {ckpt.path} records no partition index")
    return int(partition["index"])
