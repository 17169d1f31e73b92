"""The router server: generates digits by routing every denoising step to remote experts.

Routes: ``POST /v1/generate`` (JSON in, base64 PNGs out), ``GET /v1/generate/stream``
(Server-Sent Events, one ``step`` event per chunk of the grid, then ``done``), ``GET /`` (a web
page that streams the denoising live), ``GET /v1/info``, ``/healthz``, ``/readyz``, ``/metrics``
and the OpenAPI docs at ``/docs``.

The router network is small and runs here, in a worker thread; experts are reached through one
:class:`~ddm.serving.expert_pool.ExpertPool`. The lifespan starts the pool and loads the router
network in the background, so that probes are answered at once: ``/readyz`` is 200 once the
network is loaded and every expert has a ready replica, and names what is missing otherwise.

Errors: a request the DDM cannot serve is a 422 naming the problem; more generations than
``max_concurrent`` at once get a 429; an expert none of whose replicas answers within the call
deadline gives a 503 naming it, and an expert refusing what the router sent a 502. None of them
touches the process's health: ``/healthz`` fails only when the router network cannot load.

Streamed frames show the state ``x_t`` itself (``ddm.convention.to_uint8``), noise fading into
the digit, not a prediction of the end: with delegation the router never sees the velocity
between chunks, while ``x_t`` is always at hand.

Not ``from __future__ import annotations``: FastAPI reads the routes' annotations at runtime, and
the request models are built per app (they carry its limits).
"""

import asyncio
import base64
import dataclasses
import json
import logging
import os
import time
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, AsyncIterator, Iterator, Literal

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ddm.checkpoint import CheckpointError
from ddm.convention import to_uint8
from ddm.imaging import png_bytes
from ddm.sampling.mixture import RouterFn
from ddm.sampling.routing import parse_strategy
from ddm.serving.expert_pool import ExpertError, ExpertPool, PoolMetrics, pool_settings
from ddm.serving.expert_server import build_server
from ddm.serving.remote_sampling import (RemoteMixture, SamplingRequest, StepEvent, Tally,
                                         check_request, denoise, generate_remote)
from ddm.serving.router_config import RouterConfigFile

logger = logging.getLogger(__name__)

PAGE = Path(__file__).parent / "static" / "index.html"
#: Strategies the web page offers; any that ``parse_strategy`` accepts may be requested.
SUGGESTED_STRATEGIES = ("oracle", "top1", "top2", "threshold:0.2", "ensemble")
_ROUTES = ("/", "/v1/generate", "/v1/generate/stream", "/v1/info", "/healthz", "/readyz",
           "/metrics")


@dataclass(frozen=True)
class RouterSettings:
    """Limits of one router process. ``deadline_s`` bounds one expert call, retries and waiting
    for a replica included; None means every attempt may use its whole timeout."""

    max_batch: int = 64
    max_steps: int = 200
    max_concurrent: int = 16
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_steps", "max_concurrent"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s}")


def load_router_config(path: str | os.PathLike[str]) -> RouterConfigFile:
    """Read ``router.yaml``; a relative ``router_checkpoint`` is relative to the file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise FileNotFoundError(f"cannot read router config {path}: {error.strerror}") from None
    config = RouterConfigFile.from_yaml(text)
    if config.router_checkpoint and not Path(config.router_checkpoint).is_absolute():
        config = dataclasses.replace(
            config, router_checkpoint=str(path.parent / config.router_checkpoint))
    return config


class _Busy(RuntimeError):
    """More generations in flight than the router allows."""


class _NotReady(RuntimeError):
    """The router cannot generate yet (network loading or failed, experts never seen)."""


class RouterMetrics:
    """HTTP requests by route and status, their latency, and generations in flight."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("ddm_router_requests", "HTTP requests answered, by route and "
                                "status.", ["route", "status"], registry=registry)
        self.seconds = Histogram(
            "ddm_router_request_seconds", "Time to answer, to the end of the stream for "
            "/v1/generate/stream, by route.", ["route"], registry=registry,
            buckets=(1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.in_flight = Gauge("ddm_router_generations_in_flight",
                               "Generations running now (JSON and streamed).", registry=registry)


class _Router:
    """What the routes share: config, limits, the pool, the router network once loaded."""

    def __init__(self, config: RouterConfigFile, settings: RouterSettings) -> None:
        self.config = config
        self.settings = settings
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics(self.registry)
        self.pool = ExpertPool.from_config(config, pool_settings(config, settings.deadline_s),
                                           PoolMetrics(self.registry))
        self.names = tuple(e.name for e in config.experts)
        self.network: RouterFn | None = None
        self.network_shape: tuple[int, int, int] | None = None
        self.loaded = config.router_checkpoint is None
        self.failure: str | None = None
        self._in_flight = 0

    async def load(self) -> None:
        """Load the router network off the event loop; a failure is reported by the probes."""
        if self.config.router_checkpoint is None:
            return
        try:
            self.network, self.network_shape = await asyncio.to_thread(
                _load_network, self.config.router_checkpoint, self.config)
        except Exception as error:  # noqa: BLE001 - reported by /healthz and /readyz
            logger.exception("router network %s failed to load", self.config.router_checkpoint)
            self.failure = f"{type(error).__name__}: {error}"
            return
        self.loaded = True

    def image_shape(self) -> tuple[tuple[int, int, int] | None, list[str]]:
        """The experts' image shape as they report it, and any disagreement."""
        shapes = {name: info.image_shape for name in self.names
                  if (info := self.pool.info(name)) is not None}
        if self.network_shape is not None:
            shapes["the router network"] = self.network_shape
        if len(set(shapes.values())) > 1:
            return None, [f"image shapes disagree: {shapes}"]
        return next(iter(shapes.values()), None), []

    def problems(self) -> tuple[list[str], list[str]]:
        """(experts without a ready replica, every reason not to be ready)."""
        missing = [name for name in self.names if self.pool.ready_count(name) == 0]
        problems = [f"expert {name} has no ready replica" for name in missing]
        if self.failure is not None:
            problems.append(f"router network failed to load: {self.failure}")
        elif not self.loaded:
            problems.append("router network is loading")
        for entry in self.config.experts:
            info = self.pool.info(entry.name)
            if info is not None and not set(entry.classes) <= set(info.classes):
                problems.append(f"expert {entry.name} serves classes {list(info.classes)}, "
                                f"but the router config lists {list(entry.classes)}")
        shape, disagreement = self.image_shape()
        problems += disagreement
        if shape is None and not disagreement:
            problems.append("no expert has reported its image shape yet")
        return missing, problems

    def mixture(self) -> RemoteMixture:
        if not self.loaded:
            raise _NotReady(f"router network failed to load: {self.failure}" if self.failure
                            else "router network is still loading; retry when /readyz is 200")
        shape, disagreement = self.image_shape()
        if shape is None:
            raise _NotReady("; ".join(disagreement) or "no expert replica has answered yet; "
                            "retry when /readyz is 200")
        return RemoteMixture(self.names, tuple(e.classes for e in self.config.experts),
                             self.network, shape, self.config.num_classes)

    def take_slot(self) -> None:
        """Count a generation in, or refuse it; :meth:`release_slot` counts it out."""
        if self._in_flight >= self.settings.max_concurrent:
            raise _Busy(f"{self._in_flight} generations are in flight, the limit is "
                        f"{self.settings.max_concurrent}; retry shortly")
        self._in_flight += 1
        self.metrics.in_flight.inc()

    def release_slot(self) -> None:
        self._in_flight -= 1
        self.metrics.in_flight.dec()

    @contextmanager
    def slot(self) -> Iterator[None]:
        self.take_slot()
        try:
            yield
        finally:
            self.release_slot()


def create_router_app(config: RouterConfigFile, settings: RouterSettings = RouterSettings()
                      ) -> FastAPI:
    """An ASGI app routing generations over the experts ``config`` lists."""
    router = _Router(config, settings)
    generate_body, stream_query = _request_models(config, settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with router.pool:
            loading = asyncio.create_task(router.load())
            try:
                yield
            finally:
                loading.cancel()

    app = FastAPI(title="ddm router", lifespan=lifespan,
                  description="Decentralized diffusion: route each step to remote experts.")
    app.add_middleware(_Metered, metrics=router.metrics)
    _add_error_handlers(app)

    @app.post("/v1/generate")
    async def generate(body: generate_body) -> dict[str, Any]:  # type: ignore[valid-type]
        request = _sampling_request(body, tuple(body.labels))
        mixture = _checked(router, request)
        started = time.perf_counter()
        with router.slot():
            result = await generate_remote(mixture, router.pool, request)
        return {"images": [_png(image) for image in result.images],
                "labels": result.labels.tolist(), "experts": result.experts_used(),
                "expert_calls": result.expert_calls.tolist(),
                "round_trips": result.round_trips.tolist(), **_echo(request),
                "seconds": round(time.perf_counter() - started, 6)}

    @app.get("/v1/generate/stream", response_class=StreamingResponse)
    async def stream(
            query: Annotated[stream_query, Query()]  # type: ignore[valid-type]
    ) -> StreamingResponse:
        request = _sampling_request(query, (query.label,))
        mixture = _checked(router, request)
        router.take_slot()
        events = _events(router, mixture, request)
        first = await anext(events)  # started, so that closing it always frees the slot
        return StreamingResponse(_prepend(first, events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text())

    @app.get("/v1/info")
    async def info() -> dict[str, Any]:
        shape, _ = router.image_shape()
        return {
            "experts": [{"name": e.name, "classes": list(e.classes),
                         "ready_replicas": router.pool.ready_count(e.name),
                         "replicas": {r.endpoint: r.state.value
                                      for r in router.pool.replicas(e.name)}}
                        for e in config.experts],
            "num_classes": config.num_classes, "image_shape": list(shape) if shape else None,
            "router_network": config.router_checkpoint is not None,
            "defaults": dataclasses.asdict(config.sampling),
            "limits": dataclasses.asdict(settings),
            "strategies": [s for s in SUGGESTED_STRATEGIES
                           if s == "oracle" or config.router_checkpoint is not None]}

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        if router.failure is not None:
            return JSONResponse({"status": "failed", "error": router.failure}, 500)
        return JSONResponse({"status": "alive"})

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        missing, problems = router.problems()
        if problems:
            return JSONResponse({"status": "not ready", "missing_experts": missing,
                                 "problems": problems}, 503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def serve_router(config_path: str | os.PathLike[str], host: str = "127.0.0.1", port: int = 8080,
                 log_level: str = "info", *, max_batch: int = 64, max_steps: int = 200,
                 max_concurrent: int = 16, deadline_s: float | None = None) -> None:
    """Serve the router until interrupted (SIGINT/SIGTERM); what ``ddm serve router`` runs."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    settings = RouterSettings(max_batch=max_batch, max_steps=max_steps,
                              max_concurrent=max_concurrent, deadline_s=deadline_s)
    app = create_router_app(load_router_config(config_path), settings)
    build_server(app, host, port, log_level).run()


# ------------------------------------------------------------------------------- requests


def _request_models(config: RouterConfigFile, settings: RouterSettings
                    ) -> tuple[type[BaseModel], type[BaseModel]]:
    """The JSON body of ``/v1/generate`` and the query of the stream, with this router's limits
    and defaults (so that ``/docs`` shows them)."""
    defaults, num_classes = config.sampling, config.num_classes
    if defaults.steps > settings.max_steps:
        raise ValueError(f"the config's default of {defaults.steps} steps exceeds this "
                         f"router's max_steps of {settings.max_steps}")

    class Sampling(BaseModel):
        model_config = ConfigDict(extra="forbid")

        steps: int = Field(defaults.steps, ge=1, le=settings.max_steps,
                           description="denoising steps")
        seed: int = Field(0, ge=0, lt=2**63, description="image i's noise comes from (seed, i)")
        strategy: str = Field(defaults.strategy,
                              description="oracle, top1, top2, topk:K, threshold:P or ensemble")
        solver: Literal["euler", "heun"] = defaults.solver  # type: ignore[assignment]
        delegate_steps: int = Field(0, ge=0, le=settings.max_steps,
                                    description="steps per integrate request to an expert "
                                                "when one expert is selected; 0 or 1: off")

        @field_validator("strategy")
        @classmethod
        def known_strategy(cls, value: str) -> str:
            return parse_strategy(value).name

    def in_classes(labels: list[int]) -> list[int]:
        outside = sorted({y for y in labels if not 0 <= y < num_classes})
        if outside:
            raise ValueError(f"labels {outside} are outside the model's classes "
                             f"0..{num_classes - 1}")
        return labels

    class GenerateRequest(Sampling):
        labels: list[int] = Field(min_length=1, max_length=settings.max_batch,
                                  description="one image per label")

        @field_validator("labels")
        @classmethod
        def labels_in_classes(cls, value: list[int]) -> list[int]:
            return in_classes(value)

    class StreamQuery(Sampling):
        label: int

        @field_validator("label")
        @classmethod
        def label_in_classes(cls, value: int) -> int:
            return in_classes([value])[0]

    return GenerateRequest, StreamQuery


def _sampling_request(body: Any, labels: tuple[int, ...]) -> SamplingRequest:
    return SamplingRequest(labels=labels, steps=body.steps, seed=body.seed,
                           strategy=parse_strategy(body.strategy), solver=body.solver,
                           delegate_steps=body.delegate_steps)


def _checked(router: _Router, request: SamplingRequest) -> RemoteMixture:
    mixture = router.mixture()
    try:
        check_request(mixture, request)
    except ValueError as error:
        raise HTTPException(422, str(error)) from None
    return mixture


def _echo(request: SamplingRequest) -> dict[str, Any]:
    return {"steps": request.steps, "strategy": request.strategy.name, "solver": request.solver,
            "delegate_steps": request.delegate_steps}


# ---------------------------------------------------------------------------------- stream


async def _events(router: _Router, mixture: RemoteMixture, request: SamplingRequest
                  ) -> AsyncIterator[bytes]:
    """The SSE body: ``step`` events, then ``done``, or ``failure`` if an expert fails.
    Frees the generation's slot when it ends, however it ends."""
    try:
        yield b": generating\n\n"
        started = time.perf_counter()
        tally = Tally(mixture.expert_names, request.labels)
        async for event in denoise(mixture, router.pool, request):
            tally.add(event)
            yield _sse("step", _step_data(event, mixture, request))
        result = tally.result()
        yield _sse("done", {"image": _png(result.images[0]), "label": int(result.labels[0]),
                            "experts": result.experts_used()[0],
                            "expert_calls": int(result.expert_calls[0]),
                            "round_trips": int(result.round_trips[0]), **_echo(request),
                            "seconds": round(time.perf_counter() - started, 6)})
    except ExpertError as error:
        yield _sse("failure", {"status": error.status, "detail": str(error),
                               "expert": error.expert})
    finally:
        router.release_slot()


def _step_data(event: StepEvent, mixture: RemoteMixture, request: SamplingRequest
               ) -> dict[str, Any]:
    used = event.experts_used()[0]
    return {"step": event.step, "steps": request.steps, "t": round(event.t, 6),
            "image": _png(to_uint8(event.x[0, 0])),
            "experts": [name for name, on in zip(mixture.expert_names, used) if on],
            "delegated": bool(event.delegated[0]), "round_trips": int(event.round_trips[0])}


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for chunk in rest:
        yield chunk


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _png(image: Any) -> str:
    return base64.b64encode(png_bytes(image)).decode("ascii")


# ---------------------------------------------------------------------------------- errors


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _readable(error.errors())}, 422)

    @app.exception_handler(ExpertError)
    async def expert_failed(_: Request, error: ExpertError) -> JSONResponse:
        return JSONResponse({"detail": str(error), "expert": error.expert}, error.status)

    @app.exception_handler(_Busy)
    async def busy(_: Request, error: _Busy) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, 429, headers={"Retry-After": "1"})

    @app.exception_handler(_NotReady)
    async def not_ready(_: Request, error: _NotReady) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, 503, headers={"Retry-After": "1"})


def _readable(errors: Any) -> str:
    """Pydantic's errors as one line per problem: ``field: what is wrong``."""
    lines = []
    for error in errors:
        where = ".".join(str(p) for p in error["loc"] if p not in ("body", "query")) or "body"
        if error["type"] == "extra_forbidden":
            lines.append(f"unknown field {where!r} (see /docs for the fields)")
        else:
            lines.append(f"{where}: {str(error['msg']).removeprefix('Value error, ')}")
    return "; ".join(lines)


class _Metered:
    """Counts every HTTP answer by route and status, timed to its last byte (streams too)."""

    def __init__(self, app: ASGIApp, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in _ROUTES else "other"
        status, started = 500, time.perf_counter()

        async def capture(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.seconds.labels(route).observe(time.perf_counter() - started)


def _load_network(path: str, config: RouterConfigFile) -> tuple[RouterFn, tuple[int, int, int]]:
    """The router network's probabilities, checked against ``config``, and its image shape."""
    from ddm.checkpoint import load_checkpoint
    from ddm.models.config import RouterConfig
    from ddm.sampling.pipeline import router_probabilities

    ckpt = load_checkpoint(path)
    if ckpt.meta.kind != "router":
        raise CheckpointError(f"{path} is a {ckpt.meta.kind} checkpoint, not a router")
    arch = RouterConfig.from_dict(ckpt.meta.architecture)
    if arch.num_experts != len(config.experts):
        raise CheckpointError(f"router {path} was trained for {arch.num_experts} experts, but "
                              f"the config lists {len(config.experts)}")
    if arch.num_classes != config.num_classes:
        raise CheckpointError(f"router {path} knows {arch.num_classes} classes, the config says "
                              f"{config.num_classes}")
    return router_probabilities(ckpt), (arch.in_channels, arch.image_size, arch.image_size)
