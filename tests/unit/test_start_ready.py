"""``ddm up`` waits for each server as long as its plan gives it (a pool of many members, or a
compiling server, takes longer than one eager expert), and names the one that is late."""

from __future__ import annotations

import io
import sys

import pytest

from ddm.runtime.local import LocalRunError, ProcessSpec, Supervisor, free_port

#: A server that never becomes ready: it listens nowhere.
NEVER_READY = (sys.executable, "-c", "import time; time.sleep(600)")


def test_each_server_is_waited_for_as_long_as_its_own_budget() -> None:
    supervisor = Supervisor(io.StringIO())
    short = ProcessSpec("expert-a/0", NEVER_READY, free_port(), ready_s=1.0)
    long = ProcessSpec("pool-all/0", NEVER_READY, free_port(), ready_s=600.0)
    try:
        with pytest.raises(LocalRunError) as raised:
            supervisor.start_ready([short, long], "127.0.0.1")
        assert str(raised.value) == "expert-a/0 not ready within 1 s"
        assert supervisor.running("pool-all/0")  # still within its budget when a-0 was late
    finally:
        supervisor.stop()
