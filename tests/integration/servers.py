"""Real servers on loopback for tests: uvicorn on a thread over a socket bound to port 0."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

from ddm.serving.http.connections import ConnectionLimits
from ddm.serving.http.server import build_server
from ddm.serving.model.server import create_model_app
from ddm.serving.model.options import ServingOptions

READY_DEADLINE_S = 60.0
#: The name of the thread serving port P is this prefix and P.
SERVER_THREAD = "test-server-"


@contextmanager
def running(app, limits: ConnectionLimits = ConnectionLimits(), loops: int = 1) -> Iterator[str]:
    """Serve ``app`` on a free loopback port within ``limits`` on ``loops`` event loops; yields
    the base URL, stops the server after.

    The socket listens before the URL is handed out: a client may connect at once (the kernel
    queues the connection until the server's loop, still starting in its thread, accepts it)
    instead of being refused while uvicorn starts up, as it was when the server itself began
    to listen. Whether the app is *ready* is still for :func:`wait_ready` to say."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    server = build_server(app, "127.0.0.1", port, log_level="warning", limits=limits,
                          loops=loops)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name=f"{SERVER_THREAD}{port}")
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def wait_ready(base: str, deadline_s: float = READY_DEADLINE_S,
               fail_when_unhealthy: bool = False) -> None:
    """Wait until ``base``'s ``/readyz`` is 200; with ``fail_when_unhealthy``, fail at once
    when ``/healthz`` says loading failed instead of waiting out the deadline."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/readyz").status_code == 200:
                return
            if fail_when_unhealthy:
                health = httpx.get(f"{base}/healthz")
                assert health.status_code == 200, health.text
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.05)
    raise AssertionError(f"{base} not ready after {deadline_s} s: "
                         f"{httpx.get(f'{base}/readyz').text}")


@contextmanager
def ready_server(checkpoint: Path, backend: str = "torch", device: str | None = None,
                 max_batch: int = 8, max_delay_ms: float = 0.0) -> Iterator[str]:
    options = ServingOptions(backend=backend, device=device, max_batch=max_batch,
                             max_delay_ms=max_delay_ms)
    with running(create_model_app(checkpoint, options)) as base:
        wait_ready(base)
        yield base
