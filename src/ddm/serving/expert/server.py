"""The expert server: one checkpoint behind the binary protocol (``docs/protocol.md``), batched.

Routes (:mod:`ddm.serving.expert.routes`, shared with the stage server): ``POST /v1/velocity``
(velocity and integrate requests alike: the kind is in the body), ``GET /v1/info``,
``/healthz``, ``/readyz`` and ``/metrics``; their OpenAPI document at ``/openapi.json``
(browsable at ``/docs`` with ``--api-docs``). A stage checkpoint (a text DDM's expert, whose
config.json declares ``_ddm``) is served by :mod:`ddm.serving.expert.stage_server` instead.

The lifespan starts loading and warming up the model in a worker thread and returns at once, so
that the server answers probes while a backend compiles (minutes on Neuron): ``/readyz`` is 503
until the model is warm, then 200; ``/healthz`` is 200 while the process can still become ready
and 500 once loading has failed, so that an orchestrator restarts it.

Before it warms up, the server runs ``ddm expert check``'s checks of the network it serves
(:func:`ddm.experts.check.check_network`: shapes, dtypes, finiteness, determinism and that it
predicts what its config.json declares); a failure is a failure to load.

Run as a process (:func:`serve_expert`), a server whose checkpoint fails to load, pass its
check or warm up exits with status 1 and leaves the reason in the termination-message file
(:mod:`ddm.termination`), instead of staying alive and never ready.

The data plane is priced per denoising step, so it avoids JSON and extra copies: the body is
read raw and decoded as views, and replies are built by the protocol module. ``/v1/velocity``
is a bare ASGI route in front of the FastAPI app, which serves the other routes.

Limits: a body over ``max_body_bytes`` is refused with 413 before it is read; a batch over
``max_batch``, a grid over ``max_steps`` or any other value the expert refuses gets 422, an
undecodable body 400 (``docs/protocol.md``); more than ``max_pending`` requests admitted at
once (queued or running, counted once their body is in) get 429 with ``Retry-After``, which a
router retries on another replica. Slow, idle and oversized connections are cut off by the
limits of :mod:`ddm.serving.connections` before they reach this app.
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

from ddm.checkpoints.declared import read_declaration
from ddm.checkpoints.format import (Checkpoint, CheckpointError, CheckpointMeta, load_checkpoint,
                                    read_meta)
from ddm.deploy.limits import (DEFAULT_CONTEXT_CACHE_BYTES, EXPERT_PORT, MAX_STEPS,
                               SERVER_MAX_BATCH, SERVER_MAX_DELAY_MS, SERVER_MAX_PENDING)
from ddm.experts.check import behaviour_data, check_network
from ddm.experts.network_checks import require_passing
from ddm.models.loading import expert_image_shape
from ddm.sampling.solvers import iterate
from ddm.serving.auth import TokenFile
from ddm.serving.expert import metrics as expert_metrics
from ddm.serving.expert.backends import Backend, check_backend, load_backend
from ddm.serving.batching import Batcher, grid_slices
from ddm.serving.expert.routes import (SERVING_LOOPS, VELOCITY_PATH, Binary, Handling,
                                      answer_or_error, model_app)
from ddm.serving.http import ServerControl, run_server
from ddm.serving.protocol import (IntegrateRequest, Limits, ProtocolError, VelocityRequest,
                                  decode_request, encode_response)
from ddm.termination import fail_start

logger = logging.getLogger(__name__)

#: ``(checkpoint, backend, device, max_batch, compile_cache) -> Backend``; replaceable to serve
#: a custom backend.
BackendLoader = Callable[[Checkpoint, str, str | None, int, Path | None], Backend]
#: Runs the loading off the event loop: ``await start_up(work)`` is ``work()``'s result.
StartUp = Callable[[Callable[[], Any]], Awaitable[Any]]

_VELOCITY = "velocity"


@dataclass(frozen=True)
class _Integrate:
    """Batch key of an integrate request: only requests on the same solver and grid merge."""

    solver: str
    grid: bytes  # float32, as sent


class _Expert:
    """What the routes share: facts from the checkpoint's config, and the state of loading."""

    def __init__(self, meta: CheckpointMeta, limits: Limits, backend: str, device: str | None,
                 max_delay_ms: float, max_pending: int, serving_loops: int) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.meta = meta
        self.limits = limits
        self.max_pending = max_pending
        self.pending = 0
        self.backend_name = backend
        self.device = device
        self.max_delay_ms = max_delay_ms
        self.metrics = expert_metrics.ExpertMetrics()
        self.batcher = Batcher(functools.partial(_execute, self), limits.max_batch, max_delay_ms,
                               self.metrics.observe_batch, serving_loops=serving_loops)
        self.backend: Backend | None = None  # set, and the batcher started, once warm
        self.failure: str | None = None

    @property
    def ready(self) -> bool:
        return self.backend is not None

    def describe(self) -> dict[str, Any]:
        backend, device, runtime, hardware = self.backend_name, self.device, None, None
        if self.backend is not None:
            info = self.backend.info()
            backend, device, runtime, hardware = (info.backend, info.device, info.framework,
                                                  info.hardware)
        return {"name": self.meta.name, "kind": self.meta.kind, "classes": list(self.meta.classes),
                "partition": self.meta.partition, "data": self.meta.data,
                "framework": self.meta.framework, "backend": backend, "runtime": runtime,
                "device": device, "hardware": hardware,
                "image_shape": list(self.limits.image_shape or ()),
                "convention": self.meta.convention, "model": self.meta.model.kind,
                "objective": self.meta.objective.to_dict(), "serves": "velocity",
                "max_batch": self.limits.max_batch,
                "max_steps": self.limits.max_steps, "max_body_bytes": self.limits.max_body_bytes,
                "max_pending": self.max_pending, "max_delay_ms": self.max_delay_ms,
                "ready": self.backend is not None}


def create_expert_app(checkpoint_dir: str | os.PathLike, backend: str = "torch",
                      device: str | None = None, max_batch: int = SERVER_MAX_BATCH,
                      max_delay_ms: float = SERVER_MAX_DELAY_MS, *,
                      max_steps: int = MAX_STEPS, max_pending: int = SERVER_MAX_PENDING,
                      compile_cache: Path | None = None, loader: BackendLoader = load_backend,
                      on_failure: Callable[[str], None] | None = None,
                      draining: Callable[[], bool] | None = None,
                      start_up: StartUp = asyncio.to_thread,
                      api_docs: bool = False,
                      auth_token_file: str | os.PathLike[str] | None = None,
                      precision: str | None = None,
                      context_cache_bytes: int = DEFAULT_CONTEXT_CACHE_BYTES,
                      serving_loops: int = 1) -> ASGIApp:
    """An ASGI app serving the UNet checkpoint in ``checkpoint_dir`` on ``backend``, or the
    stage checkpoint of role expert there (:func:`~ddm.serving.expert.stage_server.
    create_stage_app`, with ``precision`` and its context cache's bytes).

    Requests arriving within ``max_delay_ms`` of each other (or while the model is busy) run
    as one batch of at most ``max_batch`` images; bigger requests are refused with 422. The
    backend and the checkpoint's config are checked here, so that a wrong flag fails before
    the server starts; the weights load in the lifespan, and if they cannot,
    ``on_failure(reason)`` is called (besides ``/healthz`` answering 500). While
    ``draining()`` is true (the server got SIGTERM), ``/readyz`` answers 503. The loading runs
    in ``start_up(work)`` (a worker thread; a process's server runs it in
    :meth:`~ddm.serving.http.ServerControl.start_up`, which it need not wait for). ``api_docs``
    serves Swagger UI at ``/docs`` (:func:`~ddm.serving.http.add_api_docs`). With
    ``auth_token_file``, ``/v1/*`` needs ``Authorization: Bearer <its token>`` (the router's
    per-DDM token; :mod:`ddm.serving.auth`), so that only the router reaches the model.
    ``serving_loops`` is how many event loops the server runs the app on (with more than one,
    the batcher runs a lone batch on its request's loop whatever its time).
    """
    if read_declaration(Path(checkpoint_dir)) is not None:
        # imported here: a label expert's server needs none of the text stages' libraries
        from ddm.serving.expert.stage_server import create_stage_app

        return create_stage_app(
            checkpoint_dir, "expert", backend, device, max_batch, max_delay_ms,
            max_steps=max_steps, max_pending=max_pending, on_failure=on_failure,
            draining=draining, start_up=start_up, api_docs=api_docs,
            auth_token_file=auth_token_file, precision=precision,
            context_cache_bytes=context_cache_bytes, serving_loops=serving_loops)
    if precision is not None:
        raise CheckpointError(f"{checkpoint_dir} is a label checkpoint, served in float32: "
                              "--precision is for stage checkpoints")
    check_backend(backend, device)
    if auth_token_file is not None:
        TokenFile(auth_token_file)  # unreadable, empty or malformed: fail before loading
    meta = read_meta(checkpoint_dir)
    if meta.kind not in ("expert", "monolith"):
        raise CheckpointError(f"{checkpoint_dir} is a {meta.kind} checkpoint, not a UNet to serve")
    image_shape = expert_image_shape(meta)
    limits = Limits(max_batch=max_batch, max_steps=max_steps, image_shape=image_shape,
                    allowed_labels=meta.classes)
    limits = dataclasses.replace(limits, max_body_bytes=_max_body_bytes(limits))
    expert = _Expert(meta, limits, backend, device, max_delay_ms, max_pending, serving_loops)
    load = functools.partial(_load, expert, Path(checkpoint_dir), loader, compile_cache,
                             on_failure, start_up)
    return model_app(expert, {VELOCITY_PATH: Binary(expert, functools.partial(_answer, expert))},
                     load, expert.batcher.close, title=f"ddm expert {meta.name}",
                     description="One diffusion expert behind the binary protocol of "
                                 "docs/protocol.md.",
                     api_docs=api_docs, draining=draining, auth_token_file=auth_token_file)


def serve_expert(checkpoint: str | os.PathLike, host: str = "127.0.0.1",
                 port: int = EXPERT_PORT,
                 backend: str = "torch", device: str | None = None,
                 max_batch: int = SERVER_MAX_BATCH, max_delay_ms: float = SERVER_MAX_DELAY_MS,
                 log_level: str = "info", compile_cache: Path | None = None, *,
                 max_steps: int = MAX_STEPS,
                 max_pending: int = SERVER_MAX_PENDING, drain_s: float = 0.0,
                 api_docs: bool = False,
                 auth_token_file: str | os.PathLike[str] | None = None,
                 metrics_port: int | None = None, precision: str | None = None,
                 context_cache_bytes: int = DEFAULT_CONTEXT_CACHE_BYTES) -> None:
    """Serve one expert until interrupted (SIGINT/SIGTERM, after ``drain_s`` seconds of
    draining on SIGTERM: :mod:`ddm.serving.http`; ``/metrics`` on ``metrics_port`` only, if
    given); what ``ddm serve expert`` runs.

    Exits with status 1, the reason in the termination-message file, when the checkpoint or
    the backend cannot be loaded, warmed up or compiled, or a port cannot be bound."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")

    def make_app(control: ServerControl) -> ASGIApp:
        try:
            return create_expert_app(checkpoint, backend, device, max_batch, max_delay_ms,
                                     max_steps=max_steps, max_pending=max_pending,
                                     compile_cache=compile_cache, on_failure=control.stop,
                                     draining=lambda: control.draining,
                                     start_up=control.start_up, api_docs=api_docs,
                                     auth_token_file=auth_token_file, precision=precision,
                                     context_cache_bytes=context_cache_bytes,
                                     serving_loops=SERVING_LOOPS)
        except Exception as error:  # noqa: BLE001 - every start-up failure is reported alike
            raise fail_start(f"expert {checkpoint}: {error}") from error

    run_server(make_app, host, port, log_level, drain_s, metrics_port, loops=SERVING_LOOPS)


async def _answer(expert: _Expert, body: bytes) -> tuple[int, bytes]:
    """One request body -> (HTTP status, protocol reply); every failure becomes an error
    reply."""

    async def handle(handling: Handling) -> bytes:
        message = decode_request(body, expert.limits)
        handling.request_id = message.request_id
        if not isinstance(message, (VelocityRequest, IntegrateRequest)):
            raise ProtocolError(f"expert {expert.meta.name} is conditioned on labels: send "
                                "velocity or integrate requests (protocol version 1)", 422,
                                message.request_id)
        kind = "velocity" if isinstance(message, VelocityRequest) else "integrate"
        handling.kind, handling.rows = kind, message.x.shape[0]
        if expert.backend is None:
            raise ProtocolError(_not_ready(expert), 503, message.request_id)
        return encode_response(message.request_id, await _run(expert, message))

    return await answer_or_error(expert, handle)


async def _run(expert: _Expert, message: VelocityRequest | IntegrateRequest) -> np.ndarray:
    """A velocity request as one batcher job; an integration as one job per slice of its
    grid (:func:`~ddm.serving.batching.grid_slices`)."""
    if isinstance(message, VelocityRequest):
        return await expert.batcher.submit(_VELOCITY, (message.x, message.t, message.y))
    solver, x = message.solver.name.lower(), message.x
    for piece in grid_slices(message.grid):
        x = await expert.batcher.submit(_Integrate(solver, piece.tobytes()), (x, message.y))
    return x


def _execute(expert: _Expert, key: Hashable, inputs: tuple[np.ndarray, ...]) -> np.ndarray:
    """Run one batch (the batcher runs it on an event loop or its model thread): a velocity,
    or a whole integration on one grid."""
    backend = expert.backend
    assert backend is not None, "the batcher starts only once the backend is loaded"
    if not isinstance(key, _Integrate):
        x, t, y = inputs
        return backend.velocity(x, t, y)
    x, y = inputs
    for _, x in iterate(backend.velocity, x, y, np.frombuffer(key.grid, np.float32), key.solver):
        pass
    return x


async def _load(expert: _Expert, directory: Path, loader: BackendLoader,
                compile_cache: Path | None, on_failure: Callable[[str], None] | None,
                start_up: StartUp) -> None:
    """Load, check and warm up the backend off the event loop, then start batching."""
    started = time.perf_counter()

    def load_and_warm() -> Backend:
        backend = loader(load_checkpoint(directory), expert.backend_name, expert.device,
                         expert.limits.max_batch, compile_cache)
        assert expert.limits.image_shape is not None
        require_passing(check_network(expert.meta, backend.network, expert.limits.image_shape,
                                      behaviour_data(expert.meta), expert.limits.max_batch),
                        f"expert {expert.meta.name}")
        backend.warm_up()
        return backend

    try:
        backend = await start_up(load_and_warm)
    except Exception as error:  # noqa: BLE001 - reported by /healthz and /readyz
        logger.exception("expert %s failed to load from %s", expert.meta.name, directory)
        expert.failure = f"{type(error).__name__}: {error}"
        if on_failure is not None:
            on_failure(f"expert {expert.meta.name}: cannot load, check or warm up {directory}: "
                       f"{error}")
        return
    # The batcher first: a route on another event loop submits as soon as it sees a backend.
    expert.batcher.start()
    expert.backend = backend
    info = backend.info()
    logger.info("expert %s ready on %s (%s, %s) after %.1f s", expert.meta.name, info.backend,
                info.framework, info.device, time.perf_counter() - started)


def _not_ready(expert: _Expert) -> str:
    if expert.failure is not None:
        return f"expert {expert.meta.name} failed to load: {expert.failure}"
    return f"expert {expert.meta.name} is still loading; retry when /readyz answers 200"


def _max_body_bytes(limits: Limits) -> int:
    """Twice the largest valid request, so that a batch just over ``max_batch`` is refused
    with a message about the batch rather than about the body."""
    assert limits.image_shape is not None
    per_image = math.prod(limits.image_shape) * 4 + 4 + 8  # x float32, t float32, y int64
    return 2 * (limits.max_batch * per_image + (limits.max_steps + 1) * 4) + 4096
