"""The one DDM sampling loop, sans I/O: routing, mixture weights with the label mask, solver.

:func:`denoise` is a generator that never calls a model. It yields what it needs and is sent
the answer (after h11 and diffusers' ``scheduler.step``):

* :class:`Encode` -- first, for a DDM with a text encoder asked with prompts: the prompts'
  :class:`~ddm.conditioning.Conditioning` (a negative prompt rides as the last row);
* :class:`Route` -- the router network's probabilities ``(B, K)`` for ``(x, t, cond)``, with
  the expert calls the loop expects to make next (``expect``, below);
* :class:`Calls` -- expert calls to make, concurrently where the driver can: a
  :class:`Velocity` (answer ``v`` ``(B, C, H, W)``; its conditioning carries each row's
  guidance scale, applied inside the expert) or an :class:`Integrate` of a chunk of the
  grid with the request's solver (answer ``x`` at the chunk's end);
* :class:`Concurrently` -- sub-loops (generators of the same kind) to run side by side; the
  answer is the list of their return values;
* :class:`Decode` -- last, for a DDM with a decoder: the images ``(N, 3, H, W)`` in
  ``[-1, 1]`` of the final latents; the loop then yields them as a :class:`Decoded` event.

and it yields a :class:`StepEvent` (answered with None) after each chunk of the grid. Two
drivers run it: :func:`ddm.sampling.pipeline.generate` in-process, and the router's
:func:`ddm.serving.router.fleet.remote.denoise` over HTTP. What an image becomes therefore depends
only on the request and the models, not on the driver: ``ddm sample`` and ``POST
/v1/generate`` give the same pixels.

Per sample and velocity evaluation: the strategy turns the router's probabilities, restricted to
the experts trained on the sample's label where the partition is by label
(:func:`ddm.sampling.routing.mixture_weights`; a text DDM's experts all serve every row), into
weights; ``v = sum_k w_k v_k`` with each expert evaluated only on its rows. Guidance is linear,
so guiding inside each expert and mixing equals mixing and guiding.

**Calls expected ahead.** Routing rarely changes between one evaluation and the next (the
shipped text-to-image DDM's top-2 selection changed 0-3 times in 30 steps per image), so each
:class:`Route` after a generation's first evaluation carries ``expect``: the velocity calls
the previous evaluation's selection would make at this state. A driver whose routing is a
round trip of its own may start them at once, beside the routing, and then answers the
routing with :class:`Routed` (``ahead``). Where routing keeps an expert's rows, the loop asks
for that very :class:`Velocity` object (the driver matches by identity and answers with the
call it started); where the calls went ahead, an expected call whose rows routing keeps in
part is asked too (its other rows' answers are not used) and only the expert's new rows go in
a call of their own, so that one row's switch in a generation of many does not repeat the
expert's whole call. A call expected but not asked is not used. Each row's velocity is its
expert's at that row's inputs whichever call carries it, so no value changes, only when and
in which call the rows are computed.

**Missing experts.** A driver may answer a :class:`Velocity` asked with ``fallback`` by
:class:`Missing` (the router's ``reroute`` policy, when the expert has no ready replica): the
loop then routes the rows that wanted it to the best available experts serving their labels
(:func:`ddm.sampling.routing.available_weights`), asks those for the rows they lack, and marks
the rows ``rerouted`` in the step's event. Rows no available expert serves ask the missing
expert again without ``fallback`` (the driver waits for it or fails). Delegated chunks
(:class:`Integrate`) are never rerouted.

**Delegation** (``delegate_steps`` > 1) is an approximation for remote experts: the grid is
walked in chunks of that many steps. At the start of a chunk, a sample whose strategy selects
exactly one expert (always so for ``oracle`` and ``top1``) is sent to that expert in one
:class:`Integrate` covering the chunk, grouped with the other samples of that expert; the
expert runs the same solver on the same times. Other samples step one by one through the chunk.
Routing is decided again at the next chunk, so within a chunk a delegated sample keeps the
expert chosen at its start: with ``oracle`` (the choice never changes) the result equals
per-step sampling exactly; with a learned strategy it differs only where per-step routing
would have switched experts inside a chunk, and a sample makes at most one round trip per chunk.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Generator, Sequence

import numpy as np

from ddm.conditioning import LABELS, TEXT, Conditioning
from ddm.convention import TimeGrid, to_uint8
from ddm.deploy.limits import MAX_STATE_MAGNITUDE
from ddm.sampling_params import (GUIDANCE_CUTOFF, GUIDANCE_SCALE, MAX_STEPS, SOLVER, STEPS,
                                 sampling_problems)
from ddm.sampling.routing import (Strategy, available_weights, mixture_weights, oracle_probs,
                                  random_weights, routing_weights, servable_labels)
from ddm.sampling.solvers import initial_noise, solver_named, stepper


@dataclass(frozen=True)
class Mixture:
    """What the loop knows of a DDM: experts in the router network's output order, the labels
    each was trained on (empty: every label), whether a router network exists; what it is
    conditioned on, whether it has a text encoder and a decoder stage, and its time grid.
    ``image_shape`` is the state's ``(C, H, W)``: latents where a decoder follows."""

    expert_names: tuple[str, ...]
    expert_classes: tuple[tuple[int, ...], ...]
    image_shape: tuple[int, int, int]
    num_classes: int
    routed: bool
    conditioning: str = LABELS
    encoder: bool = False
    decoder: bool = False
    grid: TimeGrid = TimeGrid()

    @functools.cached_property
    def servable(self) -> np.ndarray:
        """``(num_classes, K)`` bool; looked up at every evaluation, so computed once."""
        return servable_labels(self.expert_classes, self.num_classes)


#: What a generation returns: decoded images, or the final state (latents) as it is.
OUTPUTS = ("image", "latent")


@dataclass(frozen=True)
class SamplingRequest:
    """One generation: an image per label (a label DDM) or per prompt or row of precomputed
    ``conditioning`` (a text DDM); image ``i``'s noise comes from ``(seed, first_index + i)``,
    so an image does not depend on the batch it is made in, unless ``latents`` (N, C, H, W)
    float32 give the initial state (diffusers' ``latents``).

    Guidance (text DDMs): ``guidance_scale`` for every row (1: none), against the null
    conditioning or the ``negative_prompt``'s, for the first ``guidance_cutoff`` fraction of
    the steps. ``output="latent"`` skips the decoder."""

    labels: tuple[int, ...]
    steps: int
    seed: int
    strategy: Strategy
    solver: str = SOLVER.default
    delegate_steps: int = 0
    first_index: int = 0
    prompts: tuple[str, ...] = ()
    conditioning: Conditioning | None = field(default=None, compare=False)
    guidance_scale: float = GUIDANCE_SCALE.default
    negative_prompt: str | None = None
    guidance_cutoff: float = GUIDANCE_CUTOFF.default
    latents: np.ndarray | None = field(default=None, compare=False)
    output: str = "image"


# ------------------------------------------------------------------------ what the loop asks


@dataclass(frozen=True)
class Encode:
    """Wanted: the text encoder's conditioning of ``prompts``, one row each."""

    prompts: tuple[str, ...]


@dataclass(frozen=True)
class Velocity:
    """Wanted: expert ``expert``'s (an index) velocity at ``(x, t, cond)``, guided per row
    as ``cond.guidance`` says; with ``fallback``, :class:`Missing` is an answer too (the loop
    can route the rows elsewhere)."""

    expert: int
    x: np.ndarray
    t: np.ndarray
    cond: Conditioning
    fallback: bool = False


@dataclass(frozen=True)
class Route:
    """Wanted: the router network's ``p(k | x, t, cond)``, ``(B, K)``. ``expect``: the
    :class:`Velocity` calls the loop expects to make next (module docstring), which it asks
    for as these very objects if routing keeps their rows."""

    x: np.ndarray
    t: np.ndarray
    cond: Conditioning
    expect: tuple[Velocity, ...] = ()


@dataclass(frozen=True)
class Routed:
    """An answer to a :class:`Route`: the probabilities ``(B, K)``, and whether the driver
    started the expected calls (``ahead``); a bare array answers with none started."""

    probs: np.ndarray
    ahead: bool = False


@dataclass(frozen=True)
class Missing:
    """The answer to a :class:`Velocity` with ``fallback`` whose expert has no ready replica."""

    expert: int


@dataclass(frozen=True)
class Integrate:
    """Wanted: expert ``expert`` integrating ``x`` over ``grid`` with ``solver``."""

    expert: int
    x: np.ndarray
    cond: Conditioning
    grid: np.ndarray
    solver: str


@dataclass(frozen=True)
class Decode:
    """Wanted: the decoder's images ``(N, 3, H, W)`` in ``[-1, 1]`` of ``latents``."""

    latents: np.ndarray


@dataclass(frozen=True)
class Calls:
    """Expert calls, answered by the list of their results in order."""

    calls: tuple[Velocity | Integrate, ...]


@dataclass(frozen=True)
class Concurrently:
    """Sub-loops to run side by side, answered by the list of their return values."""

    parts: tuple[Generator[Any, Any, Any], ...]


Query = Encode | Route | Calls | Concurrently | Decode


@dataclass(frozen=True)
class StepEvent:
    """The state after a chunk of the grid (one step unless delegating).

    ``x`` (N, C, H, W) is the state at ``t = grid[step]``; ``selections`` holds one (N, K) bool
    mask per velocity evaluation of the chunk; ``round_trips`` (N,) counts the expert calls each
    sample took part in during the chunk; ``delegated`` (N,) says which went in one integrate;
    ``probs`` (N, K) float32 is the routing distribution that decided each sample's first
    evaluation of the chunk, at the state of the previous event: the router network's
    ``p(k | x_t, t, cond)``, the oracle's one-hot, or the random baseline's uniform draw;
    ``rerouted`` (N,) which had a missing expert's share moved to others. ``wanted_rows`` (K,)
    and ``wanted_weight`` (K,) are the chunk's demand on each expert as the strategy chose it,
    before any rerouting: rows evaluated and their summed weight (a delegated row counts once
    per evaluation of the chunk, with weight 1).
    """

    step: int
    t: float
    x: np.ndarray
    selections: tuple[np.ndarray, ...]
    round_trips: np.ndarray
    delegated: np.ndarray
    probs: np.ndarray
    rerouted: np.ndarray
    wanted_rows: np.ndarray
    wanted_weight: np.ndarray

    def experts_used(self) -> np.ndarray:
        """(N, K) bool: which experts each sample used during the chunk."""
        return np.any(self.selections, axis=0)


@dataclass(frozen=True)
class Decoded:
    """The decoded images after the last step, ``(N, H, W, 3)`` uint8 RGB."""

    images: np.ndarray


Loop = Generator[Query | StepEvent | Decoded, Any, None]


# ------------------------------------------------------------------------------- validation


class RequestRefused(ValueError):
    """What a DDM cannot do for a request, and the request field at fault (``param``, a
    :class:`SamplingRequest` field's name), which an API names to its client."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_labels(labels: Sequence[int], num_classes: int) -> np.ndarray:
    """``labels`` as ``(N,)`` int64, or a ``ValueError`` naming those outside the classes."""
    values = [int(v) for v in labels]  # Python integers: 2**64 is outside, not an overflow
    if not values:
        raise RequestRefused("no labels given", "labels")
    outside = sorted({v for v in values if not 0 <= v < num_classes})
    if outside:
        raise RequestRefused(f"labels {outside} are outside the model's classes "
                             f"0..{num_classes - 1}", "labels")
    return np.asarray(values, dtype=np.int64)


def check_request(mixture: Mixture, request: SamplingRequest,
                  max_steps: int = MAX_STEPS) -> np.ndarray:
    """Raise a ``ValueError`` naming what ``mixture`` cannot do for ``request``, before any
    model runs; the labels as ``(N,)`` int64 (none for a text DDM). The one request validator:
    ``ddm sample`` and the router (after its schema, which carries the same limits) both call
    it. The parameters' bounds are their declarations' (``ddm.sampling_params``); a server may
    allow fewer steps (``max_steps``)."""
    stepper(request.solver)  # one the loop implements: every declared solver (a test checks)
    problems = sampling_problems({name: _plain(getattr(request, name)) for name in
                                  ("steps", "solver", "guidance_scale", "guidance_cutoff")})
    if problems:
        raise RequestRefused("; ".join(f"{name} {message}" for name, message in problems),
                             problems[0][0])
    if request.steps > max_steps:
        raise RequestRefused(f"steps must be an integer in [{STEPS.minimum:g}, {max_steps}], "
                             f"got {request.steps!r}", "steps")
    if not _is_int(request.delegate_steps) or request.delegate_steps < 0:
        raise RequestRefused(f"delegate_steps must be an integer >= 0, got "
                             f"{request.delegate_steps!r}", "delegate_steps")
    if request.output not in OUTPUTS:
        raise RequestRefused(f"output must be one of {', '.join(OUTPUTS)}, got "
                             f"{request.output!r}", "output")
    if mixture.conditioning == TEXT:
        rows = _check_text(mixture, request)
        y = np.zeros(0, np.int64)
    else:
        y = _check_labelled(mixture, request)
        rows = len(y)
    _check_latents(mixture, request.latents, rows)
    return y


def _check_labelled(mixture: Mixture, request: SamplingRequest) -> np.ndarray:
    """A label DDM's request: its labels; no prompts and no guidance."""
    text = [name for name, given in (("prompts", bool(request.prompts)),
                                     ("conditioning", request.conditioning is not None),
                                     ("negative_prompt", request.negative_prompt is not None))
            if given]
    if text:
        raise RequestRefused(f"this DDM is conditioned on labels; it takes no "
                             f"{', '.join(text)}", text[0])
    if request.guidance_scale != 1.0:
        raise RequestRefused(f"guidance_scale must be 1 for a label DDM (got "
                             f"{request.guidance_scale!r}): classifier-free guidance needs "
                             "experts with an unconditional input, as a text DDM's",
                             "guidance_scale")
    y = check_labels(request.labels, mixture.num_classes)
    if request.strategy.kind == "oracle":
        oracle_probs(y, mixture.expert_classes)  # every label owned by exactly one expert
        return y
    _check_routable(mixture, request.strategy)
    uncovered = sorted({int(v) for v in y[~mixture.servable[y].any(axis=1)]})
    if uncovered:
        raise RequestRefused(f"labels {uncovered} are served by no expert "
                             f"(experts serve {_coverage(mixture)})", "labels")
    return y


def _check_text(mixture: Mixture, request: SamplingRequest) -> int:
    """A text DDM's request: prompts or precomputed text conditioning; its number of rows."""
    if request.labels:
        raise RequestRefused("this DDM is conditioned on text: send prompts, not labels",
                             "labels")
    if request.strategy.kind == "oracle":
        raise RequestRefused("the oracle strategy routes by label, and this DDM is conditioned "
                             "on text (its experts are not split by label); use a learned "
                             "strategy such as top2", "strategy")
    if bool(request.prompts) == (request.conditioning is not None):
        raise RequestRefused("give either prompts or precomputed conditioning, exactly one",
                             "prompts")
    if request.conditioning is None:
        if not mixture.encoder:
            raise RequestRefused("this DDM has no text encoder: send precomputed embeddings",
                                 "prompts")
        strings = [request.negative_prompt] if request.negative_prompt is not None else []
        if not all(isinstance(p, str) for p in [*request.prompts, *strings]):
            raise RequestRefused("prompts and the negative prompt must be strings", "prompts")
        rows = len(request.prompts)
    else:
        if request.conditioning.kind != TEXT:
            raise RequestRefused("this DDM is conditioned on text; the conditioning given "
                                 "holds labels", "conditioning")
        if request.negative_prompt is not None:
            raise RequestRefused("a negative prompt goes with prompts; with precomputed "
                                 "conditioning, give its embeddings as conditioning.negative",
                                 "negative_prompt")
        rows = len(request.conditioning)
    if rows < 1:
        raise RequestRefused("no prompts given", "prompts")
    _check_routable(mixture, request.strategy)
    return rows


def _check_routable(mixture: Mixture, strategy: Strategy) -> None:
    if len(mixture.expert_names) > 1 and not mixture.routed and strategy.kind != "random":
        raise RequestRefused(f"strategy {strategy.name} needs the router network, and "
                             "this DDM has none; use the oracle strategy", "strategy")


def _check_latents(mixture: Mixture, latents: np.ndarray | None, rows: int) -> None:
    if latents is None:
        return
    expected = (rows, *mixture.image_shape)
    if (not isinstance(latents, np.ndarray) or latents.dtype != np.float32
            or latents.shape != expected):
        got = (f"{latents.dtype} {latents.shape}" if isinstance(latents, np.ndarray)
               else type(latents).__name__)
        raise RequestRefused(f"latents must be float32 of shape {expected}, got {got}",
                             "latents")
    if not np.isfinite(latents).all():
        raise RequestRefused("latents hold NaN or infinity", "latents")
    largest = float(np.abs(latents).max(initial=0.0))
    if largest > MAX_STATE_MAGNITUDE:
        raise RequestRefused(f"latents must lie within +-{MAX_STATE_MAGNITUDE:g} "
                             f"(MAX_STATE_MAGNITUDE), got a value of magnitude {largest:.3g}",
                             "latents")


# ------------------------------------------------------------------------------- the loop


def guided_steps(request: SamplingRequest) -> int:
    """How many of ``request``'s first steps run guided rows guided: its ``guidance_cutoff``
    fraction of the steps (later ones run them unguided)."""
    return int(request.guidance_cutoff * request.steps)


def row_steps(request: SamplingRequest) -> int:
    """What ``request`` asks of the experts, in rows x steps: one row per image at every step,
    and a guided image's second (unconditional) row at each guided step, as the experts count
    forward rows against their batch limits. Neither the solver's evaluations per step nor the
    experts routing picks are counted: they are the router's choices, not the client's. What a
    client's budget is charged (``ddm.serving.router.api.clients``)."""
    images = (len(request.labels) + len(request.prompts)
              + (len(request.conditioning) if request.conditioning is not None else 0))
    guided = guided_steps(request) if request.guidance_scale != 1.0 else 0
    return images * (request.steps + guided)


@dataclass(frozen=True)
class CheckedRequest:
    """A request :func:`check_request` accepted for ``mixture``, and the labels it returned: a
    driver that refuses a bad request before it starts (the router, with a 422) hands this to
    :func:`denoise`, so that the request is checked once."""

    mixture: Mixture
    request: SamplingRequest
    labels: np.ndarray


def checked(mixture: Mixture, request: SamplingRequest) -> CheckedRequest:
    """:func:`check_request`, its verdict kept for :func:`denoise` (a ``ValueError``: refused)."""
    return CheckedRequest(mixture, request, check_request(mixture, request))


def denoise(mixture: Mixture, request: SamplingRequest | CheckedRequest) -> Loop:
    """The loop from noise to data: yields queries, a :class:`StepEvent` per chunk and, where
    the DDM has a decoder and images are asked for, a :class:`Decoded` at the end. A
    :class:`CheckedRequest` for this very ``mixture`` is not checked again."""
    if isinstance(request, CheckedRequest) and request.mixture is mixture:
        request, y = request.request, request.labels
    else:
        request = request.request if isinstance(request, CheckedRequest) else request
        y = check_request(mixture, request)
    cond = yield from _conditioning(mixture, request, y)
    n = len(cond)
    grid = mixture.grid.times(request.steps)
    x = (request.latents.copy() if request.latents is not None
         else initial_noise(n, mixture.image_shape, request.seed, request.first_index))
    # (seed, image index) per sample: what the random baseline's draws are keyed on.
    keys = np.stack([np.full(n, request.seed, np.int64),
                     request.first_index + np.arange(n, dtype=np.int64)], axis=1)
    guided = guided_steps(request)
    chunk = max(1, request.delegate_steps)
    selected: np.ndarray | None = None  # (N, K): the experts of the last evaluation
    for start in range(0, request.steps, chunk):
        end = min(start + chunk, request.steps)
        step_cond = (cond if cond.guidance is None or start < guided
                     else cond.with_guidance(1.0))
        event = yield from _chunk(mixture, request, x, step_cond, keys, grid[start:end + 1],
                                  end, selected)
        x, selected = event.x, event.selections[-1]
        yield event
    if mixture.decoder and request.output == "image":
        pixels = yield Decode(x)
        yield Decoded(np.ascontiguousarray(to_uint8(pixels).transpose(0, 2, 3, 1)))


def _conditioning(mixture: Mixture, request: SamplingRequest, y: np.ndarray
                  ) -> Generator[Query, Any, Conditioning]:
    """The rows' conditioning, with the request's guidance on text rows: the labels, the
    precomputed conditioning, or the text encoder's (one :class:`Encode`, the negative prompt
    as its last row)."""
    if mixture.conditioning == LABELS:
        return Conditioning.from_labels(y)
    if request.conditioning is not None:
        given = request.conditioning
        return given.with_guidance(request.guidance_scale, given.negative)
    prompts, texts = request.prompts, encoded_texts(request)
    encoded = yield Encode(texts)
    if not isinstance(encoded, Conditioning) or encoded.kind != TEXT or (
            len(encoded) != len(texts)):
        raise ValueError(f"the text encoder answered {encoded!r} for {len(texts)} prompts")
    rows = np.arange(len(prompts))
    return encoded.take(rows).with_guidance(
        request.guidance_scale,
        encoded.take(np.full(len(prompts), len(prompts))) if len(texts) > len(prompts)
        else None)


def encoded_texts(request: SamplingRequest) -> tuple[str, ...]:
    """What the text encoder is asked to encode for ``request``: its prompts, then its
    negative prompt if it has one (the rows of the encoder's answer)."""
    negative = () if request.negative_prompt is None else (request.negative_prompt,)
    return request.prompts + negative


def _chunk(mixture: Mixture, request: SamplingRequest, x: np.ndarray, cond: Conditioning,
           keys: np.ndarray, grid: np.ndarray, step: int, selected: np.ndarray | None
           ) -> Generator[Query, Any, StepEvent]:
    """One chunk: delegate the samples with one expert, step the others, concurrently;
    ``selected`` (N, K), the experts of the evaluation before (None: the first), is what the
    stepped samples' first routing expects."""
    n, k = len(cond), len(mixture.expert_names)
    evaluations = (len(grid) - 1) * solver_named(request.solver).evaluations
    delegated = np.zeros(n, bool)
    probs = np.zeros((n, k), np.float32)
    groups: list[tuple[int, np.ndarray]] = []
    if request.delegate_steps > 1:
        probs, weights, _ = yield from _weights(mixture, request.strategy, x,
                                                _times(n, grid[0]), cond, keys)
        delegated = (weights > 0).sum(axis=1) == 1
        groups = [(e, rows) for e in range(k)
                  if (rows := np.flatnonzero(delegated & (weights[:, e] > 0))).size]
    stepped = np.flatnonzero(~delegated)
    parts: list[Generator[Any, Any, Any]] = []
    if groups:
        parts.append(_delegate(groups, x, cond, grid, request.solver))
    if stepped.size:
        parts.append(_step_by_step(mixture, request.strategy, request.solver, x[stepped],
                                   cond.take(stepped), keys[stepped], grid,
                                   None if selected is None else selected[stepped]))
    results = (yield Concurrently(tuple(parts))) if len(parts) > 1 else [(yield from parts[0])]

    x_next = np.empty_like(x)
    masks = np.zeros((evaluations, n, k), bool)
    round_trips = np.zeros(n, np.int64)
    rerouted = np.zeros(n, bool)
    wanted = np.zeros((evaluations, n, k), np.float64)
    if groups:
        for (expert, rows), out in zip(groups, results[0]):
            x_next[rows] = out
            masks[:, rows, expert] = True
            wanted[:, rows, expert] = 1.0
            round_trips[rows] += 1
    if stepped.size:
        walked: _Walk = results[-1]
        x_next[stepped] = walked.x
        probs[stepped] = walked.probs
        masks[:, stepped, :] = walked.selections
        wanted[:, stepped, :] = walked.wanted
        rerouted[stepped] = walked.rerouted
        round_trips[stepped] += walked.selections.sum(axis=(0, 2))
    return StepEvent(step=step, t=float(grid[-1]), x=x_next, selections=tuple(masks),
                     round_trips=round_trips, delegated=delegated, probs=probs,
                     rerouted=rerouted,
                     wanted_rows=(wanted > 0).sum(axis=(0, 1)),
                     wanted_weight=wanted.sum(axis=(0, 1)))


def _delegate(groups: list[tuple[int, np.ndarray]], x: np.ndarray, cond: Conditioning,
              grid: np.ndarray, solver: str) -> Generator[Query, Any, list[np.ndarray]]:
    """One integrate call per expert over the chunk; the states at its end, per group."""
    return (yield Calls(tuple(Integrate(e, x[rows], cond.take(rows), grid, solver)
                              for e, rows in groups)))


@dataclass(frozen=True)
class _Walk:
    """Rows stepped one by one through a chunk: ``x`` at its end; per evaluation, the
    ``selections`` (E, B, K) that ran and the weights ``wanted`` (E, B, K) before rerouting;
    ``rerouted`` (B,); the (B, K) routing ``probs`` of the first evaluation."""

    x: np.ndarray
    selections: np.ndarray
    wanted: np.ndarray
    rerouted: np.ndarray
    probs: np.ndarray


@dataclass(frozen=True)
class _Mixed:
    """One mixture velocity ``v`` (B, C, H, W), the experts that ran (B, K), the weights the
    strategy wanted (B, K), the rows rerouted (B,) and the (B, K) probabilities the weights
    were made from."""

    v: np.ndarray
    selected: np.ndarray
    wanted: np.ndarray
    rerouted: np.ndarray
    probs: np.ndarray


def _step_by_step(mixture: Mixture, strategy: Strategy, solver: str, x: np.ndarray,
                  cond: Conditioning, keys: np.ndarray, grid: np.ndarray,
                  selected: np.ndarray | None) -> Generator[Query, Any, _Walk]:
    """The solver over ``grid`` with the mixture velocity; each evaluation's routing expects
    the experts of the one before (``selected``, (B, K), for the first; None: nothing)."""
    step_with = stepper(solver)
    mixed: list[_Mixed] = []
    for i in range(len(grid) - 1):
        step = step_with(x, float(grid[i]), float(grid[i + 1]))
        v = None
        while True:
            try:
                point = step.send(v)  # type: ignore[arg-type]
            except StopIteration as done:
                x = done.value
                break
            evaluation = yield from _mixture_velocity(mixture, strategy, point.x,
                                                      _times(len(cond), point.t), cond, keys,
                                                      selected)
            v, selected = evaluation.v, evaluation.selected
            mixed.append(evaluation)
    return _Walk(x, np.stack([m.selected for m in mixed]), np.stack([m.wanted for m in mixed]),
                 np.any([m.rerouted for m in mixed], axis=0), mixed[0].probs)


def _mixture_velocity(mixture: Mixture, strategy: Strategy, x: np.ndarray, t: np.ndarray,
                      cond: Conditioning, keys: np.ndarray, selected: np.ndarray | None
                      ) -> Generator[Query, Any, _Mixed]:
    """``sum_k w_k v_k`` per sample, each expert asked only for its rows; an expert answered
    :class:`Missing` has its rows rerouted (module docstring). Routing expects the calls of
    ``selected`` (B, K), the experts of the evaluation before (None: none)."""
    n, k = len(cond), len(mixture.expert_names)
    reroutable = strategy.kind != "random"  # the evaluation baseline is never served
    available = np.ones(k, bool)
    expected = ({} if selected is None or not _routes(mixture, strategy) else
                {e: (rows, call) for e, rows, call in
                 _velocity_calls(selected, x, t, cond, reroutable & available, {}, False)})
    probs, wanted, ahead = yield from _weights(mixture, strategy, x, t, cond, keys,
                                               tuple(call for _, call in expected.values()))
    servable = _servable(mixture, cond)
    weights, rerouted = wanted, np.zeros(n, bool)
    answered = np.zeros((n, k), bool)
    v_k: dict[int, np.ndarray] = {}
    while True:
        needed = (weights > 0) & ~answered
        calls = _velocity_calls(needed, x, t, cond, reroutable & available, expected, ahead)
        if not calls:  # the answered experts cover the rerouted rows
            break
        outs = yield Calls(tuple(call for _, _, call in calls))
        missing = [e for (e, _, _), out in zip(calls, outs) if isinstance(out, Missing)]
        for (e, rows, _), out in zip(calls, outs):
            if not isinstance(out, Missing):
                v_e = v_k.setdefault(e, np.zeros_like(x, dtype=np.float32))
                keep = needed[rows, e]  # an expected call may carry rows no longer routed here
                if keep.all():
                    v_e[rows] = out
                else:
                    rows = rows[keep]
                    v_e[rows] = out[keep]
                answered[rows, e] = True
        if not missing:
            break
        assert reroutable and available[missing].all(), "Missing answers only fallback"
        available[missing] = False
        routed = available_weights(probs, servable, available, strategy)
        weights, rerouted = routed.weights, rerouted | routed.rerouted
    v = np.zeros_like(x, dtype=np.float32)
    for e, ve in v_k.items():
        rows = np.flatnonzero(weights[:, e] > 0)
        v[rows] += weights[rows, e][:, None, None, None] * ve[rows]
    return _Mixed(v, weights > 0, wanted, rerouted, probs)


def _velocity_calls(needed: np.ndarray, x: np.ndarray, t: np.ndarray, cond: Conditioning,
                    fallback: np.ndarray,
                    expected: dict[int, tuple[np.ndarray, Velocity]], ahead: bool
                    ) -> list[tuple[int, np.ndarray, Velocity]]:
    """The calls for the rows ``needed`` (B, K) as ``(expert, rows, call)``, one per expert
    with rows (``fallback`` (K,): which may answer :class:`Missing`), ``rows`` those the call
    carries. A call ``expected`` for the same expert and fallback is asked (and taken out of
    ``expected``: asked once) where it carries exactly the rows needed, or, where the calls
    went ahead (``ahead``), some of them; the expert's other needed rows then go in a new
    call."""
    calls = []
    for e in np.flatnonzero(needed.any(axis=0)).tolist():
        rows = np.flatnonzero(needed[:, e])
        known = expected.get(e)
        if known is not None and known[1].fallback == bool(fallback[e]):
            known_rows, call = known
            if np.array_equal(known_rows, rows):
                del expected[e]
                calls.append((e, rows, call))
                continue
            if ahead and needed[known_rows, e].any():
                del expected[e]
                calls.append((e, known_rows, call))
                rows = np.setdiff1d(rows, known_rows, assume_unique=True)
                if not rows.size:
                    continue
        calls.append((e, rows, Velocity(e, x[rows], t[rows], cond.take(rows),
                                        fallback=bool(fallback[e]))))
    return calls


def _weights(mixture: Mixture, strategy: Strategy, x: np.ndarray, t: np.ndarray,
             cond: Conditioning, keys: np.ndarray, expect: tuple[Velocity, ...] = ()
             ) -> Generator[Query, Any, tuple[np.ndarray, np.ndarray, bool]]:
    """Per-sample routing probabilities and mixture weights, both (B, K), among the experts
    that serve each sample (by label where the partition is by label; a text DDM's experts
    serve every row), and whether the expected calls went ahead; ``keys`` (B, 2) are the
    samples' ``(seed, image index)``; ``expect`` rides on the :class:`Route` (the calls
    expected next)."""
    if strategy.kind == "oracle":  # check_request allows it for label DDMs only
        assert cond.labels is not None, "the oracle routes by label"
        probs = oracle_probs(cond.labels, mixture.expert_classes)
        return probs, routing_weights(probs, strategy), False
    servable = _servable(mixture, cond)
    if strategy.kind == "random":
        uniform = servable / servable.sum(axis=1, keepdims=True)
        return uniform.astype(np.float32), random_weights(keys, t, servable), False
    if not _routes(mixture, strategy):  # one expert: every strategy gives it all the weight
        ones = np.ones((len(cond), 1), np.float32)
        return ones, ones, False
    answer = yield Route(x, t, cond, expect)
    routed = answer if isinstance(answer, Routed) else Routed(answer)
    return (np.asarray(routed.probs, np.float32),
            mixture_weights(routed.probs, servable, strategy), routed.ahead)


def _routes(mixture: Mixture, strategy: Strategy) -> bool:
    """Whether ``strategy`` asks the router network (:func:`_weights` yields a :class:`Route`):
    the oracle routes by label, the random baseline draws, one expert takes every row."""
    return strategy.kind not in ("oracle", "random") and len(mixture.expert_names) > 1


def _servable(mixture: Mixture, cond: Conditioning) -> np.ndarray:
    """(B, K) bool: expert k may take row b (by label where the partition is by label)."""
    return (mixture.servable[cond.labels] if cond.labels is not None
            else np.ones((len(cond), len(mixture.expert_names)), bool))


# ------------------------------------------------------------------------------- results


@dataclass
class UsageLog:
    """Expert selections of one generation: ``selections[i]`` is a ``(B, K)`` bool mask."""

    expert_names: tuple[str, ...]
    selections: list[np.ndarray] = field(default_factory=list)

    def record(self, selected: np.ndarray) -> None:
        self.selections.append(np.asarray(selected, dtype=bool))

    def expert_calls(self) -> np.ndarray:
        """Expert forward passes per sample, ``(B,)`` int64."""
        if not self.selections:
            return np.zeros((0,), dtype=np.int64)
        return np.sum([s.sum(axis=1) for s in self.selections], axis=0).astype(np.int64)

    def calls_per_expert(self) -> np.ndarray:
        """Forward passes per sample and expert, ``(B, K)`` int64."""
        return np.sum(self.selections, axis=0).astype(np.int64)

    def step_masks(self, steps: int) -> np.ndarray:
        """``(B, steps)`` int64: bit ``k`` set when expert ``k`` ran at that step (any of the
        step's evaluations). The compact per-image routing the API reports."""
        stacked = np.stack(self.selections)  # (steps * evaluations per step, B, K)
        if steps < 1 or len(stacked) % steps:
            raise ValueError(f"{len(stacked)} evaluations do not split into {steps} steps")
        per_step = stacked.reshape(steps, -1, *stacked.shape[1:]).any(axis=1)  # (steps, B, K)
        bits = np.left_shift(1, np.arange(per_step.shape[2], dtype=np.int64))
        return (per_step.astype(np.int64) @ bits).T

    def switches(self) -> np.ndarray:
        """How often each sample's set of experts changed between evaluations, ``(B,)``."""
        if len(self.selections) < 2:
            return np.zeros((self.selections[0].shape[0] if self.selections else 0,), np.int64)
        stacked = np.stack(self.selections)
        return np.any(stacked[1:] != stacked[:-1], axis=2).sum(axis=0).astype(np.int64)


@dataclass(frozen=True)
class Generation:
    """What a generation made. ``images``: (N, H, W) uint8 (0 background, 255 ink) from a
    label DDM's state, (N, H, W, 3) uint8 RGB from a decoder, None for latent output."""

    images: np.ndarray | None
    state: np.ndarray        # (N, C, H, W) float32, the final state in model space
    labels: np.ndarray       # (N,) int64; empty for a text DDM
    usage: UsageLog
    round_trips: np.ndarray  # (N,) expert calls per image (delegated chunks count once)
    rerouted: tuple[tuple[int, ...], ...] = ()  # per image, the steps whose routing moved

    @property
    def expert_calls(self) -> np.ndarray:
        """Expert forward passes per image, ``(N,)``."""
        return self.usage.expert_calls()

    def experts_used(self) -> list[list[str]]:
        """The names of the experts each image used, at any step."""
        calls = self.usage.calls_per_expert()
        return [[name for k, name in enumerate(self.usage.expert_names) if calls[i, k]]
                for i in range(calls.shape[0])]


class Tally:
    """Sums the events of one generation into a :class:`Generation` (one per generation: it
    is the generation's own state). ``state_is_image``: the final state is the image (a label
    DDM in pixel space); otherwise images come only from a :class:`Decoded` event."""

    def __init__(self, expert_names: tuple[str, ...], labels: Sequence[int],
                 state_is_image: bool = True) -> None:
        self._labels = np.asarray(labels, np.int64)
        self._usage = UsageLog(expert_names)
        self._round_trips: np.ndarray | None = None
        self._rerouted: dict[int, list[int]] = {}  # row -> the steps its routing moved
        self._state: np.ndarray | None = None
        self._images: np.ndarray | None = None
        self._state_is_image = state_is_image

    def add(self, event: StepEvent | Decoded) -> None:
        if isinstance(event, Decoded):
            self._images = event.images
            return
        for mask in event.selections:
            self._usage.record(mask)
        self._round_trips = (event.round_trips.copy() if self._round_trips is None
                             else self._round_trips + event.round_trips)
        for row in np.flatnonzero(event.rerouted):
            self._rerouted.setdefault(int(row), []).append(event.step)
        self._state = event.x

    def result(self) -> Generation:
        assert self._state is not None and self._round_trips is not None, \
            "a generation has at least one step"
        images = (self._images if self._images is not None
                  else to_uint8(self._state[:, 0]) if self._state_is_image else None)
        return Generation(images=images, state=self._state, labels=self._labels,
                          usage=self._usage, round_trips=self._round_trips.copy(),
                          rerouted=tuple(tuple(self._rerouted.get(row, ()))
                                         for row in range(len(self._state))))


def _times(n: int, t: float) -> np.ndarray:
    return np.full((n,), t, dtype=np.float32)


def _plain(value: Any) -> Any:
    """A NumPy scalar as the Python number it holds (the declarations check Python types)."""
    return value.item() if isinstance(value, np.generic) else value


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _coverage(mixture: Mixture) -> str:
    return ", ".join(f"{name}: {list(classes) or 'all'}"
                     for name, classes in zip(mixture.expert_names, mixture.expert_classes))
