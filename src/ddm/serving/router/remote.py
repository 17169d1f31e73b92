"""The router's driver of the sampling loop (:mod:`ddm.sampling.loop`): routing in the router
process, velocities over HTTP.

The loop decides everything (noise, time grid, routing with the label mask, solver steps,
delegation); this driver only answers its queries: the router network through a shared
:class:`RouterNetwork`, expert calls through an :class:`ExpertCaller` (the
:class:`~ddm.serving.router.pool.ExpertPool`), the calls of one query concurrently and the
sub-loops of a :class:`~ddm.sampling.loop.Concurrently` side by side. So a generation here gives
the pixels ``ddm sample`` gives for the same request.

Everything a generation accumulates lives in the generation's own coroutine and loop: concurrent
generations share only the caller and the :class:`RouterNetwork`, which both merge the calls
that concurrent generations make at the same time (:mod:`ddm.serving.router.coalescing`).
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Generator, Protocol

import numpy as np

from ddm.conditioning import Conditioning
from ddm.models.loading import RouterFn
from ddm.sampling.loop import (Calls, CheckedRequest, Concurrently, Decode, Encode, Generation,
                               Integrate, Loop, Missing, Mixture, Query, Route, SamplingRequest,
                               StepEvent, Tally, Velocity, checked)
from ddm.sampling.loop import denoise as loop_denoise
from ddm.serving.router.coalescing import Coalescer
from ddm.serving.router.missing import Held, MissingExperts
from ddm.serving.router.pool import gather_all

__all__ = ["CheckedRequest", "ExpertCaller", "Guard", "RemoteMixture", "RouterNetwork",
           "SamplingRequest", "StepEvent", "Tally", "check_request", "denoise", "generate_remote"]

#: Up to this many rows, the router network runs on the event loop: at batch 1 it takes about
#: 0.15 ms, less than the two thread hops of ``asyncio.to_thread``; bigger batches go to a
#: thread, so that the loop keeps serving other generations meanwhile.
INLINE_ROUTER_ROWS = 8
#: The most rows one forward pass of the router network takes when merging calls.
ROUTER_MAX_ROWS = 256


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
    def mixture(self) -> Mixture:
        """What the sampling loop knows of it: made once, as the router makes this object once
        per change of its experts' reports (``ddm.serving.router.state``)."""
        return Mixture(self.expert_names, self.expert_classes, self.image_shape,
                       self.num_classes, routed=self.router is not None)


@dataclass(frozen=True)
class Guard:
    """One generation under the router's ``missing_expert`` policy: ``held`` collects the
    time it waited for missing experts; the policy's demand meter sees every step."""

    missing: MissingExperts
    held: Held


def check_request(mixture: RemoteMixture, request: SamplingRequest) -> CheckedRequest:
    """:func:`ddm.sampling.loop.check_request` for this mixture (a ``ValueError``: a 422), its
    verdict kept so that :func:`denoise` does not check again."""
    return checked(mixture.mixture, request)


async def denoise(mixture: RemoteMixture, caller: ExpertCaller,
                  request: SamplingRequest | CheckedRequest,
                  guard: Guard | None = None) -> AsyncIterator[StepEvent]:
    """Run the loop with remote experts, yielding its :class:`StepEvent` after each chunk;
    with ``guard``, under its missing-expert policy, counting each chunk's demand."""
    loop: Loop = loop_denoise(mixture.mixture, request)
    answer: Any = None
    try:
        while True:
            try:
                item = loop.send(answer)
            except StopIteration:
                return
            if isinstance(item, StepEvent):
                answer = None
                if guard is not None:
                    guard.missing.demand.routed(item.wanted_rows, item.wanted_weight)
                    guard.missing.demand.rerouted_steps.inc(int(item.rerouted.sum()))
                yield item
            else:
                answer = await _answer(mixture, caller, item, guard)
    finally:
        loop.close()


async def generate_remote(mixture: RemoteMixture, caller: ExpertCaller,
                          request: SamplingRequest | CheckedRequest,
                          guard: Guard | None = None) -> Generation:
    """Run :func:`denoise` to the end and sum up what each image used."""
    labels = (request.request if isinstance(request, CheckedRequest) else request).labels
    tally = Tally(mixture.expert_names, labels)
    async for event in denoise(mixture, caller, request, guard):
        tally.add(event)
    return tally.result()


async def _answer(mixture: RemoteMixture, caller: ExpertCaller, query: Query,
                  guard: Guard | None) -> Any:
    if isinstance(query, (Encode, Decode)):
        raise NotImplementedError(f"{type(query).__name__}: text encoder and decoder stages "
                                  "are not supported by the remote driver yet")
    if isinstance(query, Route):
        assert mixture.router is not None, "check_request refuses learned strategies without one"
        return await mixture.router(query.x, query.t, _labels(query.cond))
    if isinstance(query, Calls):
        return await gather_all(*(_call(mixture, caller, c, guard) for c in query.calls))
    assert isinstance(query, Concurrently), f"unknown query {query!r}"
    return await gather_all(*(_finish(mixture, caller, part, guard) for part in query.parts))


async def _call(mixture: RemoteMixture, caller: ExpertCaller, call: Velocity | Integrate,
                guard: Guard | None) -> np.ndarray | Missing:
    name = mixture.expert_names[call.expert]

    def send() -> Awaitable[np.ndarray]:
        if isinstance(call, Velocity):
            return caller.velocity(name, call.x, call.t, _labels(call.cond))
        return caller.integrate(name, call.x, _labels(call.cond), call.grid, call.solver)

    if guard is None:
        return await send()
    fallback = isinstance(call, Velocity) and call.fallback
    out = await guard.missing.call(name, send, fallback, guard.held, call.x.shape[0])
    return Missing(call.expert) if out is None else out


def _labels(cond: Conditioning) -> np.ndarray:
    """The labels the wire carries today; text conditioning does not travel yet."""
    if cond.labels is None:
        raise NotImplementedError("text conditioning is not supported by the remote driver yet")
    return cond.labels


async def _finish(mixture: RemoteMixture, caller: ExpertCaller,
                  part: Generator[Query, Any, Any], guard: Guard | None) -> Any:
    """Run a sub-loop to its end; its return value."""
    answer: Any = None
    while True:
        try:
            query = part.send(answer)
        except StopIteration as done:
            return done.value
        answer = await _answer(mixture, caller, query, guard)
