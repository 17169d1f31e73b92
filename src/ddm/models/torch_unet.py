"""The conditional UNet in PyTorch. ``ddm.models.flax_unet`` mirrors it layer for layer.

Layout: images ``(B, C, H, W)`` float32 in model space, ``t`` ``(B,)`` in ``[0, 1]``, labels
``y`` ``(B,)`` int64; the output is the velocity, same shape as the image (see
``ddm.convention``). No attention, explicit padding everywhere, nearest-neighbour upsampling:
every op has an exact Flax twin, which is what keeps the two frameworks within 1e-4.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from ddm.convention import TIME_EMBEDDING_SCALE
from ddm.models.config import UNetConfig


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of ``t * TIME_EMBEDDING_SCALE``: ``(B,) -> (B, dim)``, cos then sin."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32,
                                                         device=t.device) / half)
    args = (t.float() * TIME_EMBEDDING_SCALE)[:, None] * freqs[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ResBlock(nn.Module):
    """GroupNorm-SiLU-conv twice, with the joint embedding added between, plus a skip."""

    def __init__(self, in_ch: int, out_ch: int, embed_dim: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_ch)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.emb_proj = nn.Linear(embed_dim, out_ch)
        self.norm2 = nn.GroupNorm(groups, out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.skip = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else None

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.emb_proj(F.silu(emb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.skip is None else self.skip(x)) + h


class Level(nn.Module):
    """One resolution of the encoder or decoder: residual blocks, then an optional resample."""

    def __init__(self, blocks: list[ResBlock], resample: nn.Module | None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.resample = resample


class Upsample(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2, mode="nearest"))


class UNet(nn.Module):
    """Velocity network ``v(x_t, t, y)`` for one expert or the monolith."""

    def __init__(self, config: UNetConfig) -> None:
        super().__init__()
        self.config = config
        c, e, g = config, config.embed_dim, config.norm_groups
        widths = config.level_channels
        self.time_mlp = nn.Sequential(nn.Linear(c.time_features, e), nn.SiLU(), nn.Linear(e, e))
        self.class_embed = nn.Embedding(c.num_classes, e)
        self.conv_in = nn.Conv2d(c.in_channels, widths[0], 3, padding=1)

        skip_widths = []
        down, ch = [], widths[0]
        for i, w in enumerate(widths):
            blocks = []
            for _ in range(c.num_res_blocks):
                blocks.append(ResBlock(ch, w, e, g))
                ch = w
                skip_widths.append(ch)
            last = i == len(widths) - 1
            down.append(Level(blocks, None if last else nn.Conv2d(ch, ch, 3, stride=2, padding=1)))
        self.down = nn.ModuleList(down)
        self.mid = ResBlock(ch, ch, e, g)

        up = []
        for i, w in reversed(list(enumerate(widths))):
            blocks = []
            for _ in range(c.num_res_blocks):
                blocks.append(ResBlock(ch + skip_widths.pop(), w, e, g))
                ch = w
            up.append(Level(blocks, Upsample(ch) if i != 0 else None))
        self.up = nn.ModuleList(up)
        self.norm_out = nn.GroupNorm(g, ch)
        self.conv_out = nn.Conv2d(ch, c.in_channels, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        emb = self.time_mlp(timestep_features(t, self.config.time_features))
        emb = emb + self.class_embed(y.long())
        h = self.conv_in(x)
        skips = []
        for level in self.down:
            for block in level.blocks:
                h = block(h, emb)
                skips.append(h)
            if level.resample is not None:
                h = level.resample(h)
        h = self.mid(h, emb)
        for level in self.up:
            for block in level.blocks:
                h = block(torch.cat([h, skips.pop()], dim=1), emb)
            if level.resample is not None:
                h = level.resample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
