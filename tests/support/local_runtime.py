"""``ddm up`` in a thread for the tests: its plan, its log and its exit status."""

from __future__ import annotations

import io
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx

from ddm.deploy.spec import load_manifest
from ddm.runtime.local import LocalPlan, free_port, run_local


class Log(io.StringIO):
    """Collects the processes' output so a failure can show it; ``lines`` holds each whole
    line with when it was written (``time.monotonic()``), for those who time events."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[float, str]] = []
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            now = time.monotonic()
            *whole, self._partial = (self._partial + text).split("\n")
            self.lines.extend((now, line) for line in whole)
            return super().write(text)


@contextmanager
def ddm_up(manifest: Path, **options: Any) -> Iterator[tuple[LocalPlan, Log, list[int]]]:
    """``run_local`` in a thread until the block ends; yields its plan, its log and (once it
    returned) its exit status."""
    ready, stop, log = threading.Event(), threading.Event(), Log()
    plans: list[LocalPlan] = []
    outcome: list[int] = []

    def on_ready(plan: LocalPlan) -> None:
        plans.append(plan)
        ready.set()

    thread = threading.Thread(target=lambda: outcome.append(run_local(
        load_manifest(manifest), router_port=free_port(), out=log, on_ready=on_ready, stop=stop,
        **options)))
    thread.start()
    try:
        while not ready.wait(0.5):
            assert thread.is_alive(), f"ddm up stopped before it was ready:\n{log.getvalue()}"
        yield plans[0], log, outcome
    finally:
        stop.set()
        thread.join(timeout=60)


def one_pool_beside_the_router(plan: LocalPlan, log: Log) -> dict[str, Any]:
    """The ``/v1/info`` of the one model process ``ddm up`` started for a DDM in one pool
    (``pool-models/0``, running ``ddm serve pool``), after checking that it and the router are
    all it started."""
    (server,) = plan.servers
    assert server.name == "pool-models/0" and "serve" in server.argv
    assert server.argv[server.argv.index("serve") + 1] == "pool"
    started = [line for _, line in log.lines if line.startswith("started ")]
    assert [line.split(" (")[0] for line in started] == ["started pool-models/0",
                                                          "started router"], started
    return httpx.get(f"http://127.0.0.1:{server.port}/v1/info", timeout=30).json()
