"""Load one Paris component directory (``expert_K/`` or ``router/`` of a release) strictly.

The port never reads a component's ``config.json`` and its official field names are not
published, so a ``config.json`` is optional: its fields with the port's names
(``ParisExpertConfig`` / ``ParisRouterConfig``) are taken, others are ignored, and everything
the weights determine (sizes, depth, patch, channels, text width, clusters) is read from their
shapes and must agree with it. Only ``num_heads`` is invisible in the weights; without a
config it is the release's (16 for an expert, 12 for the router). The depth must be blocks
``layers.0 .. layers.N-1``, N at most ``MAX_NETWORK_BLOCKS``, before the network is built (on
the ``meta`` device); then any missing, unexpected or misshapen tensor is refused by name from
the safetensors header, before a tensor is read.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import torch
from safetensors.torch import load_file

from ddm.checkpoints.format import CheckpointError, check_shapes, read_config, safetensors_header
from ddm.deploy.limits import MAX_NETWORK_BLOCKS
from ddm.models.config import ConfigError
from ddm.models.paris import ParisExpert, ParisExpertConfig, ParisRouter, ParisRouterConfig

#: The weight file names a Paris component directory may hold (experts use the first, the
#: release's router the second); exactly one must be present.
WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "pytorch_model.safetensors")
CONFIG_FILE = "config.json"

Shapes = Mapping[str, tuple[int, ...]]
ConfigT = TypeVar("ConfigT", ParisExpertConfig, ParisRouterConfig)


def load_paris_expert(directory: str | Path, dtype: torch.dtype | None = None) -> ParisExpert:
    """An ``expert_K/`` directory -> a :class:`ParisExpert` in eval mode, in the weights' dtype
    unless ``dtype`` is given."""
    return _load(Path(directory), infer_expert_config, ParisExpert, dtype)


def load_paris_router(directory: str | Path, dtype: torch.dtype | None = None) -> ParisRouter:
    """A ``router/`` directory -> a :class:`ParisRouter` in eval mode."""
    return _load(Path(directory), infer_router_config, ParisRouter, dtype)


def weight_file(directory: Path) -> Path:
    """The one safetensors file of a component directory."""
    present = [directory / name for name in WEIGHT_FILES if (directory / name).is_file()]
    if len(present) != 1:
        found = ", ".join(p.name for p in present) or "neither"
        raise CheckpointError(f"Paris component {directory} must hold exactly one of "
                              f"{' or '.join(WEIGHT_FILES)}; found {found}")
    return present[0]


def weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, read from the safetensors header without loading the tensors."""
    return {name: shape for name, (_, shape) in safetensors_header(path).items()}


def infer_expert_config(shapes: Shapes, num_heads: int = 16) -> ParisExpertConfig:
    """A Paris expert's architecture from its weights' shapes (``num_heads`` is not in them)."""
    hidden, channels, patch = _patch_embed(shapes)
    patch_values = _shape(shapes, "final_layer.linear.weight")[0]
    if patch_values % (patch * patch):
        raise CheckpointError(f"final_layer.linear.weight has {patch_values} outputs, not a "
                              f"multiple of patch_size**2 = {patch * patch}")
    return _build(ParisExpertConfig, input_size=_input_size(shapes, patch), patch_size=patch,
                  in_channels=channels, out_channels=patch_values // (patch * patch),
                  hidden_size=hidden, depth=_depth(shapes), num_heads=num_heads,
                  mlp_ratio=_mlp_ratio(shapes, hidden),
                  text_embed_dim=_shape(shapes, "text_proj.weight")[1])


def infer_router_config(shapes: Shapes, num_heads: int = 12) -> ParisRouterConfig:
    """A Paris router network's architecture from its weights' shapes."""
    hidden, channels, patch = _patch_embed(shapes)
    return _build(ParisRouterConfig, input_size=_input_size(shapes, patch), patch_size=patch,
                  in_channels=channels, hidden_size=hidden, depth=_depth(shapes),
                  num_heads=num_heads, mlp_ratio=_mlp_ratio(shapes, hidden),
                  num_clusters=_shape(shapes, "head.4.weight")[0])


def resolve_config(infer: Callable[..., ConfigT], shapes: Shapes,
                   declared: Mapping[str, Any]) -> ConfigT:
    """The architecture the weights' ``shapes`` determine, with ``num_heads`` from
    ``declared`` (a config.json's fields) when given; every other declared field with a port
    name must equal what the weights say."""
    inferred = (infer(shapes) if "num_heads" not in declared
                else infer(shapes, num_heads=declared["num_heads"]))
    fields = {f.name for f in dataclasses.fields(inferred)} - {"num_heads"}
    mismatches = [f"{name}: config.json says {declared[name]!r}, the weights have "
                  f"{getattr(inferred, name)!r}"
                  for name in sorted(fields & set(declared))
                  if declared[name] != getattr(inferred, name)]
    if mismatches:
        raise CheckpointError("config.json disagrees with the weights: " + "; ".join(mismatches))
    return inferred


def read_component_config(directory: Path) -> dict[str, Any]:
    """A component's config.json as a dict, or ``{}`` when it has none."""
    path = directory / CONFIG_FILE
    return read_config(path) if path.is_file() else {}


def _load(directory: Path, infer: Callable[..., ConfigT], network: type[torch.nn.Module],
          dtype: torch.dtype | None) -> Any:
    path = weight_file(directory)
    shapes = weight_shapes(path)
    config = resolve_config(infer, shapes, read_component_config(directory))  # depth bounded
    with torch.device("meta"):
        model = network(**config.to_dict())
    check_shapes(directory, {name: tuple(t.shape) for name, t in model.state_dict().items()},
                 shapes)  # every name and shape, before any tensor is read
    model.load_state_dict(load_file(str(path)), strict=True, assign=True)
    return (model if dtype is None else model.to(dtype)).eval()


def _build(config_class: type[ConfigT], **fields: Any) -> ConfigT:
    try:
        return config_class(**fields)
    except ConfigError as exc:
        raise CheckpointError(
            f"the weights' shapes give no valid architecture: {exc} (num_heads is not in the "
            f"weights: config.json gives it, else the release's is assumed)") from None


def _shape(shapes: Shapes, name: str) -> tuple[int, ...]:
    if name not in shapes:
        raise CheckpointError(f"the weights have no {name}, which a Paris component needs")
    return shapes[name]


def _patch_embed(shapes: Shapes) -> tuple[int, int, int]:
    """(hidden_size, in_channels, patch_size) from the patch embedding's convolution."""
    shape = _shape(shapes, "patch_embed.weight")
    if len(shape) != 4 or shape[2] != shape[3]:
        raise CheckpointError(f"patch_embed.weight has shape {shape}, not a square "
                              "convolution (hidden, channels, patch, patch)")
    return shape[0], shape[1], shape[2]


def _input_size(shapes: Shapes, patch: int) -> int:
    tokens = _shape(shapes, "pos_embed")[1]
    side = round(tokens ** 0.5)
    if side * side != tokens:
        raise CheckpointError(f"pos_embed holds {tokens} positions, not a square grid")
    return side * patch


def _depth(shapes: Shapes) -> int:
    """The number of transformer blocks, ``layers.0 .. layers.N-1``: contiguous, and at most
    :data:`~ddm.deploy.limits.MAX_NETWORK_BLOCKS` (the network is built from it)."""
    blocks = sorted({int(m.group(1)) for name in shapes
                     if (m := re.match(r"layers\.(\d+)\.", name))})
    if not blocks:
        raise CheckpointError("the weights have no transformer blocks (layers.N.*)")
    if blocks[-1] >= MAX_NETWORK_BLOCKS:
        raise CheckpointError(f"the weights name transformer block {blocks[-1]} "
                              f"(layers.{blocks[-1]}.*); a network has at most "
                              f"{MAX_NETWORK_BLOCKS} blocks")
    missing = sorted(set(range(blocks[-1])) - set(blocks))
    if missing:
        raise CheckpointError(f"the weights' transformer blocks are not layers.0 .. "
                              f"layers.{blocks[-1]}: layers.{missing[0]}.* is missing")
    return len(blocks)


def _mlp_ratio(shapes: Shapes, hidden: int) -> float:
    inner = _shape(shapes, "layers.0.mlp.0.weight")[0]
    ratio = inner / hidden
    if int(hidden * ratio) != inner:
        raise CheckpointError(f"layers.0.mlp.0.weight's width {inner} is no ratio of "
                              f"hidden_size {hidden} that the architecture can express")
    return ratio
