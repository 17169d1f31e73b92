"""The router's driver of the sampling loop (:mod:`ddm.sampling.loop`): experts over HTTP,
the other stages in the router process or on their own servers.

The loop decides everything (noise, time grid, routing with the label mask, guidance, solver
steps, delegation); this driver only answers its queries: :class:`~ddm.sampling.loop.Encode`
through the text encoder's :class:`StageCaller`, :class:`~ddm.sampling.loop.Route` through a
shared :class:`RouterNetwork` (a label DDM's network, or a text DDM's router stage), expert calls
with each call's :class:`~ddm.conditioning.Conditioning` through an :class:`ExpertCaller` (the
:class:`~ddm.serving.router.fleet.pool.ExpertPool`), the calls of one query concurrently and the
sub-loops of a :class:`~ddm.sampling.loop.Concurrently` side by side, and
:class:`~ddm.sampling.loop.Decode` through the decoder's :class:`StageCaller`. A stage loaded in
the router and one served on its own implement the same
:class:`~ddm.serving.router.fleet.stage_clients.StageCaller`. So a generation here gives the pixels
``ddm sample`` gives for the same request.

Everything a generation accumulates lives in the generation's own coroutine and loop: concurrent
generations share only the caller and the :class:`RouterNetwork`, which both merge the calls
that concurrent generations make at the same time (:mod:`ddm.serving.router.fleet.coalescing`).

**Calls ahead.** Where the router network is served (a round trip of its own), a step would
cost two round trips one after the other: routing, then the experts. The loop's
:class:`~ddm.sampling.loop.Route` carries the calls it expects next (the previous evaluation's
selection at this state), and the driver starts them beside the routing; the loop then asks
for the very same call objects wherever routing kept their rows, all or some (the expert's
new rows go in a call of their own), and those are answered by the calls already under way
(:class:`_Ahead`). A call the loop does not ask for is cancelled, and the rows of an asked one
that routing moved elsewhere are not used (computed for nothing: the cost of a switch). Each
row's velocity is still its expert's at its own inputs, so no value changes; only when and in
which call rows go. Under the lockstep, a step whose calls went ahead is one flight, from its
routing's turn until its velocities land. Only calls to experts with a ready replica go
ahead: the missing-expert policy (wait, wake, reroute) runs for an expert the step asks for.
Whether calls go ahead is :data:`CALLS_AHEAD_ENV`'s choice (:func:`calls_ahead`): by default
only for a lone image (the router generating one image, no other) where the router network's
server runs on an accelerator, which runs the two passes one after the other while the hosts'
work overlaps. On a CPU the router network's forward and the experts' compete for the same
cores, and a step was not measured faster; with more images a step's calls go as two batches
per expert wherever any row switched (the calls ahead, then the switched rows), and on an H200
32 concurrent prompts made fewer images/s with calls ahead than without (docs/paris.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Generator, Mapping,
                    Protocol)

import numpy as np

from ddm.conditioning import LABELS, TEXT, Conditioning, EncodedPrompts
from ddm.convention import TimeGrid
from ddm.models.text_prior import pooled_text
from ddm.sampling.loop import (Calls, CheckedRequest, Concurrently, Decode, Decoded, Encode,
                               Generation, Integrate, Loop, Missing, Mixture, Query, Route,
                               Routed, SamplingRequest, StepEvent, Tally, Velocity, checked)
from ddm.sampling.loop import denoise as loop_denoise
from ddm.serving.router.fleet.coalescing import Coalescer
from ddm.serving.router.fleet.lockstep import Stepper
from ddm.serving.router.fleet.missing import Held, MissingExperts
from ddm.serving.router.fleet.replicas import on_accelerator
from ddm.serving.router.fleet.servers import gather_all

if TYPE_CHECKING:  # the stages' modules import torch, which a label DDM's router never needs
    from ddm.serving.router.fleet.stage_clients import StageCaller

    #: What :func:`denoise` yields: the text encoder's answer first where the loop encodes
    #: prompts, a :class:`StepEvent` per chunk, the :class:`Decoded` images last.
    Event = EncodedPrompts | StepEvent | Decoded

__all__ = ["CheckedRequest", "Decoded", "ExpertCaller", "Guard", "RemoteMixture",
           "RouterNetwork", "SamplingRequest", "StageCaller", "StepEvent", "Tally",
           "check_request", "denoise", "generate_remote", "local_network", "stage_route"]

#: Up to this many rows, the router network runs on the event loop: a small batch's pass
#: costs less than the two thread hops of ``asyncio.to_thread`` (docs/benchmarks.md,
#: ``router``); bigger batches go to a thread, so that the loop keeps serving other
#: generations meanwhile.
INLINE_ROUTER_ROWS = 8
#: The most rows one forward pass of the router network takes when merging calls.
ROUTER_MAX_ROWS = 256
#: The router's choice of calls ahead (module docstring), one of :data:`CALLS_AHEAD_CHOICES`.
CALLS_AHEAD_ENV = "DDM_CALLS_AHEAD"
#: ``auto`` (the default): for a lone image, where the served router network's device is not
#: a CPU; ``on``: always; ``off``: never.
CALLS_AHEAD_CHOICES = ("auto", "on", "off")


def calls_ahead_choice(env: Mapping[str, str]) -> str:
    """:data:`CALLS_AHEAD_ENV`'s value in ``env`` (``auto`` where unset), or a ``ValueError``
    naming the choices."""
    choice = env.get(CALLS_AHEAD_ENV, "").strip().lower() or "auto"
    if choice not in CALLS_AHEAD_CHOICES:
        raise ValueError(f"{CALLS_AHEAD_ENV}={env[CALLS_AHEAD_ENV]!r}: give one of "
                         f"{', '.join(CALLS_AHEAD_CHOICES)}")
    return choice


def calls_ahead(choice: str, device: str | None, alone: bool) -> bool:
    """Whether a step's expected calls go beside a served router network's pass, by
    ``choice``, the device its server reports (None: not said, or not probed yet) and whether
    the step is the router's only image (``alone``: one generation in flight, of one image)."""
    if choice == "auto":
        return alone and on_accelerator(device)
    return choice == "on"


class ExpertCaller(Protocol):
    """Remote experts by name; :class:`~ddm.serving.router.fleet.pool.ExpertPool` is one. ``cond``
    holds the rows' labels, or their text embeddings with each row's guidance scale (guidance
    runs inside the expert)."""

    async def velocity(self, expert: str, x: np.ndarray, t: np.ndarray,
                       cond: Conditioning) -> np.ndarray: ...

    async def integrate(self, expert: str, x: np.ndarray, cond: Conditioning,
                        grid: np.ndarray, solver: str) -> np.ndarray: ...


class RouterNetwork:
    """A router network shared by a router's generations: calls that concurrent generations
    make in the same turn of the event loop, or while a pass runs, go as one pass (at batch 1
    the network's cost is almost all per call, not per row; over the wire, per request).
    ``forward`` is awaited with the merged arrays: :func:`local_network` for a label DDM's
    network in this process, called with ``(x, t, y)``; :func:`stage_route` for a text DDM's
    router stage (in this process or a server's), called with ``(x, t)`` or
    ``(x, t, pooled text)``. Calls with different numbers of arrays never merge."""

    def __init__(self, forward: Callable[..., Awaitable[np.ndarray]],
                 calls_ahead: Callable[[int], bool] = lambda rows: False) -> None:
        """``calls_ahead``: asked at each routing with its rows (images), whether the driver
        starts the calls the loop expects beside the pass (the module docstring)."""
        self._forward_fn = forward
        self.calls_ahead = calls_ahead
        self._coalescer = Coalescer(self._forward, lambda: ROUTER_MAX_ROWS, lambda: 1)

    async def __call__(self, *inputs: np.ndarray) -> np.ndarray:
        """``p(k | inputs)`` as (B, K) probabilities."""
        return await self._coalescer.submit(len(inputs), inputs)

    async def close(self) -> None:
        """Cancel the passes in flight and refuse new calls (the router is stopping)."""
        await self._coalescer.close()

    async def _forward(self, _key: object, inputs: tuple[np.ndarray, ...],
                       _since: float) -> np.ndarray:
        return await self._forward_fn(*inputs)


def local_network(probs: Callable[..., np.ndarray]) -> Callable[..., Awaitable[np.ndarray]]:
    """A :class:`RouterNetwork`'s pass through ``probs`` in this process: on the event loop up
    to :data:`INLINE_ROUTER_ROWS` rows, in a worker thread above."""

    async def forward(*inputs: np.ndarray) -> np.ndarray:
        if inputs[0].shape[0] <= INLINE_ROUTER_ROWS:
            return probs(*inputs)
        return await asyncio.to_thread(probs, *inputs)

    return forward


def stage_route(stages: StageCaller) -> Callable[..., Awaitable[np.ndarray]]:
    """A :class:`RouterNetwork`'s pass through a text DDM's router stage: ``(x, t)``, or
    ``(x, t, pooled)`` where the conditioning carries pooled text."""

    async def forward(x: np.ndarray, t: np.ndarray, *pooled: np.ndarray) -> np.ndarray:
        return await stages.route(x, t, pooled[0] if pooled else None)

    return forward


class NullConditioning:
    """The empty prompt's conditioning, encoded once on first use: the unconditional half of
    the guided rows that name no negative prompt (an expert server takes guided rows with
    their unconditional embeddings, ``docs/protocol.md``), as the in-process driver's
    ``DDM.null`` (:class:`ddm.models.ddm.DDM`); keyed (:meth:`Conditioning.keyed`), as the
    generations' own rows, so that the expert pool hashes it once."""

    def __init__(self, encoder: StageCaller) -> None:
        self._encoder = encoder
        self._made: asyncio.Future[Conditioning] | None = None
        #: Its rows by count, made once per count: every guided call of every step takes them.
        self._rows: dict[int, Conditioning] = {}

    async def rows(self, n: int) -> Conditioning:
        """``n`` rows of it (read-only)."""
        if self._made is None or (self._made.done() and (self._made.cancelled()
                                                         or self._made.exception())):
            self._made = asyncio.ensure_future(self._encode())
        null = await asyncio.shield(self._made)
        rows = self._rows.get(n)
        if rows is None:
            # Read-only views of its one row.
            rows = self._rows[n] = dataclasses.replace(null, **{
                name: np.broadcast_to(value, (n, *value.shape[1:]))
                for name in ("embeddings", "mask", "pooled", "keys")
                if (value := getattr(null, name)) is not None})
        return rows

    async def _encode(self) -> Conditioning:
        return (await self._encoder.encode([""])).cond.keyed()


@dataclass(frozen=True)
class RemoteMixture:
    """The router's view of a DDM: experts in the router network's output order, the labels
    each serves (empty: every label), a label DDM's router network (None: oracle only), the
    state's shape (latents where a decoder follows). A text DDM adds its stages (None: absent;
    without an encoder, requests bring embeddings; without a router network, one expert) and
    its time grid."""

    expert_names: tuple[str, ...]
    expert_classes: tuple[tuple[int, ...], ...]
    router: RouterNetwork | None
    image_shape: tuple[int, int, int]
    num_classes: int
    conditioning: str = LABELS
    encoder: StageCaller | None = None
    decoder: StageCaller | None = None
    grid: TimeGrid = TimeGrid()
    null: NullConditioning | None = None

    @functools.cached_property
    def mixture(self) -> Mixture:
        """What the sampling loop knows of it: made once, as the router makes this object once
        per change of its experts' reports (``ddm.serving.router.api.state``)."""
        return Mixture(self.expert_names, self.expert_classes, self.image_shape,
                       self.num_classes,
                       routed=self.router is not None,
                       conditioning=self.conditioning, encoder=self.encoder is not None,
                       decoder=self.decoder is not None, grid=self.grid)


@dataclass(frozen=True)
class Guard:
    """One generation under the router's ``missing_expert`` policy: ``held`` collects the
    time it waited for missing experts; the policy's demand meter sees every step; ``wakes``:
    whether it may wake missing experts (its strategy is the DDM's own:
    :meth:`MissingExperts.wakes`); ``stepper``: its part in the router's
    :class:`~ddm.serving.router.fleet.lockstep.Lockstep` (None: it steps on its own)."""

    missing: MissingExperts
    held: Held
    wakes: bool
    stepper: Stepper | None = None
    #: Told after each routing that started calls ahead: how many the loop asked for, how
    #: many it did not.
    on_ahead: Callable[[int, int], None] | None = None


def check_request(mixture: RemoteMixture, request: SamplingRequest) -> CheckedRequest:
    """:func:`ddm.sampling.loop.check_request` for this mixture (a ``ValueError``: a 422), its
    verdict kept so that :func:`denoise` does not check again."""
    return checked(mixture.mixture, request)


async def denoise(mixture: RemoteMixture, caller: ExpertCaller,
                  request: SamplingRequest | CheckedRequest,
                  guard: Guard | None = None) -> AsyncIterator[Event]:
    """Run the loop with remote experts, yielding the text encoder's answer (where
    the loop encodes prompts), its :class:`StepEvent` after each chunk and the
    :class:`Decoded` images (where the DDM decodes); with ``guard``, under its missing-expert
    policy, counting each chunk's demand, and in step with the other generations of its
    ``stepper`` where it has one."""
    loop: Loop = loop_denoise(mixture.mixture, request)
    answer: Any = None
    stepper = guard.stepper if guard is not None else None
    ahead = _Ahead(guard.on_ahead if guard is not None else None)
    try:
        while True:
            try:
                item = loop.send(answer)
            except StopIteration:
                return
            if isinstance(item, (StepEvent, Decoded)):
                answer = None
                if guard is not None and isinstance(item, StepEvent):
                    guard.missing.routed(item.wanted_rows, item.wanted_weight, guard.wakes)
                    guard.missing.demand.rerouted_steps.inc(int(item.rerouted.sum()))
                yield item
            elif isinstance(item, Encode):
                assert mixture.encoder is not None, "check_request refuses prompts without one"
                encoded = await mixture.encoder.encode(item.prompts)
                # Keyed once: the expert pool names each step's rows by their content.
                answer = encoded.cond.keyed()
                yield encoded
            else:
                # Calls after a routing that started calls ahead are that routing's flight.
                went_ahead = isinstance(item, Calls) and ahead.started
                if stepper is not None and not went_ahead:
                    await _in_step(stepper, item)
                try:
                    answer = await _answer(mixture, caller, item, guard, ahead)
                finally:
                    if stepper is not None and not ahead.started:
                        stepper.landed()
    finally:
        ahead.cancel()
        if stepper is not None:
            stepper.leave()
        loop.close()


async def _in_step(stepper: Stepper, query: Query) -> None:
    """Wait for ``query``'s turn: a routing or expert query steps with the others; the
    generation leaves them when it decodes."""
    if isinstance(query, Decode):
        stepper.leave()
    elif isinstance(query, (Route, Calls)):
        await stepper.turn(type(query).__name__, query.x.shape[0] if isinstance(query, Route)
                           else sum(call.x.shape[0] for call in query.calls))


async def generate_remote(mixture: RemoteMixture, caller: ExpertCaller,
                          request: SamplingRequest | CheckedRequest,
                          guard: Guard | None = None,
                          on_encoded: Callable[[EncodedPrompts], None] | None = None
                          ) -> Generation:
    """Run :func:`denoise` to the end and sum up what each image used; ``on_encoded`` sees
    the text encoder's answer (what it cut of each prompt)."""
    labels = (request.request if isinstance(request, CheckedRequest) else request).labels
    tally = Tally(mixture.expert_names, labels, state_is_image=mixture.conditioning == LABELS)
    async for event in denoise(mixture, caller, request, guard):
        if isinstance(event, (StepEvent, Decoded)):
            tally.add(event)
        elif on_encoded is not None:
            on_encoded(event)
    return tally.result()


async def _answer(mixture: RemoteMixture, caller: ExpertCaller, query: Query,
                  guard: Guard | None, ahead: _Ahead) -> Any:
    if isinstance(query, Calls):
        return await gather_all(*(ahead.take(c) or _call(mixture, caller, c, guard)
                                  for c in ahead.asked(query.calls)))
    ahead.cancel()  # any other query: the loop asked for none of them
    if isinstance(query, Decode):
        assert mixture.decoder is not None, "the loop decodes only where a decoder exists"
        return await mixture.decoder.decode(query.latents)
    if isinstance(query, Route):
        assert mixture.router is not None, "check_request refuses learned strategies without one"
        early = (_startable(mixture, query.expect, guard)
                 if mixture.router.calls_ahead(query.x.shape[0]) else ())
        went_ahead = bool(early)
        if went_ahead:
            ahead.start(early, lambda c: _call(mixture, caller, c, guard))
        if mixture.conditioning == TEXT:
            pooled = pooled_text(query.cond)
            probs = await mixture.router(query.x, query.t,
                                         *(() if pooled is None else (pooled,)))
        else:
            probs = await mixture.router(query.x, query.t, _labels(query.cond))
        return Routed(probs, ahead=True) if went_ahead else probs
    assert isinstance(query, Concurrently), f"unknown query {query!r}"
    return await gather_all(*(_finish(mixture, caller, part, guard) for part in query.parts))


def _startable(mixture: RemoteMixture, expect: tuple[Velocity, ...],
               guard: Guard | None) -> tuple[Velocity, ...]:
    """The expected calls to start beside a routing: those to experts with a ready replica.
    A call to a missing expert would run the missing-expert policy (wait, wake it, count a
    reroute) before routing says whether the step wants that expert at all; the loop's own
    call does, if it does."""
    if guard is None:
        return expect
    return tuple(call for call in expect
                 if guard.missing.usable(mixture.expert_names[call.expert]))


async def _call(mixture: RemoteMixture, caller: ExpertCaller, call: Velocity | Integrate,
                guard: Guard | None) -> np.ndarray | Missing:
    name = mixture.expert_names[call.expert]
    cond = call.cond
    if cond.guidance is not None and cond.negative is None and mixture.null is not None:
        cond = cond.with_guidance(cond.guidance, await mixture.null.rows(len(cond)))

    def send() -> Awaitable[np.ndarray]:
        if isinstance(call, Velocity):
            return caller.velocity(name, call.x, call.t, cond)
        return caller.integrate(name, call.x, cond, call.grid, call.solver)

    if guard is None:
        return await send()
    fallback = isinstance(call, Velocity) and call.fallback
    out = await guard.missing.call(name, send, fallback, guard.held, call.x.shape[0],
                                   guard.wakes)
    return Missing(call.expert) if out is None else out


def _labels(cond: Conditioning) -> np.ndarray:
    """A label DDM's router network sees the labels."""
    assert cond.labels is not None, "a label DDM's loop carries labels"
    return cond.labels


async def _finish(mixture: RemoteMixture, caller: ExpertCaller,
                  part: Generator[Query, Any, Any], guard: Guard | None) -> Any:
    """Run a sub-loop to its end; its return value."""
    answer: Any = None
    ahead = _Ahead(guard.on_ahead if guard is not None else None)
    try:
        while True:
            try:
                query = part.send(answer)
            except StopIteration as done:
                return done.value
            answer = await _answer(mixture, caller, query, guard, ahead)
    finally:
        ahead.cancel()


class _Ahead:
    """The expert calls one loop's driver started with a routing (``Route.expect``), by the
    call objects' identity, until the loop's next query asks for them or does not."""

    def __init__(self, observe: Callable[[int, int], None] | None) -> None:
        self._calls: dict[int, tuple[Velocity, asyncio.Future[Any]]] = {}
        self._observe = observe

    @property
    def started(self) -> bool:
        """Calls went ahead and the loop has not asked its next query yet."""
        return bool(self._calls)

    def start(self, calls: tuple[Velocity, ...],
              run: Callable[[Velocity], Awaitable[Any]]) -> None:
        """Start ``calls`` now (each runs as the loop's own call of it would)."""
        for call in calls:
            future = asyncio.ensure_future(run(call))
            # A call not asked for is cancelled; its failure, if any, is read here.
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._calls[id(call)] = (call, future)

    def asked(self, calls: tuple[Velocity | Integrate, ...]
              ) -> tuple[Velocity | Integrate, ...]:
        """``calls``, the loop's next query: those of the started calls it does not ask for
        are cancelled, and the counts told."""
        if self._calls:
            wanted = {id(c) for c in calls}
            unused = [key for key, (call, _) in self._calls.items() if key not in wanted]
            for key in unused:
                self._calls.pop(key)[1].cancel()
            if self._observe is not None:
                self._observe(len(self._calls), len(unused))
        return calls

    def take(self, call: Velocity | Integrate) -> asyncio.Future[Any] | None:
        """The started call that is ``call`` (None: it was not started)."""
        found = self._calls.get(id(call))
        if found is None or found[0] is not call:
            return None
        del self._calls[id(call)]
        return found[1]

    def cancel(self) -> None:
        """Cancel the started calls not taken (the loop asked for none of them, or ended)."""
        if self._calls:
            self.asked(())
