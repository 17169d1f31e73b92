"""PyTorch edge of the checkpoint format: devices, canonical weights, velocity callables."""

from __future__ import annotations

import io
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from ddm.checkpoints.format import (Checkpoint, CheckpointError, check_weight_shapes,
                                    program_file_name)
from ddm.deploy.limits import MAX_BATCH
from ddm.models.config import ConfigError, RouterNetworkConfig, UNetConfig
from ddm.models.router_net import RouterNet
from ddm.models.torch_unet import UNet


def select_torch_device(name: str | None) -> torch.device:
    """``cpu``, ``cuda[:i]``, ``xla`` (Trainium via torch-neuronx, TPU via torch-xla) or None.

    None picks CUDA when present, else the CPU. XLA stacks are imported only when asked for.
    """
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "xla":
        try:
            import torch_xla.core.xla_model as xm  # noqa: PLC0415 - optional accelerator stack
        except ImportError as exc:
            raise RuntimeError(
                "device 'xla' needs torch-xla (TPU) or torch-neuronx (AWS Trainium), which is "
                f"not installed here ({exc}); install the Neuron or TPU image, or pick cpu/cuda"
            ) from None
        return xm.xla_device()
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {name!r} asked for, but this torch build sees no CUDA GPU")
        return torch.device(name)
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"unknown torch device {name!r}; use cpu, cuda, cuda:N or xla")


def canonical_weights(module: nn.Module) -> dict[str, np.ndarray]:
    """The module's ``state_dict`` as float32 NumPy arrays: the checkpoint's canonical form."""
    return {k: v.detach().to("cpu", torch.float32).numpy().copy()
            for k, v in module.state_dict().items()}


def load_canonical(module: nn.Module, ckpt: Checkpoint) -> nn.Module:
    """Copy checked canonical weights into ``module`` (names and shapes must match exactly)."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    check_weight_shapes(ckpt.path, expected, ckpt.weights)
    module.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in ckpt.weights.items()})
    return module.eval()


def unet_from_checkpoint(ckpt: Checkpoint, device: torch.device | None = None) -> UNet:
    if ckpt.meta.kind not in ("expert", "monolith"):
        raise CheckpointError(f"checkpoint {ckpt.path} is a {ckpt.meta.kind}, not a UNet")
    model = UNet(_config(ckpt, UNetConfig))
    return load_canonical(model, ckpt).to(device or torch.device("cpu"))


def expert_module(ckpt: Checkpoint, device: torch.device | None = None,
                  batch_sizes: Sequence[int] = (1, MAX_BATCH)) -> nn.Module:
    """An expert's network as the checkpoint names it (``ckpt.meta.model``): our UNet, a
    user's module by import path (``ddm.models.imports``), or a ``torch.export`` program read
    by our strict reader (``ddm.models.torch_program``: a graph and raw tensors, never
    ``torch.export.load``, which runs code from the archive), its memory checked at each of
    ``batch_sizes``, the only batch sizes it may then be called with."""
    device = device or torch.device("cpu")
    kind = ckpt.meta.model.kind
    if kind == "unet":
        return unet_from_checkpoint(ckpt, device)
    if kind == "import":
        from ddm.models.imports import torch_module

        return torch_module(ckpt).to(device)
    from ddm.models.torch_program import load_program

    try:
        return load_program(ckpt.path / program_file_name(ckpt.meta),
                            ckpt.meta.model.image_shape, batch_sizes).to(device)
    except CheckpointError as error:
        raise type(error)(f"checkpoint {ckpt.path}: {error}") from None


def compile_network(module: nn.Module, mode: str, shapes: int) -> None:
    """Compile ``module`` in place with ``torch.compile(mode=mode)`` (every later call of it
    runs compiled), for ``shapes`` distinct input shapes. Compilation happens at the first
    call of each shape. Dynamo keeps a bounded number of compiled versions per code object
    (``recompile_limit``, 8 by default) and runs past it eagerly, so the bound is raised to
    twice ``shapes`` (room for a second text length): same-architecture networks share their
    versions (their weights are inputs), so one bound serves a pool of them."""
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, 2 * shapes)
    module.compile(mode=mode)


def export_program(module: nn.Module, image_shape: tuple[int, int, int]) -> bytes:
    """``module`` (``(x, t, y) -> (B, C, H, W)``) as a ``torch.export`` program whose batch
    size is free: what an ``exported`` checkpoint holds in ``program.pt2``."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    example = (torch.zeros((2, *image_shape)), torch.full((2,), 0.5),
               torch.zeros(2, dtype=torch.int64))
    program = torch.export.export(module.eval(), example,
                                  dynamic_shapes=({0: batch}, {0: batch}, {0: batch}))
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def router_from_checkpoint(ckpt: Checkpoint, device: torch.device | None = None) -> RouterNet:
    if ckpt.meta.kind != "router":
        raise CheckpointError(f"checkpoint {ckpt.path} is a {ckpt.meta.kind}, not a router")
    model = RouterNet(_config(ckpt, RouterNetworkConfig))
    return load_canonical(model, ckpt).to(device or torch.device("cpu"))


def model_input(array: np.ndarray, device: torch.device | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """``array`` as a tensor that a network may write to. A request's arrays are read-only
    views of its body (``ddm.serving.wire.protocol.decode_request``), and PyTorch does not keep a
    network that works in place on its input (``x.mul_(...)``) from writing into that body (it
    only warns, once); so a read-only array is copied (microseconds next to a model call) and
    a writable one shared."""
    if not array.flags.writeable:
        array = array.copy()
    return torch.as_tensor(array, device=device, dtype=dtype)


def velocity_fn(model: nn.Module, device: torch.device
                ) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """NumPy ``(x, t, y) -> out`` over a PyTorch expert network, without autograd."""

    def velocity(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            v = model(model_input(x, device), model_input(t, device), model_input(y, device))
        return v.float().cpu().numpy()

    return velocity


def router_probs_fn(model: RouterNet, device: torch.device
                    ) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """NumPy ``(x, t, y) -> p(k | x_t, t, y)`` of shape ``(B, K)``."""

    def probs(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            logits = model(model_input(x, device), model_input(t, device),
                           model_input(y, device))
        return torch.softmax(logits.float(), dim=-1).cpu().numpy()

    return probs


def _config(ckpt: Checkpoint, cls: type) -> UNetConfig | RouterNetworkConfig:
    try:
        return cls.from_dict(ckpt.meta.architecture)
    except ConfigError as exc:
        raise CheckpointError(f"checkpoint {ckpt.path}: invalid architecture: {exc}") from None
