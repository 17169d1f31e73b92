"""Routing: router probabilities ``(B, K)`` -> mixture weights ``(B, K)``, per sample.

Every sample gets its own experts at every step; no decision is ever made for a whole batch.
Selection is exact and deterministic: ties go to the lower expert index. Where the partition is
by label, only experts trained on a sample's label may be chosen for it (:func:`mixture_weights`):
an expert never sees a label it was not trained on, in-process or served (an expert server
refuses such labels). The label mask and the ``oracle`` exist only there: a text DDM's experts
(clusters of images) all serve every prompt, and the sampling loop refuses ``oracle`` for it.

``random`` (:func:`random_weights`) is the evaluation's baseline, never served: one expert per
sample and step drawn uniformly, the choice the DDM paper found catastrophic (FID 157).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ddm.sampling_params import EVALUATION_STRATEGIES, STRATEGY_HINT, STRATEGY_PATTERN

_PATTERN = re.compile(STRATEGY_PATTERN)
MASK_64 = 2 ** 64 - 1  # NumPy's seed sequences take non-negative integers


@dataclass(frozen=True)
class Strategy:
    """``kind`` is one of ``oracle``, ``topk``, ``threshold``, ``ensemble`` or (evaluation
    only) ``random``."""

    kind: str
    k: int = 1
    threshold: float = 0.0

    @property
    def name(self) -> str:
        """The canonical spelling, which :func:`parse_strategy` reads back (the router echoes
        it and parses it again): a threshold in plain decimals, never ``1e-07``."""
        if self.kind == "topk":
            return f"top{self.k}"
        if self.kind == "threshold":
            return f"threshold:{np.format_float_positional(self.threshold, trim='-')}"
        return self.kind


def parse_strategy(text: str, evaluation: bool = False) -> Strategy:
    """``oracle``, ``top1``, ``top2`` (or ``topk:2``), ``threshold:0.2``, ``ensemble``; with
    ``evaluation`` also ``EVALUATION_STRATEGIES`` (``random``), which nothing served accepts."""
    name = str(text).strip().lower()
    if name in EVALUATION_STRATEGIES:
        if not evaluation:
            raise ValueError(f"routing strategy {name!r} is an evaluation baseline, not served; "
                             f"{STRATEGY_HINT}")
        return Strategy(kind=name)
    if not _PATTERN.match(name):
        hint = f"{STRATEGY_HINT}" + (f" (evaluation: {', '.join(EVALUATION_STRATEGIES)})"
                                     if evaluation else "")
        raise ValueError(f"unknown routing strategy {text!r}; {hint}")
    if name in ("oracle", "ensemble"):
        return Strategy(kind=name)
    if name.startswith("threshold:"):  # the grammar bounds it to (0, 1]
        return Strategy(kind="threshold", threshold=float(name.partition(":")[2]))
    return Strategy(kind="topk", k=int(name.removeprefix("topk:").removeprefix("top")))


def routing_weights(probs: np.ndarray, strategy: Strategy) -> np.ndarray:
    """Sparse, row-normalised weights from router probabilities ``(B, K)``.

    ``topk`` keeps the k most probable experts (all of them when k >= K), ``threshold`` keeps
    those with probability >= the threshold and always the most probable one, ``ensemble``
    keeps all; ``oracle`` expects one-hot ``probs`` from :func:`oracle_probs`.
    """
    probs = np.asarray(probs, dtype=np.float64)
    if probs.ndim != 2 or probs.shape[1] < 1:
        raise ValueError(f"router probabilities must have shape (B, K), got {probs.shape}")
    batch, k_total = probs.shape
    if strategy.kind == "ensemble":
        keep = np.ones_like(probs, dtype=bool)
    elif strategy.kind in ("topk", "oracle"):
        k = min(strategy.k, k_total) if strategy.kind == "topk" else 1
        # Stable sort on -p: exact top-k with ties to the lower index.
        order = np.argsort(-probs, axis=1, kind="stable")[:, :k]
        keep = np.zeros_like(probs, dtype=bool)
        np.put_along_axis(keep, order, True, axis=1)
    elif strategy.kind == "threshold":
        keep = probs >= strategy.threshold
        keep[np.arange(batch), np.argmax(probs, axis=1)] = True
    else:
        raise ValueError(f"unknown routing strategy kind {strategy.kind!r}")
    weights = np.where(keep, probs, 0.0)
    total = weights.sum(axis=1, keepdims=True)
    # A row whose kept probabilities are all zero (possible only with degenerate routers)
    # falls back to equal weights over the kept experts rather than dividing by zero.
    uniform = keep / keep.sum(axis=1, keepdims=True)
    weights = np.where(total > 0, weights / np.where(total > 0, total, 1.0), uniform)
    return weights.astype(np.float32)


def oracle_probs(labels: np.ndarray, expert_classes: Sequence[Sequence[int]]) -> np.ndarray:
    """One-hot ``(B, K)`` probabilities sending each label to the expert that owns it.

    Requires every requested label to be owned by exactly one expert; raises a ``ValueError``
    naming the uncovered or doubly-covered labels otherwise.
    """
    owner = class_owners(expert_classes)
    labels = np.asarray(labels).reshape(-1)
    uncovered = sorted({int(y) for y in labels if int(y) not in owner})
    if uncovered:
        covered = ", ".join(f"{i}: {list(c)}" for i, c in enumerate(expert_classes))
        raise ValueError(
            f"labels {uncovered} are not covered by any expert under the oracle strategy "
            f"(experts cover {covered})")
    probs = np.zeros((labels.shape[0], len(expert_classes)), dtype=np.float32)
    probs[np.arange(labels.shape[0]), [owner[int(y)] for y in labels]] = 1.0
    return probs


def class_owners(expert_classes: Sequence[Sequence[int]]) -> dict[int, int]:
    """Map each label to the one expert that owns it; overlapping classes are an error."""
    owner: dict[int, int] = {}
    for index, classes in enumerate(expert_classes):
        for c in classes:
            if int(c) in owner:
                raise ValueError(
                    f"label {int(c)} is owned by experts {owner[int(c)]} and {index}; the oracle "
                    "strategy needs expert classes without overlap")
            owner[int(c)] = index
    return owner


def routes_by_label(expert_classes: Sequence[Sequence[int]], num_classes: int) -> bool:
    """Whether every label belongs to exactly one expert (a partition by label), the only
    DDM the ``oracle`` strategy can route: in a k-means DDM every expert draws every label."""
    return bool((servable_labels(expert_classes, num_classes).sum(axis=1) == 1).all())


def servable_labels(expert_classes: Sequence[Sequence[int]], num_classes: int) -> np.ndarray:
    """``(num_classes, K)`` bool: expert k was trained on label c (no classes: every label)."""
    return np.array([[not classes or c in classes for classes in expert_classes]
                     for c in range(num_classes)], dtype=bool
                    ).reshape(num_classes, len(expert_classes))


def mixture_weights(probs: np.ndarray, servable: np.ndarray, strategy: Strategy) -> np.ndarray:
    """Weights ``(B, K)`` of a learned strategy among the experts that serve each label.

    ``probs`` are the router's ``(B, K)``, ``servable`` the ``(B, K)`` rows of
    :func:`servable_labels` for the samples' labels. Experts that do not serve a sample's label
    get probability 0 before the strategy picks, so ``top2`` of experts trained on disjoint
    labels is the one expert that knows the label.
    """
    probs = np.asarray(probs)
    if probs.shape != servable.shape:
        raise ValueError(f"router returned probabilities of shape {probs.shape}, expected "
                         f"{servable.shape}: the router was trained for other experts")
    probs = np.where(servable, probs, 0.0)
    # A row whose servable experts all got probability 0 (underflow) weighs them equally.
    dead = probs.sum(axis=1) <= 0
    probs[dead] = servable[dead] / servable[dead].sum(axis=1, keepdims=True)
    return routing_weights(probs, strategy)


@dataclass(frozen=True)
class Rerouting:
    """Weights ``(B, K)`` over the available experts. ``rerouted`` ``(B,)``: the strategy
    wanted a missing expert for the row and got others; ``stranded`` ``(B,)``: no available
    expert serves the row's label, so it keeps the weights it wanted (its missing experts
    must come back: the driver waits or fails)."""

    weights: np.ndarray
    rerouted: np.ndarray
    stranded: np.ndarray


def available_weights(probs: np.ndarray, servable: np.ndarray, available: np.ndarray,
                      strategy: Strategy) -> Rerouting:
    """The ``reroute`` policy for missing experts: a row whose weights
    (:func:`mixture_weights`) name an expert that ``available`` ``(K,)`` marks missing picks,
    with the same strategy, among the available experts that serve its label: the best of
    them, weights renormalised over them. Other rows keep their weights."""
    wanted = mixture_weights(probs, servable, strategy)
    available = np.asarray(available, bool).reshape(1, -1)
    hit = ((wanted > 0) & ~available).any(axis=1)
    allowed = servable & available
    stranded = hit & ~allowed.any(axis=1)
    rerouted = hit & ~stranded
    weights = wanted.copy()
    if rerouted.any():
        weights[rerouted] = mixture_weights(np.asarray(probs)[rerouted], allowed[rerouted],
                                            strategy)
    return Rerouting(weights, rerouted, stranded)


def random_weights(keys: np.ndarray, t: np.ndarray, servable: np.ndarray) -> np.ndarray:
    """One-hot ``(B, K)``: per sample, one expert drawn uniformly among those serving its label.

    ``keys`` ``(B, 2)`` are ``(seed, image index)``, ``t`` ``(B,)`` the times, ``servable``
    ``(B, K)`` the label mask; each draw is a function of ``(seed, image index, t)`` alone, so a
    sample's experts do not depend on its batch or driver.
    """
    keys = np.asarray(keys, dtype=np.int64)
    ticks = np.asarray(t, dtype=np.float32).view(np.uint32)  # the exact time, as an integer
    weights = np.zeros(servable.shape, np.float32)
    for row, ((seed, index), tick) in enumerate(zip(keys, ticks)):
        allowed = np.flatnonzero(servable[row])
        entropy = [int(seed) & MASK_64, int(index) & MASK_64, int(tick)]
        draw = np.random.default_rng(entropy).integers(allowed.size)
        weights[row, allowed[draw]] = 1.0
    return weights
