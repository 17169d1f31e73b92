"""Router-side coalescing: which calls merge into one request, when they go, who gets what.

The coalescer is generic over its ``send``; here ``send`` is an in-process expert that answers
``x * 10 + key`` after the test releases it, and records every request it got. The pool's use
of it against a real expert server is in tests/unit/test_expert_pool.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Hashable

import numpy as np
import pytest

from ddm.serving.router.fleet.coalescing import Coalescer


class Expert:
    """Records requests; each answers once ``release()`` lets it (all at once by default)."""

    def __init__(self, fail_with: Exception | None = None) -> None:
        self.requests: list[tuple[Hashable, int]] = []
        self.since: list[float] = []  # when each request's oldest call was made
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_with = fail_with
        self.in_flight = self.peak = 0

    async def send(self, key: Hashable, inputs: tuple[np.ndarray, ...],
                   since: float) -> np.ndarray:
        (x,) = inputs
        self.requests.append((key, x.shape[0]))
        self.since.append(since)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await self.gate.wait()
        self.in_flight -= 1
        if self.fail_with is not None:
            raise self.fail_with
        return x * 10 + key


def coalescer(expert: Expert, max_rows: int = 64, limit: int = 1) -> Coalescer:
    return Coalescer(expert.send, lambda: max_rows, lambda: limit)


def rows(*values: float) -> tuple[np.ndarray]:
    return (np.array(values, np.float32),)


async def turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def busy() -> tuple[Expert, Coalescer, asyncio.Future[np.ndarray]]:
    """An expert holding its answers, a coalescer allowing 1 request in flight, and the first
    call (``[1]``), sent and not answered."""
    expert = Expert()
    expert.gate.clear()
    c = coalescer(expert, limit=1)
    first = asyncio.ensure_future(c.submit(0, rows(1)))
    await turns()
    return expert, c, first


def test_calls_of_one_turn_go_as_one_request_and_each_gets_its_rows():
    async def scenario():
        expert = Expert()
        c = coalescer(expert)
        outs = await asyncio.gather(c.submit(1, rows(1)), c.submit(1, rows(2, 3)),
                                    c.submit(1, rows(4)))
        return expert.requests, outs

    requests, outs = asyncio.run(scenario())
    assert requests == [(1, 4)]
    assert [o.tolist() for o in outs] == [[11], [21, 31], [41]]


def test_a_lone_call_goes_out_at_once():
    async def scenario():
        expert = Expert()
        expert.gate.clear()
        c = coalescer(expert)
        call = asyncio.ensure_future(c.submit(0, rows(5)))
        await turns()
        sent, in_flight = list(expert.requests), c.in_flight
        expert.gate.set()
        return sent, in_flight, await call

    sent, in_flight, out = asyncio.run(scenario())
    assert sent == [(0, 1)] and in_flight == 1 and out.tolist() == [50]


def test_calls_wait_while_the_limit_is_reached_and_then_go_together():
    async def scenario():
        expert, c, first = await busy()
        made = time.monotonic()
        later = [asyncio.ensure_future(c.submit(0, rows(i))) for i in (2, 3, 4)]
        await turns()
        while_busy = list(expert.requests)
        await asyncio.sleep(0.05)
        expert.gate.set()
        outs = await asyncio.gather(first, *later)
        return while_busy, expert.requests, outs, expert.since[1] - made

    while_busy, requests, outs, since = asyncio.run(scenario())
    assert while_busy == [(0, 1)]
    assert requests == [(0, 1), (0, 3)]
    assert [o.tolist() for o in outs] == [[10], [20], [30], [40]]
    assert 0 <= since < 0.05  # the merged request counts from its oldest call, not from sending


def test_only_calls_with_the_same_key_merge_oldest_key_first():
    async def scenario():
        expert = Expert()
        c = coalescer(expert, limit=1)
        outs = await asyncio.gather(c.submit(1, rows(1)), c.submit(2, rows(2)),
                                    c.submit(1, rows(3)), c.submit(2, rows(4)))
        return expert.requests, outs

    requests, outs = asyncio.run(scenario())
    assert requests == [(1, 2), (2, 2)]
    assert [o.tolist() for o in outs] == [[11], [22], [31], [42]]


def test_scoped_a_call_waits_only_behind_requests_of_its_own_scope():
    """A pool member's velocity calls are scoped by key: while key 0's request is out, a key-1
    call goes at once (its pool gathers it with the others), a key-0 call waits and merges
    with the next."""
    async def scenario():
        expert = Expert()
        expert.gate.clear()
        c = Coalescer(expert.send, lambda: 64, lambda: 1, scope=lambda key: key)
        first = asyncio.ensure_future(c.submit(0, rows(1)))
        await turns()
        later = [asyncio.ensure_future(c.submit(k, rows(v))) for k, v in
                 ((1, 2), (0, 3), (2, 4), (0, 5))]
        await turns()
        while_busy, in_flight = list(expert.requests), c.in_flight
        expert.gate.set()
        outs = await asyncio.gather(first, *later)
        return while_busy, in_flight, expert.requests, outs, c.in_flight

    while_busy, in_flight, requests, outs, after = asyncio.run(scenario())
    assert while_busy == [(0, 1), (1, 1), (2, 1)] and in_flight == 3
    assert requests == [(0, 1), (1, 1), (2, 1), (0, 2)]
    assert [o.tolist() for o in outs] == [[10], [21], [30], [42], [50]]
    assert after == 0


def test_requests_never_exceed_max_rows_and_full_calls_count_against_the_limit():
    async def scenario():
        expert = Expert()
        expert.gate.clear()
        c = coalescer(expert, max_rows=3, limit=2)
        calls = asyncio.gather(*(c.submit(0, rows(i)) for i in range(7)),
                               c.submit(0, rows(7, 8, 9)), c.submit(0, rows(1, 2, 3)))
        await turns(5)
        expert.gate.set()
        outs = await calls
        return expert.requests, expert.peak, outs

    requests, peak, outs = asyncio.run(scenario())
    assert max(n for _, n in requests) == 3 and sum(n for _, n in requests) == 13
    assert peak == 2  # full calls wait their turn too
    assert [o.tolist() for o in outs[:7]] == [[i * 10] for i in range(7)]
    assert outs[7].tolist() == [70, 80, 90] and outs[8].tolist() == [10, 20, 30]


def test_max_rows_one_sends_every_call_on_its_own_without_a_limit():
    async def scenario():
        expert = Expert()
        expert.gate.clear()
        c = coalescer(expert, max_rows=1, limit=1)
        calls = [asyncio.ensure_future(c.submit(0, rows(i))) for i in range(4)]
        await turns()
        sent = len(expert.requests)
        expert.gate.set()
        await asyncio.gather(*calls)
        return sent

    assert asyncio.run(scenario()) == 4


def test_a_failed_request_fails_every_call_in_it_and_the_next_ones_still_go():
    async def scenario():
        expert = Expert(fail_with=RuntimeError("replica died"))
        c = coalescer(expert)
        outcomes = await asyncio.gather(c.submit(0, rows(1)), c.submit(0, rows(2)),
                                        return_exceptions=True)
        expert.fail_with = None
        return outcomes, await c.submit(0, rows(3)), expert.requests

    outcomes, after, requests = asyncio.run(scenario())
    assert [str(o) for o in outcomes] == ["replica died"] * 2
    assert after.tolist() == [30] and requests == [(0, 2), (0, 1)]


def test_a_caller_that_goes_away_while_waiting_is_not_sent():
    async def scenario():
        expert, c, first = await busy()
        gone = asyncio.ensure_future(c.submit(0, rows(2)))
        kept = asyncio.ensure_future(c.submit(0, rows(3)))
        await turns()
        gone.cancel()
        expert.gate.set()
        outs = await asyncio.gather(first, kept)
        return expert.requests, outs, gone.cancelled()

    requests, outs, cancelled = asyncio.run(scenario())
    assert cancelled and requests == [(0, 1), (0, 1)]
    assert [o.tolist() for o in outs] == [[10], [30]]


def test_close_cancels_requests_in_flight_and_waiting_calls_and_refuses_new_ones():
    async def scenario():
        expert, c, first = await busy()
        waiting = asyncio.ensure_future(c.submit(0, rows(2)))
        await turns()
        await c.close()
        outcomes = await asyncio.gather(first, waiting, return_exceptions=True)
        with pytest.raises(RuntimeError, match="closed"):
            await c.submit(0, rows(3))
        return outcomes, expert.requests

    outcomes, requests = asyncio.run(scenario())
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
    assert requests == [(0, 1)]  # the waiting call was never sent


@pytest.mark.parametrize("limit", [1, 2, 4])
def test_many_callers_stepping_in_lockstep_converge_to_few_big_requests(limit):
    """64 'generations' of 20 steps, each awaiting its call before the next, as the router's
    generations do: after the first steps, requests carry many rows each."""

    async def scenario():
        expert = Expert()
        c = coalescer(expert, limit=limit)

        async def generation(i: int) -> float:
            value = float(i)
            for _ in range(20):
                (value,) = (await c.submit(0, rows(value))).tolist()
                value = value / 10
            return value

        outs = await asyncio.gather(*(generation(i) for i in range(64)))
        return expert.requests, outs

    requests, outs = asyncio.run(scenario())
    assert outs == [float(i) for i in range(64)]
    assert sum(n for _, n in requests) == 64 * 20
    assert len(requests) <= 20 * limit + 2, len(requests)


def test_a_pool_members_integrate_calls_share_the_one_limit_its_velocity_calls_do_not():
    """Only velocity calls travel in a pool request; a delegated chunk (integrate) is a
    request of its own to the member's route, so concurrent generations' chunks stay under
    the member's one in-flight limit while their velocity calls are limited per context."""
    from ddm.serving.router.fleet.pool import _ContextKey, _IntegrateKey, _pooled_scope
    from ddm.serving.wire.protocol import Solver

    grid = np.linspace(0, 1, 3, dtype=np.float32).tobytes()
    chunk = _IntegrateKey(Solver.EULER, grid)

    async def scenario(kind):
        gate = asyncio.Event()

        async def send(key, inputs, since):
            await gate.wait()
            return inputs[0]

        c = Coalescer(send, lambda: 64, lambda: 1, scope=_pooled_scope)
        keys = [_ContextKey(bytes([g]) * 32, kind) for g in range(3)]
        calls = [asyncio.ensure_future(c.submit(key, rows(g))) for g, key in enumerate(keys)]
        await turns()
        in_flight = c.in_flight
        gate.set()
        await asyncio.gather(*calls)
        return in_flight

    assert asyncio.run(scenario(None)) == 3  # velocity: one per context, all at once
    assert asyncio.run(scenario(chunk)) == 1  # integrate: the one limit
