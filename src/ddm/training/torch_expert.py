"""Train a conditional UNet in PyTorch (experts, monolith) on an objective of ddm.objectives."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ddm.models.config import UNetConfig
from ddm.models.torch_unet import UNet
from ddm.objectives import NATIVE, Objective
from ddm.training.config import TrainConfig
from ddm.training.distributed import SINGLE, World
from ddm.training.resume import Resumable
from ddm.training.torch_loop import ProgressFn, expert_batch, optimise, prepare


def train_torch_unet(model_config: UNetConfig, train: TrainConfig, images: np.ndarray,
                     labels: np.ndarray, device: torch.device | None = None,
                     progress: ProgressFn | None = None, objective: Objective = NATIVE,
                     resumable: Resumable | None = None, world: World = SINGLE
                     ) -> dict[str, np.ndarray]:
    """Fit ``objective``'s target (our ``v(x_t, t, y) ~ x1 - x0`` by default); EMA weights.

    ``images`` are ``(N, C, H, W)`` float32 in model space, ``labels`` ``(N,)`` int.
    Each step draws its batch (with replacement), times and noise from ``(seed, step)``;
    ``ddm.objectives.training_example`` turns them into the network's input, time and target.
    ``resumable`` saves the training state as it goes and continues a saved one. Each of
    ``world``'s processes takes its slice of every batch (``ddm.training.distributed``).
    """
    torch.manual_seed(train.seed)
    model, ema, device = prepare(UNet(model_config), train, device, world)
    images = np.asarray(images, dtype=np.float32)
    labels = np.asarray(labels, dtype=np.int64)

    def loss_at(step: int) -> torch.Tensor:
        return unet_loss(model, images, labels, train, objective, step, device, world)

    optimise(model, train, loss_at, progress, ema, resumable)
    return ema.weights()


def unet_loss(model: nn.Module, images: np.ndarray, labels: np.ndarray, train: TrainConfig,
              objective: Objective, step: int, device: torch.device,
              world: World = SINGLE) -> torch.Tensor:
    """Step ``step``'s mean squared error to ``objective``'s target on this rank's slice of
    the global batch: under ``DistributedDataParallel`` its backward leaves every rank the
    gradient of the global batch's mean. ``images`` ``(N, C, H, W)`` float32, ``labels``
    ``(N,)`` int64; ``model`` as :func:`ddm.training.torch_loop.prepare` returns it."""
    rows, example = expert_batch(images, train, objective, step, world)
    pred = model(torch.from_numpy(example.expert_input).to(device),
                 torch.from_numpy(example.expert_time).to(device),
                 torch.from_numpy(labels[rows]).to(device))
    return torch.mean((pred - torch.from_numpy(example.target).to(device)) ** 2)
