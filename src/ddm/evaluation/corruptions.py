"""Known ways to damage real digits, to check that the metrics tell the damage apart.

A blurry model and a model that drops modes should both raise FD above the real-vs-real
floor, but in different ways: blur costs precision, dropping classes costs recall.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


def blurred(images_uint8: np.ndarray, sigma: float) -> np.ndarray:
    """Gaussian blur of uint8 ``(N, H, W)`` images (``sigma`` in pixels, background outside)."""
    if not sigma > 0:
        raise ValueError(f"blur sigma must be > 0 pixels, got {sigma}")
    radius = int(np.ceil(3 * sigma))
    taps = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    taps /= taps.sum()
    x = np.asarray(images_uint8, dtype=np.float64)
    height, width = x.shape[1:]
    x = np.pad(x, ((0, 0), (radius, radius), (radius, radius)))
    x = sum(w * x[:, i:i + height, :] for i, w in enumerate(taps))
    x = sum(w * x[:, :, i:i + width] for i, w in enumerate(taps))
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def dropped_modes(labels: np.ndarray, keep: Iterable[int]) -> np.ndarray:
    """As many labels as ``labels``, spread evenly over the classes ``keep`` only."""
    kept = np.array(sorted({int(c) for c in keep}), dtype=np.int64)
    if kept.size == 0:
        raise ValueError("keep at least one class")
    return np.sort(np.resize(kept, len(labels)))
