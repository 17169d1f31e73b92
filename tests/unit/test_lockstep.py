"""The router's lockstep: when concurrent generations get their turns.

Each test drives :class:`~ddm.serving.router.fleet.lockstep.Lockstep` with generations played
by coroutines that record when they got each turn; "time" is the event loop's, and the
straggler timer is the only thing that waits for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from ddm.deploy.router_config import RouterConfigFile
from ddm.sampling.loop import SamplingRequest
from ddm.sampling.routing import parse_strategy
from ddm.serving.router.api.state import RouterState
from ddm.serving.router.fleet.lockstep import Lockstep

DIGITS = Path(__file__).resolve().parents[2] / "checkpoints" / "digits"

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


def test_a_lone_generation_never_waits():
    async def scenario() -> None:
        lockstep = Lockstep(max_wait_s=PATIENT_S)
        stepper = lockstep.stepper()
        for _ in range(3):
            await asyncio.wait_for(stepper.turn("Route", 1), 0.5)
            await asyncio.wait_for(stepper.turn("Calls", 1), 0.5)
        assert lockstep.stepping == 1
        stepper.leave()
        assert lockstep.stepping == 0

    asyncio.run(scenario())


def test_a_wave_goes_once_every_generation_stepping_waits():
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

    assert sorted(asyncio.run(scenario())) == ["a", "b", "c"]


def test_a_group_out_of_phase_joins_the_others_at_the_next_wave():
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

    first, second = asyncio.run(scenario())
    assert sorted(first) == ["a:Route", "b:Route"]
    assert sorted(second) == ["a:Calls", "b:Calls", "c:Calls"]


def test_the_kind_with_the_most_rows_goes_first():
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

    assert asyncio.run(scenario()) == ["b"]


def test_a_straggler_holds_the_others_only_for_max_wait():
    waves: list[tuple[int, bool]] = []

    async def scenario() -> tuple[float, bool]:
        lockstep = Lockstep(max_wait_s=0.05, on_wave=lambda n, by_timer: waves.append(
            (n, by_timer)))
        a, straggler = await stepping_together(lockstep, 2)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(a.turn("Calls", 1), PATIENT_S)  # the straggler never asks
        return loop.time() - started, lockstep.stepping == 2

    waited, both_stepping = asyncio.run(scenario())
    assert waited >= 0.05 and both_stepping
    # stepping_together's two waves (the first alone, then both), then the timer's.
    assert waves == [(1, False), (2, False), (1, True)]


def test_leaving_or_stepping_away_lets_the_wave_go_without_it():
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

    asyncio.run(scenario())


def test_a_cancelled_wait_is_no_longer_waited_for():
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

    asyncio.run(scenario())


def test_max_wait_must_be_positive():
    with pytest.raises(ValueError, match="max_wait_s must be > 0, got 0"):
        Lockstep(max_wait_s=0)


def test_a_router_s_generations_step_together_unless_streamed_or_delegating():
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

    asyncio.run(scenario())
