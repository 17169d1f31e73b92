"""``ddm up`` waits for each server as long as its plan gives it (a pool of many members, or a
compiling server, takes longer than one eager expert), and names the one that is late."""

from __future__ import annotations

import io
import sys
import threading
from pathlib import Path

import pytest
from waiting import wait_for

from ddm.runtime.local import (Backoff, LocalRunError, ProcessSpec, Supervisor, _supervise,
                               free_port)

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


def test_a_dead_process_started_again_on_demand_is_not_restarted_a_second_time() -> None:
    """An on-demand expert that died is due for a restart after its back-off; a generation
    needing it meanwhile has the scaler start it at once. The restart then found it running
    and started a second process over it, and the first outlived ``ddm up`` (an expert of
    the scale-to-zero benchmark, still serving an hour later)."""
    log = io.StringIO()
    supervisor = Supervisor(log)
    spec = ProcessSpec("expert-a/0", NEVER_READY, free_port())
    started: list[int] = []
    stop = threading.Event()

    def scale() -> None:  # the scaler: a generation needs it as soon as it is seen dead
        if "restarting it in" in log.getvalue() and not supervisor.running(spec.name):
            supervisor.start(spec)
            started.append(supervisor.processes[spec.name].pid)

    supervisor.start(spec)
    started.append(supervisor.processes[spec.name].pid)
    supervisor.processes[spec.name].kill()
    supervising = threading.Thread(target=_supervise, args=(
        supervisor, stop, log, Backoff(first_s=0.5), scale))
    supervising.start()
    try:
        wait_for(lambda: "started again on demand; no restart needed" in log.getvalue(), 60,
                 "the supervisor finding it started again", interval_s=0.05)
    finally:
        stop.set()
        supervising.join()
        supervisor.stop()
    assert len(started) == 2 and "restarted expert-a/0" not in log.getvalue(), log.getvalue()
    assert all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in started)
    with pytest.raises(LocalRunError, match="expert-a/0 is running already"):
        try:
            supervisor.start(spec)
            supervisor.start(spec)
        finally:
            supervisor.stop()


def _zombie(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


#: A process that writes a byte that is not UTF-8, a line with no end, then more than a pipe
#: holds (about 400 KB), and exits: only once everything it wrote was read.
NOISY = (sys.executable, "-c",
         "import sys; out = sys.stdout.buffer; out.write(b'bad \\xff byte\\n');"
         "out.write(b'z' * 100_000 + b'\\n');"
         "[out.write(b'line %d\\n' % k) for k in range(40_000)]; out.write(b'done\\n')")


class _GoneReader(io.StringIO):
    """``ddm up | head`` after head exited: every write fails."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("out", [io.StringIO(), _GoneReader()], ids=["read", "nobody-reads"])
def test_whatever_a_process_writes_is_drained_so_it_never_blocks(out: io.StringIO) -> None:
    supervisor = Supervisor(out)
    supervisor.start(ProcessSpec("expert-a/0", NOISY, free_port()))
    try:
        assert supervisor.processes["expert-a/0"].wait(timeout=120) == 0
    finally:
        supervisor.stop()
    if not isinstance(out, _GoneReader):
        wait_for(lambda: out.getvalue().endswith("[expert-a/0] done\n"), 60,
                 "the relay reaching the end of the output", interval_s=0.05)
        lines = out.getvalue().splitlines()
        assert lines[0] == "[expert-a/0] bad \ufffd byte"
        # The line of 100,000 characters in two pieces, each behind the process's name.
        assert lines[1] == "[expert-a/0] " + "z" * 65_536
        assert lines[2] == "[expert-a/0] " + "z" * (100_000 - 65_536)
        assert len(lines) == 40_004
