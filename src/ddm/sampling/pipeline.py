"""The in-process driver of the sampling loop (:mod:`ddm.sampling.loop`): ``ddm sample``,
evaluation and benchmarks generate with it, from a DDM's stages loaded by
:func:`ddm.models.ddm.load_ddm` (label or text alike) or a Paris release's
(:mod:`ddm.models.paris_ddm`).

It answers the loop's queries by calling the models in this process: the experts of one step
one after the other, or ``DDM_EXPERT_WORKERS`` of them at once (:func:`ddm.threads.
expert_parallelism`: threads that share the intra-op budget; frameworks release the GIL in
their ops); an :class:`~ddm.sampling.loop.Integrate` (delegation) runs the same solver over
the expert alone, as an expert server does.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any, Callable, Generator, Iterator, Sequence

import numpy as np

from ddm.conditioning import Conditioning
from ddm.sampling_params import DEFAULT_SOLVER, DEFAULT_STRATEGY, GUIDANCE_CUTOFF, SOLVER
from ddm.models.ddm import DDM
from ddm.models.stages import ConditionedVelocity
from ddm.sampling.guidance import guided
from ddm.sampling.loop import (Calls, Concurrently, Decode, Decoded, Encode, Generation,
                               Integrate, Loop, Mixture, Query, Route, SamplingRequest,
                               StepEvent, Tally, Velocity, denoise)
from ddm.sampling.routing import Strategy, parse_strategy
from ddm.sampling.solvers import iterate
from ddm.threads import expert_parallelism, set_torch_threads_here


def mixture_of(ddm: DDM) -> Mixture:
    """What the loop knows of ``ddm``."""
    return Mixture(expert_names=ddm.expert_names, expert_classes=ddm.expert_classes,
                   image_shape=ddm.latent_shape, num_classes=ddm.num_classes,
                   routed=ddm.router is not None, conditioning=ddm.conditioning,
                   encoder=ddm.encode is not None, decoder=ddm.decode is not None,
                   grid=ddm.grid)


def sampling_request(labels: Sequence[int], steps: int, seed: int,
                     strategy: Strategy | str = DEFAULT_STRATEGY, solver: str = DEFAULT_SOLVER,
                     first_index: int = 0, delegate_steps: int = 0) -> SamplingRequest:
    """A :class:`SamplingRequest`, the strategy parsed from its name if need be (in-process
    sampling also runs the evaluation's baselines, e.g. ``random``)."""
    if isinstance(strategy, str):
        strategy = parse_strategy(strategy, evaluation=True)
    return SamplingRequest(labels=tuple(int(v) for v in labels), steps=steps, seed=seed,
                           strategy=strategy, solver=solver, delegate_steps=delegate_steps,
                           first_index=first_index)


def generate(ddm: DDM, labels: Sequence[int], steps: int, seed: int,
             strategy: Strategy | str = DEFAULT_STRATEGY, solver: str = DEFAULT_SOLVER,
             first_index: int = 0, delegate_steps: int = 0,
             on_step: Callable[[StepEvent], None] | None = None) -> Generation:
    """Sample one image per label; image ``i``'s noise comes from ``(seed, first_index + i)``.
    ``on_step`` sees each :class:`StepEvent` as it comes (a progress bar).

    Everything is validated before any model runs (:func:`ddm.sampling.loop.check_request`).
    """
    return generation(ddm, sampling_request(labels, steps, seed, strategy, solver, first_index,
                                            delegate_steps), on_step)


def generate_text(ddm: DDM, prompts: Sequence[str] = (), *,
                  on_step: Callable[[StepEvent], None] | None = None,
                  **settings: Any) -> Generation:
    """One image per prompt (or per row of precomputed ``conditioning``) from a text DDM, the
    request's ``settings`` as :func:`text_request` takes them. ``on_step`` sees each
    :class:`StepEvent` as it comes (a progress bar)."""
    return generation(ddm, text_request(ddm, prompts, **settings), on_step)


def text_request(ddm: DDM, prompts: Sequence[str] = (), *, steps: int | None = None,
                 seed: int = 0, strategy: Strategy | str | None = None,
                 guidance_scale: float | None = None, negative_prompt: str | None = None,
                 guidance_cutoff: float | None = None, latents: np.ndarray | None = None,
                 conditioning: Conditioning | None = None, output: str = "image",
                 solver: str | None = None, first_index: int = 0) -> SamplingRequest:
    """A text DDM's :class:`SamplingRequest`; steps, strategy and guidance scale default
    (None) to the release's, the cutoff and solver to their declared defaults. Image ``i``'s
    noise comes from ``(seed, first_index + i)`` unless ``latents``
    (N, C, S, S) float32 give it; ``output="latent"`` skips the decoder (images None)."""
    chosen = ddm.strategy if strategy is None else strategy
    return SamplingRequest(
        labels=(), steps=ddm.steps if steps is None else steps, seed=seed,
        strategy=parse_strategy(chosen, evaluation=True) if isinstance(chosen, str) else chosen,
        solver=SOLVER.default if solver is None else solver, prompts=tuple(prompts),
        conditioning=conditioning,
        guidance_scale=ddm.guidance_scale if guidance_scale is None else guidance_scale,
        negative_prompt=negative_prompt,
        guidance_cutoff=GUIDANCE_CUTOFF.default if guidance_cutoff is None else guidance_cutoff,
        latents=latents,
        output=output, first_index=first_index)


def generation(ddm: DDM, request: SamplingRequest,
               on_step: Callable[[StepEvent], None] | None = None) -> Generation:
    """Run ``request`` on ``ddm`` in this process (validated first)."""
    tally = Tally(ddm.expert_names, request.labels, state_is_image=ddm.state_is_image)
    for event in steps_of(ddm, request):
        tally.add(event)
        if on_step is not None and isinstance(event, StepEvent):
            on_step(event)
    return tally.result()


def steps_of(ddm: DDM, request: SamplingRequest) -> Iterator[StepEvent | Decoded]:
    """Run the loop in this process, yielding its :class:`StepEvent` after each chunk (and
    the :class:`Decoded` images at the end, where the DDM decodes)."""
    loop: Loop = denoise(mixture_of(ddm), request)  # validates the request first
    workers, each = expert_parallelism()
    with ExitStack() as closing:
        pool = (closing.enter_context(ThreadPoolExecutor(
                    workers, thread_name_prefix="ddm-expert",
                    initializer=set_torch_threads_here, initargs=(each,)))
                if workers > 1 and len(ddm.experts) > 1 else None)
        stages = _Stages(ddm, pool)
        answer: Any = None
        while True:
            try:
                item = loop.send(answer)
            except StopIteration:
                return
            if isinstance(item, (StepEvent, Decoded)):
                answer = None
                yield item
            else:
                answer = stages.answer(item)


class _Stages:
    """Answers the loop's queries with ``ddm``'s models, in this process: each expert reads
    its kind of conditioning from the rows', guided rows against the null conditioning.
    ``pool``: where a step's expert calls run at once (None: one after the other)."""

    def __init__(self, ddm: DDM, pool: ThreadPoolExecutor | None = None) -> None:
        self.ddm = ddm
        self.pool = pool
        self.velocities: tuple[ConditionedVelocity, ...] = tuple(
            guided(e, ddm.null) for e in ddm.experts)

    def answer(self, query: Query) -> Any:
        ddm = self.ddm
        if isinstance(query, Encode):
            assert ddm.encode is not None, "checked by the loop"
            return ddm.encode(query.prompts)
        if isinstance(query, Decode):
            assert ddm.decode is not None, "checked by the loop"
            return ddm.decode(query.latents)
        if isinstance(query, Route):
            assert ddm.router is not None, "check_request refuses learned strategies without one"
            return ddm.router(query.x, query.t, query.cond)
        if isinstance(query, Calls):
            if self.pool is not None and len(query.calls) > 1:
                return list(self.pool.map(self._call, query.calls))
            return [self._call(c) for c in query.calls]
        assert isinstance(query, Concurrently), f"unknown query {query!r}"
        return [self._finish(part) for part in query.parts]

    def _call(self, call: Velocity | Integrate) -> np.ndarray:
        """One expert call of a step: a velocity, or a delegated integration."""
        if isinstance(call, Velocity):
            return self.velocities[call.expert](call.x, call.t, call.cond)
        return self._integrate(call.expert, call.x, call.cond, call.grid, call.solver)

    def _finish(self, part: Generator[Query, Any, Any]) -> Any:
        """Run a sub-loop to its end; its return value."""
        answer: Any = None
        while True:
            try:
                query = part.send(answer)
            except StopIteration as done:
                return done.value
            answer = self.answer(query)

    def _integrate(self, expert: int, x: np.ndarray, cond: Conditioning, grid: np.ndarray,
                   solver: str) -> np.ndarray:
        for _, x in iterate(self.velocities[expert], x, cond, grid, solver):
            pass
        return x

