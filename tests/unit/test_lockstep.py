"""The router's lockstep: when concurrent generations get their turns.

Each test drives :class:`~ddm.serving.router.fleet.lockstep.Lockstep` with generations played
by coroutines that record when they got each turn; "time" is the event loop's, and the
timers (for a straggler, for a call in flight) are the only things that wait for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any, Callable, Coroutine, TypeVar

import pytest
import uvloop

from ddm.deploy.router_config import RouterConfigFile
from ddm.sampling.loop import SamplingRequest
from ddm.sampling.routing import parse_strategy
from ddm.serving.router.api.state import RouterState
from ddm.serving.router.fleet.lockstep import (LOCKSTEP_GROUPS_ENV, Lockstep, auto_groups,
                                               lockstep_groups)

T = TypeVar("T")
DIGITS = Path(__file__).resolve().parents[2] / "checkpoints" / "digits"

@pytest.fixture(params=[asyncio.new_event_loop, uvloop.new_event_loop],
                ids=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, T]], T]:
    """Runs a scenario on a fresh loop of each kind: the router's is uvloop's (whose timer
    handles differ from asyncio's)."""

    def run_on_loop(scenario: Coroutine[Any, Any, T]) -> T:
        loop = request.param()
        try:
            return loop.run_until_complete(scenario)
        finally:
            loop.close()

    return run_on_loop


#: uvloop's clock counts milliseconds: a timer may fire a rounding error early by the loop's
#: own time.
CLOCK_S = 0.001
#: Long enough that no wave in these tests goes by the timer unless the test waits for it.
PATIENT_S = 30.0


async def settle() -> None:
    """Let every ready callback run (turns given, calls made)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def stepping_together(lockstep: Lockstep, n: int) -> list:
    """``n`` generations that took a turn in the same wave (each is between two queries)."""
    steppers = [lockstep.stepper() for _ in range(n)]
    # The first joins and goes at once; the others join and wait for it to ask again.
    later = [asyncio.create_task(s.turn("Route", 1)) for s in steppers]
    await settle()
    await steppers[0].turn("Route", 1)
    await asyncio.wait_for(asyncio.gather(*later), 0.5)
    return steppers


def test_a_lone_generation_never_waits(run):
    async def scenario() -> None:
        lockstep = Lockstep(max_wait_s=PATIENT_S)
        stepper = lockstep.stepper()
        for _ in range(3):
            await asyncio.wait_for(stepper.turn("Route", 1), 0.5)
            await asyncio.wait_for(stepper.turn("Calls", 1), 0.5)
        assert lockstep.stepping == 1
        stepper.leave()
        assert lockstep.stepping == 0

    run(scenario())


def test_a_wave_goes_once_every_generation_stepping_waits(run):
    async def scenario() -> list[str]:
        lockstep = Lockstep(max_wait_s=PATIENT_S)
        a, b = await stepping_together(lockstep, 2)
        c = lockstep.stepper()
        got: list[str] = []

        async def turn(name: str, stepper) -> None:
            await stepper.turn("Route", 1)
            got.append(name)

        waiting = [asyncio.create_task(turn("a", a)), asyncio.create_task(turn("c", c))]
        await settle()
        assert got == []  # b is still between its turn and its next query
        waiting.append(asyncio.create_task(turn("b", b)))
        await settle()
        await asyncio.gather(*waiting)
        return got

    assert sorted(run(scenario())) == ["a", "b", "c"]


def test_a_group_out_of_phase_joins_the_others_at_the_next_wave(run):
    """Two generations want to route while one wants its experts: the routing (more rows) goes
    first, and then the three ask their experts in one wave."""
    async def scenario() -> list[list[str]]:
        lockstep = Lockstep(max_wait_s=PATIENT_S)
        steppers = dict(zip("abc", await stepping_together(lockstep, 3)))
        waves: list[list[str]] = []

        async def turn(name: str, kind: str) -> None:
            await steppers[name].turn(kind, 1)
            waves[-1].append(f"{name}:{kind}")

        waves.append([])
        tasks = [asyncio.create_task(turn("a", "Route")), asyncio.create_task(turn("b", "Route")),
                 asyncio.create_task(turn("c", "Calls"))]
        await settle()
        assert sorted(waves[-1]) == ["a:Route", "b:Route"]  # c waits for the next wave
        waves.append([])
        tasks += [asyncio.create_task(turn("a", "Calls")), asyncio.create_task(turn("b", "Calls"))]
        await settle()
        await asyncio.gather(*tasks)
        return waves

    first, second = run(scenario())
    assert sorted(first) == ["a:Route", "b:Route"]
    assert sorted(second) == ["a:Calls", "b:Calls", "c:Calls"]


def test_the_kind_with_the_most_rows_goes_first(run):
    async def scenario() -> list[str]:
        lockstep = Lockstep(max_wait_s=PATIENT_S)
        a, b = await stepping_together(lockstep, 2)
        went: list[str] = []

        async def turn(name: str, stepper, kind: str, rows: int) -> None:
            await stepper.turn(kind, rows)
            went.append(name)

        tasks = [asyncio.create_task(turn("a", a, "Route", 2)),
                 asyncio.create_task(turn("b", b, "Calls", 5))]
        await settle()
        order = list(went)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return order

    assert run(scenario()) == ["b"]


def test_a_straggler_holds_the_others_only_for_max_wait(run):
    waves: list[tuple[int, bool]] = []

    async def scenario() -> tuple[float, bool]:
        lockstep = Lockstep(max_wait_s=0.05, max_flight_wait_s=PATIENT_S,
                            on_wave=lambda n, by_timer: waves.append((n, by_timer)))
        a, straggler = await stepping_together(lockstep, 2)
        straggler.landed()  # its answer is in, and it never asks again
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(a.turn("Calls", 1), PATIENT_S)
        return loop.time() - started, lockstep.stepping == 2

    waited, both_stepping = run(scenario())
    assert 0.05 - CLOCK_S <= waited < PATIENT_S and both_stepping
    # stepping_together's two waves (the first alone, then both), then the timer's.
    assert waves == [(1, False), (2, False), (1, True)]


def test_a_generation_in_flight_is_waited_for_past_max_wait(run):
    """A group out of phase merges with the others by waiting out their call: here b's
    answer takes ten times max_wait_s (and less than a's own call took), and a's routing
    still goes with b's."""
    waves: list[tuple[int, bool]] = []

    async def scenario() -> None:
        lockstep = Lockstep(max_wait_s=0.01, max_flight_wait_s=PATIENT_S,
                            on_wave=lambda n, by_timer: waves.append((n, by_timer)))
        a, b = await stepping_together(lockstep, 2)
        await asyncio.sleep(0.3)  # a's call
        a.landed()
        a_routes = asyncio.create_task(a.turn("Route", 1))
        await asyncio.sleep(0.1)  # b's call is still in flight
        assert not a_routes.done()
        b.landed()
        await asyncio.wait_for(b.turn("Route", 1), 0.5)
        await asyncio.wait_for(a_routes, 0.5)

    run(scenario())
    assert waves == [(1, False), (2, False), (2, False)]


def test_a_call_in_flight_holds_the_others_only_for_max_flight_wait(run):
    waves: list[tuple[int, bool]] = []

    async def scenario() -> float:
        lockstep = Lockstep(max_wait_s=0.01, max_flight_wait_s=0.1,
                            on_wave=lambda n, by_timer: waves.append((n, by_timer)))
        a, _ = await stepping_together(lockstep, 2)  # the other's answer never lands
        await asyncio.sleep(0.3)  # a's call took longer than max_flight_wait_s
        a.landed()
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(a.turn("Calls", 1), PATIENT_S)
        return loop.time() - started

    assert 0.1 - CLOCK_S <= run(scenario()) < PATIENT_S
    assert waves == [(1, False), (2, False), (1, True)]


def test_a_generation_waits_for_one_in_flight_no_longer_than_its_own_call_took(run):
    """Generations of a fast expert are not held to a slow one's pace: a, whose call took
    0.1 s, waits 0.1 s for b, whose call never ends here."""
    waves: list[tuple[int, bool]] = []

    async def scenario() -> float:
        lockstep = Lockstep(max_wait_s=0.01, max_flight_wait_s=PATIENT_S,
                            on_wave=lambda n, by_timer: waves.append((n, by_timer)))
        a, _ = await stepping_together(lockstep, 2)
        await asyncio.sleep(0.1)
        a.landed()
        assert a.last_flight_s >= 0.1 - CLOCK_S
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(a.turn("Route", 1), PATIENT_S)
        return loop.time() - started

    assert 0.1 - 2 * CLOCK_S <= run(scenario()) < 1.0
    assert waves == [(1, False), (2, False), (1, True)]


def test_an_answer_landing_shortens_the_wait_to_max_wait(run):
    """Once every other generation's answer is in, the waiting ones wait only max_wait_s
    more: a generation that then holds elsewhere is a straggler."""
    async def scenario() -> float:
        lockstep = Lockstep(max_wait_s=0.05, max_flight_wait_s=PATIENT_S)
        a, b = await stepping_together(lockstep, 2)
        await asyncio.sleep(0.5)  # a's call: it would wait that long for b's
        a.landed()
        loop = asyncio.get_running_loop()
        started = loop.time()
        a_calls = asyncio.create_task(a.turn("Calls", 1))
        await asyncio.sleep(0.2)  # past max_wait_s, b still in flight: a waits
        assert not a_calls.done()
        b.landed()  # and b never asks
        await asyncio.wait_for(a_calls, PATIENT_S)
        return loop.time() - started

    assert 0.25 - CLOCK_S <= run(scenario()) < 1.0


def test_leaving_or_stepping_away_lets_the_wave_go_without_it(run):
    async def scenario() -> None:
        lockstep = Lockstep(max_wait_s=PATIENT_S)
        a, b, c = await stepping_together(lockstep, 3)
        waiting = asyncio.create_task(a.turn("Calls", 1))
        await settle()
        assert not waiting.done()
        b.leave()  # b decodes
        await settle()
        assert not waiting.done()
        with c.away():  # c waits for a missing expert
            await asyncio.wait_for(waiting, 0.5)
            assert lockstep.stepping == 1
            await asyncio.wait_for(a.turn("Route", 1), 0.5)  # a alone: no wait
        assert lockstep.stepping == 2  # c steps with a again
        b.leave()
        c.leave()
        a.leave()
        assert lockstep.stepping == 0

    run(scenario())


def test_a_cancelled_wait_is_no_longer_waited_for(run):
    async def scenario() -> None:
        lockstep = Lockstep(max_wait_s=PATIENT_S)
        a, b, c = await stepping_together(lockstep, 3)
        cancelled = asyncio.create_task(a.turn("Calls", 1))
        await settle()
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        a.leave()  # its generation ended (the client went away)
        b_turn = asyncio.create_task(b.turn("Calls", 1))
        await settle()
        assert not b_turn.done()  # c still steps
        await asyncio.wait_for(c.turn("Calls", 1), 0.5)
        await asyncio.wait_for(b_turn, 0.5)

    run(scenario())


def test_max_wait_must_be_positive():
    with pytest.raises(ValueError, match="max_wait_s must be > 0, got 0"):
        Lockstep(max_wait_s=0)
    with pytest.raises(ValueError, match="max_flight_wait_s must be > 0, got -1"):
        Lockstep(max_flight_wait_s=-1)


def test_generations_join_the_group_with_the_fewest_stepping_and_step_apart(run):
    """Two groups: a, c and e step in the first, b and d in the second (each joins the group
    with the fewest stepping at its first turn); a group's wave goes once its own generations
    ask, while the other group's call is still in flight: one group's calls can run while
    the other routes."""

    async def scenario() -> None:
        waves: list[int] = []
        lockstep = Lockstep(max_wait_s=PATIENT_S, max_flight_wait_s=PATIENT_S, groups=2,
                            on_wave=lambda n, by_timer: waves.append(n))
        steppers = dict(zip("abcde", (lockstep.stepper() for _ in range(5))))
        assert lockstep.groups == (0, 0)
        first = {}
        for name, stepper in steppers.items():
            first[name] = asyncio.create_task(stepper.turn("Route", 1))
            await settle()
        assert lockstep.groups == (3, 2) and lockstep.stepping == 5
        # a and b, each alone in its group when it joined, went at once and are in flight;
        # c and e wait for a, d for b.
        assert [name for name, task in first.items() if task.done()] == ["a", "b"]
        assert waves == [1, 1]

        # b's answer lands and it asks again: its group's wave goes with d, a still in flight.
        b_again = asyncio.create_task(steppers["b"].turn("Route", 1))
        await settle()
        assert b_again.done() and first["d"].done()
        assert not first["c"].done() and not first["e"].done()
        assert waves == [1, 1, 2]

        # a's lands: the first group's wave.
        a_again = asyncio.create_task(steppers["a"].turn("Route", 1))
        await settle()
        assert a_again.done() and first["c"].done() and first["e"].done()
        assert waves == [1, 1, 2, 3]
        for stepper in steppers.values():
            stepper.leave()
        assert lockstep.groups == (0, 0)

    run(scenario())


def test_groups_must_be_a_whole_number_in_range():
    for bad in (0, 9, 1.5, True):
        with pytest.raises(ValueError, match=rf"groups must be a whole number from 1 to 8, "
                                             rf"got {bad!r}"):
            Lockstep(groups=bad)
    assert lockstep_groups({LOCKSTEP_GROUPS_ENV: " 2 "}) == 2
    assert lockstep_groups({LOCKSTEP_GROUPS_ENV: "1"}) == 1
    # Unset, empty or auto: the router picks by its experts' devices.
    assert lockstep_groups({}) is lockstep_groups({LOCKSTEP_GROUPS_ENV: " "}) is None
    assert lockstep_groups({LOCKSTEP_GROUPS_ENV: "Auto"}) is None
    for bad in ("0", "two", "9", "-1"):
        with pytest.raises(ValueError, match=rf"DDM_LOCKSTEP_GROUPS='{bad}': give auto or a "
                                             r"whole number of groups from 1 to 8"):
            lockstep_groups({LOCKSTEP_GROUPS_ENV: bad})


@pytest.mark.parametrize("devices, groups", [
    (["cuda:0"], 2), (["cpu", "cuda:0"], 2), (["xla:0"], 2), (["neuron"], 2),
    (["cpu", "CPU"], 1), ([None], 1), ([], 1)])
def test_auto_keeps_two_groups_where_an_expert_reports_an_accelerator(devices, groups):
    assert auto_groups(devices) == groups


def test_new_generations_join_only_the_open_groups(run):
    """``open_groups`` is asked at each generation's first turn: while it says one, every
    generation joins the first group (their calls merge); once it says two, the next joins the
    second, the emptier, and those already stepping stay where they are."""

    async def scenario() -> None:
        open_now = [1]
        lockstep = Lockstep(max_wait_s=PATIENT_S, max_flight_wait_s=PATIENT_S, groups=2,
                            open_groups=lambda: open_now[0])
        steppers = [lockstep.stepper() for _ in range(4)]
        turns = []
        for stepper in steppers[:2]:
            turns.append(asyncio.create_task(stepper.turn("Route", 1)))
            await settle()
        assert lockstep.groups == (2, 0)
        open_now[0] = 2
        for stepper in steppers[2:]:
            turns.append(asyncio.create_task(stepper.turn("Route", 1)))
            await settle()
        assert lockstep.groups == (2, 2)
        open_now[0] = 5  # more than it keeps: all of them
        late = lockstep.stepper()
        turns.append(asyncio.create_task(late.turn("Route", 1)))
        await settle()
        assert lockstep.groups == (3, 2)
        for stepper in (*steppers, late):
            stepper.leave()
        await asyncio.gather(*turns)

    run(scenario())


def test_a_router_s_generations_step_together_unless_streamed_or_delegating(run):
    """Who takes part (``RouterState.guard``): a stream's previews and a delegated chunk (one
    call for many steps) would hold every other generation's waves."""
    config = RouterConfigFile.from_dict({
        "experts": [{"name": "expert-0-4", "classes": [0, 1, 2, 3, 4],
                     "discovery": {"endpoints": ["127.0.0.1:9"]}},
                    {"name": "expert-5-9", "classes": [5, 6, 7, 8, 9],
                     "discovery": {"endpoints": ["127.0.0.1:9"]}}],
        "router_checkpoint": str(DIGITS / "router")})
    request = SamplingRequest(labels=(3,), steps=4, seed=0, strategy=parse_strategy("top1"))

    async def scenario() -> None:
        router = RouterState(config)
        one, two = router.guard(request), router.guard(request)
        assert one.stepper is not None and two.stepper is not None
        await asyncio.wait_for(one.stepper.turn("Route", 1), 0.5)
        waiting = asyncio.create_task(two.stepper.turn("Route", 1))
        await settle()
        assert not waiting.done()  # the same lockstep: two waits for one's next query
        one.stepper.leave()
        await asyncio.wait_for(waiting, 0.5)
        assert router.guard(request, streamed=True).stepper is None
        assert router.guard(dataclasses.replace(request, delegate_steps=2)).stepper is None
        assert router.guard(dataclasses.replace(request, delegate_steps=1)).stepper is not None

    run(scenario())
