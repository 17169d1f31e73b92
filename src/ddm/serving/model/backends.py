"""Model backends an expert serves with: PyTorch, JAX, or torch-neuronx (AWS Trainium/Inferentia).

The checkpoint format is framework-neutral, so any backend serves any expert built from our
UNet; a user's network (``ddm.models.imports``) or exported program runs on its own framework.
Each backend is a NumPy network ``(x (B, C, H, W) f32, t (B,) f32, y (B,) int) -> out``
(converted to our velocity by :class:`Backend`) plus the batch sizes it is compiled for: JAX
compiles one program per batch size and a Neuron trace is fixed to one, so those backends pad
each batch up to a bucket of :func:`batch_buckets` and compile every bucket during
:meth:`Backend.warm_up`, before the server reports ready. PyTorch runs any size eagerly and is
warmed at 1 and ``max_batch`` rows, except an exported program, padded to the buckets too: its
tensors' sizes are checked at those batch sizes only (``ddm.models.torch_program``), and a
network under ``torch.compile`` (``compile_mode``), padded and warmed at every bucket and run
on the compiled-model thread (:mod:`ddm.serving.model.compiled`).

Frameworks are imported only when their backend is selected, so a JAX image needs no torch and
the CPU image needs no torch-neuronx.

Neuron compile cache: ``torch_neuronx.trace`` compiles each bucket with neuronx-cc (minutes for
a UNet). The traced modules are saved with ``torch.jit.save`` under ``compile_cache``
(default ``$DDM_NEURON_CACHE``, else ``~/.cache/ddm/neuron``), keyed by the weights' SHA-256,
the bucket and the torch-neuronx version, and reloaded with ``torch.jit.load`` on the next
start. Mount that directory on a persistent volume to skip compilation after a restart.
Compiler flags still come from ``NEURON_CC_FLAGS``; NeuronCores are chosen with
``NEURON_RT_VISIBLE_CORES``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ddm.checkpoints.format import CONFIG_FILE, Checkpoint
from ddm.deploy.limits import EXPERT_BACKENDS, compile_refusal
from ddm.models.loading import ModelFn, expert_image_shape, expert_network
from ddm.objectives import NATIVE, Objective, as_velocity
from ddm.serving.batching import batch_buckets, bucket_for, pad_rows
from ddm.serving.model.compiled import on_compiled_thread

#: The modules each backend imports, checked (without importing) before anything loads.
_REQUIRES = {"torch": ("torch",), "jax": ("jax", "flax"), "neuron": ("torch", "torch_neuronx")}
_INSTALL_HINTS = {
    "torch": "pip install 'ddm-operator[torch]'",
    "jax": "pip install 'ddm-operator[jax]' (with the jax build for your accelerator)",
    "neuron": "use the Neuron image (Dockerfile.neuron) or install torch-neuronx from AWS's "
              "repository on an Inf2/Trn1 host: pip install torch-neuronx "
              "--extra-index-url https://pip.repos.neuron.amazonaws.com",
}


class BackendUnavailable(RuntimeError):
    """The selected backend's framework is not installed, or its device does not exist."""


@dataclass(frozen=True)
class BackendInfo:
    """``framework``: the library running the model; ``device``: where it runs;
    ``hardware``: the processor's model name, for people (``/v1/info``, the router's page)."""

    framework: str
    backend: str
    device: str
    hardware: str


def cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo``), or the machine type where unknown."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.machine() or "unknown CPU"


class Backend:
    """A network with the batch sizes it is compiled for and a warm-up over them; it serves
    our velocity, converted from the network's declared ``objective`` here for every backend."""

    def __init__(self, run: ModelFn, info: BackendInfo, image_shape: tuple[int, int, int],
                 warm_sizes: tuple[int, ...], pads_to_warm_sizes: bool, warm_label: int,
                 objective: Objective = NATIVE) -> None:
        self._run = run
        self._info = info
        self._image_shape = image_shape
        self._warm_sizes = warm_sizes
        self._pads = pads_to_warm_sizes
        self._warm_label = warm_label
        self._velocity = as_velocity(objective, self.network)

    def network(self, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        """The network as trained (its own inputs and prediction), on any batch size."""
        if not self._pads:
            return self._run(x, t, y)
        rows = x.shape[0]
        padded = pad_rows((x, t, y), bucket_for(rows, self._warm_sizes))
        return self._run(*padded)[:rows]

    def velocity(self, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``v(x, t, y)``: ``x`` (B, C, H, W) float32, ``t`` (B,), ``y`` (B,) -> (B, C, H, W)."""
        return self._velocity(x, t, y)

    def info(self) -> BackendInfo:
        """What runs the model and where, for ``/v1/info`` and logs."""
        return self._info

    def warm_up(self) -> None:
        """Run every compiled batch size once, so that no request pays for compilation."""
        for size in self._warm_sizes:
            self.velocity(np.zeros((size, *self._image_shape), np.float32),
                          np.full((size,), 0.5, np.float32),
                          np.full((size,), self._warm_label, np.int64))


#: ``(checkpoint, backend, device, max_batch, compile_cache, compile_mode) -> Backend``:
#: :func:`load_backend`, or a replacement that serves a custom backend.
BackendLoader = Callable[[Checkpoint, str, str | None, int, Path | None, str], Backend]


def check_backend(name: str, device: str | None = None) -> None:
    """Fail fast, without importing anything, if backend ``name`` cannot run here."""
    if name not in EXPERT_BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(EXPERT_BACKENDS)}")
    missing = [m for m in _REQUIRES[name] if importlib.util.find_spec(m) is None]
    if missing:
        others = ", ".join(b for b in EXPERT_BACKENDS if b != name)
        raise BackendUnavailable(
            f"backend {name!r} needs {', '.join(missing)}, which is not installed here; "
            f"{_INSTALL_HINTS[name]}; or pick another backend ({others})")
    if name == "neuron" and device is not None:
        raise ValueError("the neuron backend takes no device: choose NeuronCores with "
                         "NEURON_RT_VISIBLE_CORES")


def load_backend(ckpt: Checkpoint, backend: str, device: str | None, max_batch: int,
                 compile_cache: Path | None = None, compile_mode: str = "none") -> Backend:
    """Build ``backend`` for an expert checkpoint (not yet warmed up): our UNet on any
    backend, a user's network (``ckpt.meta.model``) on its own framework (torch networks on
    Neuron too).

    ``device``: torch ``cpu``/``cuda[:N]``/``xla``; JAX ``cpu``/``gpu``/``tpu`` with an optional
    ``:N``; None for the framework's default. Neuron takes no device (see the module doc).
    ``compile_mode``: ``torch.compile``'s mode for the torch backend (``none``: eager).
    """
    check_backend(backend, device)
    refusal = compile_refusal(compile_mode, backend)
    if refusal is not None:
        raise ValueError(refusal)
    image_shape = expert_image_shape(ckpt.meta)
    label = min(ckpt.meta.classes, default=0)
    if backend == "torch":
        return _torch_backend(ckpt, device, max_batch, image_shape, label, compile_mode)
    if backend == "jax":
        return _jax_backend(ckpt, device, max_batch, image_shape, label)
    return _neuron_backend(ckpt, max_batch, image_shape, label, compile_cache)


def _torch_backend(ckpt: Checkpoint, device: str | None, max_batch: int,
                   image_shape: tuple[int, int, int], label: int, compile_mode: str) -> Backend:
    import torch

    from ddm.models.torch_io import select_torch_device

    target = select_torch_device(device)
    hardware = torch.cuda.get_device_name(target) if target.type == "cuda" else cpu_model()
    info = BackendInfo(f"torch {torch.__version__}", "torch", str(target), hardware)
    # An exported program is checked at, so run at, these sizes only; a compiled network
    # compiles (and records a CUDA graph) for each size it meets, so it meets these only.
    padded = ckpt.meta.model.kind == "exported" or compile_mode != "none"
    sizes = batch_buckets(max_batch) if padded else tuple(sorted({1, max_batch}))
    run = expert_network(ckpt, "torch", device, sizes, compile_mode)
    if compile_mode != "none":
        run = on_compiled_thread(compile_mode, run)
    return Backend(run, info, image_shape, sizes, pads_to_warm_sizes=padded, warm_label=label,
                   objective=ckpt.meta.objective)


def _jax_backend(ckpt: Checkpoint, device: str | None, max_batch: int,
                 image_shape: tuple[int, int, int], label: int) -> Backend:
    import jax

    from ddm.models.flax_unet import select_jax_device

    try:
        target = select_jax_device(device)
    except ValueError as exc:
        raise BackendUnavailable(str(exc)) from None
    run = expert_network(ckpt, "jax", device)
    info = BackendInfo(f"jax {jax.__version__}", "jax", f"{target.platform}:{target.id}",
                       cpu_model() if target.platform == "cpu" else target.device_kind)
    return Backend(run, info, image_shape, batch_buckets(max_batch), pads_to_warm_sizes=True,
                   warm_label=label, objective=ckpt.meta.objective)


def _neuron_backend(ckpt: Checkpoint, max_batch: int, image_shape: tuple[int, int, int],
                    label: int, compile_cache: Path | None) -> Backend:
    import torch
    import torch_neuronx

    from ddm.models.torch_io import expert_module, model_input

    cache = compile_cache or Path(os.environ.get("DDM_NEURON_CACHE",
                                                 Path.home() / ".cache" / "ddm" / "neuron"))
    cache.mkdir(parents=True, exist_ok=True)
    if ckpt.meta.model.kind == "exported" or ckpt.meta.framework != "torch":
        if ckpt.meta.model.kind != "unet":
            raise BackendUnavailable(
                f"expert {ckpt.meta.name} is a {ckpt.meta.framework} {ckpt.meta.model.kind} "
                "network; the neuron backend traces our UNet or a torch module by import path")
    model = expert_module(ckpt)
    sha = json.loads((ckpt.path / CONFIG_FILE).read_text())["weights_sha256"]
    version = getattr(torch_neuronx, "__version__", "unknown")
    traced = {}
    for size in batch_buckets(max_batch):
        path = cache / f"unet-{sha[:16]}-b{size}-neuronx-{version}.pt"
        if path.is_file():
            traced[size] = torch.jit.load(str(path))
            continue
        example = (torch.zeros((size, *image_shape)), torch.zeros(size),
                   torch.zeros(size, dtype=torch.int64))
        traced[size] = torch_neuronx.trace(model, example)
        torch.jit.save(traced[size], str(path))

    def run(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        with torch.inference_mode():  # the trace was made with int64 labels
            v = traced[x.shape[0]](model_input(x), model_input(t),
                                   model_input(y, dtype=torch.int64))
        return v.numpy()

    cores = os.environ.get("NEURON_RT_VISIBLE_CORES", "all")
    info = BackendInfo(f"torch-neuronx {version}", "neuron", f"neuron (cores: {cores})",
                       "AWS NeuronCore")
    return Backend(run, info, image_shape, batch_buckets(max_batch), pads_to_warm_sizes=True,
                   warm_label=label, objective=ckpt.meta.objective)
