"""Image features that k-means partitions cluster on, named so a partition can record them.

``pixels``: the flattened ``[0, 1]`` pixels (what the digits DDM's partitions used).
``hog``: histograms of oriented gradients (Dalal & Triggs 2005) over square cells: the
stroke directions in each region of a digit, which describe its shape and slant while
ignoring how dark the strokes are (why MNIST uses them: :mod:`ddm.data.partition_file`).
Every image's descriptor is scaled to unit length, so two digits of one shape drawn with
different pens land close together. Both are pure NumPy and deterministic, so a partition
file holds everything needed to assign an image (no feature network ships beside it).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ddm.models.config import ConfigError

PIXELS = "pixels"
#: HOG defaults: 8x8-pixel cells (a 4x4 grid on 32x32 MNIST) and 9 unsigned orientation bins.
HOG_CELL = 8
HOG_BINS = 9
FEATURE_NAMES = (PIXELS, "hog")
_CHUNK = 4096  # images per HOG pass: bounds the temporaries to ~100 MB on 32x32 images


def features_spec(name: str, cell: int = HOG_CELL, bins: int = HOG_BINS) -> str | dict[str, Any]:
    """The JSON-able record of a feature extractor: ``"pixels"`` or ``{"name": "hog", ...}``."""
    if name == PIXELS:
        return PIXELS
    if name == "hog":
        return check_spec({"name": "hog", "cell": cell, "bins": bins})
    raise ConfigError(f"unknown features {name!r}; known: {', '.join(FEATURE_NAMES)}")


def check_spec(spec: Any) -> str | dict[str, Any]:
    """Validate a recorded feature spec, rejecting unknown names and keys."""
    if spec == PIXELS:
        return PIXELS
    if not isinstance(spec, Mapping) or spec.get("name") != "hog":
        raise ConfigError(f"unknown features {spec!r}; known: {', '.join(FEATURE_NAMES)}")
    unknown, missing = sorted(set(spec) - {"name", "cell", "bins"}), sorted(
        {"name", "cell", "bins"} - set(spec))
    if unknown or missing:
        raise ConfigError(f"hog features: unknown keys {unknown}, missing keys {missing}")
    for key in ("cell", "bins"):
        value = spec[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"hog features: {key} must be a positive integer, got {value!r}")
    return {"name": "hog", "cell": spec["cell"], "bins": spec["bins"]}


def extract(spec: str | Mapping[str, Any], images: np.ndarray) -> np.ndarray:
    """Images ``(N, 1, H, W)`` in ``[0, 1]`` -> features ``(N, D)`` float32."""
    images = np.asarray(images, dtype=np.float32)
    if images.ndim != 4:
        raise ValueError(f"expected images (N, C, H, W), got shape {images.shape}")
    spec = check_spec(spec)
    if spec == PIXELS:
        return images.reshape(len(images), -1)
    chunks = [hog(images[start:start + _CHUNK], spec["cell"], spec["bins"])
              for start in range(0, len(images), _CHUNK)]
    return np.concatenate(chunks) if chunks else np.zeros((0, 0), np.float32)


def hog(images: np.ndarray, cell: int, bins: int) -> np.ndarray:
    """``(N, 1, H, W)`` -> ``(N, (H / cell) * (W / cell) * bins)`` unit-length HOG descriptors.

    Gradients by central differences; each pixel votes its gradient magnitude into the two
    nearest of ``bins`` unsigned orientations (0 to 180 degrees), linearly weighted.
    """
    n, channels, height, width = images.shape
    if channels != 1 or height % cell or width % cell:
        raise ValueError(f"hog needs one-channel images whose sides divide by the cell size "
                         f"{cell}, got shape {images.shape}")
    x = images[:, 0]
    padded = np.pad(x, ((0, 0), (1, 1), (1, 1)))
    gx = (padded[:, 1:-1, 2:] - padded[:, 1:-1, :-2]) / 2.0
    gy = (padded[:, 2:, 1:-1] - padded[:, :-2, 1:-1]) / 2.0
    magnitude = np.hypot(gx, gy)
    position = (np.arctan2(gy, gx) % np.pi) / np.pi * bins - 0.5  # bin centres at 0, 1, ...
    low = np.floor(position)
    upper_weight = position - low
    lower_bin, upper_bin = low.astype(np.int64) % bins, (low.astype(np.int64) + 1) % bins
    cells = np.empty((n, height // cell, width // cell, bins), dtype=np.float32)
    for b in range(bins):
        votes = magnitude * (np.where(lower_bin == b, 1.0 - upper_weight, 0.0)
                             + np.where(upper_bin == b, upper_weight, 0.0))
        cells[..., b] = votes.reshape(n, height // cell, cell, width // cell, cell).sum((2, 4))
    flat = cells.reshape(n, -1)
    norms = np.linalg.norm(flat, axis=1, keepdims=True)
    return (flat / np.maximum(norms, 1e-6)).astype(np.float32)
