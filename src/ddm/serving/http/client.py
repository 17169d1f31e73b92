"""The router's one HTTP/1.1 client: a POST per expert call on a kept-alive connection, and
the GETs that probe the experts (``/readyz``, ``/v1/info``).

The router sends a request to an expert at every denoising step, so the client's own cost is
paid per step, and a general client's machinery (headers objects, cookie and redirect handling,
payload writers, response objects) costs more CPU and wall time per call than a plain asyncio
protocol with httptools' C parser (docs/benchmarks.md, ``router``). This client does only what
an expert call needs: ``POST`` a body with a fixed header block, read a response with
``Content-Length`` or chunked encoding, keep the connection for the next call. The probes use
it too, rather than a second client stack in the router (aiohttp's, which they used to): the
same caps, deadlines and connections, and one less dependency in the router's image.

An expert is a peer, not a trusted part of the router: a reply's headers are capped at
:data:`MAX_REPLY_HEAD_BYTES` and its body at what the request implies (the caller's
``max_reply_bytes``; an error reply at ``max_error_bytes``), refused as soon as it is declared
or received over that; informational replies (``100 Continue``, ``103``) are skipped; bytes
after a reply close the connection, so they are never read as the next request's reply; and
the whole exchange has one deadline, so a reply trickled a byte at a time ends in
``TimeoutError``.

Connections are kept per ``host:port`` (an IPv6 address in brackets, as the ``Host`` header
names it: :func:`~ddm.deploy.endpoints.split_endpoint`) and used by one request at a time
(no pipelining): a request takes an idle connection or opens one (``TCP_NODELAY``, which
asyncio and uvloop set on every TCP connection, so a small request is not held back by Nagle's
algorithm). A connection
the server closed, answered with ``Connection: close``, or left mid-request (a timeout, a
cancelled call) is never reused. Idle connections are closed after ``keep_alive_s``, shorter
than the expert's own keep-alive, so that the client, not the server, closes an idle
connection and a request never goes out on one the server is closing.

The client does not sleep through a long call whose time it can expect (the same endpoint
and path's last successful call took 20 ms or more): from four fifths of that time on, it
ticks every millisecond until the reply comes (:mod:`ddm.serving.http.polling`), so that reading,
parsing and decoding the reply run warm.

Errors: :class:`HttpClientError` for anything the transport or the response framing did wrong
(the caller treats it as the replica's failure); ``TimeoutError`` when no answer came in time.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import cast

import httptools

from ddm.deploy.endpoints import split_endpoint
from ddm.serving.http.polling import LastTimes, WarmTicks, first_tick_s

#: Status line and headers of a reply: an expert's are a few dozen bytes.
MAX_REPLY_HEAD_BYTES = 8 * 1024
#: ``(endpoint, path)`` pairs whose last call time a client remembers, to tick near the next
#: call's reply: a router calls each replica of each expert on a few paths.
KNOWN_CALLS = 1024


class HttpClientError(ConnectionError):
    """The connection failed or the response was not valid HTTP/1.1."""


class ReplyTooLarge(HttpClientError):
    """The reply's body was declared or received over what the request allows."""


class _ClosedBeforeReply(HttpClientError):
    """The server closed the connection before a byte of the reply arrived."""


@dataclass(frozen=True)
class HttpReply:
    status: int
    body: bytes


@dataclass(frozen=True)
class _Caps:
    """Body bytes a reply may have: ``ok`` for a 2xx, ``error`` for any other final status."""

    ok: int
    error: int


class _Connection(asyncio.Protocol):
    """One kept-alive connection; at most one request in flight."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._reply: asyncio.Future[HttpReply] | None = None
        self._caps = _Caps(0, 0)
        self._chunks: list[bytes] = []
        self._size = 0  # body bytes of the current reply
        self._limit = 0  # body bytes the current reply may have, once its status is known
        self._declared: int | None = None  # its Content-Length
        self._head_bytes = 0
        self._in_head = True
        self._replied = False  # a byte of the current reply arrived
        self._close_after = False
        self.closed = False
        self.idle_since = time.monotonic()

    # asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not registered as an asyncio.Transport subclass).
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._reply is None or self._reply.done():
            # Bytes nobody asked for (after the reply, or between requests): the stream is out
            # of step, and they must never be read as the next request's reply.
            self._fail(HttpClientError("the server sent bytes beyond its reply"))
            return
        self._replied = True
        if self._in_head:
            room = MAX_REPLY_HEAD_BYTES - self._head_bytes
            head, data = data[:room], data[room:]
            self._head_bytes += len(head)
            self._feed(head)
            if self._in_head and data:
                self._fail(HttpClientError(f"reply headers exceed {MAX_REPLY_HEAD_BYTES} bytes"))
        if data and not self.closed:
            self._feed(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._reply is not None and not self._reply.done():
            reason = f"connection closed by the server{f': {exc}' if exc else ''}"
            self._reply.set_exception(HttpClientError(reason) if self._replied
                                      else _ClosedBeforeReply(reason))

    # httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._reply is None or self._reply.done():  # a second reply in the same read
            self._fail(HttpClientError("the server sent bytes beyond its reply"))
            return
        self._chunks, self._size, self._head_bytes, self._in_head = [], 0, 0, True
        self._declared = None

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"connection" and value.lower() == b"close":
            self._close_after = True
        elif name == b"content-length":
            self._declared = int(value) if value.strip().isdigit() else None

    def on_headers_complete(self) -> None:
        self._in_head = False
        status = self._parser.get_status_code()
        self._limit = self._caps.ok if 200 <= status < 300 else self._caps.error
        if self._declared is not None and self._declared > self._limit and status >= 200:
            self._fail(ReplyTooLarge(f"reply of {self._declared} bytes declared, over the "
                                       f"{self._limit} this request can be answered with"))

    def on_body(self, body: bytes) -> None:
        if self.closed:
            return
        self._size += len(body)
        if self._size > self._limit:
            self._fail(ReplyTooLarge(f"reply body over {self._limit} bytes, the most this "
                                       f"request can be answered with"))
            return
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        if self._reply is None or self._reply.done() or self.closed:
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # informational (100 Continue, 103...): the reply follows
            if status == 101:
                self._fail(HttpClientError("the server switched protocols"))
            return
        if not self._parser.should_keep_alive():
            self._close_after = True
        body = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks = []
        self._reply.set_result(HttpReply(status, body))

    # requests ---------------------------------------------------------------------------

    async def exchange(self, request: bytes, caps: _Caps) -> HttpReply:
        """Send one whole request and await its whole response."""
        assert self._transport is not None and self._reply is None
        self._reply = asyncio.get_running_loop().create_future()
        self._caps, self._replied = caps, False
        self._chunks, self._size, self._head_bytes, self._in_head = [], 0, 0, True
        try:
            self._transport.write(request)
            reply = await self._reply
        except BaseException:
            self.close()  # mid-request: what arrives later must not reach the next request
            raise
        finally:
            self._reply = None
        if self._close_after:
            self.close()
        self.idle_since = time.monotonic()
        return reply

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    def _feed(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(HttpClientError(f"malformed HTTP response: {error}"))

    def _fail(self, error: HttpClientError) -> None:
        if self._reply is not None and not self._reply.done():
            self._reply.set_exception(error)
        self.close()


class HttpClient:
    """Keep-alive requests to many ``host:port`` endpoints. Create and use it on one event loop;
    ``close()`` when done."""

    def __init__(self, keep_alive_s: float, max_idle_per_endpoint: int = 32) -> None:
        if keep_alive_s <= 0 or max_idle_per_endpoint < 1:
            raise ValueError("HttpClient needs keep_alive_s > 0 and max_idle_per_endpoint >= 1")
        self._keep_alive_s = keep_alive_s
        self._max_idle = max_idle_per_endpoint
        self._idle: dict[str, list[_Connection]] = {}
        self._took: LastTimes[tuple[str, str]] = LastTimes(KNOWN_CALLS)
        #: Calls in flight whose time is expected -> from when (``perf_counter``) to tick.
        self._near: dict[int, float] = {}
        self._call_ids = itertools.count()
        self._ticks = WarmTicks(self._next_tick_s)

    async def post(self, endpoint: str, path: str, body: bytes, content_type: str,
                   timeout_s: float, connect_timeout_s: float, *, max_reply_bytes: int,
                   max_error_bytes: int, authorization: bytes | None = None) -> HttpReply:
        """``POST http://{endpoint}{path}``: the reply, :class:`HttpClientError` or
        ``TimeoutError`` (``timeout_s`` bounds the whole exchange, connecting included).

        A 2xx body over ``max_reply_bytes`` or another body over ``max_error_bytes`` is an
        :class:`HttpClientError` as soon as it is declared or received, never buffered.
        ``authorization`` is sent as the ``Authorization`` header."""
        head = (f"POST {path} HTTP/1.1\r\nHost: {endpoint}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n").encode("latin-1")
        return await self._send(endpoint, path, head, body, authorization, timeout_s,
                                connect_timeout_s, _Caps(max_reply_bytes, max_error_bytes))

    async def get(self, endpoint: str, path: str, timeout_s: float, connect_timeout_s: float,
                  *, max_reply_bytes: int, authorization: bytes | None = None) -> HttpReply:
        """``GET http://{endpoint}{path}`` (the router's probes), as :meth:`post`: any body
        over ``max_reply_bytes``, whatever its status, is :class:`ReplyTooLarge`."""
        head = f"GET {path} HTTP/1.1\r\nHost: {endpoint}\r\n".encode("latin-1")
        return await self._send(endpoint, path, head, b"", authorization, timeout_s,
                                connect_timeout_s, _Caps(max_reply_bytes, max_reply_bytes))

    async def _send(self, endpoint: str, path: str, head: bytes, body: bytes,
                    authorization: bytes | None, timeout_s: float, connect_timeout_s: float,
                    caps: _Caps) -> HttpReply:
        if authorization is not None:
            head += b"Authorization: " + authorization + b"\r\n"
        request = head + b"\r\n" + body
        started, call = time.perf_counter(), (endpoint, path)
        first_tick = first_tick_s(self._took.expected(call, len(request)))
        call_id = next(self._call_ids)
        if first_tick is not None:
            self._near[call_id] = started + first_tick
            self._ticks.due_in(first_tick)
        try:
            async with asyncio.timeout(timeout_s):
                connection = self._take(endpoint)
                if connection is not None:
                    try:
                        reply = await connection.exchange(request, caps)
                    except _ClosedBeforeReply:
                        # The server closed this idle connection as the request went out:
                        # that says nothing of the replica, and the request is pure (an
                        # expert call, a probe), so send it once more.
                        connection = None
                if connection is None:
                    connection = await self._open(endpoint, connect_timeout_s)
                    reply = await connection.exchange(request, caps)
        finally:
            self._near.pop(call_id, None)
        if 200 <= reply.status < 300:
            self._took.record(call, time.perf_counter() - started, len(request))
        self._give_back(endpoint, connection)
        return reply

    def close(self) -> None:
        self._ticks.stop()
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()

    def close_idle(self) -> None:
        """Close connections idle longer than ``keep_alive_s`` or closed by the server, and
        forget endpoints left with none (replicas come and go)."""
        now = time.monotonic()
        for endpoint, connections in list(self._idle.items()):
            fresh = [c for c in connections if self._fresh(c, now)]
            for connection in set(connections) - set(fresh):
                connection.close()
            if fresh:
                self._idle[endpoint] = fresh
            else:
                del self._idle[endpoint]

    def _next_tick_s(self) -> float | None:
        """When the loop ticks next: from the earliest expected reply's tick time on; never
        once no call of known time is in flight."""
        if not self._near:
            return None
        return min(self._near.values()) - time.perf_counter()

    def _take(self, endpoint: str) -> _Connection | None:
        idle, now = self._idle.get(endpoint, []), time.monotonic()
        while idle:
            connection = idle.pop()  # the most recently used: the least likely to be stale
            if self._fresh(connection, now):
                return connection
            connection.close()
        return None

    def _fresh(self, connection: _Connection, now: float) -> bool:
        """Open, and idle for less than ``keep_alive_s``: safe to send on."""
        return not connection.closed and now - connection.idle_since < self._keep_alive_s

    def _give_back(self, endpoint: str, connection: _Connection) -> None:
        idle = self._idle.setdefault(endpoint, [])
        if connection.closed or len(idle) >= self._max_idle:
            connection.close()
        else:
            idle.append(connection)

    async def _open(self, endpoint: str, connect_timeout_s: float) -> _Connection:
        try:
            host, port = split_endpoint(endpoint)
            async with asyncio.timeout(connect_timeout_s):
                _, connection = await asyncio.get_running_loop().create_connection(
                    _Connection, host, port)
        except (OSError, ValueError) as error:
            raise HttpClientError(f"cannot connect to {endpoint}: {error}") from None
        return connection
