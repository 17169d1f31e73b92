"""The in-process driver of the sampling loop (:mod:`ddm.sampling.loop`): ``ddm sample``,
evaluation and benchmarks generate with it, from a DDM loaded by :mod:`ddm.models.loading`.

It answers the loop's queries by calling the models in this process, one after the other; an
:class:`~ddm.sampling.loop.Integrate` (delegation) runs the same solver over the expert alone,
as an expert server does.
"""

from __future__ import annotations

from typing import Any, Callable, Generator, Iterator, Sequence

import numpy as np

from ddm.models.loading import LoadedDDM
from ddm.sampling.loop import (Calls, Concurrently, Generation, Loop, Mixture, Query, Route,
                               SamplingRequest, StepEvent, Tally, Velocity, denoise)
from ddm.sampling.routing import Strategy, parse_strategy
from ddm.sampling.solvers import iterate


def mixture_of(ddm: LoadedDDM) -> Mixture:
    """What the loop knows of ``ddm``."""
    return Mixture(expert_names=tuple(e.name for e in ddm.experts),
                   expert_classes=tuple(tuple(e.classes) for e in ddm.experts),
                   image_shape=ddm.image_shape, num_classes=ddm.num_classes,
                   routed=ddm.router is not None)


def sampling_request(labels: Sequence[int], steps: int, seed: int,
                     strategy: Strategy | str = "top1", solver: str = "euler",
                     first_index: int = 0, delegate_steps: int = 0) -> SamplingRequest:
    """A :class:`SamplingRequest`, the strategy parsed from its name if need be (in-process
    sampling also runs the evaluation's baselines, e.g. ``random``)."""
    if isinstance(strategy, str):
        strategy = parse_strategy(strategy, evaluation=True)
    return SamplingRequest(labels=tuple(int(v) for v in labels), steps=steps, seed=seed,
                           strategy=strategy, solver=solver, delegate_steps=delegate_steps,
                           first_index=first_index)


def generate(ddm: LoadedDDM, labels: Sequence[int], steps: int, seed: int,
             strategy: Strategy | str = "top1", solver: str = "euler",
             first_index: int = 0, delegate_steps: int = 0,
             on_step: Callable[[StepEvent], None] | None = None) -> Generation:
    """Sample one image per label; image ``i``'s noise comes from ``(seed, first_index + i)``.
    ``on_step`` sees each :class:`StepEvent` as it comes (a progress bar).

    Everything is validated before any model runs (:func:`ddm.sampling.loop.check_request`).
    """
    request = sampling_request(labels, steps, seed, strategy, solver, first_index,
                               delegate_steps)
    tally = Tally(tuple(e.name for e in ddm.experts), request.labels)
    for event in steps_of(ddm, request):
        tally.add(event)
        if on_step is not None:
            on_step(event)
    return tally.result()


def steps_of(ddm: LoadedDDM, request: SamplingRequest) -> Iterator[StepEvent]:
    """Run the loop in this process, yielding its :class:`StepEvent` after each chunk."""
    loop: Loop = denoise(mixture_of(ddm), request)  # validates the request first
    answer: Any = None
    while True:
        try:
            item = loop.send(answer)
        except StopIteration:
            return
        if isinstance(item, StepEvent):
            answer = None
            yield item
        else:
            answer = _answer(ddm, item)


def _answer(ddm: LoadedDDM, query: Query) -> Any:
    if isinstance(query, Route):
        assert ddm.router is not None, "check_request refuses learned strategies without one"
        return ddm.router(query.x, query.t, query.y)
    if isinstance(query, Calls):
        return [ddm.experts[c.expert].velocity(c.x, c.t, c.y) if isinstance(c, Velocity)
                else _integrate(ddm, c.expert, c.x, c.y, c.grid, c.solver) for c in query.calls]
    assert isinstance(query, Concurrently), f"unknown query {query!r}"
    return [_finish(ddm, part) for part in query.parts]


def _finish(ddm: LoadedDDM, part: Generator[Query, Any, Any]) -> Any:
    """Run a sub-loop to its end; its return value."""
    answer: Any = None
    while True:
        try:
            query = part.send(answer)
        except StopIteration as done:
            return done.value
        answer = _answer(ddm, query)


def _integrate(ddm: LoadedDDM, expert: int, x: np.ndarray, y: np.ndarray, grid: np.ndarray,
               solver: str) -> np.ndarray:
    for _, x in iterate(ddm.experts[expert].velocity, x, y, grid, solver):
        pass
    return x
