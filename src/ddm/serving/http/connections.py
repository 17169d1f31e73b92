"""What one HTTP connection may cost a server: deadlines, byte caps and a connection cap that a
slow, idle or oversized client cannot get around (both servers; :mod:`ddm.serving.http.server`).

uvicorn times out only a kept-alive connection between two requests: a connection that never
sends, a request line or header block trickled a byte at a time and a body that never ends
all stay open for ever, and httptools buffers a header block of any size. So the servers run
uvicorn's httptools protocol wrapped by :class:`GuardedHttpProtocol`, which follows each
connection through its phases and gives each one a deadline:

=============  ================================================  ===============================
phase          from .. to                                        limit, then
=============  ================================================  ===============================
head           connection opened, or first byte after a reply,   ``head_timeout_s``: 408 (close
               .. end of the header block                        without a word if no byte came);
                                                                 ``max_head_bytes``: 431
body           end of the header block .. last byte of the body  ``body_timeout_s``: 408
serving        request complete .. reply complete                the app's own limits; a reply
                                                                 the client does not read for
                                                                 ``send_timeout_s``: abort
keep-alive     reply sent .. first byte of the next request      ``keep_alive_s``: close
=============  ================================================  ===============================

Every refusal closes the connection, and so does a reply sent before the request's body is in
(413, 401): it says ``connection: close``, and the rest of the body is never read. A route that
counts requests does so once the body is in (the expert's ``max_pending``).

At most ``max_connections`` connections are open: one more evicts the connection that has
waited longest in the head, body or keep-alive phase (a prompt client spends microseconds
there, a slow one the whole deadline), and is itself refused with 503 only when every other
connection has a request being served. So the memory a server spends on clients is bounded by
``max_connections * (max_head_bytes + body limit)``, and slow clients cost others nothing but
their share of that cap. Requests are not pipelined: bytes of a next request that arrive before
the reply is sent are dropped and the connection closes after the reply, which RFC 9112 (9.3.2)
tells a pipelining client to expect.

A reply leaves in one write: uvicorn writes the head as soon as the app starts its reply and
the body when the app sends it, two segments that wake the client twice; each request's cycle
writes through :class:`_HeadWithBody`, which holds the head until the body (one writev).

Per client address there is no quota: behind an ingress or a Service every client may share one
address, and the routers are the experts' only legitimate clients.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import http
import time
from dataclasses import dataclass
from typing import Any, Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ddm.deploy.limits import MAX_PROMPT_BYTES

#: The router's stream (``GET /v1/generate/stream``) takes its prompt and negative prompt in
#: the query, each up to ``MAX_PROMPT_BYTES`` of UTF-8, percent-encoded at three characters
#: per byte outside ASCII: a request line its own schema accepts must not be refused as too
#: long (431).
STREAM_QUERY_BYTES = 2 * 3 * MAX_PROMPT_BYTES


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits of the table in this module's docstring; the defaults are what both servers
    run with."""

    #: A request line and headers sent this slowly is an attack, never a router or a browser.
    head_timeout_s: float = 10.0
    #: The largest body either server accepts (an expert's batch of 64) takes milliseconds
    #: inside a cluster; this leaves room for a slow network between a browser and the router.
    body_timeout_s: float = 30.0
    #: A client that reads none of a reply for this long is gone or hostile.
    send_timeout_s: float = 30.0
    #: Longer than a router's pause between two generations and than common load balancers'
    #: idle timeout (60 s), so that a keep-alive connection is not closed just as a router
    #: reuses it (the router's own client gives up idle connections sooner).
    keep_alive_s: float = 75.0
    #: Request line and headers: the router's longest stream query (:data:`STREAM_QUERY_BYTES`)
    #: and 16 KiB of headers (nginx's and Node's whole default), where a bearer token and
    #: cookies fit many times over.
    max_head_bytes: int = STREAM_QUERY_BYTES + 16 * 1024
    #: Open connections; with 40 KiB heads and an expert's bodies, well under a pod's memory.
    max_connections: int = 1024

    def __post_init__(self) -> None:
        for name in ("head_timeout_s", "body_timeout_s", "send_timeout_s", "keep_alive_s",
                     "max_head_bytes", "max_connections"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class Phase(enum.Enum):
    HEAD = "head"
    BODY = "body"
    SERVING = "serving"
    KEEP_ALIVE = "keep-alive"


#: Phases in which a connection holds no request being served, so that it may be evicted.
_WAITING = (Phase.HEAD, Phase.BODY, Phase.KEEP_ALIVE)


def protocol_factory(limits: ConnectionLimits) -> Callable[..., GuardedHttpProtocol]:
    """What uvicorn's ``Config(http=...)`` takes to build each connection's protocol."""
    return functools.partial(GuardedHttpProtocol, limits=limits)


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines and caps of :class:`ConnectionLimits`."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.phase = Phase.HEAD
        self.since = time.monotonic()
        self._head_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._send_deadline: asyncio.TimerHandle | None = None

    # connection ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm(self.limits.head_timeout_s)
        if len(self.connections) > self.limits.max_connections:
            victim = min((c for c in self.connections if c is not self
                          and isinstance(c, GuardedHttpProtocol) and c.phase in _WAITING
                          and not c.transport.is_closing()),
                         key=lambda c: c.since, default=None)
            if victim is None:
                self._refuse(503, "too many connections; retry shortly")
            else:
                victim.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._send_deadline is not None:
            self._send_deadline.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.phase is Phase.KEEP_ALIVE:
            self._enter(Phase.HEAD, self.limits.head_timeout_s)
        elif self.phase is Phase.SERVING:  # a pipelined request: not read, see the docstring
            self.cycle.keep_alive = False
            return
        if self.phase is Phase.HEAD:
            room = self.limits.max_head_bytes - self._head_bytes
            head, data = data[:room], data[room:]
            self._head_bytes += len(head)
            super().data_received(head)
            if self.phase is Phase.HEAD and data and not self.transport.is_closing():
                self._refuse(431, f"request line and headers exceed "
                                  f"{self.limits.max_head_bytes} bytes")
                return
            if not data or self.transport.is_closing():
                return
            if self.phase is Phase.SERVING:
                self.cycle.keep_alive = False
                return
        super().data_received(data)

    # parser callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.phase is Phase.SERVING:  # pipelined in the same read: close after this reply
            self.cycle.keep_alive = False
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        if self.phase is Phase.SERVING:  # a pipelined request is never started
            super().on_headers_complete()
            return
        self._head_bytes = 0
        self._enter(Phase.BODY, self.limits.body_timeout_s)
        previous = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is None or cycle is previous:  # an upgrade, which these servers refuse
            return
        send = cycle.send
        writer = cycle.transport = _HeadWithBody(cycle.transport)

        async def send_closing(message: Any) -> None:
            if message["type"] != "http.response.start":
                await send(message)
                writer.flush()  # a body-less reply (HEAD, 304) sends its head now
                return
            if self.phase is Phase.BODY:
                # Answered before its body was in (413, 401, 404...): the rest is not worth
                # reading, so the reply says "connection: close" and uvicorn closes after it.
                cycle.keep_alive = False
            writer.holding = True
            try:
                await send(message)
            finally:
                writer.holding = False

        cycle.send = send_closing  # type: ignore[method-assign]  # looked up when the app runs

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self.phase is Phase.BODY:
            self._enter(Phase.SERVING, None)

    def on_response_complete(self) -> None:
        self._enter(Phase.KEEP_ALIVE, None)  # uvicorn arms its keep-alive timer
        super().on_response_complete()

    # writing ------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_deadline is None:
            self._send_deadline = self.loop.call_later(self.limits.send_timeout_s,
                                                       self.transport.abort)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    # deadlines ----------------------------------------------------------------------------

    def _enter(self, phase: Phase, deadline_s: float | None) -> None:
        self.phase, self.since = phase, time.monotonic()
        self._disarm()
        if deadline_s is not None:
            self._arm(deadline_s)

    def _arm(self, deadline_s: float) -> None:
        self._deadline = self.loop.call_later(deadline_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.phase is Phase.HEAD and self._head_bytes == 0:
            self.transport.close()  # nothing was asked: nothing to answer
            return
        what = "request line and headers" if self.phase is Phase.HEAD else "request body"
        limit = (self.limits.head_timeout_s if self.phase is Phase.HEAD
                 else self.limits.body_timeout_s)
        if self.phase is Phase.BODY and self.cycle.response_started:
            self.transport.close()
            return
        self._refuse(408, f"the {what} did not arrive within {limit:g} s")

    def _refuse(self, status: int, reason: str) -> None:
        """Answer ``status`` with ``reason`` and close, whatever the app is doing."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's own reply, if any, goes nowhere
            self.cycle.message_event.set()
        body = reason.encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, http.HTTPStatus(status).phrase.encode(), len(body), body))
        self.transport.close()


class _HeadWithBody:
    """A request cycle's transport that holds the reply's head (status line and headers,
    which uvicorn writes as soon as the app starts its reply) until the first body bytes, so
    that both leave in one ``writelines`` (one writev, one segment, one wake-up of the client)
    rather than two writes; everything else goes to ``transport`` as it is."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.holding = False  # the next write is the head
        self.head: bytes | None = None

    def write(self, data: bytes) -> None:
        if self.holding:
            self.head = data
        elif self.head is not None:
            head, self.head = self.head, None
            self.transport.writelines((head, data))
        else:
            self.transport.write(data)

    def flush(self) -> None:
        if self.head is not None:
            head, self.head = self.head, None
            self.transport.write(head)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)
