"""A tiny DiT-style transformer (Peebles & Xie 2023): an expert architecture that is not ours.

docs/experts.md's worked example. Nothing in ddm knows this module: a checkpoint names it by
import path (``tests.support.tiny_dit:build``), and whoever serves the checkpoint allows it with
``DDM_ALLOW_IMPORT=tests.support.tiny_dit``. The image is cut into patches, each a token; time
and label condition every block through adaptive layer norm, zero-initialised (adaLN-Zero).
The call is the one ddm expects of every network: ``(x (B, C, H, W), t (B,), y (B,)) -> (B, C,
H, W)``, here our velocity (a checkpoint's ``objective`` may declare another prediction).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

#: The architecture dict a checkpoint records; ``build`` gets it back.
SMALL = {"image_size": 16, "channels": 1, "patch": 4, "dim": 64, "depth": 2, "heads": 4,
         "num_classes": 10}


def build(architecture: dict[str, Any]) -> "TinyDiT":
    """The factory a checkpoint names: ``tests.support.tiny_dit:build``."""
    return TinyDiT(**architecture)


class TinyDiT(nn.Module):
    def __init__(self, image_size: int, channels: int, patch: int, dim: int, depth: int,
                 heads: int, num_classes: int) -> None:
        super().__init__()
        if image_size % patch:
            raise ValueError(f"image_size {image_size} is not a multiple of patch {patch}")
        self.channels, self.patch, self.side = channels, patch, image_size // patch
        self.embed = nn.Conv2d(channels, dim, patch, stride=patch)
        self.position = nn.Parameter(0.02 * torch.randn(1, self.side * self.side, dim))
        self.time = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.label = nn.Embedding(num_classes, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.modulation = nn.Linear(dim, 2 * dim)
        self.head = nn.Linear(dim, patch * patch * channels)
        for layer in (self.modulation, self.head):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).flatten(2).transpose(1, 2) + self.position
        condition = self.time(sinusoid(t, tokens.shape[-1])) + self.label(y)
        for block in self.blocks:
            tokens = block(tokens, condition)
        shift, scale = self.modulation(nn.functional.silu(condition)).unsqueeze(1).chunk(2, -1)
        patches = self.head(self.norm(tokens) * (1 + scale) + shift)
        b, p, c, s = x.shape[0], self.patch, self.channels, self.side
        return patches.reshape(b, s, s, c, p, p).permute(0, 3, 1, 4, 2, 5).reshape(x.shape)


class Block(nn.Module):
    """Self-attention and an MLP, each modulated by the condition and gated (adaLN-Zero)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.modulation = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)

    def forward(self, tokens: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        mod = self.modulation(nn.functional.silu(condition)).unsqueeze(1).chunk(6, -1)
        shift1, scale1, gate1, shift2, scale2, gate2 = mod
        h = self.norm1(tokens) * (1 + scale1) + shift1
        tokens = tokens + gate1 * self.attention(h, h, h, need_weights=False)[0]
        h = self.norm2(tokens) * (1 + scale2) + shift2
        return tokens + gate2 * self.mlp(h)


def sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` in ``[0, 1]`` ``(B,)`` -> ``(B, dim)`` sinusoidal features of ``1000 t``."""
    half = dim // 2
    frequencies = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
    angles = 1000.0 * t.float()[:, None] * frequencies[None]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)


def train(images: np.ndarray, labels: np.ndarray, steps: int, seed: int = 0,
          architecture: dict[str, Any] | None = None) -> TinyDiT:
    """Flow matching in ddm's convention (``x_t = t x1 + (1 - t) x0``, target ``x1 - x0``) on
    ``images`` ``(N, C, H, W)`` in model space: how a team elsewhere might have trained it."""
    torch.manual_seed(seed)
    model = build(architecture or SMALL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, 2e-3, total_steps=steps,
                                                   pct_start=0.1)
    data, classes = torch.from_numpy(images), torch.from_numpy(labels)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        rows = torch.randint(len(data), (128,), generator=generator)
        x1, y = data[rows], classes[rows]
        x0 = torch.randn(x1.shape, generator=generator)
        t = torch.rand(len(rows), generator=generator)
        x_t = t[:, None, None, None] * x1 + (1 - t[:, None, None, None]) * x0
        loss = nn.functional.mse_loss(model(x_t, t, y), x1 - x0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    return model.eval()
