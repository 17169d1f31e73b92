"""Train a conditional UNet with the flow-matching objective in PyTorch (experts, monolith)."""

from __future__ import annotations

import numpy as np
import torch

from ddm.models.config import UNetConfig
from ddm.models.torch_unet import UNet
from ddm.training.config import TrainConfig
from ddm.training.torch_loop import ProgressFn, noisy_batch, optimise, prepare


def train_torch_unet(model_config: UNetConfig, train: TrainConfig, images: np.ndarray,
                     labels: np.ndarray, device: torch.device | None = None,
                     progress: ProgressFn | None = None) -> dict[str, np.ndarray]:
    """Fit ``v(x_t, t, y) ~ x1 - x0``; returns the EMA weights in canonical form.

    ``images`` are ``(N, C, H, W)`` float32 in model space, ``labels`` ``(N,)`` int.
    Each step draws its batch (with replacement), times and noise from ``(seed, step)``.
    """
    torch.manual_seed(train.seed)
    model, ema, device = prepare(UNet(model_config), train, device)
    images = np.asarray(images, dtype=np.float32)
    labels = np.asarray(labels, dtype=np.int64)

    def loss_at(step: int) -> torch.Tensor:
        rows, path = noisy_batch(images, train, step)
        pred = model(torch.from_numpy(path.x_t).to(device), torch.from_numpy(path.t).to(device),
                     torch.from_numpy(labels[rows]).to(device))
        return torch.mean((pred - torch.from_numpy(path.velocity).to(device)) ** 2)

    optimise(model, train, loss_at, progress, ema)
    return ema.weights()
