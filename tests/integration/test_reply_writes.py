"""A server's reply leaves in one write: its head (status line and headers) and its body in one
writev, so that the client wakes once (``ddm.serving.http.connections``). Counted with the kernel's
own tally of the server thread's write calls (``syscw`` in ``/proc/self/task/TID/io``: write
and writev), against a real expert server on a thread."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import numpy as np
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from ddm.serving.wire.protocol import CONTENT_TYPE, decode_response
from ddm.serving.model.server import create_model_app
from ddm.serving.model.options import ServingOptions
from tests.support.label_wire import post_call, velocity_call
from servers import SERVER_THREAD, running, wait_ready

#: How long the server thread may stay runnable once its client has its reply.
SETTLE_S = 30.0
READYZ = Route("/readyz", lambda request: PlainTextResponse("ready"))


def _write_calls(port: int) -> int:
    """Write calls so far of the thread serving ``port`` (its event loop: the model thread's
    own wake-ups of the loop are not counted), read once the thread sleeps: the kernel counts
    a write after its bytes are sent, so a thread still running may not have counted the
    reply its client already read."""
    (thread,) = [t for t in threading.enumerate() if t.name == f"{SERVER_THREAD}{port}"]
    task = Path(f"/proc/self/task/{thread.native_id}")
    deadline = time.monotonic() + SETTLE_S
    while (task / "stat").read_text().rpartition(")")[2].split()[0] == "R":
        assert time.monotonic() < deadline, f"the server thread ran for {SETTLE_S} s"
        time.sleep(0.001)
    for line in (task / "io").read_text().splitlines():
        if line.startswith("syscw:"):
            return int(line.split()[1])
    raise AssertionError(f"no syscw in {task}/io")


def _exchange(sock: socket.socket, request: bytes, *, has_body: bool = True) -> bytes:
    """Send ``request`` and read one whole reply with a Content-Length (or none, for HEAD)."""
    sock.sendall(request)
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += sock.recv(65536)
    head, _, body = reply.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while has_body and len(body) < length:
        body += sock.recv(65536)
    return reply if not has_body else head + b"\r\n\r\n" + body


def test_binary_and_json_replies_leave_in_one_write_each(smoke_expert_checkpoint: Path):
    x = np.random.default_rng(0).standard_normal((1, 1, 8, 8), np.float32)
    call = velocity_call(3, x, np.array([0.5], np.float32), np.array([1]))
    body = call.call  # its label context is posted once the server is up
    velocity = (f"POST /v1/velocity HTTP/1.1\r\nHost: e\r\nContent-Type: {CONTENT_TYPE}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    healthz = b"GET /healthz HTTP/1.1\r\nHost: e\r\n\r\n"
    with running(create_model_app(smoke_expert_checkpoint, ServingOptions(max_batch=8))) as base:
        wait_ready(base)
        assert post_call(base, call).status_code == 200
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for request in (velocity, healthz):  # the first of each warms up
                _exchange(sock, request)
            for request in (velocity, healthz, velocity, velocity, healthz):
                before = _write_calls(port)
                reply = _exchange(sock, request)
                assert _write_calls(port) - before == 1, reply[:200]
                assert reply.startswith(b"HTTP/1.1 200 ")
                if request is velocity:
                    out = decode_response(reply[reply.index(b"\r\n\r\n") + 4:], 3,
                                          (1, 1, 8, 8))
                    assert np.isfinite(out).all()


def test_a_body_less_reply_sends_its_head_and_the_connection_serves_on():
    app = Starlette(routes=[Route("/ping", lambda request: PlainTextResponse("pong")), READYZ])
    with running(app) as base:
        wait_ready(base)
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            head = _exchange(sock, b"HEAD /ping HTTP/1.1\r\nHost: p\r\n\r\n", has_body=False)
            assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")
            assert _exchange(sock, b"GET /ping HTTP/1.1\r\nHost: p\r\n\r\n").endswith(
                b"\r\n\r\npong")


def test_a_streamed_reply_arrives_whole_in_order():
    async def chunks():
        for word in (b"one ", b"two ", b"three"):
            yield word

    app = Starlette(routes=[Route("/stream", lambda request: StreamingResponse(chunks())),
                            READYZ])
    with running(app) as base:
        wait_ready(base)
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /stream HTTP/1.1\r\nHost: s\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked" in head
    assert body == b"4\r\none \r\n4\r\ntwo \r\n5\r\nthree\r\n0\r\n\r\n"
