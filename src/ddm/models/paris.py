"""Bagel Labs' Paris DDM: its expert (DiT-XL/2 with cross-attention to CLIP tokens) and its
router network (DiT-B with a CLS token that sees only ``(x_t, t)``).

Module and parameter names are those of the public AWS Neuron port (GitHub
jimburtoft/neuronx-distributed-inference, branch contrib/paris-diffusion-model,
``modeling_paris.py``), so a release's ``diffusion_pytorch_model.safetensors`` loads with
``strict=True``; constructor arguments carry the port's names. Both networks follow
diffusers' FlowMatchEulerDiscrete convention, not ours: the time input is
``timestep = sigma * 1000`` (sigma 1 = noise) and the expert predicts ``noise - data``;
:mod:`ddm.convention` converts (``flow_match_timestep``, ``velocity_from_flow_match``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from diffusers.models.embeddings import get_timestep_embedding
from torch import nn

from ddm.models.config import ConfigError

#: Width of the sinusoidal time features both networks embed (fixed in the port).
FREQUENCY_EMBEDDING_SIZE = 256
#: PyTorch's grouped matrix product: ``F.grouped_mm`` in recent releases, the same operator
#: as ``torch._grouped_mm`` in those before (a device image's PyTorch may be older).
_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


@dataclass(frozen=True)
class ParisExpertConfig:
    """A Paris expert's architecture; the defaults are the release's DiT-XL/2 (605M)."""

    input_size: int = 32
    patch_size: int = 2
    in_channels: int = 4
    out_channels: int = 4
    hidden_size: int = 1152
    depth: int = 28
    num_heads: int = 16
    mlp_ratio: float = 4.0
    text_embed_dim: int = 768

    def __post_init__(self) -> None:
        _check_transformer(self)

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)


@dataclass(frozen=True)
class ParisRouterConfig:
    """A Paris router network's architecture; the defaults are the release's DiT-B (129M)."""

    input_size: int = 32
    patch_size: int = 2
    in_channels: int = 4
    hidden_size: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    num_clusters: int = 8

    def __post_init__(self) -> None:
        _check_transformer(self)

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)


class TimestepEmbedder(nn.Module):
    """``timestep`` (B,) in ``sigma * 1000`` units -> (B, hidden) through DiT's cos/sin
    features and a two-layer MLP."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(FREQUENCY_EMBEDDING_SIZE, hidden_size), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size))

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        features = get_timestep_embedding(timestep, FREQUENCY_EMBEDDING_SIZE,
                                          flip_sin_to_cos=True, downscale_freq_shift=0)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


class Attention(nn.Module):
    """Multi-head attention with ``nn.MultiheadAttention``'s parameters and initialisation
    (``in_proj_weight`` (3D, D) packing q, k and v, ``in_proj_bias``, ``out_proj``: the port's
    names, so a release loads unchanged), computed batch-first: one packed projection,
    ``scaled_dot_product_attention`` on the heads as strided views, one copy back. PyTorch's
    module works sequence-first and copies q, k, v and its output between the two layouts, five
    copies a block over the whole activations (docs/benchmarks.md, ``forwards``)."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * hidden_size, hidden_size))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * hidden_size))
        self.out_proj = nn.Linear(hidden_size, hidden_size)
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.zeros_(self.in_proj_bias)
        nn.init.zeros_(self.out_proj.bias)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (B, N, D) attending to itself, or to ``context`` (B, L, D) -> (B, N, D)."""
        heads, width = self.num_heads, x.shape[-1]
        if context is None:
            q, k, v = _heads(F.linear(x, self.in_proj_weight, self.in_proj_bias), 3, heads)
        else:
            weight_q, weight_kv = self.in_proj_weight.split((width, 2 * width))
            bias_q, bias_kv = self.in_proj_bias.split((width, 2 * width))
            (q,) = _heads(F.linear(x, weight_q, bias_q), 1, heads)
            k, v = _heads(F.linear(context, weight_kv, bias_kv), 2, heads)
        return self.out_proj(_attend(q, k, v))


class ExpertBlock(nn.Module):
    """Self-attention, cross-attention to the text tokens, MLP; adaLN-single modulation
    (one shared projection of time, plus a learned per-block table), as in PixArt-alpha."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.scale_shift_table = nn.Parameter(torch.zeros(6, hidden_size))
        self.attn = Attention(hidden_size, num_heads)
        self.cross_attn = Attention(hidden_size, num_heads)
        self.mlp = _mlp(hidden_size, mlp_ratio)

    def forward(self, x: torch.Tensor, time_modulation: torch.Tensor,
                text: torch.Tensor) -> torch.Tensor:
        """``x`` (B, N, D), ``time_modulation`` (B, 6, D), ``text`` (B, L, D) -> (B, N, D)."""
        shift1, scale1, gate1, shift2, scale2, gate2 = (
            self.scale_shift_table[None] + time_modulation).chunk(6, dim=1)
        x = torch.addcmul(x, gate1, self.attn(_modulate(x, shift1, scale1)))
        x = x + self.cross_attn(x, text)
        return torch.addcmul(x, gate2, self.mlp(_modulate(x, shift2, scale2)))


class ExpertFinalLayer(nn.Module):
    """Modulated layer norm and the projection of each token back to a patch."""

    def __init__(self, hidden_size: int, patch_values: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, patch_values)
        self.scale_shift_table = nn.Parameter(torch.zeros(2, hidden_size))


class ParisExpert(nn.Module):
    """A Paris expert: ``(latents (B, C, S, S), timestep (B,), text (B, L, text_embed_dim))``
    -> the flow-matching output ``noise - data`` (B, C, S, S); ``timestep = sigma * 1000``.

    ``text`` is CLIP's last hidden state (all 77 tokens, padding included, no mask)."""

    def __init__(self, input_size: int = 32, patch_size: int = 2, in_channels: int = 4,
                 out_channels: int = 4, hidden_size: int = 1152, depth: int = 28,
                 num_heads: int = 16, mlp_ratio: float = 4.0, text_embed_dim: int = 768) -> None:
        super().__init__()
        self.config = ParisExpertConfig(input_size, patch_size, in_channels, out_channels,
                                        hidden_size, depth, num_heads, mlp_ratio, text_embed_dim)
        self.patch_embed = nn.Conv2d(in_channels, hidden_size, patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, (input_size // patch_size) ** 2, hidden_size))
        self.time_embed = TimestepEmbedder(hidden_size)
        self.text_proj = nn.Linear(text_embed_dim, hidden_size)
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        self.layers = nn.ModuleList(ExpertBlock(hidden_size, num_heads, mlp_ratio)
                                    for _ in range(depth))
        self.final_layer = ExpertFinalLayer(hidden_size, patch_size * patch_size * out_channels)

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor,
                text: torch.Tensor) -> torch.Tensor:
        batch, width = latents.shape[0], self.config.hidden_size
        # Token-major in memory, once: the sum keeps the convolution's channel-major layout,
        # and every block's layer norms and projections would copy it back (three copies a
        # block over the whole activations: docs/benchmarks.md, ``forwards``).
        x = (self.patch_embed(latents).flatten(2).transpose(1, 2) + self.pos_embed).contiguous()
        time = self.time_embed(timestep)
        time_modulation = self.t_block(time).reshape(batch, 6, width)
        text = self.text_proj(text)
        for layer in self.layers:
            x = layer(x, time_modulation, text)
        final = self.final_layer
        shift, scale = (final.scale_shift_table[None] + time[:, None]).chunk(2, dim=1)
        patches = final.linear(_modulate(x, shift, scale))
        return _unpatchify(patches, self.config.patch_size, self.config.out_channels)


class ParisExpertGroup(nn.Module):
    """Same-architecture Paris experts as one forward over rows of any of them:
    ``(latents (B, C, S, S), timestep (B,), text (B, L, E), experts (B,))`` -> each row
    through expert ``experts[row]`` (an index into the group), as that expert alone computes
    it. Each projection is one ``F.grouped_mm`` over the experts' stacked weights, taking
    each expert's rows as one group (a group may be empty: top-2 of eight experts runs only
    the two a step picked, no padding); attention, norms and the elementwise work run over all
    rows at once. One forward's kernels instead of one per expert: what a batch of a few rows
    is bound by on an accelerator (docs/benchmarks.md, ``forwards``).

    The experts' parameters move into the stacked tensors: each expert's parameters become
    views of its slice, so the group holds no second copy and each expert still runs alone.
    Build the group before any expert is compiled into CUDA graphs (which hold parameters'
    addresses)."""

    def __init__(self, experts: Sequence[ParisExpert]) -> None:
        super().__init__()
        if not experts:
            raise ValueError("a group needs at least one expert")
        first = next(experts[0].parameters())
        for index, expert in enumerate(experts):
            reason = grouped_forward_unsupported(expert.config, first.dtype, first.device)
            parameter = next(expert.parameters())
            if expert.config != experts[0].config:
                reason = f"its architecture {expert.config} is not {experts[0].config}"
            elif (parameter.dtype, parameter.device) != (first.dtype, first.device):
                reason = (f"it runs in {parameter.dtype} on {parameter.device}, expert 0 in "
                          f"{first.dtype} on {first.device}")
            if reason is not None:
                raise ValueError(f"expert {index} cannot join the group: {reason}")
        self.config = experts[0].config
        self.group_size = len(experts)
        # Plain tensors even where the group is built in inference mode: the experts' own
        # parameters become views of them, and may run with autograd later.
        with torch.inference_mode(False), torch.no_grad():
            for name, _ in experts[0].named_parameters():
                each = [expert.get_parameter(name) for expert in experts]
                stacked = torch.stack(each)
                for parameter, view in zip(each, stacked.unbind(0)):
                    parameter.data = view
                self.register_buffer(_buffer_name(name), stacked, persistent=False)

    def stacked(self, name: str) -> torch.Tensor:
        """The experts' parameter ``name`` (as named in :class:`ParisExpert`), stacked (K, ...)."""
        return self.get_buffer(_buffer_name(name))

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor:
        config = self.config
        # Each expert's rows next to each other (the order grouped_mm's groups take), once
        # for the whole forward; the output goes back to the caller's order at the end.
        experts, order = torch.sort(experts, stable=True)
        latents, timestep, text = latents[order], timestep[order], text[order]
        rows = torch.zeros(self.group_size, dtype=torch.int32, device=experts.device).scatter_add_(
            0, experts, torch.ones_like(experts, dtype=torch.int32))
        ends = rows.cumsum(0, dtype=torch.int32)
        batch, width, patch = latents.shape[0], config.hidden_size, config.patch_size

        def linear(x: torch.Tensor, name: str, weight: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
            """``x`` (B, N, in), row b through its expert's projection ``name`` -> (B, N,
            out)."""
            weight = self.stacked(f"{name}.weight") if weight is None else weight
            bias = self.stacked(f"{name}.bias") if bias is None else bias
            tokens = x.shape[1]
            out = _grouped_mm(x.reshape(batch * tokens, -1), weight.transpose(1, 2),
                              offs=ends * tokens)
            return out.view(batch, tokens, -1).add_(bias[experts][:, None])

        def attention(x: torch.Tensor, context: torch.Tensor | None,
                      name: str) -> torch.Tensor:
            weight, bias = self.stacked(f"{name}.in_proj_weight"), self.stacked(
                f"{name}.in_proj_bias")
            if context is None:
                q, k, v = _heads(linear(x, name, weight, bias), 3, config.num_heads)
            else:
                (q,) = _heads(linear(x, name, weight[:, :width], bias[:, :width]), 1,
                              config.num_heads)
                k, v = _heads(linear(context, name, weight[:, width:], bias[:, width:]), 2,
                              config.num_heads)
            return linear(_attend(q, k, v), f"{name}.out_proj")

        patches = _patchify(latents, patch)
        embed = self.stacked("patch_embed.weight").flatten(2)
        x = (linear(patches, "patch_embed", embed)
             + self.stacked("pos_embed")[experts, 0])
        features = get_timestep_embedding(timestep, FREQUENCY_EMBEDDING_SIZE,
                                          flip_sin_to_cos=True, downscale_freq_shift=0)
        time = linear(F.silu(linear(features.to(x.dtype)[:, None], "time_embed.mlp.0")),
                      "time_embed.mlp.2")
        time_modulation = linear(F.silu(time), "t_block.1").view(batch, 6, width)
        text = linear(text, "text_proj")
        for index in range(config.depth):
            name = f"layers.{index}"
            shift1, scale1, gate1, shift2, scale2, gate2 = (
                self.stacked(f"{name}.scale_shift_table")[experts]
                + time_modulation).chunk(6, dim=1)
            x = torch.addcmul(x, gate1, attention(_modulate(x, shift1, scale1), None,
                                                  f"{name}.attn"))
            x = x + attention(x, text, f"{name}.cross_attn")
            hidden = F.gelu(linear(_modulate(x, shift2, scale2), f"{name}.mlp.0"),
                            approximate="tanh")
            x = torch.addcmul(x, gate2, linear(hidden, f"{name}.mlp.2"))
        shift, scale = (self.stacked("final_layer.scale_shift_table")[experts]
                        + time).chunk(2, dim=1)
        patches = linear(_modulate(x, shift, scale), "final_layer.linear")
        out = _unpatchify(patches, patch, config.out_channels)
        return torch.empty_like(out).index_copy_(0, order, out)


def grouped_forward_unsupported(config: ParisExpertConfig, dtype: torch.dtype,
                                device: torch.device, compiled: bool = False) -> str | None:
    """Why experts of ``config`` in ``dtype`` on ``device`` cannot run as a
    :class:`ParisExpertGroup` (``compiled``: under ``torch.compile``), or None.
    ``F.grouped_mm`` takes bfloat16 on CUDA from compute capability 8.0 and under
    ``torch.compile`` (any floating dtype in an eager forward on a CPU), and every row of its
    operands 16-byte aligned."""
    if compiled and dtype != torch.bfloat16:
        return f"a compiled grouped matrix product takes bfloat16, not {dtype}"
    if device.type == "cuda":
        if dtype != torch.bfloat16:
            return f"grouped matrix products on CUDA take bfloat16, not {dtype}"
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "grouped matrix products on CUDA need compute capability 8.0 or newer"
    elif device.type != "cpu":
        return f"grouped matrix products run on CUDA and the CPU, not {device.type}"
    size = torch.empty((), dtype=dtype).element_size()
    widths = {"hidden_size": config.hidden_size, "text_embed_dim": config.text_embed_dim,
              "MLP width": int(config.hidden_size * config.mlp_ratio),
              "patch values": config.in_channels * config.patch_size ** 2,
              "output patch values": config.out_channels * config.patch_size ** 2}
    for what, value in widths.items():
        if value * size % 16:
            return f"its {what} ({value}) in {dtype} is not a multiple of 16 bytes"
    return None


class RouterBlock(nn.Module):
    """Self-attention and MLP under adaLN-Zero modulation from the time embedding (DiT)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float) -> None:
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        self.attn = Attention(hidden_size, num_heads)
        self.mlp = _mlp(hidden_size, mlp_ratio)

    def forward(self, x: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        """``x`` (B, N, D), ``time`` (B, D) -> (B, N, D)."""
        modulation = self.adaLN_modulation(time).reshape(x.shape[0], 6, x.shape[-1])
        shift1, scale1, gate1, shift2, scale2, gate2 = modulation.chunk(6, dim=1)
        x = torch.addcmul(x, gate1, self.attn(_modulate(x, shift1, scale1)))
        return torch.addcmul(x, gate2, self.mlp(_modulate(x, shift2, scale2)))


class ParisRouter(nn.Module):
    """Paris's router network: ``(latents (B, C, S, S), timestep (B,))`` -> cluster logits
    (B, num_clusters), read from a CLS token; ``timestep = sigma * 1000``. No text input."""

    def __init__(self, input_size: int = 32, patch_size: int = 2, in_channels: int = 4,
                 hidden_size: int = 768, depth: int = 12, num_heads: int = 12,
                 mlp_ratio: float = 4.0, num_clusters: int = 8) -> None:
        super().__init__()
        self.config = ParisRouterConfig(input_size, patch_size, in_channels, hidden_size, depth,
                                        num_heads, mlp_ratio, num_clusters)
        self.patch_embed = nn.Conv2d(in_channels, hidden_size, patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, (input_size // patch_size) ** 2, hidden_size))
        self.time_embed = TimestepEmbedder(hidden_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, hidden_size))
        self.layers = nn.ModuleList(RouterBlock(hidden_size, num_heads, mlp_ratio)
                                    for _ in range(depth))
        self.head = nn.Sequential(
            nn.Linear(hidden_size, hidden_size), nn.GELU(approximate="tanh"),
            nn.LayerNorm(hidden_size), nn.GELU(approximate="tanh"),
            nn.Linear(hidden_size, num_clusters))

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(latents).flatten(2).transpose(1, 2) + self.pos_embed
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        time = self.time_embed(timestep)
        for layer in self.layers:
            x = layer(x, time)
        return self.head(x[:, 0])


def _mlp(hidden_size: int, mlp_ratio: float) -> nn.Sequential:
    inner = int(hidden_size * mlp_ratio)
    return nn.Sequential(nn.Linear(hidden_size, inner), nn.GELU(approximate="tanh"),
                         nn.Linear(inner, hidden_size))


def _heads(projected: torch.Tensor, parts: int, heads: int) -> tuple[torch.Tensor, ...]:
    """(B, N, parts * D) -> ``parts`` views (B, heads, N, D / heads), none copied."""
    batch, tokens, width = projected.shape
    return projected.view(batch, tokens, parts, heads,
                          width // (parts * heads)).permute(2, 0, 3, 1, 4).unbind(0)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Heads (B, heads, N, D / heads) -> attention's output (B, N, D), copied back once."""
    batch, heads, tokens, depth = q.shape
    out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(batch, tokens, heads * depth)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Parameter-free layer norm over the width, then ``* (1 + scale) + shift`` (one kernel
    for the two)."""
    return torch.addcmul(shift, F.layer_norm(x, (x.shape[-1],)), 1 + scale)


def _patchify(latents: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, tokens, C * patch * patch), each token's values ``(c, p, q)`` in
    a patch-embedding convolution's weight order."""
    batch, channels, height, width = latents.shape
    x = latents.reshape(batch, channels, height // patch, patch, width // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(batch, -1, channels * patch * patch)


def _buffer_name(parameter: str) -> str:
    return parameter.replace(".", "__")


def _unpatchify(patches: torch.Tensor, patch: int, channels: int) -> torch.Tensor:
    """(B, side * side, patch * patch * channels), each token ``(p, q, c)`` -> (B, C, H, W)."""
    batch, tokens = patches.shape[:2]
    side = math.isqrt(tokens)
    x = patches.reshape(batch, side, side, patch, patch, channels)
    return torch.einsum("nhwpqc->nchpwq", x).reshape(batch, channels, side * patch,
                                                      side * patch)


def _check_transformer(config: ParisExpertConfig | ParisRouterConfig) -> None:
    name = type(config).__name__
    for field, value in asdict(config).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{name}.{field} must be a positive number, got {value!r}")
        if field != "mlp_ratio" and not isinstance(value, int):
            raise ConfigError(f"{name}.{field} must be an integer, got {value!r}")
    if config.input_size % config.patch_size:
        raise ConfigError(f"{name}: input_size {config.input_size} is not a multiple of "
                          f"patch_size {config.patch_size}")
    if config.hidden_size % config.num_heads:
        raise ConfigError(f"{name}: hidden_size {config.hidden_size} is not a multiple of "
                          f"num_heads {config.num_heads}")
