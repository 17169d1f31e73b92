"""ODE steppers following ``ddm.convention`` (t: 0 noise -> 1 data), sans I/O.

A stepper never calls a model (after diffusers' ``scheduler.step``): ``stepper(x, t, t_next)``
is a generator that yields each :class:`Evaluation` it needs, is sent the velocity ``v`` at that
point (``(B, C, H, W)`` float32), and returns the state at ``t_next``. So one stepper serves
every driver: :func:`iterate` here with a NumPy velocity, the sampling loop
(:mod:`ddm.sampling.loop`) with a routed mixture in-process or with remote experts. Steppers
hold no state between calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator, Protocol

import numpy as np

from ddm import sampling_params
from ddm.convention import time_grid
from ddm.sampling_params import DEFAULT_SOLVER


class VelocityFn(Protocol):
    """``velocity(x (B, C, H, W) f32, t (B,) f32, cond) -> v (B, C, H, W) f32``; ``cond`` is
    the rows' conditioning as the velocity takes it: labels ``(B,)`` int64 or a
    :class:`~ddm.conditioning.Conditioning`, passed through untouched."""

    def __call__(self, x: np.ndarray, t: np.ndarray, cond: Any) -> np.ndarray: ...


@dataclass(frozen=True)
class Evaluation:
    """A point where a stepper needs the velocity: state ``x`` (B, C, H, W) at time ``t``."""

    x: np.ndarray
    t: float


#: ``stepper(x, t, t_next)``: yields :class:`Evaluation`s, is sent velocities, returns x(t_next).
Step = Generator[Evaluation, np.ndarray, np.ndarray]
Stepper = Callable[[np.ndarray, float, float], Step]


def euler_update(x: np.ndarray, v: np.ndarray, t: float, t_next: float) -> np.ndarray:
    """``x + (t_next - t) v``: Euler's step, and Heun's predictor, given ``v`` at ``(x, t)``."""
    return (x + (t_next - t) * v).astype(np.float32)


def heun_update(x: np.ndarray, v0: np.ndarray, v1: np.ndarray, t: float,
                t_next: float) -> np.ndarray:
    """Heun's corrector: ``v0`` at ``(x, t)``, ``v1`` at the Euler prediction at ``t_next``."""
    return (x + 0.5 * (t_next - t) * (v0 + v1)).astype(np.float32)


def euler(x: np.ndarray, t: float, t_next: float) -> Step:
    """Explicit Euler: one velocity evaluation per step."""
    v = yield Evaluation(x, t)
    return euler_update(x, v, t, t_next)


def heun(x: np.ndarray, t: float, t_next: float) -> Step:
    """Heun (explicit trapezoid): two evaluations per step, second-order accurate."""
    v0 = yield Evaluation(x, t)
    v1 = yield Evaluation(euler_update(x, v0, t, t_next), t_next)
    return heun_update(x, v0, v1, t, t_next)


@dataclass(frozen=True)
class Solver:
    """A solver's stepper and its velocity evaluations per step (what counts expert forward
    passes)."""

    step: Stepper
    evaluations: int


#: The solvers by the names ``ddm.sampling_params.SOLVERS`` gives them, in its order (the one
#: list of their names, for the layers that import no NumPy, the wire protocol and the CRD).
SOLVERS: dict[str, Solver] = dict(zip(sampling_params.SOLVERS,
                                      (Solver(euler, 1), Solver(heun, 2)), strict=True))


def solver_named(name: str) -> Solver:
    """The solver called ``name``; an unknown name is a ``ValueError`` naming the known ones."""
    try:
        return SOLVERS[name]
    except KeyError:
        raise ValueError(f"unknown solver {name!r}; known: {', '.join(SOLVERS)}") from None


def stepper(name: str) -> Stepper:
    """The stepper of the solver called ``name`` (:func:`solver_named`)."""
    return solver_named(name).step


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


def iterate(velocity: VelocityFn, x0: np.ndarray, y: Any, grid: np.ndarray,
            solver: str = DEFAULT_SOLVER) -> Iterator[tuple[int, np.ndarray]]:
    """Drive ``solver`` with one velocity callable over ``grid``; yield ``(i, x at grid[i+1])``.

    What an expert runs for a delegated chunk, and what the in-process driver runs for one.
    """
    step_with = stepper(solver)
    x = np.asarray(x0, dtype=np.float32)
    for i in range(len(grid) - 1):
        step = step_with(x, float(grid[i]), float(grid[i + 1]))
        v = None
        while True:
            try:
                point = step.send(v)  # type: ignore[arg-type]
            except StopIteration as done:
                x = done.value
                break
            v = velocity(point.x, np.full((len(point.x),), point.t, np.float32), y)
        yield i, x


def integrate(velocity: VelocityFn, x0: np.ndarray, y: Any, steps: int,
              solver: str = DEFAULT_SOLVER) -> np.ndarray:
    """Integrate ``dx/dt = v`` from noise ``x0`` at t=0 to data at t=1 in ``steps`` steps."""
    x = x0
    for _, x in iterate(velocity, x0, y, time_grid(steps), solver):
        pass
    return x
