"""The text-to-image DDM's router network: p(cluster | x_t, t), a small transformer classifier.

As Paris's router (a DiT-B classifier) it sees only the noisy latent and the time, never the
prompt. Its constructor takes the Paris port's names (input_size, patch_size, hidden_size,
depth, num_heads, mlp_ratio, num_clusters) plus ``in_channels``; it is a diffusers
``ModelMixin``/``ConfigMixin``, so ``save_pretrained`` writes config.json + safetensors and
``from_pretrained`` reads them back. Time enters as in the experts: ``t * TIME_EMBEDDING_SCALE``
in our convention (t = 0 noise), sinusoidal features through an MLP, added to every patch token.
"""

from __future__ import annotations

import math

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from ddm.convention import TIME_EMBEDDING_SCALE


def timestep_features(t: torch.Tensor, width: int) -> torch.Tensor:
    """Sinusoidal features ``(B, width)`` of ``t * TIME_EMBEDDING_SCALE`` (``t`` in [0, 1])."""
    half = width // 2
    frequencies = torch.exp(-math.log(10_000.0) * torch.arange(half, dtype=torch.float32) / half)
    angles = (t.float() * TIME_EMBEDDING_SCALE)[:, None] * frequencies[None, :]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class LatentRouter(ModelMixin, ConfigMixin):
    """``(x_t (B, C, S, S), t (B,)) -> logits (B, num_clusters)``."""

    @register_to_config
    def __init__(self, input_size: int = 8, in_channels: int = 4, patch_size: int = 2,
                 hidden_size: int = 128, depth: int = 3, num_heads: int = 4,
                 mlp_ratio: float = 4.0, num_clusters: int = 4) -> None:
        super().__init__()
        if input_size % patch_size:
            raise ValueError(f"input_size {input_size} is not a multiple of patch_size "
                             f"{patch_size}")
        tokens = (input_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_channels, hidden_size, patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens, hidden_size))
        nn.init.normal_(self.pos_embed, std=0.02)
        self.time_embed = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.SiLU(),
                                        nn.Linear(hidden_size, hidden_size))
        layer = nn.TransformerEncoderLayer(hidden_size, num_heads,
                                           int(hidden_size * mlp_ratio), dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(hidden_size)
        self.head = nn.Linear(hidden_size, num_clusters)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed
        time = self.time_embed(timestep_features(t, self.config.hidden_size))
        hidden = self.blocks(tokens + time[:, None, :])
        return self.head(self.norm(hidden).mean(dim=1))
