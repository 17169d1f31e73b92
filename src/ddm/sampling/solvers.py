"""ODE solvers over a velocity callable, following ``ddm.convention`` (t: 0 noise -> 1 data).

A solver never sees a model: it takes ``velocity(x, t, y) -> v`` with ``x`` ``(B, C, H, W)``
float32, ``t`` ``(B,)`` float32 and ``y`` ``(B,)`` int64, so the same code drives a PyTorch
expert, a JAX expert, a remote expert and a routed mixture. Solvers hold no state.
"""

from __future__ import annotations

from typing import Callable, Iterator, Protocol

import numpy as np

from ddm.convention import time_grid


class VelocityFn(Protocol):
    def __call__(self, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray: ...


StepFn = Callable[[VelocityFn, np.ndarray, float, float, np.ndarray], np.ndarray]


def euler_step(velocity: VelocityFn, x: np.ndarray, t: float, t_next: float,
               y: np.ndarray) -> np.ndarray:
    """One explicit Euler step from ``t`` to ``t_next``: one velocity evaluation."""
    return euler_update(x, velocity(x, _times(x, t), y), t, t_next)


def heun_step(velocity: VelocityFn, x: np.ndarray, t: float, t_next: float,
              y: np.ndarray) -> np.ndarray:
    """One Heun (explicit trapezoid) step: two velocity evaluations, second-order accurate."""
    v0 = velocity(x, _times(x, t), y)
    v1 = velocity(euler_update(x, v0, t, t_next), _times(x, t_next), y)
    return heun_update(x, v0, v1, t, t_next)


# The update formulas alone, so that a sampler whose velocity is asynchronous (a remote
# expert) takes exactly the steps these solvers take.

def euler_update(x: np.ndarray, v: np.ndarray, t: float, t_next: float) -> np.ndarray:
    """``x + (t_next - t) v``: Euler's step, and Heun's predictor, given ``v`` at ``(x, t)``."""
    return (x + (t_next - t) * v).astype(np.float32)


def heun_update(x: np.ndarray, v0: np.ndarray, v1: np.ndarray, t: float,
                t_next: float) -> np.ndarray:
    """Heun's corrector: ``v0`` at ``(x, t)``, ``v1`` at the Euler prediction at ``t_next``."""
    return (x + 0.5 * (t_next - t) * (v0 + v1)).astype(np.float32)


SOLVERS: dict[str, StepFn] = {"euler": euler_step, "heun": heun_step}

#: Velocity evaluations per step, for counting expert forward passes.
EVALUATIONS_PER_STEP = {"euler": 1, "heun": 2}


def solver_step(name: str) -> StepFn:
    try:
        return SOLVERS[name]
    except KeyError:
        raise ValueError(f"unknown solver {name!r}; known: {', '.join(SOLVERS)}") from None


def initial_noise(batch: int, image_shape: tuple[int, int, int], seed: int,
                  first_index: int = 0) -> np.ndarray:
    """The starting points ``x0 ~ N(0, I)``, ``(batch, C, H, W)``.

    Image ``i`` draws from ``(seed, first_index + i)`` alone, so an image does not change
    with the batch it is generated in.
    """
    out = np.empty((batch, *image_shape), dtype=np.float32)
    for i in range(batch):
        out[i] = np.random.default_rng([seed, first_index + i]).standard_normal(
            image_shape, dtype=np.float32)
    return out


def iterate(velocity: VelocityFn, x0: np.ndarray, y: np.ndarray, grid: np.ndarray,
            solver: str = "euler") -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(i, x at grid[i + 1])`` after each step, for streaming and per-step routing."""
    step = solver_step(solver)
    x = np.asarray(x0, dtype=np.float32)
    for i in range(len(grid) - 1):
        x = step(velocity, x, float(grid[i]), float(grid[i + 1]), y)
        yield i, x


def integrate(velocity: VelocityFn, x0: np.ndarray, y: np.ndarray, steps: int,
              solver: str = "euler") -> np.ndarray:
    """Integrate ``dx/dt = v`` from noise ``x0`` at t=0 to data at t=1 in ``steps`` steps."""
    x = x0
    for _, x in iterate(velocity, x0, y, time_grid(steps), solver):
        pass
    return x


def _times(x: np.ndarray, t: float) -> np.ndarray:
    return np.full((x.shape[0],), t, dtype=np.float32)
