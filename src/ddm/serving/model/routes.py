"""The routes every model server shares, whatever it serves (a label expert, a stage
checkpoint of any role): ``POST /v1/velocity`` (the binary protocol of ``docs/protocol.md``,
every message kind on one route), ``GET /v1/info``, ``/healthz``, ``/readyz`` and ``/metrics``,
and the OpenAPI document that lists the binary route beside the JSON ones.

A server supplies a :class:`ModelState` (what it reports, whether it is ready, its metrics)
and, for each binary route, a :class:`Binary` (the model's limits and admission count, and an
``answer(body) -> (status, reply)`` coroutine): one at ``/v1/velocity`` for a server of one
model, one per member for a pool (:mod:`ddm.serving.wire.paths`). :func:`model_routes` wraps its
FastAPI app in the bare ASGI route, so that the hot path skips FastAPI's routing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Protocol

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ddm.serving.http.auth import BearerAuth, TokenFile
from ddm.serving.model import metrics as expert_metrics
from ddm.serving.http.server import (RETRY_AFTER_HEADER, BodyTooLarge, ClientDisconnected,
                                     add_api_docs, probe_responses, read_body, retry_after,
                                     send_bytes, send_json)
from ddm.serving.batching import BatcherClosed
from ddm.serving.wire.protocol import CONTENT_TYPE, Limits, ProtocolError, encode_error

logger = logging.getLogger(__name__)

#: ``body -> (HTTP status, reply body)``: every failure is an error reply, never an exception.
Answer = Callable[[bytes], Awaitable[tuple[int, bytes]]]

#: Event loops a model server (an expert's or a stage's) serves on (:mod:`ddm.serving.http.server`):
#: with a second one answering probes and other clients, a lone request's batch runs on the
#: loop it came on whatever the model's time, with no hand-off to the model thread and back
#: (:class:`~ddm.serving.batching.Batcher`). So everything the routes share is thread-safe:
#: the pending count and the metrics take a lock, and so does a stage's context cache.
SERVING_LOOPS = 2
_CONTENT_TYPE = CONTENT_TYPE.encode()


class Rendered(Protocol):
    def render(self) -> bytes: ...


class ModelState(Protocol):
    """What the shared JSON routes read of a model server (of one model, or of a pool)."""

    metrics: Rendered

    @property
    def failure(self) -> str | None: ...

    @property
    def ready(self) -> bool: ...

    def describe(self) -> dict[str, Any]: ...


class Observed(Protocol):
    """Counts a route's requests: :class:`~ddm.serving.model.metrics.ExpertMetrics`, or a
    pool's step route's own."""

    def observe_request(self, kind: str, status: int, images: int) -> None: ...


class Admitted(Protocol):
    """What a binary route reads of the one model it serves: its body cap, its admission
    count and limit, and the metrics that count what it refuses."""

    limits: Limits
    pending: int
    max_pending: int
    metrics: Observed


@dataclass(frozen=True)
class Binary:
    """One binary route's model and how it answers a body."""

    model: Admitted
    answer: Answer


@dataclass
class Handling:
    """What a request turned out to be, filled in as it is decoded: for the error reply's
    request id and the metrics' kind and rows."""

    request_id: int = 0
    kind: str = "invalid"
    rows: int = 0


async def answer_or_error(state: Admitted,
                          handle: Callable[[Handling], Awaitable[bytes]]) -> tuple[int, bytes]:
    """``handle``'s reply (200), or the error reply every failure becomes: a
    ``ProtocolError``'s status, 503 once the batcher closed, 500 for the model's own failure
    (a failing model must not take the server down); counted in the metrics."""
    handling = Handling()
    try:
        status, reply = 200, await handle(handling)
    except Exception as error:  # noqa: BLE001 - see the docstring
        status, message = refusal(error, handling.request_id)
        echoed = (error.request_id if isinstance(error, ProtocolError)
                  and error.request_id is not None else handling.request_id)
        reply = encode_error(echoed, status, message)
    state.metrics.observe_request(handling.kind, status, handling.rows)
    return status, reply


def refusal(error: Exception, request_id: int) -> tuple[int, str]:
    """The status and message a request's failure is answered with: a ``ProtocolError``'s
    own, 503 once the batcher closed, 500 for anything else (the model's own failure, logged
    with ``request_id``)."""
    if isinstance(error, ProtocolError):
        return error.status, str(error)
    if isinstance(error, BatcherClosed):
        return 503, str(error)
    logger.error("request %d failed", request_id, exc_info=error)
    return 500, f"internal error: {type(error).__name__}: {error}"


def lifespan_app(title: str, description: str, load: Callable[[], Awaitable[None]],
                 close: Callable[[], Awaitable[None]]) -> FastAPI:
    """A model server's FastAPI app, without routes yet: ``load()`` starts in its lifespan
    (the probes answer meanwhile) and ``close()`` (the batchers') runs at its end."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(load())
        try:
            yield
        finally:
            loading.cancel()
            await close()

    return FastAPI(title=title, lifespan=lifespan, docs_url=None, redoc_url=None,
                   description=description)


def readiness(ready: bool, failure: str | None,
              draining: Callable[[], bool] | None) -> JSONResponse:
    """A ``/readyz`` answer: 200 once loaded; 503 while draining, loading or failed."""
    if draining is not None and draining():
        return JSONResponse({"status": "draining"}, 503)
    if ready:
        return JSONResponse({"status": "ready"})
    if failure is not None:
        return JSONResponse({"status": "failed", "error": failure}, 503)
    return JSONResponse({"status": "loading"}, 503)


def model_routes(app: FastAPI, state: ModelState, binary: Mapping[str, Binary], *,
                 api_docs: bool, draining: Callable[[], bool] | None,
                 auth_token_file: str | os.PathLike[str] | None) -> ASGIApp:
    """Add the JSON routes to ``app`` and put the binary routes (path -> :class:`Binary`) in
    front of it (behind bearer auth on ``/v1/*`` with ``auth_token_file``)."""
    if api_docs:
        add_api_docs(app)
    _document(app, tuple(binary))

    @app.get("/v1/info")
    async def info() -> dict[str, Any]:
        return state.describe()

    @app.get("/healthz", responses=probe_responses(500, "the model failed to load"))
    async def healthz() -> JSONResponse:
        if state.failure is not None:
            return JSONResponse({"status": "failed", "error": state.failure}, 500)
        return JSONResponse({"status": "alive"})

    @app.get("/readyz", responses=probe_responses(
        503, "the model is loading or failed to load, or the server is draining"))
    async def readyz() -> JSONResponse:
        return readiness(state.ready, state.failure, draining)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format"}})
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=expert_metrics.CONTENT_TYPE)

    route = _BinaryRoute(app, binary)
    if auth_token_file is None:
        return route
    return BearerAuth(route, TokenFile(auth_token_file))


_TENSORS = {CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}}
#: Why the expert answers each status of ``POST /v1/velocity`` (``docs/protocol.md``).
_VELOCITY_STATUSES = {
    "200": "a response message: the velocity, or the state at the grid's end (a stage: the "
           "context's id, the prompts' embeddings, the images or the routing probabilities)",
    "400": "an error message: the body cannot be decoded",
    "412": "an error message: a text call names a context this expert does not hold "
           "(evicted, or the server restarted); send the context, then retry",
    "413": "an error message: the body is over max_body_bytes (see /v1/info)",
    "422": "an error message: a decodable request the expert refuses (batch, steps, labels, "
           "values)",
    "429": "an error message: max_pending requests are admitted; retry after Retry-After",
    "500": "an error message: the model failed on this request",
    "503": "an error message: the model is loading, or the server is shutting down"}
_VELOCITY_OPERATION = {
    "summary": "Velocity or integration",
    "operationId": "velocity_v1_velocity_post",
    "description": "A request in the binary protocol of docs/protocol.md "
                   "(application/x-ddm-tensor): a context (text, or version 4's labels), a "
                   "velocity or integrate request naming its rows, an encode, decode or route "
                   "request to a DDM's stages; the kind is in the body "
                   "(a server refuses the kinds it does not serve, 422). Every answer "
                   "is a message of that protocol: a response (200) or an error message whose "
                   "code is the HTTP status and which echoes the request id.",
    "requestBody": {"required": True, "content": _TENSORS,
                    "description": "a request message of a kind this server serves"},
    "responses": {status: {"description": why, "content": _TENSORS}
                  for status, why in _VELOCITY_STATUSES.items()},
}
_VELOCITY_OPERATION["responses"]["429"]["headers"] = RETRY_AFTER_HEADER


def _document(app: FastAPI, paths: tuple[str, ...]) -> None:
    """Merge the binary routes (``POST /v1/velocity``, or each member's), served by
    :class:`_BinaryRoute` outside FastAPI's routes, into the OpenAPI document FastAPI
    generates for the others."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        document = generate()  # cached by FastAPI: this runs once on the same dict
        for path in paths:
            operation = {**_VELOCITY_OPERATION,
                         "operationId": "velocity" + path.replace("/", "_").replace("-", "_")
                         + "_post"}
            document["paths"][path] = {"post": operation}
        return document

    app.openapi = openapi  # type: ignore[method-assign]


class _BinaryRoute:
    """The binary routes (``POST /v1/velocity``, or each pool member's) as bare ASGI in front
    of ``app``, which serves everything else: the hot path skips FastAPI's routing,
    dependency resolution and response classes. Each route admits and caps bodies by its own
    model's limits."""

    def __init__(self, app: ASGIApp, binary: Mapping[str, Binary]) -> None:
        self.app = app
        self.binary = dict(binary)
        #: Guards each model's ``pending``: the server's event loops count on it alike.
        self._admission = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        target = self.binary.get(scope["path"]) if scope["type"] == "http" else None
        if target is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            await send_json(send, 405, {"detail": "use POST"}, [(b"allow", b"POST")])
            return
        expert = target.model
        try:
            body = await read_body(scope, receive, expert.limits.max_body_bytes)
        except ClientDisconnected:
            return  # cut off by a deadline, or gone: nobody to answer
        except BodyTooLarge as error:
            expert.metrics.observe_request("invalid", 413, 0)
            await send_bytes(send, 413, encode_error(0, 413, str(error)), _CONTENT_TYPE)
            return
        # Pending from here: a body still on its way costs the expert nothing but its
        # connection (bounded by ddm.serving.http.connections), so slow senders cannot fill the
        # queue.
        with self._admission:
            pending = expert.pending
            if pending < expert.max_pending:
                expert.pending += 1
        if pending >= expert.max_pending:
            message = (f"{pending} requests are pending, the limit is "
                       f"{expert.max_pending}; retry shortly")
            expert.metrics.observe_request("invalid", 429, 0)
            await send_bytes(send, 429, encode_error(0, 429, message), _CONTENT_TYPE,
                             [retry_after()])
            return
        try:
            status, reply = await target.answer(body)
        finally:
            with self._admission:
                expert.pending -= 1
        await send_bytes(send, status, reply, _CONTENT_TYPE)
