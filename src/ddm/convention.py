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


# diffusers' FlowMatchEulerDiscreteScheduler (Paris and other rectified-flow releases) ---------
#
# Its models see the same straight path from the other end: ``sigma`` runs from 1 (noise) down
# to 0 (data), ``x_sigma = (1 - sigma) * data + sigma * noise``, the model's time input is
# ``timestep = sigma * num_train_timesteps`` and its output is ``d x / d sigma = noise - data``
# (``scheduler.step`` moves ``x + (sigma_next - sigma) * output``). Hence, exactly:
# ``t = 1 - sigma`` and our velocity ``v = x1 - x0 = -output``.

#: diffusers' default ``num_train_timesteps``: a flow-matching model's time input is
#: ``sigma * 1000``.
FLOW_MATCH_TRAIN_TIMESTEPS = 1000


@dataclass(frozen=True)
class SigmaGrid:
    """A FlowMatchEulerDiscrete schedule as ``set_timesteps`` makes it, float32.

    ``sigmas`` has ``steps + 1`` entries from 1 down to a final 0; ``timesteps`` has ``steps``,
    the model's time input ``sigma * num_train_timesteps`` at each visited sigma.
    """

    sigmas: np.ndarray
    timesteps: np.ndarray

    @property
    def times(self) -> np.ndarray:
        """The same grid in our time, ``t = 1 - sigma``, from 0 (noise) to 1 (data)."""
        return time_from_sigma(self.sigmas)


def shift_sigmas(sigmas: np.ndarray, shift: float) -> np.ndarray:
    """diffusers' static shift ``shift * s / (1 + (shift - 1) * s)``: ``shift > 1`` spends more
    steps near noise. Keeps the array's dtype."""
    s = np.asarray(sigmas)
    k = s.dtype.type(shift) if np.issubdtype(s.dtype, np.floating) else shift
    return k * s / (1 + (k - 1) * s)


def flow_match_sigma_grid(steps: int, shift: float = 1.0,
                          num_train_timesteps: int = FLOW_MATCH_TRAIN_TIMESTEPS) -> SigmaGrid:
    """The grid ``FlowMatchEulerDiscreteScheduler(num_train_timesteps, shift).set_timesteps(steps)``
    visits (no dynamic shifting, Karras or terminal stretching), value for value.

    As diffusers does, the training grid's smallest sigma ``1 / num_train_timesteps`` is shifted
    once when the scheduler is built and the inference grid is shifted again.
    """
    if not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if not shift > 0:
        raise ValueError(f"shift must be positive, got {shift!r}")
    if not isinstance(num_train_timesteps, (int, np.integer)) or num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be a positive integer, "
                         f"got {num_train_timesteps!r}")
    n = np.float32(num_train_timesteps)
    train_ends = shift_sigmas(np.array([n, 1.0], dtype=np.float32) / n, shift)
    sigma_max, sigma_min = (float(s) for s in train_ends)
    visited = np.linspace(sigma_max * num_train_timesteps, sigma_min * num_train_timesteps,
                          int(steps)) / num_train_timesteps
    sigmas = shift_sigmas(visited, shift).astype(np.float32)
    return SigmaGrid(sigmas=np.append(sigmas, np.float32(0.0)),
                     timesteps=sigmas * np.float32(num_train_timesteps))


def time_from_sigma(sigma: np.ndarray) -> np.ndarray:
    """FlowMatchEulerDiscrete's ``sigma`` -> our ``t = 1 - sigma`` (float32): exact for
    ``sigma >= 0.5``, rounded by at most 3e-8 below (float32 spacing near 1)."""
    return (np.float32(1.0) - np.asarray(sigma, dtype=np.float32)).astype(np.float32)


def sigma_from_time(t: np.ndarray) -> np.ndarray:
    """Our ``t`` -> FlowMatchEulerDiscrete's ``sigma = 1 - t`` (float32): exact for ``t >= 0.5``,
    rounded by at most 3e-8 below; ``sigma -> t -> sigma`` is exact or within 3e-8."""
    return (np.float32(1.0) - np.asarray(t, dtype=np.float32)).astype(np.float32)


def flow_match_timestep(t: np.ndarray,
                        num_train_timesteps: int = FLOW_MATCH_TRAIN_TIMESTEPS) -> np.ndarray:
    """Our ``t`` -> the time input a FlowMatchEulerDiscrete model takes, ``sigma * N``."""
    return sigma_from_time(t) * np.float32(num_train_timesteps)


def velocity_from_flow_match(output: np.ndarray) -> np.ndarray:
    """A FlowMatchEulerDiscrete model's output ``noise - data`` -> our ``v = x1 - x0``."""
    return -np.asarray(output)


def flow_match_from_velocity(v: np.ndarray) -> np.ndarray:
    """Our velocity ``x1 - x0`` -> the ``noise - data`` a FlowMatchEulerDiscrete step takes."""
    return -np.asarray(v)


@dataclass(frozen=True)
class FlowMatchNetwork:
    """What a network trained for FlowMatchEulerDiscrete declares, so that it is converted
    exactly instead of having its weights rewritten: its time input is
    ``sigma * num_train_timesteps`` and its output ``noise - data`` (our velocity negated)."""

    num_train_timesteps: int = FLOW_MATCH_TRAIN_TIMESTEPS

    def timestep(self, t: np.ndarray) -> np.ndarray:
        """Our ``t`` (B,) -> the network's time input (B,) float32."""
        return flow_match_timestep(t, self.num_train_timesteps)

    def velocity(self, output: np.ndarray) -> np.ndarray:
        """The network's output -> our ``v = x1 - x0``."""
        return velocity_from_flow_match(output)


#: The time grids a DDM may sample on: ours, or FlowMatchEulerDiscrete's sigmas in our time.
GRID_KINDS = ("uniform", "flow-match")


@dataclass(frozen=True)
class TimeGrid:
    """The grid a DDM's sampler walks: ``uniform`` (:func:`time_grid`) or ``flow-match``
    (:func:`flow_match_sigma_grid` with ``shift``, as ``t = 1 - sigma``), from 0 to 1."""

    kind: str = "uniform"
    shift: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in GRID_KINDS:
            raise ValueError(f"unknown time grid {self.kind!r}; known: {', '.join(GRID_KINDS)}")
        if self.kind == "uniform" and self.shift != 1.0:
            raise ValueError("the uniform grid takes no shift")

    def times(self, steps: int) -> np.ndarray:
        """``steps + 1`` float32 times from 0 (noise) to 1 (data)."""
        if self.kind == "uniform":
            return time_grid(steps)
        return flow_match_sigma_grid(steps, self.shift).times


@dataclass(frozen=True)
class ScaledTimeNetwork:
    """What a network trained in our convention declares: its time input is
    ``t * timestep_scale`` (our ``t``, 0 noise) and its output is our velocity itself."""

    timestep_scale: float = TIME_EMBEDDING_SCALE

    def timestep(self, t: np.ndarray) -> np.ndarray:
        """Our ``t`` (B,) -> the network's time input (B,) float32."""
        return np.asarray(t, np.float32) * np.float32(self.timestep_scale)

    def velocity(self, output: np.ndarray) -> np.ndarray:
        """The network's output is already our ``v = x1 - x0``."""
        return np.asarray(output)


#: How a stage checkpoint names its network's convention (``_ddm.convention``): ``ours``
#: (also spelled :data:`CONVENTION_NAME`) or ``flow-match-N`` (FlowMatchEulerDiscrete, ``N``
#: training timesteps).
OURS, FLOW_MATCH_PREFIX = "ours", "flow-match-"
NetworkConvention = ScaledTimeNetwork | FlowMatchNetwork


def network_convention(name: str, timestep_scale: float = TIME_EMBEDDING_SCALE
                       ) -> NetworkConvention:
    """A declared convention name -> its exact conversion; ``ValueError`` for anything else."""
    if name in (OURS, CONVENTION_NAME):
        return ScaledTimeNetwork(timestep_scale)
    steps = name.removeprefix(FLOW_MATCH_PREFIX)
    if name.startswith(FLOW_MATCH_PREFIX) and steps.isdigit() and 0 < int(steps) <= 100_000:
        return FlowMatchNetwork(int(steps))
    raise ValueError(f"unknown network convention {name!r}; known: {OURS!r} and "
                     f"'{FLOW_MATCH_PREFIX}N' (e.g. 'flow-match-1000')")
