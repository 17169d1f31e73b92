"""Concurrent generations step together (issue 37).

The router runs each generation's sampling loop in a coroutine of its own, and the coalescers
merge the calls that concurrent generations make at the same time. Left alone, generations
drift apart: the text encoder's batches start them in groups, and the groups then alternate,
one group routing while another's expert calls are in flight. Every group then costs its own
forward of each expert it uses at every step, each forward's fixed cost paid again (the
shipped text-to-image DDM at 32 concurrent prompts ran 1.5 times the expert forwards of the
same prompts sampled as one batch).

A :class:`Lockstep` keeps its generations in step. Before each routing and each expert query
a generation asks for its turn, and turns are given in waves: as soon as every generation
stepping has asked (none is between its turn and its next query), every waiting generation
of one kind of query (the kind with the most rows, so that a group out of phase joins the
others at the next wave) gets its turn at once, and their calls, made in the same turn of the
event loop, go as one request per expert or pool. From its turn until its query's answer
lands (:meth:`Stepper.landed`) a generation is in flight, and the waiting ones wait for it:
it asks again as soon as its answer is in, and a group out of phase merges with the others
only by waiting out one of their calls (a model call at a high load takes far longer than a
straggler's timer, so groups released by that timer alternated for good). The waiting ones
wait for it as long as their own last call took at most (a group out of phase is at most a
call ahead of them; generations of a fast expert are not held to a slow one's pace: each
waits at most as long again as it steps), and never past ``max_flight_wait_s``. A
generation held elsewhere (its answer landed, its next query not asked) does not hold the
others for long: ``max_wait_s`` after the first generation began waiting (or after the last
answer landed, if later), every waiting one goes; one that waits for a missing expert steps
out meanwhile (:meth:`Stepper.away`).

A lone generation never waits, and a generation joins the waves only from its first routing
or expert query on (encoding the prompts and decoding are outside them).

**Groups.** One lockstep's waves leave an accelerator idle between them: while the router
routes and steps, no call is on the device (docs/paris.md: the GPU's busy share at 32
concurrent prompts on an H200). A lockstep of ``groups`` > 1 (the router's
``DDM_LOCKSTEP_GROUPS``, :func:`lockstep_groups`) keeps that many groups stepping apart, each
in waves of its own, so that one group's calls can run while another routes; a generation
joins the group with the fewest stepping at its first turn, so that the groups stay even. Each
group's forwards are smaller, and each pays its forwards' fixed cost. By default (``auto``)
the router keeps :data:`ACCELERATOR_GROUPS` where its experts report an accelerator (on an
H200 two groups kept the GPU busier and made more images/s than one: docs/paris.md) and one
elsewhere (on a CPU the router's work and the model's
share the same cores); ``open_groups`` says how many of its groups new generations join.

Which generations take part is the router's choice (``RouterState.guard``: not a streamed
one, whose previews would hold the others, nor one delegating chunks of steps). One event loop
only, as the coalescers.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping

from ddm.serving.router.fleet.replicas import on_accelerator

__all__ = ["ACCELERATOR_GROUPS", "LOCKSTEP_GROUPS_ENV", "MAX_FLIGHT_WAIT_S", "MAX_GROUPS",
           "MAX_WAIT_S", "Lockstep", "Stepper", "WaveObserver", "auto_groups", "lockstep_groups"]

#: The longest a generation waits for the others of its wave: past it, the waiting ones go
#: without a generation that is held elsewhere.
MAX_WAIT_S = 0.02
#: The longest the waiting generations wait where every other one stepping is in flight,
#: however long their own calls take.
MAX_FLIGHT_WAIT_S = 1.0
#: The router's environment variable that sets its lockstep's groups (module docstring).
LOCKSTEP_GROUPS_ENV = "DDM_LOCKSTEP_GROUPS"
#: The most groups a lockstep keeps: beyond a few, each group's batches only get smaller.
MAX_GROUPS = 8
#: ``auto``'s groups where the experts run on an accelerator (module docstring).
ACCELERATOR_GROUPS = 2


def lockstep_groups(env: Mapping[str, str]) -> int | None:
    """:data:`LOCKSTEP_GROUPS_ENV`'s value in ``env``: a number of groups, None for ``auto``
    (also where unset), or a ``ValueError`` naming the choices."""
    text = env.get(LOCKSTEP_GROUPS_ENV, "").strip().lower() or "auto"
    if text == "auto":
        return None
    if not (text.isdigit() and 1 <= int(text) <= MAX_GROUPS):
        raise ValueError(f"{LOCKSTEP_GROUPS_ENV}={env[LOCKSTEP_GROUPS_ENV]!r}: give auto or a "
                         f"whole number of groups from 1 to {MAX_GROUPS}")
    return int(text)


def auto_groups(devices: Iterable[str | None]) -> int:
    """``auto``'s groups for experts that report ``devices`` (None: not said):
    :data:`ACCELERATOR_GROUPS` where any is an accelerator, else one."""
    return ACCELERATOR_GROUPS if any(map(on_accelerator, devices)) else 1


@dataclass(eq=False)
class _Waiter:
    kind: str
    rows: int
    future: asyncio.Future[None]
    #: How long its generation's last query was in flight: how long it waits for others'.
    patience_s: float


#: Told of each wave: how many generations it let go, and whether the timer let them
#: (a generation was held elsewhere) rather than every generation stepping having asked.
WaveObserver = Callable[[int, bool], None]


class Lockstep:
    """Gives the turns of the generations stepping together (the module docstring), in
    ``groups`` groups stepping apart, of which a new generation joins one of the first
    ``open_groups()`` (all where not given; at least the first, at most all); each generation
    takes part through its own :meth:`stepper`; ``on_wave`` sees every group's every wave."""

    def __init__(self, max_wait_s: float = MAX_WAIT_S,
                 on_wave: WaveObserver | None = None,
                 max_flight_wait_s: float = MAX_FLIGHT_WAIT_S, groups: int = 1,
                 open_groups: Callable[[], int] | None = None) -> None:
        for name, value in (("max_wait_s", max_wait_s),
                            ("max_flight_wait_s", max_flight_wait_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if isinstance(groups, bool) or not isinstance(groups, int) or \
                not 1 <= groups <= MAX_GROUPS:
            raise ValueError(f"groups must be a whole number from 1 to {MAX_GROUPS}, "
                             f"got {groups!r}")
        self._groups = tuple(_Group(max_wait_s, max(max_flight_wait_s, max_wait_s), on_wave)
                             for _ in range(groups))
        self._open_groups = open_groups

    @property
    def stepping(self) -> int:
        """Generations stepping together now, in every group."""
        return sum(group.stepping for group in self._groups)

    @property
    def groups(self) -> tuple[int, ...]:
        """How many generations step in each group now."""
        return tuple(group.stepping for group in self._groups)

    def stepper(self) -> Stepper:
        """A new generation's part in the waves (it joins a group at its first turn)."""
        return Stepper(self)

    def _group(self) -> _Group:
        """The group a generation joins: of the open ones, the one with the fewest stepping
        (the first of those)."""
        count = len(self._groups) if self._open_groups is None else self._open_groups()
        return min(self._groups[:max(1, min(count, len(self._groups)))],
                   key=lambda group: group.stepping)


class _Group:
    """One group's waves (the module docstring)."""

    def __init__(self, max_wait_s: float, max_flight_wait_s: float,
                 on_wave: WaveObserver | None) -> None:
        self._max_wait_s = max_wait_s
        self._max_flight_wait_s = max_flight_wait_s
        self._on_wave = on_wave
        self.stepping = 0
        self._flying = 0  # of those stepping, how many have a query in flight
        self._waiting: list[_Waiter] = []
        self._patience_s = 0.0  # the longest of the waiting ones' patience
        #: When the first of the waiting generations began waiting (the loop's time).
        self._since = 0.0
        #: When a query's answer last landed: the generation is then held elsewhere.
        self._landed = 0.0
        #: The timer, and when it lets the waiting ones go (uvloop's handles do not say).
        self._timer: asyncio.Handle | None = None
        self._deadline = 0.0

    def _join(self) -> None:
        self.stepping += 1

    def _leave(self) -> None:
        self.stepping -= 1
        self._consider()

    def _flight(self, change: int) -> None:
        self._flying += change
        if change < 0:
            self._landed = asyncio.get_running_loop().time()
        self._consider()

    async def _turn(self, kind: str, rows: int, patience_s: float) -> None:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(kind, rows, loop.create_future(), patience_s)
        if not self._waiting:
            self._since = loop.time()
        self._waiting.append(waiter)
        self._patience_s = max(self._patience_s, patience_s)
        self._consider()
        if waiter.future.done():  # every other generation was waiting too
            return
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter in self._waiting:
                self._waiting.remove(waiter)
                self._patience_s = max((w.patience_s for w in self._waiting), default=0.0)
                self._consider()
            raise

    def _consider(self) -> None:
        """Give a wave its turn when every generation stepping waits; else keep a timer: while
        every other generation is in flight, as long as the waiting ones' own last calls
        took (bounded), and while one is held elsewhere, the straggler's (from when the last
        answer landed, at the earliest)."""
        if not self._waiting:
            self._stop_timer()
        elif len(self._waiting) >= self.stepping:
            rows: Counter[str] = Counter()
            for waiter in self._waiting:
                rows[waiter.kind] += waiter.rows
            self._release(max(rows, key=rows.__getitem__), by_timer=False)
        else:
            if len(self._waiting) + self._flying >= self.stepping:
                deadline = self._since + min(max(self._patience_s, self._max_wait_s),
                                             self._max_flight_wait_s)
            else:  # one is held elsewhere: since they began waiting, or since it landed
                deadline = max(self._since, self._landed) + self._max_wait_s
            if self._timer is None or self._deadline != deadline:
                self._stop_timer()
                self._deadline = deadline
                self._timer = asyncio.get_running_loop().call_at(deadline, self._expired)

    def _expired(self) -> None:
        self._timer = None
        self._release(None, by_timer=True)

    def _release(self, kind: str | None, by_timer: bool) -> None:
        """Give every waiter of ``kind`` (None: every waiter) its turn."""
        self._stop_timer()
        going = [w for w in self._waiting if kind is None or w.kind == kind]
        self._waiting = [w for w in self._waiting if not (kind is None or w.kind == kind)]
        self._patience_s = max((w.patience_s for w in self._waiting), default=0.0)
        for waiter in going:
            if not waiter.future.done():
                waiter.future.set_result(None)
        if going and self._on_wave is not None:
            self._on_wave(len(going), by_timer)
        if self._waiting:  # passed over for another kind: they go with the next wave
            self._since = asyncio.get_running_loop().time()
            self._consider()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Stepper:
    """One generation's part in a :class:`Lockstep`: it steps with the others from its first
    :meth:`turn` until :meth:`leave`, and steps out while :meth:`away`."""

    def __init__(self, lockstep: Lockstep) -> None:
        self._lockstep = lockstep
        self._group: _Group | None = None  # joined at its first turn
        self._state = "new"  # then "in", "away" (and back), "left"
        self._flying = False
        self._took_off = 0.0  # when its query in flight got its turn (the loop's time)
        #: How long its last query was in flight, in seconds.
        self.last_flight_s = 0.0

    async def turn(self, kind: str, rows: int) -> None:
        """Returns when it is this generation's turn to make its ``kind`` query of ``rows``
        rows (at once once it has left); its query is then in flight until :meth:`landed`."""
        if self._state == "left":
            return
        self.landed()
        if self._state == "new":
            self._state = "in"
            self._group = self._lockstep._group()
            self._group._join()
        assert self._group is not None
        await self._group._turn(kind, rows, self.last_flight_s)
        if self._state == "in":
            self._flying = True
            self._took_off = asyncio.get_running_loop().time()
            self._group._flight(+1)

    def landed(self) -> None:
        """Its query's answer (or failure) is in: the others wait for it no longer than for
        a generation held elsewhere."""
        if self._flying:
            self._flying = False
            self.last_flight_s = asyncio.get_running_loop().time() - self._took_off
            self._group._flight(-1)

    def leave(self) -> None:
        """The generation steps no more (it decodes, or it ended): the others go on without
        it."""
        self.landed()
        if self._state == "in":
            self._group._leave()
        self._state = "left"

    @contextmanager
    def away(self) -> Iterator[None]:
        """Steps out while inside (the generation waits for a missing expert), so that the
        others do not wait for it."""
        if self._state != "in":
            yield
            return
        self.landed()
        self._state = "away"
        self._group._leave()
        try:
            yield
        finally:
            if self._state == "away":
                self._state = "in"
                self._group._join()
