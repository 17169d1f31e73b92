"""Hybrid polling's two parts: the expected time of a key's next job, and the chain of ticks
on an event loop (ddm.serving.http.polling). The waits that use them are tested with their
owners: the batcher's model thread (test_batching) and the HTTP client's calls
(test_http_client)."""

from __future__ import annotations

import asyncio
from typing import Callable

import pytest
import uvloop

from ddm.serving.http.polling import WARM_MIN_S, WARM_TICK_S, LastTimes, WarmTicks, first_tick_s


#: The servers run uvloop; asyncio's own loop is the fallback.
LOOPS = pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop],
                                ids=["asyncio", "uvloop"])


def test_only_a_wait_of_known_time_long_enough_to_go_cold_ticks_over_its_last_fifth():
    assert first_tick_s(None) is None  # not known
    assert first_tick_s(WARM_MIN_S / 2) is None  # too short for the vCPU to go cold
    assert first_tick_s(0.060) == pytest.approx(0.048)
    assert first_tick_s(WARM_MIN_S) == pytest.approx(0.8 * WARM_MIN_S)


def test_a_key_s_next_job_is_expected_from_its_last_scaled_up_never_down():
    times: LastTimes[str] = LastTimes(capacity=4)
    assert times.expected("velocity", 1) is None  # not seen yet
    times.record("velocity", 0.060, 2)
    assert times.expected("velocity", 2) == pytest.approx(0.060)
    assert times.expected("velocity", 1) == pytest.approx(0.060)  # smaller: not scaled down
    assert times.expected("velocity", 8) == pytest.approx(0.240)  # four times the size
    times.record("velocity", 0.010, 2)  # the last time counts, not an average
    assert times.expected("velocity", 2) == pytest.approx(0.010)
    times.record("empty", 0.001, 0)  # a size of 0 (a GET's body) counts as 1
    assert times.expected("empty", 3) == pytest.approx(0.003)


def test_past_capacity_the_key_recorded_longest_ago_is_forgotten():
    times: LastTimes[int] = LastTimes(capacity=3)
    for key in (1, 2, 3):
        times.record(key, 1.0, 1)
    times.record(1, 1.0, 1)  # recorded again: now the newest
    times.record(4, 1.0, 1)
    assert [times.expected(key, 1) is not None for key in (1, 2, 3, 4)] == [
        True, False, True, True]
    with pytest.raises(ValueError, match="capacity >= 1"):
        LastTimes(capacity=0)


@LOOPS
def test_ticks_come_from_the_due_time_at_least_a_tick_apart_until_told_to_stop(
        new_loop: Callable[[], asyncio.AbstractEventLoop]):
    async def scenario() -> tuple[list[float], bool]:
        loop = asyncio.get_running_loop()
        asked: list[float] = []

        def next_delay() -> float | None:
            asked.append(loop.time())
            return 0.0 if len(asked) < 5 else None  # "now" is still a tick later

        ticks = WarmTicks(next_delay)
        started = loop.time()
        ticks.due_in(0.02)
        while ticks.ticking:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.01)
        return [t - started for t in asked], ticks.ticking

    with asyncio.Runner(loop_factory=new_loop) as runner:
        asked, ticking = runner.run(scenario())
    assert len(asked) == 5 and not ticking  # the chain ended when next_delay said None
    assert asked[0] >= 0.02 - 0.002  # the loop's clock has millisecond granularity
    assert all(b - a >= WARM_TICK_S - 0.0005 for a, b in zip(asked, asked[1:]))


@LOOPS
def test_an_earlier_due_time_brings_the_chain_forward_and_a_later_one_never_delays_it(
        new_loop: Callable[[], asyncio.AbstractEventLoop]):
    async def scenario() -> dict[str, list[float]]:
        loop = asyncio.get_running_loop()
        ticked: dict[str, list[float]] = {"moved": [], "stopped": [], "at_once": []}
        chains = {name: WarmTicks(lambda name=name: ticked[name].append(loop.time()))
                  for name in ticked}  # one tick each: None ends a chain
        started = loop.time()
        chains["moved"].due_in(10.0)
        chains["moved"].due_in(0.01)  # earlier: replaces the tick due in 10 s
        chains["moved"].due_in(5.0)  # later: changes nothing
        chains["stopped"].due_in(0.01)
        chains["stopped"].stop()
        chains["at_once"].due_in(0.0)  # due now (uvloop makes it a plain callback)
        chains["at_once"].due_in(0.0)
        while any(chain.ticking for chain in chains.values()):
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.02)
        return {name: [t - started for t in times] for name, times in ticked.items()}

    with asyncio.Runner(loop_factory=new_loop) as runner:
        ticked = runner.run(scenario())
    assert len(ticked["moved"]) == 1 and ticked["moved"][0] < 1.0
    assert ticked["stopped"] == []  # stopped before its tick
    assert len(ticked["at_once"]) == 1
