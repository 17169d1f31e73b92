"""Load a DDM (experts + router, or one model) from checkpoints and generate images in-process.

Each expert runs on the backend of its choice: ``native`` (the framework it was trained
with), ``torch`` or ``jax`` — the checkpoint format is the same for both. ML frameworks are
imported only when a backend needs them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ddm.checkpoints.format import Checkpoint, CheckpointError, load_checkpoint, read_meta
from ddm.convention import time_grid, to_uint8
from ddm.deploy.limits import MAX_STEPS
from ddm.sampling.mixture import (MixtureExpert, RouterFn, UsageLog, mixture_velocity,
                                  single_model, validate_oracle)
from ddm.sampling.routing import Strategy, parse_strategy
from ddm.sampling.solvers import VelocityFn, initial_noise, iterate, solver_step

BACKENDS = ("native", "torch", "jax")


@dataclass(frozen=True)
class LoadedDDM:
    """Either a mixture (``experts`` + optional ``router``) or a single model (one expert)."""

    experts: tuple[MixtureExpert, ...]
    router: RouterFn | None
    image_shape: tuple[int, int, int]
    num_classes: int
    is_mixture: bool
    source: Path


@dataclass(frozen=True)
class Generation:
    images: np.ndarray        # (N, H, W) uint8, 0 background, 255 ink
    labels: np.ndarray        # (N,) int64
    expert_calls: np.ndarray  # (N,) expert forward passes per image
    usage: UsageLog


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


def load_ddm(directory: str | os.PathLike, backend: str = "native",
             device: str | None = None) -> LoadedDDM:
    """Load what ``directory`` holds: a DDM of experts (+ router), or one model alone."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    found = discover(directory)
    root = Path(directory)
    if (root / "config.json").exists():
        ckpt = load_checkpoint(root)
        if ckpt.meta.kind not in ("expert", "monolith"):
            raise CheckpointError(f"{root} is a {ckpt.meta.kind} checkpoint; it cannot generate")
        return _assemble([ckpt], None, backend, device, root, is_mixture=False)
    experts = [load_checkpoint(p) for p in found.get("expert", [])]
    if not experts:
        raise CheckpointError(f"{root} holds no expert checkpoints (found: {', '.join(found)})")
    experts.sort(key=_partition_index)
    routers = found.get("router", [])
    if len(routers) > 1:
        raise CheckpointError(f"{root} holds {len(routers)} routers; keep exactly one")
    router = load_checkpoint(routers[0]) if routers else None
    return _assemble(experts, router, backend, device, root, is_mixture=True)


def generate(ddm: LoadedDDM, labels: Sequence[int], steps: int, seed: int,
             strategy: Strategy | str = "top1", solver: str = "euler",
             first_index: int = 0) -> Generation:
    """Sample one image per label; image ``i``'s noise comes from ``(seed, first_index + i)``.

    Everything is validated before any model runs.
    """
    strategy = parse_strategy(strategy) if isinstance(strategy, str) else strategy
    y = validate_request(ddm, labels, steps, solver)
    if ddm.is_mixture and strategy.kind == "oracle":
        validate_oracle(ddm.experts, y)
    log = UsageLog(tuple(e.name for e in ddm.experts))
    if ddm.is_mixture:
        velocity = mixture_velocity(ddm.experts, ddm.router, strategy, log)
    else:
        velocity = single_model(ddm.experts[0].name, ddm.experts[0].velocity, log)
    x = initial_noise(len(y), ddm.image_shape, seed, first_index)
    for _, x in iterate(velocity, x, y, time_grid(steps), solver):
        pass
    return Generation(images=to_uint8(x[:, 0]), labels=y, expert_calls=log.expert_calls(),
                      usage=log)


def validate_request(ddm: LoadedDDM, labels: Sequence[int], steps: int, solver: str) -> np.ndarray:
    """Check labels, steps and solver; returns labels as ``(N,)`` int64."""
    solver_step(solver)
    if not isinstance(steps, (int, np.integer)) or not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps must be an integer in [1, {MAX_STEPS}], got {steps!r}")
    y = np.asarray(list(labels), dtype=np.int64).reshape(-1)
    if y.size == 0:
        raise ValueError("no labels given")
    bad = sorted({int(v) for v in y if not 0 <= v < ddm.num_classes})
    if bad:
        raise ValueError(f"labels {bad} are outside the model's classes 0..{ddm.num_classes - 1}")
    return y


def expert_velocity(ckpt: Checkpoint, backend: str = "native",
                    device: str | None = None) -> VelocityFn:
    """A NumPy velocity callable for a UNet checkpoint on the chosen framework."""
    framework = ckpt.meta.framework if backend == "native" else backend
    if framework == "torch":
        from ddm.models import torch_io

        torch_device = torch_io.select_torch_device(device)
        return torch_io.velocity_fn(torch_io.unet_from_checkpoint(ckpt, torch_device),
                                    torch_device)
    if framework == "jax":
        import jax

        from ddm.models import flax_unet
        from ddm.models.config import UNetConfig

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


def router_probabilities(ckpt: Checkpoint, device: str | None = None) -> RouterFn:
    from ddm.models import torch_io

    torch_device = torch_io.select_torch_device(device)
    return torch_io.router_probs_fn(torch_io.router_from_checkpoint(ckpt, torch_device),
                                    torch_device)


def _assemble(unets: list[Checkpoint], router: Checkpoint | None, backend: str,
              device: str | None, source: Path, is_mixture: bool) -> LoadedDDM:
    archs = {(a["in_channels"], a["image_size"], a["num_classes"])
             for a in (c.meta.architecture for c in unets)}
    if len(archs) != 1:
        raise CheckpointError(f"experts in {source} disagree on channels, size or classes: {archs}")
    channels, size, num_classes = archs.pop()
    if router is not None:
        k = router.meta.architecture.get("num_experts")
        if k != len(unets):
            raise CheckpointError(
                f"router {router.path} was trained for {k} experts, "
                f"but {source} holds {len(unets)}")
    experts = tuple(MixtureExpert(name=c.meta.name, classes=c.meta.classes,
                                  velocity=expert_velocity(c, backend, device)) for c in unets)
    return LoadedDDM(experts=experts,
                     router=router_probabilities(router, device) if router else None,
                     image_shape=(channels, size, size), num_classes=num_classes,
                     is_mixture=is_mixture, source=source)


def _partition_index(ckpt: Checkpoint) -> int:
    partition = ckpt.meta.partition or {}
    if "index" not in partition:
        raise CheckpointError(f"expert {ckpt.path} records no partition index")
    return int(partition["index"])
