"""The one flow-matching convention every backend, sampler and trainer uses.

Time runs from noise to data:

* ``t = 0`` is pure Gaussian noise ``x0 ~ N(0, I)``;
* ``t = 1`` is data ``x1`` (images scaled to ``[-1, 1]``, ink at ``+1``);
* the path is the straight line ``x_t = (1 - t) * x0 + t * x1``;
* the velocity a model predicts is ``v(x_t, t, y) = d x_t / d t = x1 - x0``.

Sampling integrates ``dx/dt = v`` from ``t = 0`` to ``t = 1`` over :func:`time_grid`.
This module is pure NumPy so that PyTorch, JAX, the wire protocol and the router share it
without importing each other; framework code applies the same formulas to its own arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Recorded in every checkpoint and served by ``/v1/info``; loaders refuse anything else.
CONVENTION_NAME = "linear-fm/t0-noise/t1-data/v=x1-x0"

#: Sinusoidal time features are computed from ``t * TIME_EMBEDDING_SCALE`` so that the
#: frequencies cover the unit interval the way they cover integer diffusion steps.
TIME_EMBEDDING_SCALE = 1000.0

#: Pixel range of the model's image space.
DATA_MIN, DATA_MAX = -1.0, 1.0


@dataclass(frozen=True)
class PathSample:
    """A point on the probability path and the velocity target there.

    ``x_t`` and ``velocity`` have the image layout ``(B, C, H, W)``; ``t`` has shape ``(B,)``.
    """

    x_t: np.ndarray
    t: np.ndarray
    velocity: np.ndarray


def interpolate(x0: np.ndarray, x1: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``x_t = (1 - t) x0 + t x1`` with ``t`` broadcast over the trailing image axes."""
    tb = _broadcast_time(t, x0.ndim)
    return (1.0 - tb) * x0 + tb * x1


def target_velocity(x0: np.ndarray, x1: np.ndarray) -> np.ndarray:
    """The conditional velocity ``x1 - x0`` that a model is trained to predict."""
    return x1 - x0


def sample_path(x0: np.ndarray, x1: np.ndarray, t: np.ndarray) -> PathSample:
    """Noise ``x0``, data ``x1`` and times ``t`` -> the training triple on the path."""
    return PathSample(x_t=interpolate(x0, x1, t), t=t, velocity=target_velocity(x0, x1))


def data_from_velocity(x_t: np.ndarray, t: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Inverse of the path: the data end ``x1 = x_t + (1 - t) v`` implied by a velocity."""
    return x_t + (1.0 - _broadcast_time(t, x_t.ndim)) * v


def noise_from_velocity(x_t: np.ndarray, t: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Inverse of the path: the noise end ``x0 = x_t - t v`` implied by a velocity."""
    return x_t - _broadcast_time(t, x_t.ndim) * v


def time_grid(steps: int) -> np.ndarray:
    """The ``steps + 1`` float32 times from 0 (noise) to 1 (data) that samplers visit."""
    if not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    return np.linspace(0.0, 1.0, int(steps) + 1, dtype=np.float32)


def to_model_space(images: np.ndarray) -> np.ndarray:
    """Images in ``[0, 1]`` (ink = 1) -> model space ``[-1, 1]``, float32."""
    return (np.asarray(images, dtype=np.float32) * 2.0 - 1.0).astype(np.float32)


def to_uint8(x: np.ndarray) -> np.ndarray:
    """Model space -> uint8 images, 0 background and 255 ink, clipped."""
    pixels = (np.clip(x, DATA_MIN, DATA_MAX) + 1.0) * 127.5
    return np.rint(pixels).astype(np.uint8)


def _broadcast_time(t: np.ndarray, ndim: int) -> np.ndarray:
    t = np.asarray(t, dtype=np.float32)
    return t.reshape(t.shape + (1,) * (ndim - t.ndim))
