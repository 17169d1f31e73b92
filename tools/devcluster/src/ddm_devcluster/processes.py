"""Start, watch and stop the control-plane processes.

Each component runs in its own session (so its own process group), with its output in a log
file; it outlives the Python process that started it (`ddm-dev-cluster up` returns while the
cluster keeps running). Stopping signals the whole group, after checking that the pid still
belongs to this cluster (its command line names the state directory), so a recycled pid is
never killed.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

# Popen objects of the components this Python process started, by pid: kept so they are reaped
# (no zombies, no "still running" ResourceWarning) when the same process stops them.
_STARTED: dict[int, subprocess.Popen[bytes]] = {}


#: Where :func:`free_ports` draws: below the kernel's ephemeral range (whose ports every outgoing
#: connection takes: one free a moment ago could be a connection's by the time the component
#: that was given it binds it, seconds later) and below the range ``ddm up`` draws its servers'
#: ports from (20000-32767), so that tests running beside the cluster never draw its ports.
PORT_RANGE = range(10000, 20000)


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that were free a moment ago, from
    :data:`PORT_RANGE`."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(100 * count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind(("127.0.0.1", random.choice(PORT_RANGE)))  # held: no port twice
            except OSError:
                sock.close()
                continue
            sockets.append(sock)
            if len(sockets) == count:
                return [s.getsockname()[1] for s in sockets]
        raise StartupError(f"no {count} free ports in {PORT_RANGE.start}..{PORT_RANGE.stop - 1} "
                           f"after {100 * count} tries")
    finally:
        for sock in sockets:
            sock.close()


def spawn(command: Sequence[str], log_file: Path) -> int:
    """Start ``command`` in a new session with stdout+stderr to ``log_file``; returns its pid."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        process = subprocess.Popen(
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    _STARTED[process.pid] = process
    return process.pid


def is_ours(pid: int, marker: str) -> bool:
    """Whether ``pid`` runs (not a zombie) with ``marker`` in its command line.

    A component this process started is judged by its Popen (its /proc cmdline can read
    empty for a moment right after the exec).
    """
    process = _STARTED.get(pid)
    if process is not None:
        return process.poll() is None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and marker in cmdline


def stop(pids: Sequence[int], marker: str, *, grace_s: float = 10.0) -> None:
    """SIGTERM the process groups of ``pids`` still ours; SIGKILL what outlives ``grace_s``."""
    alive = [pid for pid in pids if is_ours(pid, marker)]
    for pid in alive:
        _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if is_ours(pid, marker)]
        if alive:
            time.sleep(0.05)  # polling another process's exit: there is no portable wait
    for pid in alive:
        _signal_group(pid, signal.SIGKILL)
    for pid in pids:
        process = _STARTED.pop(pid, None)
        if process is not None:
            process.wait(timeout=grace_s)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)  # the component is its session's (and group's) leader
    except ProcessLookupError:
        pass


# How a Go component's death starts in its log: klog's Fatal (``F1123 20:20:19.005095 ...``),
# which then dumps every goroutine's stack, or the runtime's own panic or fatal error.
_FATAL = re.compile(r"^(F\d{4} \d|panic: |fatal error: )")


def log_tail(log_file: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a component's log, for error messages.

    When the log has a fatal error, the lines up to it: the goroutine dump after it would
    fill the tail and hide why the component died.
    """
    try:
        text = log_file.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    fatal = next((i for i, line in enumerate(text) if _FATAL.match(line)), None)
    if fatal is None:
        return "\n".join(text[-lines:])
    shown = text[max(0, fatal + 1 - lines):fatal + 1]
    return "\n".join([*shown, f"(then {len(text) - fatal - 1} lines of stack dump in {log_file})"])


class StartupError(RuntimeError):
    """A component died or did not become healthy in time; the message has its log's tail."""


def wait_until(
    check: Callable[[], bool],
    *,
    what: str,
    timeout_s: float,
    watched: Sequence[tuple[str, int, Path]],
    marker: str,
    interval_s: float = 0.1,
) -> float:
    """Poll ``check`` until it is true; returns the seconds it took.

    Fails fast, with the component's log tail, as soon as one of ``watched`` (name, pid, log)
    exits; fails after ``timeout_s`` otherwise.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    while True:
        if check():
            return time.monotonic() - started
        for name, pid, log_file in watched:
            if not is_ours(pid, marker):
                raise StartupError(f"{name} exited while waiting for {what}:\n{log_tail(log_file)}")
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {n}:\n{log_tail(f, 10)}" for n, _, f in watched)
            raise StartupError(f"timed out after {timeout_s:.0f} s waiting for {what}\n{tails}")
        time.sleep(interval_s)
