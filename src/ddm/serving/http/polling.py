"""Hybrid polling: an event loop that awaits something long whose time it can expect keeps its
vCPU warm over the last fifth of the wait, so that what runs when the wait ends runs warm.

On a virtual machine, Python run right after its vCPU sat idle for milliseconds runs far slower
than warm (``python -m benchmarks calls``: ``cold_code``; docs/benchmarks.md, ``calls``), so an
event loop that sleeps through an expert's model run pays for the few lines that deliver its
result many times over. Linux polls NVMe completions the same way: sleep through most of
the expected time, then poll. Two waits use it, each with :func:`first_tick_s`,
:class:`WarmTicks` and :class:`LastTimes`: an expert's loop awaiting a batch on its model
thread (:class:`ddm.serving.batching.Batcher`), and the router's loop awaiting an expert's
reply (:class:`ddm.serving.http.client.HttpClient`).

A tick is a timer callback that does nothing but decide the next one, so it is cheap; ticking
only over a wait's last fifth keeps the cost a small share of a core while such waits run, and
nothing while the loop has nothing to await. A wait that runs far past its expected time (an
expert queueing other calls) ticks until it ends (the figures: docs/benchmarks.md, ``calls``)."""

from __future__ import annotations

import asyncio
from typing import Callable, Generic, Hashable, TypeVar

#: Ticks start at WARM_AFTER of a wait's expected time and come every WARM_TICK_S until it ends.
WARM_AFTER = 0.8
WARM_TICK_S = 0.001
#: Waits expected to be shorter do not tick: a vCPU idle for a few milliseconds comes back
#: nearly warm, and a tick can take the core from the very work awaited when both share a
#: machine (``cold_code`` and the client's ticks on short calls: docs/benchmarks.md, ``calls``).
WARM_MIN_S = 0.02

Key = TypeVar("Key", bound=Hashable)


def first_tick_s(expected_s: float | None) -> float | None:
    """Seconds from the start of a wait expected to take ``expected_s`` to its first tick;
    None for a wait that does not tick: its time unknown, or under :data:`WARM_MIN_S`."""
    if expected_s is None or expected_s < WARM_MIN_S:
        return None
    return WARM_AFTER * expected_s


class LastTimes(Generic[Key]):
    """How long the next job of a key is expected to take: the key's last time, scaled up
    (never down) to the job's size, so that a bigger job is never expected to be quicker (a
    batcher must not run it on its event loop, nor tick for it early); None for a key not
    seen yet. Remembers the ``capacity`` keys recorded last: a peer may make any number of keys
    (every grid a client sends is one), so the oldest is forgotten."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"LastTimes needs capacity >= 1, got {capacity}")
        self._capacity = capacity
        self._times: dict[Key, tuple[float, int]] = {}  # key -> (seconds, size), oldest first

    def record(self, key: Key, seconds: float, size: int) -> None:
        """A job of ``key`` and ``size`` (rows, bytes: any measure its time grows with) took
        ``seconds``."""
        self._times.pop(key, None)
        self._times[key] = (seconds, max(1, size))
        if len(self._times) > self._capacity:
            del self._times[next(iter(self._times))]

    def expected(self, key: Key, size: int) -> float | None:
        """Seconds a job of ``key`` and ``size`` is expected to take."""
        last = self._times.get(key)
        if last is None:
            return None
        seconds, last_size = last
        return seconds * max(1.0, size / last_size)


class WarmTicks:
    """A chain of ticks on one event loop. ``next_delay()``, asked at every tick, says in how
    many seconds the next is due (at least :data:`WARM_TICK_S`), or None to end the chain.
    Use it on its loop only."""

    def __init__(self, next_delay: Callable[[], float | None]) -> None:
        self._next_delay = next_delay
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0  # the loop's time of the next tick (uvloop's handles do not say)

    @property
    def ticking(self) -> bool:
        """A tick is due."""
        return self._handle is not None

    def due_in(self, seconds: float) -> None:
        """A tick at most ``seconds`` from now: starts the chain, or brings its next tick
        forward (a later wait never delays an earlier one's ticks)."""
        loop = asyncio.get_running_loop()
        due = loop.time() + seconds
        if self._handle is not None:
            if self._due <= due:
                return
            self._handle.cancel()
        self._handle, self._due = loop.call_at(due, self._tick), due

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        delay = self._next_delay()
        if delay is None:
            self._handle = None
            return
        loop = asyncio.get_running_loop()
        self._due = loop.time() + max(WARM_TICK_S, delay)
        self._handle = loop.call_at(self._due, self._tick)
