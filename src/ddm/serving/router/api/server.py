"""The router server: generates images by routing every denoising step to remote experts.

Routes: ``POST /v1/generate`` (JSON in, labels or prompts; base64 PNGs out),
``POST /v1/images/generations`` (OpenAI's image API, for text DDMs, with this router's
extensions), ``GET /v1/generate/stream`` (Server-Sent Events, one ``step`` event per chunk of
the grid, then ``done``), ``GET /`` (a web page that streams the denoising live),
``GET /v1/info``, ``GET /v1/models`` (OpenAI's list: the one DDM; its image edits and
variations are refused with 400 saying why), ``/healthz``, ``/readyz``,
``/metrics`` and the OpenAPI document at
``/openapi.json`` (browsable at ``/docs`` with ``api_docs``), which says what the router
enforces: :mod:`ddm.serving.router.api.requests` builds the request schemas from the config.

A text DDM's stages (text encoder, decoder, router network) run in the router process or on
their own servers (:mod:`ddm.serving.router.fleet.remote`); its images are RGB. A prompt longer
than the tokenizer takes is cut as CLIP cuts it, and the answer says how many tokens each
prompt lost (``truncated``).

The router network is small and runs here; experts are reached through one
:class:`~ddm.serving.router.fleet.pool.ExpertPool` (:mod:`ddm.serving.router.api.state` holds
both). The lifespan starts the pool and loads the router network in the background, so that probes
are answered at once: ``/readyz`` is 200 once the network is loaded and the experts agree with the
config, ``"degraded"`` (still 200, naming them) while some experts have no ready replica, and 503
naming what is wrong otherwise (no expert ready at all included). Run as a process
(:func:`serve_router`), a router whose config, token file or network cannot load, or whose port is
taken, exits with status 1 and leaves the reason in the termination-message file
(:mod:`ddm.termination`).

Errors, each answered as ``{"detail": "what is wrong", "param": field}`` (:class:`ErrorDetail`;
on ``/v1/images/*`` and ``/v1/models`` in OpenAI's shape, ``{"error": {"message", "type",
"param", "code"}}``, which OpenAI's SDKs show: :mod:`ddm.serving.router.api.openai_compat`): a
body over
``limits.max_body_bytes`` (by default the DDM's largest valid request: its labels, or its
prompts and latents at the state's shape, ``requests.max_body_bytes``) gets 413 naming it; a
request the DDM cannot serve (too many labels or steps, labels outside the classes, unknown
fields or strategies) a 422 naming the problem; malformed JSON a 400 with its line and column
(or saying it is not UTF-8); a body not sent as JSON (``Content-Type``) a 415 saying how to
send it; more generations than ``limits.max_concurrent`` at once, or than
``limits.max_concurrent_per_client`` from one client (:mod:`ddm.serving.router.api.clients`), a 429
with ``Retry-After`` naming the limit; a generation costing more rows x steps than the
client's budget holds now (``limits.client_row_steps``, refilled at
``limits.client_row_steps_per_s``) a 429 whose ``Retry-After`` says when it will, and one
costing more than the whole budget a 422; with ``auth`` configured, a ``/v1/*`` request
without the bearer token a 401 (:mod:`ddm.serving.http.auth`). An expert none of whose replicas
answers within the call deadline, or whose every replica sent a report the router refuses
(:mod:`ddm.serving.router.fleet.pool`), gives a 503 naming it; an expert refusing the request's
values (its 422: a state beyond ``MAX_STATE_MAGNITUDE``, an output that would not be finite) a
422, and refusing anything else the router sent a 502. None of them touches the process's
health: ``/healthz`` fails only when the router network cannot load; nor does any request's
outcome make a replica look down (only probes and transport failures do), so ``/readyz`` says
what the router can serve, not how the last request fared. ``/readyz`` and the bodies of 502
and 503 are the router's own words naming the expert by its ``router.yaml`` name; what the
expert said goes to the log. A client that disconnects before its JSON answer stops its
generation (counted as status 499), as a streamed one's does.

Streamed frames of a pixel DDM show the state ``x_t`` itself (``ddm.convention.to_uint8``),
noise fading into the digit. A latent DDM's frames show its decoder's image of the clean latent
each step predicts (:mod:`ddm.serving.router.api.previews`).

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
from dataclasses import dataclass, field
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import (Annotated, Any, AsyncGenerator, AsyncIterator, Awaitable, Callable,
                    Mapping, Sequence, TypeVar)

import numpy as np
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (HTMLResponse, JSONResponse, PlainTextResponse, Response,
                               StreamingResponse)
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ddm.conditioning import TEXT, EncodedPrompts
from ddm.convention import to_uint8
from ddm.deploy.limits import MAX_GUIDANCE_SCALE, ROUTER_PORT
from ddm.imaging import png_bytes
from ddm.serving.http.auth import BearerAuth
from ddm.sampling.loop import row_steps
from ddm.serving.router.api.clients import FORWARDED_FOR, OverBudget
from ddm.serving.router.api.info import expert_card, has_router_network, strategies
from ddm.serving.router.fleet.servers import ExpertError
from ddm.serving.http.server import (RETRY_AFTER_HEADER, RETRY_AFTER_S, BodyLimit, ServerControl,
                                     add_api_docs, page_headers, probe_responses, run_server)
from ddm.serving.router.api.previews import StatePoint, latent_preview
from ddm.serving.router.fleet.remote import (CheckedRequest, Decoded, RemoteMixture,
                                             SamplingRequest, StepEvent, Tally, check_request,
                                             denoise, generate_remote)
from ddm.sampling.loop import RequestRefused, encoded_texts
from ddm.deploy.router_config import Auth, RouterConfigFile
from ddm.serving.router.api.openai_compat import (NO_IMAGE_EDITS, OpenAIError, OpenAIErrors,
                                                  models_list)
from ddm.serving.router.api.requests import (STREAM_EVENT_SCHEMA, ErrorDetail, GenerateResponse,
                                             ImagesResponse, echo, field_name, invalid_request,
                                             max_body_bytes, parse_latents, request_models,
                                             sampling_request)
from ddm.serving.router.api.state import (Busy, NotReady, RouterMetrics, RouterState,
                                          load_router_config)
from ddm.termination import fail_start

logger = logging.getLogger(__name__)
T = TypeVar("T")

PAGE = Path(__file__).parent / "static" / "index.html"
_ROUTES = ("/", "/v1/generate", "/v1/generate/stream", "/v1/images/generations", "/v1/info",
           "/v1/demand", "/v1/models", "/healthz", "/readyz", "/metrics")
#: Why the router answers each error status (the body is always :class:`ErrorDetail`).
_ERRORS = {400: "the body is not JSON (detail: the line and column) or not UTF-8",
           401: "no valid bearer token (auth is on)",
           413: "the body is over limits.max_body_bytes (/v1/info; by default the DDM's "
                "largest valid request)",
           415: "the body is not sent as JSON (Content-Type: application/json)",
           422: "a request the router cannot serve, or whose values an expert refused; detail "
                "names the problem",
           429: "limits.max_concurrent generations are running, or this client's "
                "limits.max_concurrent_per_client, or its budget of rows x steps "
                "(limits.client_row_steps) holds too little now; detail names which; retry "
                "after Retry-After",
           502: "an expert refused or garbled what the router sent",
           503: "the router is not ready, or no replica of an expert answered"}


def create_router_app(config: RouterConfigFile, deadline_s: float | None = None, *,
                      on_failure: Callable[[str], None] | None = None,
                      draining: Callable[[], bool] | None = None,
                      api_docs: bool = False) -> FastAPI:
    """An ASGI app routing generations over the experts ``config`` lists, within
    ``config.limits``, behind a bearer token when ``config.auth`` is set. ``deadline_s`` bounds
    one expert call, retries and waiting for a replica included (default: every attempt may
    use its whole timeout). ``on_failure(reason)`` is called if the router network cannot
    load (besides ``/healthz`` answering 500). While ``draining()`` is true (the server got
    SIGTERM), ``/readyz`` answers 503. ``api_docs`` serves Swagger UI at ``/docs``
    (:func:`~ddm.serving.http.server.add_api_docs`); the web page at ``/`` is sent with a
    Content-Security-Policy and frame protection (:func:`~ddm.serving.http.server.page_headers`)."""
    router = RouterState(config, deadline_s, on_failure)
    page_html = PAGE.read_text()
    page_security = page_headers(page_html)
    generate_body, stream_query, images_body = request_models(config)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with router.pool:
            loading = asyncio.create_task(router.load())
            try:
                yield
            finally:
                loading.cancel()
                await router.close()

    app = FastAPI(title="ddm router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Decentralized diffusion: route each step to remote experts.")
    if api_docs:
        add_api_docs(app)
    app.state.router = router  # what the routes share, for tests and debugging
    auth = router.tokens is not None
    if auth:
        _document_bearer_auth(app)
    app.add_middleware(BodyLimit, limit=lambda: max_body_bytes(
        config.limits, config.conditioning, router.image_shape()[0]))
    if router.tokens is not None:
        app.add_middleware(BearerAuth, tokens=router.tokens)
    app.add_middleware(OpenAIErrors)  # outside the body limit and the token check
    app.add_middleware(_Metered, metrics=router.metrics)  # outermost: counts 401s and 413s
    _add_error_handlers(app, "/docs" if api_docs else "/openapi.json")

    @app.post("/v1/generate", response_model=GenerateResponse,
              responses=_errors(400, 413, 415, 422, 429, 502, 503, auth=auth))
    async def generate(body: generate_body,  # type: ignore[valid-type]
                       http: Request) -> dict[str, Any]:
        request = sampling_request(body, tuple(body.labels), tuple(body.prompts))
        mixture, checked = _checked(router, request)
        started = time.perf_counter()
        guard = router.guard(request)
        encoded = _Encoding(request)
        with router.slot(_client(router, http), row_steps(request)):
            result = await _while_connected(http, generate_remote(
                mixture, router.pool, checked, guard, encoded.add))
        return {"images": [_png(image) for image in result.images],
                "labels": result.labels.tolist(), "prompts": list(request.prompts),
                "truncated": encoded.truncated, "warnings": encoded.warnings,
                "experts": result.experts_used(),
                "expert_names": list(mixture.expert_names),
                "routing": result.usage.step_masks(request.steps).tolist(),
                "expert_calls": result.expert_calls.tolist(),
                "round_trips": result.round_trips.tolist(),
                "rerouted": [list(steps) for steps in result.rerouted],
                "waited_s": round(guard.held.total_s, 6), **echo(request),
                "seconds": round(time.perf_counter() - started, 6)}

    @app.get("/v1/generate/stream", response_class=StreamingResponse, responses={
        200: {"description": "Server-Sent Events: step, ..., then done or failure",
              "content": {"text/event-stream": {"schema": STREAM_EVENT_SCHEMA}}},
        **_errors(422, 429, 503, auth=auth)})
    async def stream(
            query: Annotated[stream_query, Query()],  # type: ignore[valid-type]
            http: Request) -> StreamingResponse:
        request = sampling_request(query, () if query.label is None else (query.label,),
                                   () if query.prompt is None else (query.prompt,))
        mixture, checked = _checked(router, request, {"labels": "label", "prompts": "prompt"})
        client = _client(router, http)
        router.take_slot(client, row_steps(request))
        events = _events(router, mixture, checked, client)
        first = await anext(events)  # started, so that closing it always frees the slot
        body = _prepend(first, events)
        # Closed when the response ends, however it ends, not left to where the stream's
        # cancellation lands: were it to land in a ``send`` that waits for a client who has
        # gone, the generator would stay suspended at a ``yield`` until garbage collected.
        # (uvicorn releases that ``send`` when the connection is lost, so there the
        # cancellation reaches the generator at its next expert call, this close or not.)
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"},
                                 background=BackgroundTask(body.aclose))

    # Documented for a text DDM only: a label DDM refuses every prompt (a 422 saying so).
    @app.post("/v1/images/generations", response_model=ImagesResponse,
              include_in_schema=config.conditioning == TEXT,
              responses=_errors(400, 413, 415, 422, 429, 502, 503, auth=auth,
                                model=OpenAIError))
    async def images(body: images_body,  # type: ignore[valid-type]
                     http: Request) -> dict[str, Any]:
        """OpenAI's image generation for a text DDM: ``n`` images of ``prompt``."""
        try:
            latents = None if body.latents is None else parse_latents(body.latents)
        except ValueError as error:
            raise _FieldRefused("latents", str(error)) from None
        request = sampling_request(body, prompts=(body.prompt,) * body.n, latents=latents)
        mixture, checked = _checked(router, request, {"prompts": "prompt"})
        if body.size is not None:
            own = _image_size(mixture, await router.decoded_size(mixture.image_shape))
            if own is not None and body.size != own:
                raise _FieldRefused("size", f"size {body.size} is not this DDM's; it makes "
                                            f"{own} images only")
        encoded = _Encoding(request)
        with router.slot(_client(router, http), row_steps(request)):
            result = await _while_connected(http, generate_remote(
                mixture, router.pool, checked, router.guard(request), encoded.add))
        return {"created": int(time.time()),
                "data": [{"b64_json": _png(image)} for image in result.images],
                "truncated": encoded.truncated, "warnings": encoded.warnings,
                "expert_names": list(mixture.expert_names),
                "routing": result.usage.step_masks(request.steps).tolist(),
                "seed": request.seed, "steps": request.steps,
                "strategy": request.strategy.name, "guidance_scale": request.guidance_scale}

    # Not served: said plainly (OpenAI's SDKs show it) rather than a bare 404.
    @app.post("/v1/images/edits", include_in_schema=False)
    @app.post("/v1/images/variations", include_in_schema=False)
    async def edits() -> JSONResponse:
        return JSONResponse({"detail": NO_IMAGE_EDITS, "param": "image"}, 400)

    @app.get("/v1/models", responses=_errors(auth=auth, model=OpenAIError))
    async def models() -> dict[str, Any]:
        """OpenAI's model list: the one DDM this router serves (``model`` is ``ddm``)."""
        return models_list(config.conditioning, list(router.names), started)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(page_html, headers=page_security)

    @app.get("/v1/info", responses=_errors(auth=auth))
    async def info() -> dict[str, Any]:
        shape, _ = router.image_shape()
        return {
            "experts": [expert_card(e, router.pool.info(e.name),
                                    {r.endpoint: r.state.value
                                     for r in router.pool.replicas(e.name)},
                                    router.pool.ready_count(e.name))
                        for e in config.experts],
            # what a request conditions on, so the page builds its inputs (a label or a
            # prompt per image)
            "conditioning": config.conditioning,
            "max_guidance_scale": MAX_GUIDANCE_SCALE,
            "num_classes": config.num_classes, "image_shape": list(shape) if shape else None,
            "router_network": has_router_network(config),
            "example_prompt": router.example_prompt(),
            "defaults": dataclasses.asdict(config.sampling),
            "limits": {**dataclasses.asdict(config.limits), "max_body_bytes": max_body_bytes(
                config.limits, config.conditioning, shape)},
            "auth": config.auth is not None,
            "strategies": strategies(config)}

    @app.get("/v1/demand", responses=_errors(auth=auth))
    async def demand() -> dict[str, Any]:
        """Per expert, over the last ``window_s`` seconds: rows per second the routing sent
        it, their weight, rows rerouted away while it was missing, seconds waited for it per
        second; and now: generations waiting for it, seconds since its last demand."""
        return {**router.demand.as_json(), "missing_expert": router.config.missing_expert.policy}

    @app.get("/healthz", responses=probe_responses(
        500, "the router network or a stage in the router cannot load"))
    async def healthz() -> JSONResponse:
        if router.failure is not None:
            return JSONResponse({"status": "failed", "error": router.failure}, 500)
        return JSONResponse({"status": "alive"})

    @app.get("/readyz", responses=probe_responses(503, "loading, or an expert without a ready "
                                                       "replica"))
    async def readyz() -> JSONResponse:
        if draining is not None and draining():
            return JSONResponse({"status": "draining"}, 503)
        missing, problems = router.problems()
        if problems:
            return JSONResponse({"status": "not ready", "missing_experts": missing,
                                 "problems": problems}, 503)
        if missing:
            return JSONResponse({"status": "degraded", "missing_experts": missing})
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format"}})
    async def metrics() -> Response:
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def serve_router(config_path: str | os.PathLike[str], host: str = "127.0.0.1",
                 port: int = ROUTER_PORT,
                 log_level: str = "info", *, max_batch: int | None = None,
                 max_steps: int | None = None, max_concurrent: int | None = None,
                 max_body_bytes: int | None = None, deadline_s: float | None = None,
                 auth_token_file: str | os.PathLike[str] | None = None,
                 drain_s: float = 0.0, api_docs: bool = False,
                 metrics_port: int | None = None,
                 max_concurrent_per_client: int | None = None,
                 trusted_proxies: Sequence[str] | None = None,
                 context_cache_bytes: int | None = None) -> None:
    """Serve the router until interrupted (SIGINT/SIGTERM, after ``drain_s`` seconds of
    draining on SIGTERM: :mod:`ddm.serving.http.server`; ``/metrics`` on ``metrics_port`` only, if
    given); what ``ddm serve router`` runs.

    Limits, the token file and the trusted proxies given here override ``router.yaml``'s.
    Exits with status 1,
    the reason in the termination-message file, when the config, the token file or the
    router network cannot be loaded, or a port cannot be bound."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    overrides = {name: value for name, value in (
        ("max_batch", max_batch), ("max_steps", max_steps), ("max_concurrent", max_concurrent),
        ("max_body_bytes", max_body_bytes),
        ("max_concurrent_per_client", max_concurrent_per_client),
        ("context_cache_bytes", context_cache_bytes)) if value is not None}

    def make_app(control: ServerControl) -> ASGIApp:
        try:
            config = load_router_config(config_path)
            config = dataclasses.replace(
                config, limits=dataclasses.replace(config.limits, **overrides),
                auth=(config.auth if not auth_token_file else
                      dataclasses.replace(config.auth, token_file=str(auth_token_file))
                      if config.auth else Auth(str(auth_token_file))),
                trusted_proxies=(config.trusted_proxies if trusted_proxies is None
                                 else tuple(trusted_proxies)))
            return create_router_app(config, deadline_s, on_failure=control.stop,
                                     draining=lambda: control.draining, api_docs=api_docs)
        except Exception as error:  # noqa: BLE001 - every start-up failure is reported alike
            raise fail_start(f"router: {error}") from error

    run_server(make_app, host, port, log_level, drain_s, metrics_port)


def _client(router: RouterState, http: Request) -> str:
    """The client ``http`` counts against: its peer, or whom a trusted proxy forwarded."""
    return router.client(http.client.host if http.client else None,
                         [value for name, value in http.scope["headers"]
                          if name == FORWARDED_FOR])


class _FieldRefused(ValueError):
    """A request the router cannot serve because of one field: a 422 naming it (``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _ClientGone(Exception):
    """The client disconnected before its answer, and its generation was stopped."""


#: The status counted (``/metrics``) for a generation whose client left before its answer, as
#: nginx's "client closed request": nobody receives it.
CLIENT_CLOSED = 499


async def _while_connected(http: Request, generation: Awaitable[T]) -> T:
    """``generation``'s result, or :class:`_ClientGone` once the client disconnects: the
    server does not cancel a JSON route whose client went, and a generation nobody will read
    would hold its slot and call experts to its last step."""
    work = asyncio.ensure_future(generation)
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            task.cancel()  # nothing if it ended
        await asyncio.wait((work, gone))  # stopped before its slot is freed
    if not work.cancelled():
        return work.result()
    raise _ClientGone()


async def _disconnected(http: Request) -> None:
    """Return when the client disconnects (the body was read: nothing else comes)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


@dataclass
class _Encoding:
    """What the text encoder cut of each prompt of one generation (empty: no prompts), and
    what it ignored, in words (:meth:`EncodedPrompts.warnings`)."""

    request: SamplingRequest
    truncated: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def add(self, encoded: EncodedPrompts) -> None:
        self.truncated = encoded.tokens_cut.tolist()
        self.warnings = encoded.warnings(encoded_texts(self.request))


def _image_size(mixture: RemoteMixture, decoded: tuple[int, int] | None) -> str | None:
    """The DDM's images' ``WxH``: the state's, or its decoder's (``decoded``: (H, W), None
    when unknown)."""
    if mixture.decoder is None:
        return f"{mixture.image_shape[2]}x{mixture.image_shape[1]}"
    if decoded is None:
        return None
    return f"{decoded[1]}x{decoded[0]}"


def _checked(router: RouterState, request: SamplingRequest, fields: Mapping[str, str] = {}
             ) -> tuple[RemoteMixture, CheckedRequest]:
    """The mixture to generate with, and ``request`` checked against it (a 422 if refused,
    naming the field at fault: as the route calls it, ``fields``, where its name is not the
    request's)."""
    mixture = router.mixture()
    if mixture.conditioning == TEXT and mixture.decoder is None:
        raise HTTPException(422, "this DDM has no decoder: it makes latents, not images")
    try:
        return mixture, check_request(mixture, request)
    except RequestRefused as error:
        raise _FieldRefused(fields.get(error.param, error.param), str(error)) from None
    except ValueError as error:
        raise HTTPException(422, str(error)) from None


# ---------------------------------------------------------------------------------- stream


async def _events(router: RouterState, mixture: RemoteMixture, checked: CheckedRequest,
                  client: str) -> AsyncGenerator[bytes, None]:
    """The SSE body: ``encoded`` (a prompt), ``step`` events, then ``done``, or ``failure``
    if an expert fails. Frees ``client``'s generation slot when it ends, however it ends."""
    request = checked.request
    try:
        yield b": generating\n\n"
        started = time.perf_counter()
        tally = Tally(mixture.expert_names, request.labels,
                      state_is_image=mixture.decoder is None)
        guard = router.guard(request, streamed=True)
        before: StatePoint | None = None
        async for event in denoise(mixture, router.pool, checked, guard):
            if not isinstance(event, (StepEvent, Decoded)):  # the encoder's answer
                yield _sse("encoded", {"truncated": event.tokens_cut.tolist(),
                                       "warnings": event.warnings(encoded_texts(request))})
                continue
            tally.add(event)
            if isinstance(event, StepEvent):
                now = StatePoint(event.t, event.x[:1])
                yield _sse("step", _step_data(event, mixture, request,
                                              await _frame(mixture, before, now)))
                before = now
        result = tally.result()
        subject = ({"prompt": request.prompts[0]} if request.prompts
                   else {"label": int(result.labels[0])})
        yield _sse("done", {"image": _png(result.images[0]), **subject,
                            "experts": result.experts_used()[0],
                            "expert_names": list(mixture.expert_names),
                            "routing": result.usage.step_masks(request.steps)[0].tolist(),
                            "expert_calls": int(result.expert_calls[0]),
                            "round_trips": int(result.round_trips[0]),
                            "rerouted": list(result.rerouted[0]),
                            "waited_s": round(guard.held.total_s, 6), **echo(request),
                            "seconds": round(time.perf_counter() - started, 6)})
    except ExpertError as error:
        logger.warning("generation failed: %s", error)
        yield _sse("failure", {"status": error.status, "detail": error.public,
                               "expert": error.expert})
    finally:
        router.release_slot(client)


def _step_data(event: StepEvent, mixture: RemoteMixture, request: SamplingRequest,
               frame: np.ndarray) -> dict[str, Any]:
    used = event.experts_used()[0]
    return {"step": event.step, "steps": request.steps, "t": round(event.t, 6),
            "image": _png(frame),
            "experts": [name for name, on in zip(mixture.expert_names, used) if on],
            "delegated": bool(event.delegated[0]), "round_trips": int(event.round_trips[0]),
            "rerouted": bool(event.rerouted[0]),
            "probs": [round(float(p), 4) for p in event.probs[0]]}


async def _frame(mixture: RemoteMixture, before: StatePoint | None, now: StatePoint
                 ) -> np.ndarray:
    """A step's picture (H, W) or (H, W, 3) uint8: a pixel state as it is, a latent one as the
    decoder's image of what the step predicts (``before``: the previous step's state)."""
    if mixture.decoder is None:
        return to_uint8(now.x[0, 0])
    return await latent_preview(mixture.decoder, before, now)


async def _prepend(first: bytes, rest: AsyncGenerator[bytes, None]
                   ) -> AsyncGenerator[bytes, None]:
    async with aclosing(rest):
        yield first
        async for chunk in rest:
            yield chunk


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _png(image: Any) -> str:
    return base64.b64encode(png_bytes(image)).decode("ascii")


# ---------------------------------------------------------------------------------- errors


def _errors(*statuses: int, auth: bool, model: type[BaseModel] = ErrorDetail
            ) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error statuses (and 401 when ``auth``), each a
    ``model`` (:class:`ErrorDetail`; OpenAI's paths: :class:`OpenAIError`); 422 replaces
    FastAPI's default ``HTTPValidationError``."""
    documented: dict[int | str, dict[str, Any]] = {}
    for status in sorted({*statuses, *((401,) if auth else ())}):
        documented[status] = {"model": model, "description": _ERRORS[status]}
        if status in (429, 503):
            documented[status]["headers"] = RETRY_AFTER_HEADER
        if status == 401:
            documented[status]["headers"] = {"WWW-Authenticate": {
                "description": "the bearer challenge", "schema": {"type": "string"}}}
    return documented


def _document_bearer_auth(app: FastAPI) -> None:
    """Declare the bearer scheme :class:`BearerAuth` enforces on every ``/v1/*`` operation
    (middleware, so FastAPI cannot see it)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        document = generate()  # cached by FastAPI: this runs once on the same dict
        document.setdefault("components", {})["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"}}
        for path, operations in document["paths"].items():
            if path.startswith("/v1/"):
                for operation in operations.values():
                    operation["security"] = [{"bearer": []}]
        return document

    app.openapi = openapi  # type: ignore[method-assign]


_RETRY = {"Retry-After": str(RETRY_AFTER_S)}


def _add_error_handlers(app: FastAPI, fields_at: str) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        status, detail = invalid_request(error.errors(), error.body,
                                         request.headers.get("content-type"), fields_at)
        param = field_name(error.errors()[0]) if status == 422 and error.errors() else None
        return JSONResponse({"detail": detail, "param": param}, status)

    @app.exception_handler(_FieldRefused)
    async def field_refused(_: Request, error: _FieldRefused) -> JSONResponse:
        return JSONResponse({"detail": str(error), "param": error.param}, 422)

    @app.exception_handler(ExpertError)
    async def expert_failed(_: Request, error: ExpertError) -> JSONResponse:
        logger.warning("generation failed: %s", error)  # what the expert said: the log only
        return JSONResponse({"detail": error.public, "expert": error.expert}, error.status)

    @app.exception_handler(_ClientGone)
    async def client_gone(_: Request, __: _ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Busy)
    async def busy(_: Request, error: Busy) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, 429, headers=_RETRY if error.retry_after_s
                            is None else {"Retry-After": str(error.retry_after_s)})

    @app.exception_handler(OverBudget)
    async def over_budget(_: Request, error: OverBudget) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, 422)

    @app.exception_handler(NotReady)
    async def not_ready(_: Request, error: NotReady) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, 503, headers=_RETRY)


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
