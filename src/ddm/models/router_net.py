"""The learned router: a small CNN estimating ``p(k | x_t, t, y)`` over K experts (PyTorch).

It sees the noisy sample, the time (sinusoidal features, as in the UNet) and, when
``use_labels``, the class label, and outputs K logits. It is trained with cross-entropy
against the partition id of the clean sample that ``x_t`` was made from.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ddm.models.config import RouterNetworkConfig
from ddm.models.torch_unet import timestep_features


class RouterNet(nn.Module):
    def __init__(self, config: RouterNetworkConfig) -> None:
        super().__init__()
        self.config = config
        convs, ch = [], config.in_channels
        for width in config.channels:
            convs.append(nn.Conv2d(ch, width, 3, stride=2, padding=1))
            ch = width
        self.convs = nn.ModuleList(convs)
        hidden = 2 * ch
        self.time_proj = nn.Linear(config.time_features, hidden)
        self.label_embed = nn.Embedding(config.num_classes, hidden) if config.use_labels else None
        self.image_proj = nn.Linear(ch, hidden)
        self.head = nn.Sequential(nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                                  nn.Linear(hidden, config.num_experts))

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``x`` (B, C, H, W), ``t`` (B,), ``y`` (B,) -> logits (B, K)."""
        h = x
        for conv in self.convs:
            h = F.silu(conv(h))
        h = self.image_proj(h.mean(dim=(2, 3)))
        h = h + self.time_proj(timestep_features(t, self.config.time_features))
        if self.label_embed is not None:
            h = h + self.label_embed(y.long())
        return self.head(h)
