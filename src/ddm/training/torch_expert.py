"""Train a conditional UNet with the flow-matching objective in PyTorch (experts, monolith)."""

from __future__ import annotations

import numpy as np
import torch

from ddm.convention import sample_path
from ddm.models.config import UNetConfig
from ddm.models.torch_unet import UNet
from ddm.training.config import TrainConfig
from ddm.training.torch_loop import EMA, ProgressFn, optimise, step_rng


def train_torch_unet(model_config: UNetConfig, train: TrainConfig, images: np.ndarray,
                     labels: np.ndarray, device: torch.device | None = None,
                     progress: ProgressFn | None = None) -> dict[str, np.ndarray]:
    """Fit ``v(x_t, t, y) ~ x1 - x0``; returns the EMA weights in canonical form.

    ``images`` are ``(N, C, H, W)`` float32 in model space, ``labels`` ``(N,)`` int.
    Each step draws its batch (with replacement), times and noise from ``(seed, step)``.
    """
    device = device or torch.device("cpu")
    torch.manual_seed(train.seed)
    model = UNet(model_config).to(device)
    ema = EMA(model, train.ema_decay)
    images = np.asarray(images, dtype=np.float32)
    labels = np.asarray(labels, dtype=np.int64)

    def loss_at(step: int) -> torch.Tensor:
        rng = step_rng(train.seed, step)
        idx = rng.integers(0, len(images), train.batch_size)
        x1 = images[idx]
        t = rng.random(train.batch_size, dtype=np.float32)
        x0 = rng.standard_normal(x1.shape, dtype=np.float32)
        path = sample_path(x0, x1, t)
        pred = model(torch.from_numpy(path.x_t).to(device), torch.from_numpy(t).to(device),
                     torch.from_numpy(labels[idx]).to(device))
        return torch.mean((pred - torch.from_numpy(path.velocity).to(device)) ** 2)

    optimise(model, train, loss_at, progress, ema)
    return ema.weights()
