"""Pieces every PyTorch trainer here shares: batches from (seed, step), optimiser, EMA."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn

from ddm.training.config import TrainConfig

#: ``progress(step, loss)``; trainers call it every ``PROGRESS_EVERY`` steps and at the end.
ProgressFn = Callable[[int, float], None]
PROGRESS_EVERY = 10


def step_rng(seed: int, step: int) -> np.random.Generator:
    """The generator for one step's batch and noise: reproducible from (seed, step) alone."""
    return np.random.default_rng([seed, step])


def make_optimizer(model: nn.Module, train: TrainConfig
                   ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW whose learning rate follows ``TrainConfig.learning_rate_at`` exactly."""
    opt = torch.optim.AdamW(model.parameters(), lr=train.learning_rate,
                            weight_decay=train.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: train.learning_rate_at(step) / train.learning_rate)
    return opt, sched


class EMA:
    """Exponential moving average of a model's parameters (buffers are copied as they are)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone().float() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for k, v in model.state_dict().items():
            if v.dtype.is_floating_point:
                self.shadow[k].mul_(self.decay).add_(v.float(), alpha=1.0 - self.decay)
            else:
                self.shadow[k].copy_(v)

    def weights(self) -> dict[str, np.ndarray]:
        return {k: v.cpu().numpy().copy() for k, v in self.shadow.items()}


def optimise(model: nn.Module, train: TrainConfig, loss_at: Callable[[int], torch.Tensor],
             progress: ProgressFn | None = None, ema: EMA | None = None) -> None:
    """Run ``train.steps`` updates of ``loss_at(step)`` with clipping, schedule and EMA."""
    opt, sched = make_optimizer(model, train)
    model.train()
    for step in range(train.steps):
        loss = loss_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        opt.step()
        sched.step()
        if ema is not None:
            ema.update(model)
        if progress is not None and ((step + 1) % PROGRESS_EVERY == 0 or step + 1 == train.steps):
            progress(step + 1, float(loss.detach()))
    model.eval()
