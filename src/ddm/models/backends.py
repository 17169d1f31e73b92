"""Where a stage's network runs: the backends a model server offers (PyTorch, JAX, or
torch-neuronx on AWS Trainium/Inferentia), checked before anything loads, and what runs a loaded
stage (:class:`Runtime`: ``/v1/info``'s runtime, device and hardware).

Frameworks are imported only when their backend is selected, so a JAX image needs no torch and
the CPU image needs no torch-neuronx; :func:`check_backend` says, without importing, what is
missing and how to install it.

Neuron compile cache (:func:`neuron_network`, our label UNet or a torch module by import
path): ``torch_neuronx.trace`` compiles each batch size with neuronx-cc (minutes for a UNet).
The traced modules are saved with ``torch.jit.save`` under ``compile_cache`` (default
``$DDM_NEURON_CACHE``, else ``~/.cache/ddm/neuron``), keyed by the weights' SHA-256, the batch
size and the torch-neuronx version, and reloaded with ``torch.jit.load`` on the next start.
Mount that directory on a persistent volume to skip compilation after a restart. Compiler
flags still come from ``NEURON_CC_FLAGS``; NeuronCores are chosen with
``NEURON_RT_VISIBLE_CORES``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ddm.checkpoints.format import CONFIG_FILE, Checkpoint, CheckpointError
from ddm.deploy.accelerators import NEURON_CACHE_ENV
from ddm.deploy.limits import EXPERT_BACKENDS
from ddm.models.loading import ModelFn, expert_image_shape

if TYPE_CHECKING:
    import jax
    import torch

__all__ = ["BackendUnavailable", "Runtime", "check_backend", "cpu_model", "jax_runtime",
           "neuron_network", "torch_runtime"]

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
class Runtime:
    """What runs a loaded stage, for people (``/v1/info``, the router's page): ``library``,
    the framework and its version (``torch 2.5.1``); ``device``, where it runs (``cpu``,
    ``cuda:0``, ``gpu:0``); ``hardware``, the processor's model name."""

    library: str
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


def torch_runtime(device: torch.device) -> Runtime:
    """What runs a torch network on ``device``."""
    import torch

    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return Runtime(f"torch {torch.__version__}", str(device), hardware)


def jax_runtime(device: jax.Device) -> Runtime:
    """What runs a JAX network on ``device``."""
    import jax

    hardware = cpu_model() if device.platform == "cpu" else device.device_kind
    return Runtime(f"jax {jax.__version__}", f"{device.platform}:{device.id}", hardware)


def neuron_network(ckpt: Checkpoint, batch_sizes: Sequence[int],
                   compile_cache: Path | None = None) -> tuple[ModelFn, Runtime]:
    """An expert checkpoint's network traced by torch-neuronx at each of ``batch_sizes`` (the
    only sizes it may then be called with), from the compile cache where traced before (module
    doc): ``(x (B, C, H, W) f32, t (B,) f32, y (B,) int64) -> its prediction``, and what runs
    it. Our UNet or a torch module by import path; anything else is a ``CheckpointError``."""
    import torch
    import torch_neuronx

    from ddm.models.torch_io import expert_module, model_input

    meta = ckpt.meta
    if meta.model.kind == "exported" or meta.framework != "torch":
        if meta.model.kind != "unet":
            raise CheckpointError(
                f"expert {meta.name} is a {meta.framework} {meta.model.kind} network; the "
                "neuron backend traces our UNet or a torch module by import path")
    cache = compile_cache or Path(os.environ.get(NEURON_CACHE_ENV,
                                                 Path.home() / ".cache" / "ddm" / "neuron"))
    cache.mkdir(parents=True, exist_ok=True)
    model, image_shape = expert_module(ckpt), expert_image_shape(meta)
    sha = json.loads((ckpt.path / CONFIG_FILE).read_text())["weights_sha256"]
    version = getattr(torch_neuronx, "__version__", "unknown")
    traced = {}
    for size in batch_sizes:
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
    return run, Runtime(f"torch-neuronx {version}", f"neuron (cores: {cores})",
                        "AWS NeuronCore")
