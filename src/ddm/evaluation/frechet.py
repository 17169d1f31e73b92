"""Frechet distance between two feature sets, each summarised as a Gaussian.

``FD = |mu_a - mu_b|^2 + tr(S_a) + tr(S_b) - 2 tr((S_a^1/2 S_b S_a^1/2)^1/2)``, the FID
formula over the evaluation classifier's features. The trace term goes through two
symmetric eigendecompositions rather than ``scipy.linalg.sqrtm`` of the non-symmetric
``S_a S_b``: symmetric matrices have real eigenvalues, so there is no complex round-off to
discard, and the tiny negative eigenvalues of rank-deficient covariances are clipped to 0.
Values depend on the sample counts (the estimate is biased), so compare FDs at equal N.
"""

from __future__ import annotations

import numpy as np


def frechet_distance(feats_a: np.ndarray, feats_b: np.ndarray) -> float:
    """Frechet distance between features ``(N_a, D)`` and ``(N_b, D)``; each N must be >= 2."""
    a, b = _checked(feats_a, "feats_a"), _checked(feats_b, "feats_b")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"feature dimensions differ: {a.shape[1]} and {b.shape[1]}")
    return frechet_distance_from_stats(*feature_stats(a), *feature_stats(b))


def feature_stats(feats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean ``(D,)`` and unbiased covariance ``(D, D)`` of features ``(N, D)``."""
    x = _checked(feats, "features")
    return x.mean(axis=0), np.atleast_2d(np.cov(x, rowvar=False))


def frechet_distance_from_stats(mu_a: np.ndarray, cov_a: np.ndarray,
                                mu_b: np.ndarray, cov_b: np.ndarray) -> float:
    """The Frechet distance of ``N(mu_a, cov_a)`` and ``N(mu_b, cov_b)``."""
    root_a = _psd_sqrt(cov_a)
    middle = root_a @ cov_b @ root_a
    eigenvalues = np.linalg.eigvalsh((middle + middle.T) / 2.0)
    trace_root = float(np.sqrt(np.clip(eigenvalues, 0.0, None)).sum())
    diff = np.asarray(mu_a, dtype=np.float64) - np.asarray(mu_b, dtype=np.float64)
    fd = float(diff @ diff) + float(np.trace(cov_a) + np.trace(cov_b)) - 2.0 * trace_root
    return max(fd, 0.0)


def _psd_sqrt(cov: np.ndarray) -> np.ndarray:
    """Symmetric square root of a covariance, negative round-off eigenvalues clipped to 0."""
    sym = (np.asarray(cov, dtype=np.float64) + np.asarray(cov, dtype=np.float64).T) / 2.0
    eigenvalues, vectors = np.linalg.eigh(sym)
    return (vectors * np.sqrt(np.clip(eigenvalues, 0.0, None))) @ vectors.T


def _checked(feats: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(feats, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2 or x.shape[1] < 1:
        raise ValueError(f"{name} must be (N, D) with N >= 2, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} contain NaN or infinite values")
    return x
