"""The expert server: one checkpoint behind the binary protocol (``docs/protocol.md``), batched.

Routes: ``POST /v1/velocity`` (velocity and integrate requests alike: the kind is in the body),
``GET /v1/info``, ``/healthz``, ``/readyz`` and ``/metrics``.

The lifespan starts loading and warming up the model in a worker thread and returns at once, so
that the server answers probes while a backend compiles (minutes on Neuron): ``/readyz`` is 503
until the model is warm, then 200; ``/healthz`` is 200 while the process can still become ready
and 500 once loading has failed, so that an orchestrator restarts it.

The data plane is priced per denoising step, so it avoids JSON and extra copies: the body is
read raw and decoded as views, and replies are built by the protocol module. Nagle's algorithm
would hold a small reply back for a delayed ACK (40 ms); uvloop and asyncio set ``TCP_NODELAY``
on every accepted connection, as aiohttp does on the client side.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib.util
import logging
import math
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Hashable

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ddm.checkpoint import Checkpoint, CheckpointError, CheckpointMeta, load_checkpoint, read_meta
from ddm.models.config import UNetConfig
from ddm.sampling.solvers import iterate
from ddm.serving import metrics as expert_metrics
from ddm.serving.backends import Backend, check_backend, load_backend
from ddm.serving.batching import Batcher, BatcherClosed
from ddm.serving.protocol import (CONTENT_TYPE, IntegrateRequest, Limits, ProtocolError,
                                  VelocityRequest, decode_request, encode_error, encode_response)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 64
#: No waiting by default: requests that arrive while the model is busy already form the next
#: batch, and a router stepping alone would otherwise pay the whole delay at every step
#: (measured: +1 ms or more per batch-1 step at 1 ms, with no clear throughput gain).
DEFAULT_MAX_DELAY_MS = 0.0
#: Longer than a router's pause between two generations and than common load balancers' idle
#: timeout (60 s), so that a keep-alive connection is not closed just as a router reuses it.
KEEP_ALIVE_S = 75

#: ``(checkpoint, backend, device, max_batch, compile_cache) -> Backend``; replaceable to serve
#: a custom backend.
BackendLoader = Callable[[Checkpoint, str, str | None, int, Path | None], Backend]

_VELOCITY = "velocity"


@dataclass(frozen=True)
class _Integrate:
    """Batch key of an integrate request: only requests on the same solver and grid merge."""

    solver: str
    grid: bytes  # float32, as sent


class _Expert:
    """What the routes share: facts from the checkpoint's config, and the state of loading."""

    def __init__(self, meta: CheckpointMeta, limits: Limits, backend: str, device: str | None,
                 max_delay_ms: float) -> None:
        self.meta = meta
        self.limits = limits
        self.backend_name = backend
        self.device = device
        self.max_delay_ms = max_delay_ms
        self.metrics = expert_metrics.ExpertMetrics()
        self.batcher = Batcher(functools.partial(_execute, self), limits.max_batch, max_delay_ms,
                               self.metrics.observe_batch)
        self.backend: Backend | None = None  # set, and the batcher started, once warm
        self.failure: str | None = None

    def describe(self) -> dict[str, Any]:
        backend, device, runtime = self.backend_name, self.device, None
        if self.backend is not None:
            info = self.backend.info()
            backend, device, runtime = info.backend, info.device, info.framework
        return {"name": self.meta.name, "kind": self.meta.kind, "classes": list(self.meta.classes),
                "partition": self.meta.partition, "framework": self.meta.framework,
                "backend": backend, "runtime": runtime, "device": device,
                "image_shape": list(self.limits.image_shape or ()),
                "convention": self.meta.convention, "max_batch": self.limits.max_batch,
                "max_delay_ms": self.max_delay_ms, "ready": self.backend is not None}


def create_expert_app(checkpoint_dir: str | os.PathLike, backend: str = "torch",
                      device: str | None = None, max_batch: int = DEFAULT_MAX_BATCH,
                      max_delay_ms: float = DEFAULT_MAX_DELAY_MS, *,
                      compile_cache: Path | None = None,
                      loader: BackendLoader = load_backend) -> FastAPI:
    """An ASGI app serving the UNet checkpoint in ``checkpoint_dir`` on ``backend``.

    Requests arriving within ``max_delay_ms`` of each other (or while the model is busy) run
    as one batch of at most ``max_batch`` images; bigger requests are refused with 413. The
    backend and the checkpoint's config are checked here, so that a wrong flag fails before
    the server starts; the weights load in the lifespan.
    """
    check_backend(backend, device)
    meta = read_meta(checkpoint_dir)
    if meta.kind not in ("expert", "monolith"):
        raise CheckpointError(f"{checkpoint_dir} is a {meta.kind} checkpoint, not a UNet to serve")
    config = UNetConfig.from_dict(meta.architecture)
    image_shape = (config.in_channels, config.image_size, config.image_size)
    limits = Limits(max_batch=max_batch, image_shape=image_shape, allowed_labels=meta.classes)
    limits = dataclasses.replace(limits, max_body_bytes=_max_body_bytes(limits))
    expert = _Expert(meta, limits, backend, device, max_delay_ms)
    load = functools.partial(_load, expert, Path(checkpoint_dir), loader, compile_cache)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(load())
        try:
            yield
        finally:
            loading.cancel()
            await expert.batcher.close()

    app = FastAPI(title=f"ddm expert {meta.name}", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)

    @app.post("/v1/velocity")
    async def velocity(request: Request) -> Response:
        status, reply = await _answer(expert, request)
        return Response(reply, status_code=status, media_type=CONTENT_TYPE)

    @app.get("/v1/info")
    async def info() -> dict[str, Any]:
        return expert.describe()

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        if expert.failure is not None:
            return JSONResponse({"status": "failed", "error": expert.failure}, 500)
        return JSONResponse({"status": "alive"})

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        if expert.backend is not None:
            return JSONResponse({"status": "ready"})
        if expert.failure is not None:
            return JSONResponse({"status": "failed", "error": expert.failure}, 503)
        return JSONResponse({"status": "loading"}, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(expert.metrics.render(), media_type=expert_metrics.CONTENT_TYPE)

    return app


def build_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for ``app``: uvloop and httptools when installed, long keep-alive,
    no access log (one line per denoising step would cost more than the step)."""
    config = uvicorn.Config(app, host=host, port=port, loop=_installed_or("uvloop", "asyncio"),
                            http=_installed_or("httptools", "h11"), lifespan="on",
                            log_level=log_level, access_log=False, timeout_keep_alive=KEEP_ALIVE_S)
    return uvicorn.Server(config)


def serve_expert(checkpoint: str | os.PathLike, host: str = "127.0.0.1", port: int = 8000,
                 backend: str = "torch", device: str | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH, max_delay_ms: float = DEFAULT_MAX_DELAY_MS,
                 log_level: str = "info", compile_cache: Path | None = None) -> None:
    """Serve one expert until interrupted (SIGINT/SIGTERM); what ``ddm serve expert`` runs."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    app = create_expert_app(checkpoint, backend, device, max_batch, max_delay_ms,
                            compile_cache=compile_cache)
    build_server(app, host, port, log_level).run()


async def _answer(expert: _Expert, request: Request) -> tuple[int, bytes]:
    """One request -> (HTTP status, protocol reply); every failure becomes an error reply."""
    kind, images, request_id = "invalid", 0, 0
    try:
        message = decode_request(await _read_body(request, expert.limits), expert.limits)
        request_id = message.request_id
        kind = "velocity" if isinstance(message, VelocityRequest) else "integrate"
        images = message.x.shape[0]
        if expert.backend is None:
            raise ProtocolError(_not_ready(expert), 503, request_id)
        out = await expert.batcher.submit(*_work(message))
        status, reply = 200, encode_response(request_id, out)
    except ProtocolError as error:
        echoed = request_id if error.request_id is None else error.request_id
        status, reply = error.status, encode_error(echoed, error.status, str(error))
    except BatcherClosed as error:
        status, reply = 503, encode_error(request_id, 503, str(error))
    except Exception as error:  # noqa: BLE001 - a failing model must not take the server down
        logger.exception("request %d failed", request_id)
        status, reply = 500, encode_error(request_id, 500,
                                          f"internal error: {type(error).__name__}: {error}")
    expert.metrics.observe_request(kind, status, images)
    return status, reply


async def _read_body(request: Request, limits: Limits) -> bytes:
    """The raw body; a declared length over the limit is refused before reading it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise ProtocolError(f"body of {declared} bytes exceeds the limit of "
                            f"{limits.max_body_bytes}", 413)
    return await request.body()


def _work(message: VelocityRequest | IntegrateRequest) -> tuple[Hashable, tuple[np.ndarray, ...]]:
    """The batch key and the per-row inputs of a request."""
    if isinstance(message, VelocityRequest):
        return _VELOCITY, (message.x, message.t, message.y)
    return _Integrate(message.solver.name.lower(), message.grid.tobytes()), (message.x, message.y)


def _execute(expert: _Expert, key: Hashable, inputs: tuple[np.ndarray, ...]) -> np.ndarray:
    """Run one batch in the worker thread: a velocity, or a whole integration on one grid."""
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
                compile_cache: Path | None) -> None:
    """Load and warm up the backend off the event loop, then start batching."""
    started = time.perf_counter()

    def load_and_warm() -> Backend:
        backend = loader(load_checkpoint(directory), expert.backend_name, expert.device,
                         expert.limits.max_batch, compile_cache)
        backend.warm_up()
        return backend

    try:
        backend = await asyncio.to_thread(load_and_warm)
    except Exception as error:  # noqa: BLE001 - reported by /healthz and /readyz
        logger.exception("expert %s failed to load from %s", expert.meta.name, directory)
        expert.failure = f"{type(error).__name__}: {error}"
        return
    expert.backend = backend
    expert.batcher.start()
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


def _installed_or(module: str, fallback: str) -> str:
    return module if importlib.util.find_spec(module) is not None else fallback
