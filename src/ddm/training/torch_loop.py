"""Pieces every PyTorch trainer here shares: batches from (seed, step), optimiser, EMA, and
data parallelism (``ddm.training.distributed``: each rank's slice of the global batch, DDP)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn

from ddm.convention import PathSample, sample_path
from ddm.objectives import Objective, TrainingExample, training_example
from ddm.training.config import TrainConfig
from ddm.training.distributed import SINGLE, World
from ddm.training.resume import Resumable

#: The PyTorch trainers' state file in ``Resumable.directory``.
TORCH_STATE = "state.pt"

#: ``progress(step, loss)``; trainers call it every ``PROGRESS_EVERY`` steps and at the end.
ProgressFn = Callable[[int, float], None]
PROGRESS_EVERY = 10


def noisy_batch(images: np.ndarray, train: TrainConfig, step: int, world: World = SINGLE
                ) -> tuple[np.ndarray, PathSample]:
    """Step ``step``'s batch: row indices and their point on the path, from (seed, step) alone.

    Rows are drawn with replacement, ``t ~ U(0, 1)``, noise ``x0 ~ N(0, I)``; ``images`` are
    ``(N, C, H, W)`` in model space. Experts and the router see the same distribution. The
    global batch has ``train.batch_size`` rows; ``world``'s rank gets its slice of it.
    """
    rows, u, x0 = _draws(images, train, step, world)
    return rows, sample_path(x0, images[rows], u)


def expert_batch(images: np.ndarray, train: TrainConfig, objective: Objective, step: int,
                 world: World = SINGLE) -> tuple[np.ndarray, TrainingExample]:
    """As :func:`noisy_batch`, in ``objective``'s terms (the same draws, so our own velocity
    objective reproduces :func:`noisy_batch` exactly); arrays are float32."""
    rows, u, x0 = _draws(images, train, step, world)
    example = training_example(objective, x0, images[rows], u)
    return rows, TrainingExample(*(np.asarray(a, dtype=np.float32) for a in (
        example.t, example.expert_input, example.expert_time, example.target)))


def _draws(images: np.ndarray, train: TrainConfig, step: int, world: World
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The whole global batch is drawn on every rank (its draws follow one another in one
    stream), then cut: a world of one keeps all of it, as before there were worlds."""
    rng = np.random.default_rng([train.seed, step])
    rows = rng.integers(0, len(images), train.batch_size)
    u = rng.random(train.batch_size, dtype=np.float32)
    x0 = rng.standard_normal((train.batch_size, *images.shape[1:]), dtype=np.float32)
    part = world.shard(train.batch_size)
    return rows[part], u[part], x0[part]


def prepare(model: nn.Module, train: TrainConfig, device: torch.device | None,
            world: World = SINGLE) -> tuple[nn.Module, EMA, torch.device]:
    """Seeded initialisation happens before this; moves ``model`` and starts its EMA.

    With several processes the model returned is wrapped in ``DistributedDataParallel``
    (call it for the forward pass: its backward averages the gradients over the world; every
    rank starts from rank 0's weights); :func:`unwrapped` is the model itself.
    """
    device = device or torch.device("cpu")
    model = model.to(device)
    return data_parallel(model, device, world), EMA(model, train), device


def data_parallel(model: nn.Module, device: torch.device, world: World) -> nn.Module:
    """``model`` (on ``device``) wrapped in ``DistributedDataParallel`` when ``world`` has
    several processes, else itself: :func:`prepare`'s wrapping, for models without an EMA."""
    if world.size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=None if device.type == "cpu" else
                                   [device.index])


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a ``DistributedDataParallel`` wrapper (or ``model`` itself)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def make_optimizer(model: nn.Module, train: TrainConfig
                   ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW whose learning rate follows ``TrainConfig.learning_rate_at`` exactly."""
    opt = torch.optim.AdamW(model.parameters(), lr=train.learning_rate,
                            weight_decay=train.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: train.learning_rate_at(step) / train.learning_rate)
    return opt, sched


class EMA:
    """Exponential moving average of a model's parameters (buffers are copied as they are),
    with ``TrainConfig.ema_decay_at``'s warm-up."""

    def __init__(self, model: nn.Module, train: TrainConfig) -> None:
        self.train = train
        self.shadow = {k: v.detach().clone().float() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """Fold in ``model`` after update ``step`` (0-based)."""
        decay = float(self.train.ema_decay_at(step))
        for k, v in model.state_dict().items():
            if v.dtype.is_floating_point:
                self.shadow[k].mul_(decay).add_(v.float(), alpha=1.0 - decay)
            else:
                self.shadow[k].copy_(v)

    def weights(self) -> dict[str, np.ndarray]:
        return {k: v.cpu().numpy().copy() for k, v in self.shadow.items()}


def optimise(model: nn.Module, train: TrainConfig, loss_at: Callable[[int], torch.Tensor],
             progress: ProgressFn | None = None, ema: EMA | None = None,
             resumable: Resumable | None = None) -> None:
    """Run ``train.steps`` updates of ``loss_at(step)`` with clipping, schedule and EMA,
    continuing ``resumable``'s saved state when there is one and saving it as it goes.

    ``model`` is :func:`prepare`'s (wrapped for data parallelism when there are several
    processes, whose ``loss_at`` are means over their equal slices of the global batch).
    """
    opt, sched = make_optimizer(model, train)
    start = _restore(resumable, model, opt, sched, ema) if resumable is not None else 0
    model.train()
    for step in range(start, train.steps):
        loss = loss_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        opt.step()
        sched.step()
        if ema is not None:
            ema.update(unwrapped(model), step)
        done = step + 1
        if resumable is not None and resumable.due(done, train.steps):
            state = {"model": unwrapped(model).state_dict(), "optimizer": opt.state_dict(),
                     "scheduler": sched.state_dict(), "step": done,
                     "torch_rng": torch.get_rng_state(),
                     "ema": ema.shadow if ema is not None else {}}
            resumable.save(TORCH_STATE, done, lambda path: torch.save(state, path))
        if progress is not None and (done % PROGRESS_EVERY == 0 or done == train.steps):
            progress(done, float(loss.detach()))
    model.eval()


def _restore(resumable: Resumable, model: nn.Module, opt: torch.optim.Optimizer,
             sched: torch.optim.lr_scheduler.LambdaLR, ema: EMA | None) -> int:
    """Load the saved state into the live objects; the step to continue from (0: none)."""
    path = resumable.saved(TORCH_STATE)
    if path is None:
        return 0
    device = next(model.parameters()).device
    state = torch.load(path, map_location=device, weights_only=True)
    unwrapped(model).load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"].cpu())
    if ema is not None:
        ema.shadow = {k: v.to(device) for k, v in state["ema"].items()}
    return int(state["step"])
