"""Where a served level's host time goes: py-spy samples of each process while it runs.

At one prompt on a GPU a compiled step spends most of its time outside the GPU (docs/paris.md:
the GPU busy 36-43% of a 19.4 ms step), and whether that time is Python holding the
interpreter (the router's loop, the pool's HTTP handling, the batchers' staging) or waiting
(on the GPU, on the network, on another thread) decides what to cut. So each process of a level
is sampled with py-spy (a sampling profiler that reads another process's stacks: no change to
the servers, which it never pauses: ``--nonblocking``, so that the level's figures stay what
they would be), counting only the samples of threads that hold the GIL: their share of the
level's samples is how busy the interpreter was, and the frames they were in are where.

py-spy is a dev dependency (and a device wheel): where it is missing, or may not read another
process (ptrace refused), the figures say so instead of failing the benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

__all__ = ["host_profile", "summarise"]

#: Samples per second and process (py-spy's default).
RATE_HZ = 100
#: How many frames each ranking keeps.
TOP = 12
#: A frame on the stack of at least this share of the samples (the event loop's run, a
#: thread's bootstrap) says nothing about where the time went: ``inclusive`` leaves it out.
OUTER_SHARE = 0.9
#: How long py-spy may take to start sampling, and to write its samples once asked to stop.
WAIT_S = 30.0


def py_spy() -> str | None:
    """The py-spy executable: on ``PATH``, else beside this Python (a virtualenv's bin)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else None


@contextlib.asynccontextmanager
async def host_profile(pids: dict[str, int]) -> AsyncIterator[dict[str, Any]]:
    """Sample each of ``pids`` (by name) from entry to exit; the dict yielded is filled on exit
    with :func:`summarise`'s figures per process (or ``{"error": why}``)."""
    figures: dict[str, Any] = {}
    executable = py_spy()
    if executable is None:
        yield figures
        figures.update({name: {"error": "py-spy is not installed"} for name in pids})
        return
    with tempfile.TemporaryDirectory(prefix="ddm-host-profile-") as directory:
        recorders, said = {}, {}
        started = None
        try:
            for name, pid in pids.items():
                output = Path(directory) / f"{pid}.txt"
                recorder = await asyncio.create_subprocess_exec(
                    executable, "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--gil",
                    "--nonblocking", "--function", "--format", "raw", "--output", str(output),
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                recorders[name] = (output, recorder)
                said[name] = await _sampling(recorder)
            started = time.perf_counter()
            yield figures
        finally:
            seconds = 0.0 if started is None else time.perf_counter() - started
            for name, (output, recorder) in recorders.items():
                figures[name] = await _stopped(recorder, output, seconds, said.get(name, []))


async def _sampling(recorder: asyncio.subprocess.Process) -> list[str]:
    """Wait until py-spy says it samples (so that the level's start is in its samples), or
    has ended (it could not read the process); the lines it said meanwhile (on stdout: its
    errors go to stderr)."""
    assert recorder.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            line = await asyncio.wait_for(recorder.stdout.readline(),
                                          deadline - time.monotonic())
        except asyncio.TimeoutError:
            break
        if not line:  # ended
            break
        lines.append(line.decode(errors="replace").strip())
        if lines[-1].startswith("py-spy> Sampling"):
            break
    return lines


async def _stopped(recorder: asyncio.subprocess.Process, output: Path, seconds: float,
                   said: list[str]) -> dict[str, Any]:
    """Stop one recorder as Ctrl-C would (py-spy then writes its samples) and summarise them;
    where it sampled nothing, the last thing it said."""
    if recorder.returncode is None:
        recorder.send_signal(signal.SIGINT)
    try:
        stdout, stderr = await asyncio.wait_for(recorder.communicate(), WAIT_S)
    except asyncio.TimeoutError:
        recorder.kill()
        await recorder.wait()
        return {"error": f"py-spy did not stop within {WAIT_S:g} s"}
    if not any(line.startswith("py-spy> Sampling") for line in said) or not output.is_file():
        lines = [line.strip() for line in (*said, *(stdout + stderr).decode(
            errors="replace").splitlines()) if line.strip()]
        why = next((line for line in lines if line.startswith("Error")),
                   lines[-1] if lines else "no message")
        return {"error": f"py-spy sampled nothing (exit {recorder.returncode}): {why}"}
    return summarise(output.read_text(), seconds)


def summarise(raw: str, seconds: float, rate_hz: int = RATE_HZ) -> dict[str, Any]:
    """py-spy's raw output (``frame;frame;... count`` per line, outermost frame first) as the
    GIL's share of the samples a process could have given in ``seconds`` (a little over 1 may
    be: py-spy samples a little past the level's ends), and the functions most often running
    (``self``) and on the stack (``inclusive``, below :data:`OUTER_SHARE`) when it was held,
    each with its share of those samples."""
    own: Counter[str] = Counter()
    within: Counter[str] = Counter()
    held = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [_function(frame) for frame in stack.split(";")]
        held += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            within[frame] += int(count)
    below = Counter({frame: count for frame, count in within.items()
                     if count < OUTER_SHARE * held})
    return {"seconds": round(seconds, 3), "gil_samples": held,
            "gil_share": round(held / max(seconds * rate_hz, 1), 3),
            "self": _ranked(own, held), "inclusive": _ranked(below, held)}


def _function(frame: str) -> str:
    """``name (package/module.py:line)`` as ``name (package/module.py)``: one entry per
    function (``--function`` gives each the line it starts at)."""
    name, _, where = frame.partition(" (")
    module = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({module})" if module else name


def _ranked(counts: Counter[str], total: int) -> list[list[Any]]:
    return [[frame, round(count / total, 3)] for frame, count in counts.most_common(TOP)]
