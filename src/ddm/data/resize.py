"""Deterministic image resizing in pure NumPy, shared by every data source.

One separable triangle ("bilinear") filter, as PIL's ``Image.resize(BILINEAR)`` does it:
when enlarging (digits 8 -> 16, MNIST 28 -> 32) it is plain bilinear interpolation with
half-pixel centres and clamped edges; when shrinking (MNIST 28 -> 16) the triangle widens
by the shrink factor, so every input pixel contributes (area-like antialiasing) instead of
strokes aliasing away. Weights are non-negative and sum to one, so ``[0, 1]`` stays ``[0, 1]``.
Pure NumPy keeps the result identical on every machine and free of PIL version changes.
"""

from __future__ import annotations

import numpy as np


def resize_images(images: np.ndarray, size: int) -> np.ndarray:
    """``(N, H, W)`` float images -> ``(N, size, size)`` float32."""
    if images.ndim != 3:
        raise ValueError(f"resize_images expects (N, H, W) images, got shape {images.shape}")
    if not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"image size must be a positive integer, got {size!r}")
    rows = _filter_matrix(images.shape[1], int(size))
    cols = _filter_matrix(images.shape[2], int(size))
    out = rows @ images.astype(np.float32) @ cols.T
    return out.astype(np.float32)


def _filter_matrix(n_in: int, n_out: int) -> np.ndarray:
    """``(n_out, n_in)`` weights of the triangle filter; row ``i`` resamples output pixel ``i``."""
    scale = n_in / n_out
    half_width = max(scale, 1.0)  # widen only when shrinking: that is the antialiasing
    centres = (np.arange(n_out) + 0.5) * scale
    inputs = np.arange(n_in) + 0.5
    weights = np.maximum(0.0, 1.0 - np.abs(inputs[None, :] - centres[:, None]) / half_width)
    return (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)
