"""Optimisation settings shared by the PyTorch and JAX trainers, so both optimise one objective."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ddm.models.config import ConfigError, config_from_dict

#: The EMA's warm-up: update ``t`` (0-based) averages with decay
#: ``min(ema_decay, (1 + t) / (EMA_WARMUP + t))`` (TensorFlow's ExponentialMovingAverage with
#: ``num_updates``, timm and diffusers' EMAModel), so the random initial weights weigh 0.1 after
#: the first update and ``9! t! / (t + 9)!`` after ``t``: gone within tens of steps, where a
#: fixed 0.999 keeps 22% of them after 1,500 steps.
EMA_WARMUP = 10.0


@dataclass(frozen=True)
class TrainConfig:
    """AdamW with linear warm-up then cosine decay to zero, gradient clipping and an EMA whose
    decay warms up too (:meth:`ema_decay_at`).

    The loss is the MSE to the target of the expert's objective (``ddm.objectives``; by
    default ``ddm.convention``'s: ``t ~ U(0, 1)``, ``x0 ~ N(0, I)``, predict ``x1 - x0`` at
    ``x_t``). Batch ``i`` and its noise come from ``seed`` and the step number alone, so a run
    is reproducible given the config and the objective.
    """

    steps: int = 1500
    batch_size: int = 128
    learning_rate: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ema_decay: float = 0.999
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"TrainConfig.{name} must be a positive integer, got {value!r}")
        if not 0 <= self.warmup_steps:
            raise ConfigError(f"TrainConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not self.learning_rate > 0:
            raise ConfigError(f"TrainConfig.learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.ema_decay < 1:
            raise ConfigError(f"TrainConfig.ema_decay must be in [0, 1), got {self.ema_decay}")

    def learning_rate_at(self, step: int) -> float:
        """The schedule both frameworks follow: step 0-based, returns the rate for that update."""
        import math

        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))

    def ema_decay_at(self, step: Any, xp: Any = np) -> Any:
        """The EMA decay for update ``step`` (0-based; an int, or a ``jax.numpy`` scalar with
        ``xp=jax.numpy``): both trainers call this one definition."""
        return xp.minimum(self.ema_decay, (1.0 + step) / (EMA_WARMUP + step))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TrainConfig":
        return config_from_dict(cls, d)
