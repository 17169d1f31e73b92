"""HTTP plumbing the expert and the router share: the uvicorn server, bare ASGI answers, body
limits, running a server that exits with a reason when its start-up fails or drains on SIGTERM,
and the OpenAPI descriptions of what both answer alike (probes, ``Retry-After``). What one
connection may cost (deadlines, header and connection caps) is in
:mod:`ddm.serving.http.connections`.

Draining: Kubernetes sends SIGTERM to a pod while Services, kube-proxy and the routers' DNS
caches still send it traffic for a few seconds. With ``drain_s`` > 0, the first SIGTERM makes
``/readyz`` answer 503 ``draining`` and the server keeps serving for ``drain_s`` seconds, then
stops accepting connections and finishes the requests in flight (at most
``GRACEFUL_SHUTDOWN_S``). SIGINT, and a second signal, stop at once. Stopping on SIGTERM is
how a server's life normally ends: it exits 0, as PID 1 of a container or not (uvicorn would
raise the SIGTERM again once stopped, which kills a process that is not PID 1 with -15).
A server still starting (its app's start-up work, e.g. loading and compiling a model, running
in :meth:`ServerControl.start_up`) has never been ready, so no Service sends it traffic: SIGTERM
stops it at once, and the process exits without waiting for that work (minutes for a compile),
so that a pod deleted while it starts is gone long before its grace period ends.

Event loops: a server may serve on more than one (``loops``; a model server does, so that a long
batch can run on the loop its request came on while another answers probes and other clients:
:class:`ddm.serving.batching.Batcher`). The first loop, in the main thread, is uvicorn's server
as usual (signals, the app's lifespan, draining); each other one is a uvicorn server of its own
in a thread of its own, serving the same app on duplicates of the same listening sockets (the
kernel hands each new connection to whichever loop accepts it first), started once the app has
started and stopping when the first does; the app's lifespan ends only after they have stopped.
The connection cap is shared out among the loops.

The data plane pays for every byte and every layer at each denoising step, so its hot routes
are bare ASGI (no FastAPI dependency resolution) and the server sends no ``date`` or
``server`` header and writes no access log. uvloop and asyncio set ``TCP_NODELAY`` on every
accepted connection, so a small reply is not held back by Nagle's algorithm.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from html.parser import HTMLParser
from types import FrameType
from typing import Any, Callable, Iterable, Iterator, TypeVar

import uvicorn
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.config import LOGGING_CONFIG

from ddm.serving.http.connections import ConnectionLimits, protocol_factory
from ddm.serving.http.handoff import HandoffError, handed_socket
from ddm.termination import fail_start

#: Seconds a client told 429 or 503 should wait before trying again.
RETRY_AFTER_S = 1
#: After draining, how long requests in flight may take before they are cancelled: with the
#: operator's drain, within Kubernetes' default 30 s termination grace period.
GRACEFUL_SHUTDOWN_S = 20

logger = logging.getLogger(__name__)

T = TypeVar("T")
Headers = Iterable[tuple[bytes, bytes]]

#: OpenAPI: the ``Retry-After`` header of a 429 or 503.
RETRY_AFTER_HEADER = {"Retry-After": {"description": f"seconds to wait ({RETRY_AFTER_S}; for a "
                                                     "router client's budget, until it holds "
                                                     "enough)",
                                      "schema": {"type": "integer"}}}
_PROBE = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}


class ClientDisconnected(Exception):
    """The client went away (or was cut off by a deadline) before its body was in."""


class BodyTooLarge(Exception):
    """A request body over the limit (declared or streamed)."""

    def __init__(self, size: int | str, limit: int) -> None:
        super().__init__(f"body of {size} bytes exceeds the limit of {limit}")


def build_server(app: ASGIApp, host: str, port: int, log_level: str = "info",
                 drain_s: float = 0.0, control: ServerControl | None = None,
                 limits: ConnectionLimits = ConnectionLimits(), loops: int = 1) -> uvicorn.Server:
    """A uvicorn server for ``app``: uvloop when installed, httptools behind the connection
    ``limits`` of :mod:`ddm.serving.http.connections`, no access log (one line per denoising step
    would cost more than the step; it would also be one more place a credential could leak),
    no ``date`` or ``server`` header; draining for ``drain_s`` seconds on SIGTERM, telling
    ``control``; serving on ``loops`` event loops (more than one only when run on listening
    sockets: ``server.run(sockets=...)``, as :func:`run_server` does)."""
    if loops < 1:
        raise ValueError(f"loops must be >= 1, got {loops}")
    # ceil: the loops' caps add up to at least the server's
    per_loop = dataclasses.replace(limits, max_connections=-(-limits.max_connections // loops))
    control = control or ServerControl()
    others = _OtherLoops([_config(app, host, port, log_level, per_loop, lifespan="off")
                          for _ in range(loops - 1)], control)
    main = _config(others.after_them(app) if loops > 1 else app, host, port, log_level,
                   per_loop, lifespan="on")
    return _DrainingServer(main, control, drain_s, others)


def _config(app: ASGIApp, host: str, port: int, log_level: str, limits: ConnectionLimits,
            lifespan: str) -> uvicorn.Config:
    """One event loop's uvicorn configuration (:func:`build_server`); only the main loop's
    runs the app's lifespan and configures logging."""
    return uvicorn.Config(app, host=host, port=port, loop=_installed_or("uvloop", "asyncio"),
                          http=protocol_factory(limits), ws="none", lifespan=lifespan,
                          log_level=log_level, access_log=False,
                          log_config=LOGGING_CONFIG if lifespan == "on" else None,
                          timeout_keep_alive=limits.keep_alive_s,
                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                          server_header=False, date_header=False,
                          # The peer stays the peer: uvicorn would otherwise take a loopback
                          # peer's X-Forwarded-For as the client, which any local process
                          # can write (the router reads it itself, from trusted proxies
                          # only: ddm.serving.router.api.clients).
                          proxy_headers=False)


@dataclass
class ServerControl:
    """What a running server and its app tell each other: the app runs its background
    start-up through ``start_up`` and calls ``stop(reason)`` when it fails; the server sets
    ``draining`` on SIGTERM (``/readyz`` answers 503 from then on)."""

    draining: bool = False
    failures: list[str] = field(default_factory=list)
    server: uvicorn.Server | None = None
    _start_up: threading.Thread | None = None

    def stop(self, reason: str) -> None:
        self.failures.append(reason)
        if self.server is not None:
            self.server.should_exit = True

    async def start_up(self, work: Callable[[], T]) -> T:
        """``work()`` in a daemon thread (not ``asyncio.to_thread``'s pool, which the event
        loop and the interpreter wait for when they end), awaited."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def settle(outcome: Callable[[], None]) -> None:
            if not done.done():  # cancelled when the server stopped first
                outcome()

        def run() -> None:
            try:
                result = work()
            except BaseException as error:  # noqa: BLE001 - handed to the awaiting task
                report = functools.partial(settle, functools.partial(done.set_exception, error))
            else:
                report = functools.partial(settle, functools.partial(done.set_result, result))
            try:
                loop.call_soon_threadsafe(report)
            except RuntimeError:  # the loop is closed: the server is gone, nobody awaits
                pass

        self._start_up = threading.Thread(target=run, name="start-up", daemon=True)
        self._start_up.start()
        return await done

    @property
    def starting(self) -> bool:
        """Whether the app's start-up work is still running."""
        return self._start_up is not None and self._start_up.is_alive()


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, holding the first SIGTERM for ``drain_s`` seconds of draining, and
    starting the server's other event loops (``others``) once the app has started."""

    def __init__(self, config: uvicorn.Config, control: ServerControl, drain_s: float,
                 others: _OtherLoops) -> None:
        if drain_s < 0:
            raise ValueError(f"drain_s must be >= 0, got {drain_s}")
        super().__init__(config)
        control.server = self
        self._control = control
        self._drain_s = drain_s
        self._drain_until: float | None = None
        self._others = others

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            self._others.start(self, sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if (sig == signal.SIGTERM and self._drain_s > 0 and self._drain_until is None
                and not self._control.starting):
            self._control.draining = True
            self._drain_until = time.monotonic() + self._drain_s
            logger.info("SIGTERM: draining for %g s (not ready, still serving), then stopping",
                        self._drain_s)
            return
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, less raising SIGTERM again after the graceful stop (SIGINT still is:
        ``ddm`` then exits 130, interrupted)."""
        with super().capture_signals():
            yield
            self._captured_signals[:] = [s for s in self._captured_signals
                                         if s != signal.SIGTERM]

    async def on_tick(self, counter: int) -> bool:
        if (self._drain_until is not None and not self.should_exit
                and time.monotonic() >= self._drain_until):
            super().handle_exit(signal.SIGTERM, None)  # uvicorn's own stop on that SIGTERM
        return await super().on_tick(counter)


#: The threads of a server's other event loops are named this and their number.
_OTHER_LOOP_THREAD = "ddm-loop-"


class _OneServersLifeLines(logging.Filter):
    """Drops uvicorn's lines about a server's life (started, shutting down, finished) when an
    other loop's server logs them: to its reader a process is one server, which logs each
    once; a warning or an error from any loop still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.levelno > logging.INFO
                or not (record.threadName or "").startswith(_OTHER_LOOP_THREAD))


_ONE_SERVERS_LIFE_LINES = _OneServersLifeLines()


class _OtherLoops:
    """A server's event loops besides the main one (:func:`build_server`): each a uvicorn
    server (:class:`_FollowingServer`) in a daemon thread of its own, sharing the main
    server's ``control``."""

    def __init__(self, configs: list[uvicorn.Config], control: ServerControl) -> None:
        self._configs = configs
        self._control = control
        self._threads: list[threading.Thread] = []

    def start(self, main: uvicorn.Server, sockets: list[socket.socket] | None) -> None:
        """Serve ``sockets`` (duplicated: each loop closes its own) on every other loop."""
        if self._configs and sockets is None:
            raise ValueError("a server on several event loops runs on listening sockets")
        if self._configs:
            logging.getLogger("uvicorn.error").addFilter(_ONE_SERVERS_LIFE_LINES)  # once
        for number, config in enumerate(self._configs, start=1):
            server = _FollowingServer(config, main)
            thread = threading.Thread(target=self._serve, name=f"{_OTHER_LOOP_THREAD}{number}",
                                      daemon=True,
                                      args=(server, [s.dup() for s in sockets or ()]))
            self._threads.append(thread)
            thread.start()

    def _serve(self, server: uvicorn.Server, sockets: list[socket.socket]) -> None:
        """One loop's life; a loop that fails stops the whole server with the reason (never
        half of it serving on)."""
        try:
            server.run(sockets=sockets)
        except BaseException as error:  # noqa: BLE001 - reported as the server's failure
            logger.exception("event loop %s failed", threading.current_thread().name)
            self._control.stop(f"event loop {threading.current_thread().name} failed: {error!r}")
        finally:
            for sock in sockets:
                sock.close()

    async def stopped(self) -> None:
        """Return once every other loop has stopped (each within its graceful shutdown), or
        after :data:`GRACEFUL_SHUTDOWN_S` more for one that has not: a loop stuck in a model
        call that never returns must not keep the process from ending. Not at all while the
        app still starts: it has run no request, and the process exits without waiting for
        anything (:func:`run_server`; seconds for a throttled pod)."""
        if self._control.starting:
            return
        for thread in self._threads:
            await asyncio.to_thread(thread.join, GRACEFUL_SHUTDOWN_S)
            if thread.is_alive():
                logger.error("event loop %s did not stop within %g s (a request stuck in its "
                             "model?); stopping without it", thread.name, GRACEFUL_SHUTDOWN_S)

    def after_them(self, app: ASGIApp) -> ASGIApp:
        """``app``, whose lifespan shutdown (closing what requests use: an expert's batcher)
        waits until the other loops have stopped serving."""

        async def lifespan_last(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "lifespan":
                await app(scope, receive, send)
                return

            async def receive_after_them() -> Message:
                message = await receive()
                if message["type"] == "lifespan.shutdown":
                    await self.stopped()
                return message

            await app(scope, receive_after_them, send)

        return lifespan_last


class _MainServersFlag:
    """A flag of :class:`_FollowingServer` that is its main server's: read from it, and set
    on it when set (uvicorn's own ``= False`` at construction changes nothing)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, server: _FollowingServer, owner: type | None = None) -> bool:
        return bool(getattr(server._main, self._name))

    def __set__(self, server: _FollowingServer, value: bool) -> None:
        if value:
            setattr(server._main, self._name, True)


class _FollowingServer(uvicorn.Server):
    """One more event loop of a server: it stops when the main one does (its ``should_exit``
    and ``force_exit`` are the main server's) and takes no signals (uvicorn handles them in the
    main thread only); one that stops of itself stops the main one too."""

    should_exit = _MainServersFlag()
    force_exit = _MainServersFlag()

    def __init__(self, config: uvicorn.Config, main: uvicorn.Server) -> None:
        self._main = main
        super().__init__(config)


def run_server(make_app: Callable[[ServerControl], ASGIApp], host: str, port: int,
               log_level: str, drain_s: float = 0.0, metrics_port: int | None = None,
               loops: int = 1) -> None:
    """Serve ``make_app(control)`` until interrupted, draining for ``drain_s`` seconds on
    SIGTERM; when the app's background start-up fails (``control.stop(reason)``), end the
    server and exit with status 1 after writing ``reason`` where Kubernetes shows it
    (:mod:`ddm.termination`), as when a port cannot be bound (:func:`_bound`); when stopped
    while the app's start-up work still runs, exit 0 at once without waiting for it. With
    ``metrics_port``, ``/metrics`` moves there (:class:`MetricsPort`): one server, two
    listening sockets, served on ``loops`` event loops alike."""
    control = ServerControl()
    sockets: list[socket.socket] = []
    try:
        for bound in (port,) if metrics_port is None else (port, metrics_port):
            sockets.append(_bound(host, bound))
        app = make_app(control)
        if metrics_port is not None:
            app = MetricsPort(app, metrics_port)
        build_server(app, host, port, log_level, drain_s, control,
                     loops=loops).run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
    if control.failures:
        raise fail_start(control.failures[0])
    if control.starting:  # stopped before the app was ready: nothing will use that work
        logger.info("stopped while still starting; not waiting for the start-up to finish")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # a daemon thread at interpreter shutdown may take C++ code down with it


def _bound(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, as uvicorn binds one (listening once the server
    starts), before the app starts: the one this process was handed for that port
    (:mod:`~ddm.serving.http.handoff`, ``ddm up``), or a new one; or, when the port cannot be
    had, the start's failure naming it (uvicorn would only log it and exit 3, leaving no
    reason where Kubernetes and ``ddm up`` look)."""
    try:
        handed = handed_socket(host, port)
    except HandoffError as error:
        raise fail_start(str(error)) from None
    if handed is not None:
        # Held alone until now; from here flagged as a socket this function binds, since its
        # connections inherit the flag: without it, those in TIME_WAIT after this process
        # ends keep a restarted server off the port for a minute.
        handed.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return handed
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise fail_start(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


class MetricsPort:
    """ASGI middleware for a server listening on a data port and a metrics port: ``/metrics``
    is answered on the metrics port only, and nothing else is, so that letting Prometheus
    scrape a pod (a NetworkPolicy rule for that port) does not open its API."""

    def __init__(self, app: ASGIApp, port: int) -> None:
        self.app = app
        self.port = port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            server = scope.get("server")
            on_metrics_port = server is not None and server[1] == self.port
            if (scope["path"] == "/metrics") != on_metrics_port:
                where = "the data port" if on_metrics_port else f"port {self.port}"
                await send_json(send, 404, {"detail": f"not served here; try {where}"})
                return
        await self.app(scope, receive, send)


def header(scope: Scope, name: bytes) -> bytes | None:
    """The value of request header ``name`` (lower case), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body; :class:`BodyTooLarge` as soon as the declared length or the
    bytes received pass ``limit``, so that an oversized body is never buffered;
    :class:`ClientDisconnected` if the connection ends first (a truncated body is not a body)."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(declared.decode(), limit)
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected(f"the client left after {size} bytes of the body")
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(size if not more else f"over {limit}", limit)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def send_bytes(send: Send, status: int, body: bytes, content_type: bytes,
                     headers: Headers = ()) -> None:
    """Answer with ``body`` in one message."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, content: Any, headers: Headers = ()) -> None:
    await send_bytes(send, status, json.dumps(content).encode(), b"application/json", headers)


def retry_after() -> tuple[bytes, bytes]:
    return (b"retry-after", str(RETRY_AFTER_S).encode())


class BodyLimit:
    """ASGI middleware answering 413 for a body over ``limit()`` bytes (asked per request: it
    may follow what the app learns, e.g. the state's shape), declared or streamed, before the
    app buffers it; the app then reads the body as usual."""

    def __init__(self, app: ASGIApp, limit: Callable[[], int]) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        try:
            body = await read_body(scope, receive, self.limit())
        except BodyTooLarge as error:
            await send_json(send, 413, {"detail": str(error)})
            return
        except ClientDisconnected:
            return  # nobody to answer
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if delivered:  # the app waits for a disconnect, e.g. while streaming
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def page_headers(html: str, *, sources: tuple[str, ...] = ()) -> dict[str, str]:
    """Headers for an HTML page: a Content-Security-Policy that runs only the page's own inline
    ``<script>`` and ``<style>`` elements (by the SHA-256 of their text, :func:`inline_blocks`)
    and what ``sources`` serve, fetches only from its own origin and shows only its own or
    ``data:`` images; and no framing by any other page (``frame-ancestors`` and, for old
    browsers, ``X-Frame-Options``), so that a page that keeps a token cannot be clickjacked or
    made to run injected code."""
    extra = " ".join(sources)
    blocks = inline_blocks(html)

    def hashes(tag: str) -> str:
        digests = (hashlib.sha256(text.encode()).digest() for kind, text in blocks if kind == tag)
        return " ".join(f"'sha256-{base64.b64encode(d).decode()}'" for d in digests)

    policy = (f"default-src 'none'; script-src {hashes('script')} {extra}; "
              f"style-src {hashes('style')} {extra}; img-src 'self' data:; "
              f"connect-src 'self'; base-uri 'none'; form-action 'none'; "
              f"frame-ancestors 'none'")
    return {"Content-Security-Policy": re.sub(r" +", " ", policy),
            "X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer"}


def inline_blocks(html: str) -> list[tuple[str, str]]:
    """``(tag, text)`` of every inline ``<script>`` (one without ``src``) and ``<style>``
    element of ``html``, in order: the exact text a browser hashes to check a CSP. Read by an
    HTML parser, so that a comment or a string that mentions a tag is not taken for one."""
    parser = _InlineBlocks()
    parser.feed(html)
    parser.close()
    return parser.blocks


class _InlineBlocks(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)  # script and style text is never unescaped
        self.blocks: list[tuple[str, str]] = []
        self._open: tuple[str, list[str]] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "style" or (tag == "script" and "src" not in dict(attrs)):
            self._open = (tag, [])

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._open[1].append(data)

    def handle_endtag(self, tag: str) -> None:
        if self._open is not None and self._open[0] == tag:
            self.blocks.append((tag, "".join(self._open[1])))
            self._open = None


#: Where FastAPI's Swagger UI loads its script and styles from.
SWAGGER_UI_CDN = "https://cdn.jsdelivr.net"


def add_api_docs(app: FastAPI) -> None:
    """Serve Swagger UI at ``/docs`` for ``app``'s OpenAPI document. Off unless asked for
    (``--api-docs``): it loads from a CDN, and on the router it would share an origin with the
    web page that keeps the API token; its CSP admits only that CDN besides itself."""
    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        page = get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - API",
                                   swagger_favicon_url="data:,")
        html = bytes(page.body).decode()
        return HTMLResponse(html, headers=page_headers(html, sources=(SWAGGER_UI_CDN,)))


def probe_responses(failing: int, why: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` of a probe: 200, or ``failing`` for ``why``; a JSON object with a
    ``status`` either way."""
    content = {"application/json": {"schema": _PROBE}}
    return {200: {"content": content}, failing: {"description": why, "content": content}}


def _installed_or(module: str, fallback: str) -> str:
    return module if importlib.util.find_spec(module) is not None else fallback
