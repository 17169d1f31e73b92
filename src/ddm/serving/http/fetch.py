"""One bounded read of a small JSON document over HTTP: :func:`fetch_json`.

Every small JSON read outside the router's event loop goes through it: ``ddm sample --router``
(the router's ``/v1/info`` and ``/v1/generate``), ``ddm up``'s readiness polls and its
scale-to-zero demand polls. The router's own probes of its experts (``/readyz``,
``/v1/info``) run on its event loop through the keep-alive client
(:class:`ddm.serving.http.client.HttpClient`), whose ``get`` applies the same kind of deadline
and cap, and whose JSON is judged by :func:`decode_json` as here.

A peer is never trusted to be quick, small or well-formed: ``deadline`` bounds the whole
exchange (connecting, sending, every byte of the reply: a reply trickled a byte at a time ends
at the deadline), ``cap`` the reply's body, refused as soon as it is declared or read over it
and never buffered past it. Anything that goes wrong is a :class:`FetchError` naming the URL
and what went wrong (the cap, the deadline, the status and the peer's ``detail``).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse
from typing import Any

#: The most of an error reply's body read for its ``detail``.
MAX_ERROR_DETAIL_BYTES = 4096
#: The most bytes asked of the socket at once.
_READ_BYTES = 256 * 1024


class FetchError(RuntimeError):
    """A JSON read failed; the message names the URL and why. ``status``: the HTTP status the
    peer answered, None when it answered none (unreachable, too slow, too large)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def fetch_json(url: str, *, deadline: float, cap: int, token: str | None = None,
               body: Any = None) -> Any:
    """``GET url`` (a ``POST`` of ``body`` as JSON when it is not None) -> its 2xx reply
    decoded from JSON. ``deadline``: seconds for the whole exchange; ``cap``: the most body
    bytes read; ``token``: sent as a bearer token. :class:`FetchError` otherwise."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError(f"{url!r} is not an http:// or https:// URL")
    if deadline <= 0 or cap < 1:
        raise ValueError(f"fetch_json needs deadline > 0 and cap >= 1, got {deadline}, {cap}")
    ends = time.monotonic() + deadline
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = kind(parts.hostname, parts.port, timeout=deadline)
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if token:
        headers["Authorization"] = f"Bearer {token}"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        connection.request("GET" if data is None else "POST", target, body=data,
                           headers=headers)
        _within(connection, ends)
        reply = connection.getresponse()
        ok = 200 <= reply.status < 300
        declared = reply.getheader("Content-Length", "")
        if ok and declared.strip().isdigit() and int(declared) > cap:
            raise FetchError(f"{url} declared a reply of {int(declared)} bytes, over the "
                             f"{cap}-byte cap of this read")
        content = _read(connection, reply, cap if ok else min(cap, MAX_ERROR_DETAIL_BYTES), ends)
    except (TimeoutError, socket.timeout):
        raise FetchError(f"{url} did not answer within {deadline:g} s") from None
    except (OSError, http.client.HTTPException) as error:
        raise FetchError(f"{url} could not be reached: {getattr(error, 'reason', error)}"
                         ) from None
    finally:
        connection.close()
    if not ok:
        raise FetchError(f"{url} answered {reply.status}: "
                         f"{_detail(content[:MAX_ERROR_DETAIL_BYTES])}", reply.status)
    if len(content) > cap:
        raise FetchError(f"{url} sent a reply over the {cap}-byte cap of this read")
    return decode_json(url, content)


def decode_json(url: str, content: bytes) -> Any:
    """A reply's body as JSON; a :class:`FetchError` naming ``url`` if it is not."""
    try:
        return json.loads(content)
    except (ValueError, RecursionError) as error:
        raise FetchError(f"{url} sent a reply that is not JSON: {error}") from None


def _within(connection: http.client.HTTPConnection, ends: float) -> None:
    """The socket's next wait ends by ``ends`` (monotonic), or TimeoutError now."""
    left = ends - time.monotonic()
    if left <= 0:
        raise TimeoutError
    if connection.sock is not None:
        connection.sock.settimeout(left)


def _read(connection: http.client.HTTPConnection, reply: http.client.HTTPResponse,
          limit: int, ends: float) -> bytes:
    """At most ``limit`` + 1 body bytes (one more than allowed tells an overflow), by
    ``ends``."""
    chunks, size = [], 0
    while size <= limit:
        _within(connection, ends)
        chunk = reply.read1(min(_READ_BYTES, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _detail(content: bytes) -> str:
    """An error reply's ``detail`` (FastAPI's), else its text."""
    text = content.decode(errors="replace")
    try:
        detail = json.loads(text).get("detail", text)
    except (ValueError, AttributeError, RecursionError):
        return text
    return detail if isinstance(detail, str) else json.dumps(detail)
