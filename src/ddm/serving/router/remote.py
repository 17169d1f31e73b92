"""The DDM sampling loop with remote experts: routing in the router process, velocities over HTTP.

It takes the steps :func:`ddm.sampling.pipeline.generate` takes — the same noise, time grid,
routing strategies, per-sample expert selection and solver update formulas
(``ddm.sampling.solvers``) — but awaits each expert's velocity from an :class:`ExpertCaller`
(the :class:`~ddm.serving.router.pool.ExpertPool`), calling the experts one evaluation needs
concurrently. Two differences from in-process sampling:

* an expert is never asked for a label outside its ``classes`` (the expert server refuses them):
  router probabilities of such experts are zeroed before the strategy picks, so ``top2`` works
  with experts trained on disjoint labels. With experts that serve every label, results equal
  the in-process ones.
* **delegation** (``delegate_steps`` > 1): the grid is walked in chunks of that many steps. At
  the start of a chunk, a sample whose strategy selects exactly one expert (always so for
  ``oracle`` and ``top1``) is sent to that expert in one integrate request covering the chunk,
  grouped with every other sample of that expert; the expert runs the same solver on the same
  times, so with ``oracle`` the result equals per-step sampling. Other samples step one by one
  through the chunk. Routing is decided again at the next chunk.

Everything a generation accumulates lives in the generation's own coroutine: concurrent
generations share only the caller and the :class:`RouterNetwork`, which both merge the calls
that concurrent generations make at the same time (:mod:`ddm.serving.router.coalescing`).
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Protocol

import numpy as np

from ddm.convention import time_grid, to_uint8
from ddm.sampling.mixture import RouterFn, UsageLog
from ddm.sampling.routing import Strategy, oracle_probs, routing_weights
from ddm.sampling.solvers import (EVALUATIONS_PER_STEP, euler_update, heun_update,
                                  initial_noise, solver_step)
from ddm.serving.router.coalescing import Coalescer
from ddm.serving.router.pool import gather_all

#: Up to this many rows, the router network runs on the event loop: at batch 1 it takes about
#: 0.15 ms, less than the two thread hops of ``asyncio.to_thread``; bigger batches go to a
#: thread, so that the loop keeps serving other generations meanwhile.
INLINE_ROUTER_ROWS = 8
#: The most rows one forward pass of the router network takes when merging calls.
ROUTER_MAX_ROWS = 256

#: ``async (x (B, C, H, W), t (B,), y (B,)) -> v``.
AsyncVelocity = Callable[[np.ndarray, np.ndarray, np.ndarray], Awaitable[np.ndarray]]


class ExpertCaller(Protocol):
    """Remote experts by name; :class:`~ddm.serving.router.pool.ExpertPool` is one."""

    async def velocity(self, expert: str, x: np.ndarray, t: np.ndarray,
                       y: np.ndarray) -> np.ndarray: ...

    async def integrate(self, expert: str, x: np.ndarray, y: np.ndarray, grid: np.ndarray,
                        solver: str) -> np.ndarray: ...


class RouterNetwork:
    """The router network, shared by a router's generations: calls that concurrent
    generations make in the same turn of the event loop, or while a pass runs, go as one
    forward pass (at batch 1 the network's cost is almost all per call, not per row)."""

    def __init__(self, probs: RouterFn) -> None:
        self._probs = probs
        self._coalescer = Coalescer(self._forward, lambda: ROUTER_MAX_ROWS, lambda: 1)

    async def __call__(self, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``p(k | x, t, y)`` as (B, K) probabilities."""
        return await self._coalescer.submit(None, (x, t, y))

    async def close(self) -> None:
        """Cancel the passes in flight and refuse new calls (the router is stopping)."""
        await self._coalescer.close()

    async def _forward(self, _key: object, inputs: tuple[np.ndarray, ...],
                       _since: float) -> np.ndarray:
        if inputs[0].shape[0] <= INLINE_ROUTER_ROWS:
            return self._probs(*inputs)
        return await asyncio.to_thread(self._probs, *inputs)


@dataclass(frozen=True)
class RemoteMixture:
    """The router's view of a DDM: experts in the router network's output order, the labels
    each serves (empty: every label), the router network (None: oracle only)."""

    expert_names: tuple[str, ...]
    expert_classes: tuple[tuple[int, ...], ...]
    router: RouterNetwork | None
    image_shape: tuple[int, int, int]
    num_classes: int

    @functools.cached_property
    def servable(self) -> np.ndarray:
        """(num_classes, K) bool: expert k serves label c (an expert with no classes serves
        every label); looked up at every step, so computed once."""
        return np.array([[not classes or c in classes for classes in self.expert_classes]
                         for c in range(self.num_classes)], dtype=bool
                        ).reshape(self.num_classes, len(self.expert_classes))


@dataclass(frozen=True)
class SamplingRequest:
    """One generation: an image per label; image ``i``'s noise comes from ``(seed, i)``."""

    labels: tuple[int, ...]
    steps: int
    seed: int
    strategy: Strategy
    solver: str = "euler"
    delegate_steps: int = 0


@dataclass(frozen=True)
class StepEvent:
    """The state after a chunk of the grid (one step unless delegating).

    ``x`` (N, C, H, W) is the state at ``t = grid[step]``; ``selections`` holds one (N, K) bool
    mask per velocity evaluation of the chunk (as :class:`UsageLog` records them);
    ``round_trips`` (N,) counts the expert requests each sample took part in during the chunk;
    ``delegated`` (N,) says which samples went in one integrate request.
    """

    step: int
    t: float
    x: np.ndarray
    selections: tuple[np.ndarray, ...]
    round_trips: np.ndarray
    delegated: np.ndarray

    def experts_used(self) -> np.ndarray:
        """(N, K) bool: which experts each sample used during the chunk."""
        return np.any(self.selections, axis=0)


@dataclass(frozen=True)
class RemoteGeneration:
    images: np.ndarray       # (N, H, W) uint8, 0 background, 255 ink
    state: np.ndarray        # (N, C, H, W) float32, the final state in model space
    labels: np.ndarray       # (N,) int64
    usage: UsageLog
    round_trips: np.ndarray  # (N,) expert requests per image

    @property
    def expert_calls(self) -> np.ndarray:
        """Expert forward passes per image, ``(N,)``, counted as in-process sampling does."""
        return self.usage.expert_calls()

    def experts_used(self) -> list[list[str]]:
        calls = self.usage.calls_per_expert()
        return [[name for k, name in enumerate(self.usage.expert_names) if calls[i, k]]
                for i in range(calls.shape[0])]


def check_request(mixture: RemoteMixture, request: SamplingRequest) -> np.ndarray:
    """Raise ``ValueError`` naming what the mixture cannot do; the labels as ``(N,)`` int64."""
    solver_step(request.solver)
    assert request.solver in _ASYNC_STEPS, f"no asynchronous twin of solver {request.solver}"
    if not isinstance(request.steps, int) or request.steps < 1:
        raise ValueError(f"steps must be a positive integer, got {request.steps!r}")
    if request.delegate_steps < 0:
        raise ValueError(f"delegate_steps must be >= 0, got {request.delegate_steps}")
    y = np.asarray(request.labels, dtype=np.int64).reshape(-1)
    if y.size == 0:
        raise ValueError("no labels given")
    outside = sorted({int(v) for v in y if not 0 <= v < mixture.num_classes})
    if outside:
        raise ValueError(f"labels {outside} are outside the model's classes "
                         f"0..{mixture.num_classes - 1}")
    if request.strategy.kind == "oracle":
        oracle_probs(y, mixture.expert_classes)
        return y
    if mixture.router is None:
        raise ValueError(f"strategy {request.strategy.name} needs the router network, and this "
                         "router has none; use the oracle strategy")
    uncovered = sorted({int(v) for v in y[~_servable(mixture, y).any(axis=1)]})
    if uncovered:
        raise ValueError(f"labels {uncovered} are served by no expert")
    return y


async def denoise(mixture: RemoteMixture, caller: ExpertCaller,
                  request: SamplingRequest) -> AsyncIterator[StepEvent]:
    """Yield a :class:`StepEvent` after every chunk of the grid, from noise to data."""
    y = check_request(mixture, request)
    grid = time_grid(request.steps)
    x = initial_noise(len(y), mixture.image_shape, request.seed)
    chunk = max(1, request.delegate_steps)
    for start in range(0, request.steps, chunk):
        end = min(start + chunk, request.steps)
        event = await _advance(mixture, caller, request, x, y, grid[start:end + 1], end)
        x = event.x
        yield event


async def generate_remote(mixture: RemoteMixture, caller: ExpertCaller,
                          request: SamplingRequest) -> RemoteGeneration:
    """Run :func:`denoise` to the end and sum up what each image used."""
    tally = Tally(mixture.expert_names, request.labels)
    async for event in denoise(mixture, caller, request):
        tally.add(event)
    return tally.result()


class Tally:
    """Sums the events of one generation into a :class:`RemoteGeneration` (one per
    generation: it is the generation's own state)."""

    def __init__(self, expert_names: tuple[str, ...], labels: tuple[int, ...]) -> None:
        self._labels = np.asarray(labels, np.int64)
        self._usage = UsageLog(expert_names)
        self._round_trips = np.zeros(len(labels), np.int64)
        self._state: np.ndarray | None = None

    def add(self, event: StepEvent) -> None:
        for mask in event.selections:
            self._usage.record(mask)
        self._round_trips += event.round_trips
        self._state = event.x

    def result(self) -> RemoteGeneration:
        assert self._state is not None, "a generation has at least one step"
        return RemoteGeneration(images=to_uint8(self._state[:, 0]), state=self._state,
                                labels=self._labels, usage=self._usage,
                                round_trips=self._round_trips.copy())


async def _advance(mixture: RemoteMixture, caller: ExpertCaller, request: SamplingRequest,
                   x: np.ndarray, y: np.ndarray, grid: np.ndarray, step: int) -> StepEvent:
    """One chunk: delegate the samples with one expert, step the others, concurrently."""
    n, k = len(y), len(mixture.expert_names)
    evaluations = (len(grid) - 1) * EVALUATIONS_PER_STEP[request.solver]
    selected, delegated = np.zeros((n, k), bool), np.zeros(n, bool)
    if request.delegate_steps > 1:
        selected = await _route(mixture, request.strategy, x, _times(n, grid[0]), y) > 0
        delegated = selected.sum(axis=1) == 1
    x_next = np.empty_like(x)
    masks = np.zeros((evaluations, n, k), bool)
    round_trips = np.zeros(n, np.int64)

    async def delegate(expert: int, rows: np.ndarray) -> None:
        x_next[rows] = await caller.integrate(mixture.expert_names[expert], x[rows], y[rows],
                                              grid, request.solver)
        masks[:, rows, expert] = True
        round_trips[rows] += 1

    async def step_by_step(rows: np.ndarray) -> None:
        evaluated: list[np.ndarray] = []

        async def velocity(xe: np.ndarray, te: np.ndarray, ye: np.ndarray) -> np.ndarray:
            v, chosen = await _mixture_velocity(mixture, caller, request.strategy, xe, te, ye)
            evaluated.append(chosen)
            return v

        xs, ys = x[rows], y[rows]
        for i in range(len(grid) - 1):
            xs = await _ASYNC_STEPS[request.solver](velocity, xs, float(grid[i]),
                                                    float(grid[i + 1]), ys)
        x_next[rows] = xs
        masks[:, rows, :] = np.stack(evaluated)
        round_trips[rows] += masks[:, rows, :].sum(axis=(0, 2))

    work = [delegate(e, rows) for e in range(k)
            if (rows := np.flatnonzero(delegated & selected[:, e])).size]
    if not delegated.all():
        work.append(step_by_step(np.flatnonzero(~delegated)))
    await gather_all(*work)
    return StepEvent(step=step, t=float(grid[-1]), x=x_next, selections=tuple(masks),
                     round_trips=round_trips, delegated=delegated)


async def _mixture_velocity(mixture: RemoteMixture, caller: ExpertCaller, strategy: Strategy,
                            x: np.ndarray, t: np.ndarray, y: np.ndarray
                            ) -> tuple[np.ndarray, np.ndarray]:
    """``sum_k w_k v_k`` as :func:`ddm.sampling.mixture.mixture_velocity` sums it, with the
    selected experts called concurrently; also the (B, K) selection."""
    weights = await _route(mixture, strategy, x, t, y)
    calls = [(k, rows) for k in range(len(mixture.expert_names))
             if (rows := np.flatnonzero(weights[:, k] > 0)).size]
    outs = await gather_all(*(caller.velocity(mixture.expert_names[k], x[rows], t[rows], y[rows])
                              for k, rows in calls))
    v = np.zeros_like(x, dtype=np.float32)
    for (k, rows), vk in zip(calls, outs):
        v[rows] += weights[rows, k][:, None, None, None] * vk
    return v, weights > 0


async def _route(mixture: RemoteMixture, strategy: Strategy, x: np.ndarray, t: np.ndarray,
                 y: np.ndarray) -> np.ndarray:
    """Per-sample mixture weights (B, K) among the experts that serve each sample's label."""
    if strategy.kind == "oracle":
        return routing_weights(oracle_probs(y, mixture.expert_classes), strategy)
    assert mixture.router is not None, "check_request refuses learned strategies without one"
    probs = await mixture.router(x, t, y)
    servable = _servable(mixture, y)
    probs = np.where(servable, probs, 0.0)
    # A row whose servable experts all got probability 0 (underflow) weighs them equally.
    dead = probs.sum(axis=1) <= 0
    probs[dead] = servable[dead] / servable[dead].sum(axis=1, keepdims=True)
    return routing_weights(probs, strategy)


def _servable(mixture: RemoteMixture, y: np.ndarray) -> np.ndarray:
    """(B, K) bool: expert k serves label ``y[b]`` (an expert with no classes serves all)."""
    return mixture.servable[y]


async def _euler(velocity: AsyncVelocity, x: np.ndarray, t: float, t_next: float,
                 y: np.ndarray) -> np.ndarray:
    """:func:`ddm.sampling.solvers.euler_step` with an awaited velocity."""
    return euler_update(x, await velocity(x, _times(len(x), t), y), t, t_next)


async def _heun(velocity: AsyncVelocity, x: np.ndarray, t: float, t_next: float,
                y: np.ndarray) -> np.ndarray:
    """:func:`ddm.sampling.solvers.heun_step` with an awaited velocity."""
    v0 = await velocity(x, _times(len(x), t), y)
    v1 = await velocity(euler_update(x, v0, t, t_next), _times(len(x), t_next), y)
    return heun_update(x, v0, v1, t, t_next)


_ASYNC_STEPS = {"euler": _euler, "heun": _heun}


def _times(n: int, t: float) -> np.ndarray:
    return np.full((n,), t, dtype=np.float32)
