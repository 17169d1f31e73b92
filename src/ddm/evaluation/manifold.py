"""k-nearest-neighbour manifold metrics: which way a generated set differs from the real one.

FD is one number: a blurry model and a model that drops modes both raise it. These split it:
precision and recall (Kynkaanniemi et al. 2019) ask what fraction of generated points lie
within the real set's manifold (each real point's ball reaching its k-th nearest real
neighbour), and what fraction of real points lie within the generated set's. A blurry model
loses precision (its images look like no real digit); a mode-dropping one loses recall.
Density and coverage (Naeem et al. 2020) are the outlier-robust variants, both measured
with the real balls only: density counts how many real balls hold each generated point
(about 1 for matching sets), coverage the fraction of real balls holding any.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Neighbours that set each ball's radius: Kynkaanniemi et al. use 3, Naeem et al. 5.
PRECISION_RECALL_K = 3
DENSITY_COVERAGE_K = 5


@dataclass(frozen=True)
class ManifoldScores:
    precision: float
    recall: float
    density: float
    coverage: float


def manifold_metrics(real: np.ndarray, fake: np.ndarray) -> ManifoldScores:
    """Scores of features ``fake`` ``(M, D)`` against ``real`` ``(N, D)``; both need > 5 rows."""
    real, fake = np.asarray(real, np.float64), np.asarray(fake, np.float64)
    if real.ndim != 2 or fake.ndim != 2 or real.shape[1] != fake.shape[1]:
        raise ValueError(f"features must be (N, D) with one D, got {real.shape} and {fake.shape}")
    if min(len(real), len(fake)) <= DENSITY_COVERAGE_K:
        raise ValueError(f"manifold metrics need more than {DENSITY_COVERAGE_K} points per set, "
                         f"got {len(real)} real and {len(fake)} generated")
    real_to_fake = _distances(real, fake)
    inside_real_pr = real_to_fake <= _kth_neighbour(real, PRECISION_RECALL_K)[:, None]
    inside_fake = real_to_fake <= _kth_neighbour(fake, PRECISION_RECALL_K)[None, :]
    inside_real_dc = real_to_fake <= _kth_neighbour(real, DENSITY_COVERAGE_K)[:, None]
    return ManifoldScores(
        precision=float(inside_real_pr.any(axis=0).mean()),
        recall=float(inside_fake.any(axis=1).mean()),
        density=float(inside_real_dc.sum() / (DENSITY_COVERAGE_K * len(fake))),
        coverage=float(inside_real_dc.any(axis=1).mean()))


def _distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Euclidean distances ``(len(a), len(b))``."""
    squared = (a * a).sum(1)[:, None] - 2.0 * a @ b.T + (b * b).sum(1)[None, :]
    return np.sqrt(np.maximum(squared, 0.0))


def _kth_neighbour(x: np.ndarray, k: int) -> np.ndarray:
    """Distance from each row to its ``k``-th nearest other row (itself excluded)."""
    d = _distances(x, x)
    np.fill_diagonal(d, np.inf)
    return np.partition(d, k - 1, axis=1)[:, k - 1]
