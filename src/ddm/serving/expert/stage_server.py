"""The model server for stage checkpoints (DESIGN-22 section 1): one server for every role.

``ddm serve expert DIR`` serves a text DDM's expert from a stage checkpoint, ``ddm serve stage
DIR`` its text encoder, decoder or router network, each loaded by
:func:`ddm.models.stages.load_stage` (``--precision`` casts the weights) behind the same routes,
batcher and protocol as a label expert (:mod:`ddm.serving.expert.routes`, ``docs/protocol.md``
version 2):

* expert: CONTEXT (stored in a :class:`~ddm.serving.expert.contexts.ContextCache`, acknowledged
  with its id), TEXT_VELOCITY and TEXT_INTEGRATE. Classifier-free guidance runs here
  (:func:`ddm.sampling.guidance.guided`): each guided row and its unconditional twin (the
  context's negative row: the empty prompt's embeddings unless a negative prompt replaced
  them; the router sends them with the context, so an expert needs no text encoder) go through
  the network in one batch with the other requests' rows; rows with scale 1 run once. Batches
  count forward rows, so a guided row costs two. Replies, velocities and an integrate
  request's final state alike, travel in the weights' dtype (``wire_dtype``: float32, float16
  or bfloat16); the chunk's own steps stay float32.
* text_encoder: ENCODE -> embeddings, mask and the tokens truncation cut.
* decoder: DECODE -> images (B, 3, H, W) in [-1, 1].
* router: ROUTE (x, t and the prompts' pooled text vectors, for a router's text prior) ->
  probabilities (B, K).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Hashable

import numpy as np
from starlette.types import ASGIApp

from ddm.checkpoints.declared import DECODER, EXPERT, ROUTER, TEXT_ENCODER
from ddm.checkpoints.format import CheckpointError
from ddm.conditioning import TEXT, Conditioning, EncodedPrompts, guided_rows
from ddm.convention import CONVENTION_NAME
from ddm.deploy.limits import (DEFAULT_CONTEXT_CACHE_BYTES, EXPERT_PORT, MAX_CONTEXT_BODY_BYTES,
                               MAX_CONTEXT_CACHE_BYTES, MAX_STEPS, PRECISIONS, SERVER_MAX_BATCH,
                               SERVER_MAX_DELAY_MS, SERVER_MAX_PENDING)
from ddm.models.paris_loading import read_component_config
from ddm.models.stages import Stage, StageDeclaration, load_stage
from ddm.sampling.guidance import guided
from ddm.sampling.solvers import iterate
from ddm.serving.auth import TokenFile
from ddm.serving.batching import Batcher, grid_slices
from ddm.serving.expert import metrics as expert_metrics
from ddm.serving.expert.backends import cpu_model
from ddm.serving.expert.contexts import ContextCache
from ddm.serving.expert.routes import (SERVING_LOOPS, VELOCITY_PATH, Binary, Handling,
                                      answer_or_error, model_app)
from ddm.serving.http import ServerControl, run_server
from ddm.serving.protocol import (WIRE_DTYPES, Context, DecodeRequest, EncodeRequest, Limits,
                                  ProtocolError, Request, RouteRequest, TextIntegrateRequest,
                                  TextVelocityRequest, decode_request, encode_context_ack,
                                  encode_encoded, encode_probabilities, encode_response)
from ddm.termination import fail_start

__all__ = ["DEFAULT_CONTEXT_CACHE_BYTES", "StageServer", "answer_stage", "create_stage_app",
           "load_member", "serve_stage", "stage_member", "text_velocity"]

logger = logging.getLogger(__name__)

#: What each role's ``/v1/velocity`` answers (``/v1/info`` ``serves``); ``ddm serve stage``
#: serves :data:`~ddm.checkpoints.declared.STAGE_ROLES`, ``ddm serve expert`` the experts.
_SERVES = {EXPERT: "velocity", TEXT_ENCODER: "encode", DECODER: "decode", ROUTER: "route"}
#: The request kinds each role takes.
_TAKES: dict[str, tuple[type, ...]] = {
    EXPERT: (Context, TextVelocityRequest, TextIntegrateRequest),
    TEXT_ENCODER: (EncodeRequest,), DECODER: (DecodeRequest,), ROUTER: (RouteRequest,)}
#: Tokens per row of the expert's warm-up call (any length runs; the context decides).
_WARM_TOKENS = 8

StartUp = Callable[[Callable[[], Any]], Awaitable[Any]]


@dataclass(frozen=True)
class _Velocity:
    """Batch key of text velocity calls: rows merge when their contexts' token length does."""

    tokens: int


@dataclass(frozen=True)
class _Integrate:
    solver: str
    grid: bytes
    tokens: int


class StageServer:
    """One stage checkpoint as a server holds it: the declaration, limits, its batcher and
    metrics, the context cache, the loaded stage. ``ddm serve stage`` serves one; a pool
    server (:mod:`ddm.serving.expert.pool_server`) one per member."""

    def __init__(self, directory: Path, declared: StageDeclaration, limits: Limits,
                 backend: str, device: str | None, precision: str | None, max_delay_ms: float,
                 max_pending: int, context_cache_bytes: int, serving_loops: int) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.directory = directory
        self.declared = declared
        self.limits = limits
        self.backend_name = backend
        self.device = device
        self.precision = precision
        self.max_delay_ms = max_delay_ms
        self.max_pending = max_pending
        self.pending = 0
        self.metrics = expert_metrics.ExpertMetrics()
        self.contexts = ContextCache(context_cache_bytes)
        self.batcher = Batcher(functools.partial(_execute, self), limits.max_batch,
                               max_delay_ms, self.metrics.observe_batch,
                               serving_loops=serving_loops)
        self.stage: Stage | None = None
        self.failure: str | None = None
        self.hardware: str | None = None

    @property
    def ready(self) -> bool:
        return self.stage is not None

    @property
    def wire_dtype(self) -> str | None:
        return None if self.stage is None else self.stage.dtype

    def describe(self) -> dict[str, Any]:
        stage, declared = self.stage, self.declared
        if stage is not None:
            declared = stage.declaration
        latent = list(declared.latent_shape or ())
        image = (list(stage.image_shape) if stage is not None and stage.image_shape is not None
                 else latent)
        return {"name": self.directory.name, "kind": declared.role, "role": declared.role,
                "family": declared.family,
                "conditioning": TEXT if declared.role == EXPERT else None,
                "classes": [], "partition": None, "data": None, "summary": None,
                **(declared.trained_on.info(declared.cluster)
                   if declared.trained_on is not None else {}),
                "cluster": declared.cluster,
                "clusters": None if stage is None else stage.clusters,
                "latent_shape": latent, "image_shape": image,
                "text_width": declared.text_width, "example_prompt": declared.example_prompt,
                "wire_dtype": self.wire_dtype,
                "precision": self.wire_dtype, "convention": CONVENTION_NAME,
                "network_convention": declared.convention, "serves": _SERVES[declared.role],
                "framework": self.backend_name, "backend": self.backend_name,
                "runtime": self.backend_name, "device": self.device or "cpu",
                "hardware": self.hardware,
                "max_batch": self.limits.max_batch, "max_steps": self.limits.max_steps,
                "max_body_bytes": self.limits.max_body_bytes, "max_pending": self.max_pending,
                "max_delay_ms": self.max_delay_ms,
                "context_cache_bytes": self.contexts.max_bytes if declared.role == EXPERT
                else None,
                "ready": self.ready}


def stage_member(directory: str | os.PathLike, role: str | tuple[str, ...],
                 backend: str = "torch", device: str | None = None,
                 max_batch: int = SERVER_MAX_BATCH,
                 max_delay_ms: float = SERVER_MAX_DELAY_MS, *, max_steps: int = MAX_STEPS,
                 max_pending: int = SERVER_MAX_PENDING, precision: str | None = None,
                 context_cache_bytes: int = DEFAULT_CONTEXT_CACHE_BYTES,
                 serving_loops: int = 1) -> StageServer:
    """The stage checkpoint in ``directory``, whose declared role must be ``role`` (or one of
    them), not loaded yet. The declaration, precision and limits are checked here, so that a
    wrong flag fails before the server starts."""
    path = Path(directory)
    declared = StageDeclaration.from_config(path, read_component_config(path))
    roles = (role,) if isinstance(role, str) else role
    if declared.role not in roles:
        raise CheckpointError(f"{path} is a stage of role {declared.role}; this command "
                              f"serves {' or '.join(roles)}")
    if precision is not None and precision not in PRECISIONS:
        raise CheckpointError(f"unknown precision {precision!r}; expected one of "
                              f"{', '.join(PRECISIONS)}")
    if not 1 <= context_cache_bytes <= MAX_CONTEXT_CACHE_BYTES:
        raise ValueError(f"the context cache takes 1..{MAX_CONTEXT_CACHE_BYTES} bytes, got "
                         f"{context_cache_bytes}")
    limits = Limits(max_batch=max_batch, max_steps=max_steps,
                    image_shape=declared.latent_shape, text_width=declared.text_width)
    limits = dataclasses.replace(limits, max_body_bytes=_max_body_bytes(declared.role, limits))
    return StageServer(path, declared, limits, backend, device, precision, max_delay_ms,
                       max_pending, context_cache_bytes, serving_loops)


def create_stage_app(directory: str | os.PathLike, role: str | tuple[str, ...],
                     backend: str = "torch", device: str | None = None,
                     max_batch: int = SERVER_MAX_BATCH,
                     max_delay_ms: float = SERVER_MAX_DELAY_MS, *, max_steps: int = MAX_STEPS,
                     max_pending: int = SERVER_MAX_PENDING,
                     on_failure: Callable[[str], None] | None = None,
                     draining: Callable[[], bool] | None = None,
                     start_up: StartUp = asyncio.to_thread, api_docs: bool = False,
                     auth_token_file: str | os.PathLike[str] | None = None,
                     precision: str | None = None,
                     context_cache_bytes: int = DEFAULT_CONTEXT_CACHE_BYTES,
                     serving_loops: int = 1) -> ASGIApp:
    """An ASGI app serving the stage checkpoint in ``directory`` (:func:`stage_member`) on
    ``serving_loops`` event loops (the batcher's rule: :class:`~ddm.serving.batching.Batcher`);
    the weights load in the lifespan."""
    if auth_token_file is not None:
        TokenFile(auth_token_file)
    server = stage_member(directory, role, backend, device, max_batch, max_delay_ms,
                          max_steps=max_steps, max_pending=max_pending, precision=precision,
                          context_cache_bytes=context_cache_bytes, serving_loops=serving_loops)
    declared, path = server.declared, server.directory
    return model_app(server, {VELOCITY_PATH: Binary(server, functools.partial(answer_stage,
                                                                               server))},
                     functools.partial(load_member, server, on_failure, start_up),
                     server.batcher.close, title=f"ddm {declared.role} {path.name}",
                     description=f"A text DDM's {declared.role} stage behind the binary "
                                 "protocol of docs/protocol.md.",
                     api_docs=api_docs, draining=draining, auth_token_file=auth_token_file)


def serve_stage(directory: str | os.PathLike, role: str | tuple[str, ...],
                host: str = "127.0.0.1", port: int = EXPERT_PORT, backend: str = "torch",
                device: str | None = None, log_level: str = "info", *,
                drain_s: float = 0.0, metrics_port: int | None = None,
                **options: Any) -> None:
    """Serve one stage until interrupted (``ddm serve stage``); exits with status 1 and the
    reason in the termination-message file when it cannot load."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")

    def make_app(control: ServerControl) -> ASGIApp:
        try:
            return create_stage_app(directory, role, backend, device,
                                    on_failure=control.stop,
                                    draining=lambda: control.draining,
                                    start_up=control.start_up,
                                    serving_loops=SERVING_LOOPS, **options)
        except Exception as error:  # noqa: BLE001 - every start-up failure is reported alike
            raise fail_start(f"stage {directory}: {error}") from error

    run_server(make_app, host, port, log_level, drain_s, metrics_port, loops=SERVING_LOOPS)


async def answer_stage(server: StageServer, body: bytes) -> tuple[int, bytes]:
    """One request body to ``server`` -> (HTTP status, protocol reply)."""

    async def handle(handling: Handling) -> bytes:
        message = decode_request(body, server.limits)
        handling.request_id, handling.kind = message.request_id, type(message).__name__
        takes = _TAKES[server.declared.role]
        if not isinstance(message, takes):
            raise ProtocolError(f"this {server.declared.role} stage takes "
                                f"{', '.join(t.__name__ for t in takes)}, not "
                                f"{handling.kind}", 422, message.request_id)
        if server.stage is None:
            raise ProtocolError(_not_ready(server), 503, message.request_id)
        reply = await _run(server, message)
        handling.rows = 0 if isinstance(message, (Context, EncodeRequest)) else message.x.shape[0]
        return reply

    return await answer_or_error(server, handle)


async def _run(server: StageServer, message: Request) -> bytes:
    """The reply body to a decoded, accepted request."""
    request_id, batcher = message.request_id, server.batcher
    if isinstance(message, Context):
        server.contexts.put(message.id, message.embeddings, message.negative)
        return encode_context_ack(request_id, message.id)
    if isinstance(message, EncodeRequest):
        if len(message.prompts) > server.limits.max_batch:
            raise ProtocolError(f"{len(message.prompts)} prompts exceed this encoder's "
                                f"max_batch of {server.limits.max_batch}", 422)
        embeddings, mask, cut, unknown = await batcher.submit(
            "encode", (np.array(message.prompts, dtype=object),))
        spans = np.array([(row, start, end) for row, words in enumerate(unknown)
                          for start, end in words], np.int64).reshape(-1, 3)
        return encode_encoded(request_id, EncodedPrompts(
            Conditioning(embeddings=_wire(server, embeddings), mask=mask), cut, spans))
    if isinstance(message, DecodeRequest):
        return encode_response(request_id,
                               _wire(server, await batcher.submit("decode", (message.x,))))
    if isinstance(message, RouteRequest):
        return encode_probabilities(request_id, await batcher.submit(
            "route", (message.x, message.t, _pooled(server, message))))
    if isinstance(message, TextVelocityRequest):
        return encode_response(request_id, await text_velocity(server, message))
    assert isinstance(message, TextIntegrateRequest)
    embeddings, negative, cost = _context_rows(server, message)
    tokens = embeddings.shape[1]
    solver, x = message.solver.name.lower(), message.x
    for piece in grid_slices(message.grid):
        x = await batcher.submit(_Integrate(solver, piece.tobytes(), tokens),
                                 (x, embeddings, negative, message.guidance), cost)
    return encode_response(request_id, _wire(server, x))


async def text_velocity(server: StageServer, message: TextVelocityRequest) -> np.ndarray:
    """The guided velocity of ``message``'s rows (B, C, H, W) in the stage's wire dtype, run in
    the expert's batcher with other requests' rows: for its own route and a pool's
    (:mod:`ddm.serving.expert.pool_step`) alike."""
    embeddings, negative, cost = _context_rows(server, message)
    out = await server.batcher.submit(_Velocity(embeddings.shape[1]), (
        message.x, message.t, embeddings, negative, message.guidance), cost)
    return _wire(server, out)


def _context_rows(server: StageServer, message: TextVelocityRequest | TextIntegrateRequest
                  ) -> tuple[np.ndarray, np.ndarray, int]:
    """The rows' embeddings and negative rows (float32; a row without guidance gets its own
    embeddings as a placeholder that is never run), and the forward rows the call costs."""
    context = server.contexts.get(message.context)
    held = context.embeddings.shape[0]
    if message.rows.max() >= held:
        raise ProtocolError(f"'rows' name row {int(message.rows.max())} of a context of {held}",
                            422)
    try:
        guided_mask = guided_rows(message.guidance, len(message.rows),
                                  context.negative.shape[0] > 0, "the context")
    except ValueError as error:
        raise ProtocolError(str(error), 422) from None
    cost = message.x.shape[0] + int(guided_mask.sum())
    if cost > server.limits.max_batch:
        raise ProtocolError(f"{message.x.shape[0]} rows, {int(guided_mask.sum())} of them "
                            f"guided, run {cost} forward rows; the limit is "
                            f"{server.limits.max_batch}", 422)
    embeddings = np.asarray(context.embeddings[message.rows], np.float32)
    negative = (np.asarray(context.negative[message.rows], np.float32)
                if context.negative.shape[0] else embeddings)
    return embeddings, negative, cost


def _execute(server: StageServer, key: Hashable, inputs: tuple[np.ndarray, ...]) -> Any:
    """One batch, run by the batcher (on the event loop or its model thread)."""
    stage = server.stage
    assert stage is not None, "the batcher starts once the stage is loaded"
    if key == "encode":
        (prompts,) = inputs
        cond = stage.forward(list(prompts))
        assert stage.tokens_cut is not None and stage.unknown_spans is not None
        assert cond.mask is not None
        spans = stage.unknown_spans(list(prompts))
        words = np.empty(len(prompts), object)  # per row, as the batcher splits rows
        for row in range(len(prompts)):
            words[row] = [(start, end) for _, start, end in spans[spans[:, 0] == row]]
        return (cond.embeddings, cond.mask.astype(np.uint8),
                stage.tokens_cut(list(prompts)).astype(np.int32), words)
    if key in ("decode", "route"):
        return np.asarray(stage.forward(*inputs), np.float32)
    velocity = guided(stage.forward, None)
    if isinstance(key, _Velocity):
        x, t, embeddings, negative, guidance = inputs
        return velocity(x, t, _guided(embeddings, negative, guidance))
    assert isinstance(key, _Integrate), f"unknown batch key {key!r}"
    x, embeddings, negative, guidance = inputs
    for _, x in iterate(velocity, x, _guided(embeddings, negative, guidance),
                        np.frombuffer(key.grid, np.float32), key.solver):
        pass
    return x


def _pooled(server: StageServer, message: RouteRequest) -> np.ndarray:
    """The request's pooled text rows as the router takes them: (B, D) for a router with a
    text prior (none sent: zeros, no evidence), else (B, 0), unused."""
    assert server.stage is not None, "requests are answered once the stage is loaded"
    prior, pooled = server.stage.declaration.text_prior, message.pooled
    if prior is None:
        return np.zeros((len(pooled), 0), np.float32)
    if pooled.shape[1] == 0:
        return np.zeros((len(pooled), prior.text_width), np.float32)
    if pooled.shape[1] != prior.text_width:
        raise ProtocolError(f"'pooled' is {pooled.shape[1]} wide; this router's text prior "
                            f"takes {prior.text_width}", 422)
    return pooled


def _guided(embeddings: np.ndarray, negative: np.ndarray,
            guidance: np.ndarray) -> Conditioning:
    return Conditioning(embeddings=embeddings).with_guidance(
        guidance, Conditioning(embeddings=negative))


def _wire(server: StageServer, out: np.ndarray) -> np.ndarray:
    """``out`` (float32) in the dtype the stage declares for its replies."""
    return np.asarray(out).astype(WIRE_DTYPES[server.wire_dtype or "float32"])


async def load_member(server: StageServer, on_failure: Callable[[str], None] | None,
                      start_up: StartUp) -> None:
    """Load and warm up the stage off the event loop, then start batching; a failure is
    kept in ``server.failure`` and told to ``on_failure``."""
    started = time.perf_counter()

    def load_and_warm() -> Stage:
        stage = load_stage(server.directory, server.precision, server.device or "cpu",
                           server.backend_name)
        _warm_up(stage)
        return stage

    try:
        stage = await start_up(load_and_warm)
    except Exception as error:  # noqa: BLE001 - reported by /healthz and /readyz
        logger.exception("stage %s failed to load", server.directory)
        server.failure = f"{type(error).__name__}: {error}"
        if on_failure is not None:
            on_failure(f"stage {server.directory}: cannot load or warm up: {error}")
        return
    declared = stage.declaration
    limits = dataclasses.replace(server.limits, image_shape=declared.latent_shape,
                                 text_width=declared.text_width)
    server.limits = dataclasses.replace(
        limits, max_body_bytes=_max_body_bytes(declared.role, limits))
    server.hardware = cpu_model() if (server.device or "cpu") == "cpu" else server.device
    # The batcher first: a route on another event loop submits as soon as it sees a stage.
    server.batcher.start()
    server.stage = stage
    logger.info("%s stage %s ready (%s, %s) after %.1f s", declared.role, server.directory.name,
                declared.family, stage.dtype, time.perf_counter() - started)


def _warm_up(stage: Stage) -> None:
    """One call at batch 1, so that the first request pays no lazy initialisation."""
    declared = stage.declaration
    if declared.role == TEXT_ENCODER:
        stage.forward([""])
        return
    assert declared.latent_shape is not None
    x = np.zeros((1, *declared.latent_shape), np.float32)
    t = np.full((1,), 0.5, np.float32)
    if declared.role == EXPERT:
        assert declared.text_width is not None
        stage.forward(x, t, Conditioning(
            embeddings=np.zeros((1, _WARM_TOKENS, declared.text_width), np.float32)))
    elif declared.role == ROUTER:
        stage.forward(x, t)
    else:
        stage.forward(x)


def _not_ready(server: StageServer) -> str:
    if server.failure is not None:
        return f"stage {server.directory.name} failed to load: {server.failure}"
    return f"stage {server.directory.name} is still loading; retry when /readyz answers 200"


def _max_body_bytes(role: str, limits: Limits) -> int:
    """Twice the largest valid request of the role (a context for an expert, whose cap is
    :data:`~ddm.deploy.limits.MAX_CONTEXT_BODY_BYTES`), so that a batch just over
    ``max_batch`` is refused with a message about the batch."""
    if role == TEXT_ENCODER:
        return 2 * limits.max_prompts * (limits.max_prompt_bytes + 4) + 4096
    shape = limits.image_shape
    if shape is None:  # not declared: until the network says, a context's cap
        return MAX_CONTEXT_BODY_BYTES
    per_row = 4 * math.prod(shape) + 4 + 4 + 4  # x, t, rows, guidance
    calls = 2 * (limits.max_batch * per_row + (limits.max_steps + 1) * 4) + 4096
    return max(calls, MAX_CONTEXT_BODY_BYTES) if role == EXPERT else calls
