"""The DDM mixture velocity: ``v(x_t) = sum_k w_k(x_t, t, y) v_k(x_t, t, y)``, per sample.

At every evaluation the router scores each sample, the strategy keeps some experts with
renormalised weights, and each expert runs only on the samples routed to it. A
:class:`UsageLog` (one per generation, never shared) records which experts each sample used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ddm.sampling.routing import Strategy, class_owners, oracle_probs, routing_weights
from ddm.sampling.solvers import VelocityFn

#: ``router(x (B,C,H,W), t (B,), y (B,)) -> probabilities (B, K)``.
RouterFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class MixtureExpert:
    name: str
    classes: tuple[int, ...]
    velocity: VelocityFn


@dataclass
class UsageLog:
    """Expert selections of one generation: ``selections[i]`` is a ``(B, K)`` bool mask."""

    expert_names: tuple[str, ...]
    selections: list[np.ndarray] = field(default_factory=list)

    def record(self, selected: np.ndarray) -> None:
        self.selections.append(np.asarray(selected, dtype=bool))

    def expert_calls(self) -> np.ndarray:
        """Expert forward passes per sample, ``(B,)`` int64."""
        if not self.selections:
            return np.zeros((0,), dtype=np.int64)
        return np.sum([s.sum(axis=1) for s in self.selections], axis=0).astype(np.int64)

    def calls_per_expert(self) -> np.ndarray:
        """Forward passes per sample and expert, ``(B, K)`` int64."""
        return np.sum(self.selections, axis=0).astype(np.int64)

    def switches(self) -> np.ndarray:
        """How often each sample's set of experts changed between evaluations, ``(B,)``."""
        if len(self.selections) < 2:
            return np.zeros((self.selections[0].shape[0] if self.selections else 0,), np.int64)
        stacked = np.stack(self.selections)
        return np.any(stacked[1:] != stacked[:-1], axis=2).sum(axis=0).astype(np.int64)


def validate_oracle(experts: Sequence[MixtureExpert], labels: np.ndarray) -> None:
    """Fail before sampling if the oracle strategy cannot route these labels."""
    oracle_probs(labels, [e.classes for e in experts])


def mixture_velocity(experts: Sequence[MixtureExpert], router: RouterFn | None,
                     strategy: Strategy, log: UsageLog | None = None) -> VelocityFn:
    """A velocity callable for the solvers that routes each sample to its experts."""
    if not experts:
        raise ValueError("a mixture needs at least one expert")
    classes = [e.classes for e in experts]
    if strategy.kind == "oracle":
        class_owners(classes)
    elif router is None:
        raise ValueError(f"strategy {strategy.name} needs a learned router checkpoint")

    def velocity(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        probs = oracle_probs(y, classes) if strategy.kind == "oracle" else router(x, t, y)
        if probs.shape != (x.shape[0], len(experts)):
            raise ValueError(
                f"router returned probabilities of shape {probs.shape}, expected "
                f"({x.shape[0]}, {len(experts)}): the router was trained for other experts")
        weights = routing_weights(probs, strategy)
        v = np.zeros_like(x, dtype=np.float32)
        for k, expert in enumerate(experts):
            rows = np.flatnonzero(weights[:, k] > 0)
            if rows.size == 0:
                continue
            vk = expert.velocity(x[rows], t[rows], y[rows])
            v[rows] += weights[rows, k][:, None, None, None] * vk
        if log is not None:
            log.record(weights > 0)
        return v

    return velocity


def single_model(name: str, velocity: VelocityFn, log: UsageLog | None = None) -> VelocityFn:
    """Wrap one model (the monolith, or one expert alone) so its calls are logged alike."""

    def counted(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        if log is not None:
            log.record(np.ones((x.shape[0], 1), dtype=bool))
        return velocity(x, t, y)

    return counted
