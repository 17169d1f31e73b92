"""Calls ahead: each routing carries the expert calls the loop expects next (the previous
evaluation's selection at this state), the loop asks for those very objects where routing
keeps their rows, and the router's driver starts them beside a served router network's pass,
changing no value (``ddm.sampling.loop``, ``ddm.serving.router.fleet.remote``)."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Callable

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from ddm.deploy.router_config import MissingExpert, RouterConfigFile
from ddm.sampling.loop import Calls, Mixture, Route, Routed, SamplingRequest, StepEvent, denoise
from ddm.sampling.routing import parse_strategy
from ddm.serving.router.api.state import RouterState
from ddm.serving.router.fleet.demand import DemandMeter
from ddm.serving.router.fleet.missing import Held, MissingExperts
from ddm.serving.router.fleet.pool import ExpertPool
from ddm.serving.router.fleet.remote import (CALLS_AHEAD_ENV, Guard, RemoteMixture,
                                             RouterNetwork, calls_ahead, calls_ahead_choice,
                                             generate_remote, local_network)
from ddm.serving.router.fleet.servers import PoolSettings
from tests.unit.test_remote_sampling import ALL, SHAPE, LocalExperts, _request, _router


def _drive(probs_per_routing: list[list[list[float]]], ahead: bool = False
           ) -> tuple[list[tuple[Route, Calls]], np.ndarray]:
    """The loop over three experts of constant velocity, two rows, answered with the given
    probabilities at each routing (as a driver that started the expected calls, ``ahead``);
    each routing and the expert query that followed it, and the final state."""
    mixture = Mixture(("a", "b", "c"), ((), (), ()), (1, 2, 2), 10, routed=True)
    request = SamplingRequest(labels=(4, 5), steps=len(probs_per_routing), seed=0,
                              strategy=parse_strategy("top1"))
    loop, answer, pairs, route, x = denoise(mixture, request), None, [], None, None
    while True:
        try:
            query = loop.send(answer)
        except StopIteration:
            return pairs, x
        if isinstance(query, StepEvent):
            answer, x = None, query.x
        elif isinstance(query, Route):
            probs = np.array(probs_per_routing[len(pairs)], np.float32)
            route, answer = query, Routed(probs, ahead=True) if ahead else probs
        else:
            assert isinstance(query, Calls) and route is not None
            pairs.append((route, query))
            answer = [np.full_like(c.x, 1.0 + c.expert) for c in query.calls]


def test_a_routing_expects_the_calls_of_the_selection_before_it() -> None:
    pairs, _ = _drive([[[0.9, 0.1, 0.0], [0.1, 0.9, 0.0]],    # row 0 -> a, row 1 -> b
                       [[0.9, 0.1, 0.0], [0.1, 0.9, 0.0]],    # the same
                       [[0.9, 0.1, 0.0], [0.1, 0.0, 0.9]]])   # row 1 moves to c
    (first, _), (second, kept), (third, moved) = pairs
    assert first.expect == ()  # nothing is known before the first routing
    assert [(c.expert, c.x.shape[0]) for c in second.expect] == [(0, 1), (1, 1)]
    # Routing kept both experts' rows: the loop asks for the very objects it expected.
    assert len(kept.calls) == 2
    assert all(asked is expected for asked, expected in zip(kept.calls, second.expect))
    # Row 1 moved from b to c: a's call is the one expected, c's is new, b's is not asked.
    assert [c.expert for c in third.expect] == [0, 1]
    assert moved.calls[0] is third.expect[0]
    assert moved.calls[1].expert == 2 and all(moved.calls[1] is not c for c in third.expect)
    # Each expected call holds exactly the inputs a call made after the routing would.
    np.testing.assert_array_equal(second.expect[1].x, second.x[[1]])
    np.testing.assert_array_equal(second.expect[1].t, second.t[[1]])


#: Both rows on expert a, then row 1 moves to b.
BOTH_ON_A = [[0.9, 0.1, 0.0], [0.9, 0.1, 0.0]]
ONE_MOVES = [[0.9, 0.1, 0.0], [0.1, 0.9, 0.0]]


def test_where_the_calls_went_ahead_a_call_routing_keeps_in_part_is_asked_too() -> None:
    pairs, x = _drive([BOTH_ON_A, BOTH_ON_A, ONE_MOVES], ahead=True)
    (_, _), (_, _), (third, moved) = pairs
    # The expected call for a (both rows) is asked, though only row 0 stays on a; b gets a
    # call of row 1 alone, and a's row 1 is not used.
    (a_call,) = third.expect
    assert moved.calls[0] is a_call and a_call.x.shape[0] == 2
    assert moved.calls[1].expert == 1 and moved.calls[1].x.shape[0] == 1
    # Without the calls ahead, a's call would be a new one of row 0 alone: the same state.
    plain_pairs, plain_x = _drive([BOTH_ON_A, BOTH_ON_A, ONE_MOVES])
    assert [(c.expert, c.x.shape[0]) for c in plain_pairs[2][1].calls] == [(0, 1), (1, 1)]
    np.testing.assert_array_equal(x, plain_x)


class _ServedNetwork(RouterNetwork):
    """The test's router network as a served one would be: a pass that lets the event loop
    run a while; it counts the routings asked and answered."""

    def __init__(self, ahead: Callable[[int], bool]) -> None:
        super().__init__(self._pass, calls_ahead=ahead)
        self.asked = self.answered = 0

    async def __call__(self, *inputs: np.ndarray) -> np.ndarray:
        self.asked += 1
        try:
            return await super().__call__(*inputs)
        finally:
            self.answered += 1

    async def _pass(self, x, t, y):
        for _ in range(20):
            await asyncio.sleep(0)
        return _router(x, t, y)


class _Traced(LocalExperts):
    """``LocalExperts`` noting, as each velocity call arrives, whether a routing was under
    way, and counting the calls cancelled."""

    def __init__(self, network: _ServedNetwork) -> None:
        super().__init__({"up": ALL, "down": ALL})
        self.network = network
        self.during_routing: list[bool] = []
        self.cancelled = 0

    async def velocity(self, expert, x, t, cond):
        self.during_routing.append(self.network.asked > self.network.answered)
        try:
            return await super().velocity(expert, x, t, cond)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def _generate(request: SamplingRequest, ahead: bool | Callable[[int], bool]):
    network = _ServedNetwork(ahead if callable(ahead) else lambda rows: ahead)
    caller = _Traced(network)
    mixture = RemoteMixture(("up", "down"), (ALL, ALL), network, SHAPE, 10)
    return asyncio.run(generate_remote(mixture, caller, request)), caller


@pytest.mark.parametrize("strategy", ["top1", "top2"])
def test_calls_ahead_go_beside_the_routing_and_change_no_value(strategy):
    request = _request(strategy, steps=10, solver="heun")
    plain_caller = LocalExperts({"up": ALL, "down": ALL})
    plain = asyncio.run(generate_remote(
        RemoteMixture(("up", "down"), (ALL, ALL), RouterNetwork(local_network(_router)),
                      SHAPE, 10), plain_caller, request))
    ahead, caller = _generate(request, ahead=True)
    np.testing.assert_array_equal(ahead.state, plain.state)
    np.testing.assert_array_equal(ahead.round_trips, plain.round_trips)
    routings = 10 * 2  # heun: two evaluations per step, each routed
    if strategy == "top2":  # both experts at every evaluation: every call from the second
        # routing on went during its routing, and the loop asked for each
        assert caller.during_routing == [False] * 2 + [True] * 2 * (routings - 1)
        assert caller.cancelled == 0 and len(caller.requests) == len(plain_caller.requests)
    else:  # top-1 here switches experts: a switch's rows go in a call after its routing
        assert caller.during_routing.count(True) >= routings // 2
        # A switch costs the row that moved, computed for nothing, never a whole call again.
        rows_ahead = sum(len(labels) for _, _, labels in caller.requests)
        rows_plain = sum(len(labels) for _, _, labels in plain_caller.requests)
        assert rows_plain <= rows_ahead <= rows_plain + int(plain.usage.switches().sum())


def test_without_calls_ahead_no_call_goes_during_a_routing():
    plain, caller = _generate(_request("top2", steps=4), ahead=False)
    assert caller.during_routing == [False] * 2 * 4 and caller.cancelled == 0
    ahead, _ = _generate(_request("top2", steps=4), ahead=True)
    np.testing.assert_array_equal(plain.state, ahead.state)


@pytest.mark.parametrize("value,choice", [(None, "auto"), ("", "auto"), ("on", "on"),
                                          (" OFF ", "off"), ("auto", "auto")])
def test_the_calls_ahead_choice_reads_the_environment(value, choice):
    env = {} if value is None else {CALLS_AHEAD_ENV: value}
    assert calls_ahead_choice(env) == choice


def test_a_bad_calls_ahead_choice_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"DDM_CALLS_AHEAD='yes': give one of auto, on, off"):
        calls_ahead_choice({CALLS_AHEAD_ENV: "yes"})


@pytest.mark.parametrize("choice,device,alone,expected", [
    ("auto", "cuda:0", True, True), ("auto", "neuron", True, True), ("auto", "cpu", True, False),
    ("auto", None, True, False), ("auto", "cuda:0", False, False), ("on", "cpu", False, True),
    ("on", None, True, True), ("off", "cuda:0", True, False)])
def test_auto_sends_calls_ahead_for_a_lone_image_where_the_router_network_runs_on_an_accelerator(
        choice, device, alone, expected):
    assert calls_ahead(choice, device, alone) is expected


def test_the_choice_is_asked_with_each_routing_s_images():
    """A step of two images asks with 2 (``auto`` says no: not a lone image), and then no call
    goes during its routing."""
    asked: list[int] = []

    def lone_image(rows: int) -> bool:
        asked.append(rows)
        return rows == 1

    two, caller = _generate(_request("top2", steps=4, labels=(3, 4)), ahead=lone_image)
    assert asked == [2] * 4 and caller.during_routing == [False] * 2 * 4
    one, caller = _generate(_request("top2", steps=4, labels=(3,)), ahead=lone_image)
    assert asked[4:] == [1] * 4 and caller.during_routing == [False] * 2 + [True] * 2 * 3


def test_a_router_is_alone_with_one_image_and_no_other_generation_in_flight():
    """What ``auto`` asks of the router (``RouterState.alone``), from its own slots."""
    router = RouterState(RouterConfigFile.from_dict({
        "experts": [{"name": "all", "classes": list(range(10)),
                     "discovery": {"endpoints": ["127.0.0.1:9"]}}],
        "sampling": {"strategy": "oracle"}}))
    assert router.alone(1) and not router.alone(2)
    router.take_slot("a", 10)
    assert router.alone(1) and not router.alone(2)  # its own slot is the one in flight
    router.take_slot("b", 10)
    assert not router.alone(1)
    router.release_slot("b")
    assert router.alone(1)


class _Listed:
    """An expert's replicas as a source that can be emptied (the expert scaled to zero)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoints = [endpoint]

    async def __call__(self) -> list[str]:
        return list(self.endpoints)


def test_no_call_goes_ahead_to_an_expert_without_a_ready_replica():
    """``down`` serves the first step and is scaled to zero right after; routing then prefers
    ``up``. Under ``wait``, a call ahead to ``down`` would wait for it (and wake it) though
    the step never asks for it: none goes, and nothing waits for ``down``."""
    # Replicas that accept connections and never answer: not probed yet, so usable until
    # their source lists them no more.
    listener = socket.create_server(("127.0.0.1", 0))
    endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
    sources = {"up": _Listed(endpoint), "down": _Listed(endpoint)}
    routings: list[str] = []

    async def route(x, t, y):
        routings.append("down" if not routings else "up")
        return np.tile([0.1, 0.9] if routings[-1] == "down" else [0.9, 0.1],
                       (len(x), 1)).astype(np.float32)

    class ScaledAfterItsStep(LocalExperts):
        def __init__(self, pool: ExpertPool) -> None:
            super().__init__({"up": ALL, "down": ALL})
            self.pool = pool

        async def velocity(self, expert, x, t, cond):
            if expert == "down":
                sources["down"].endpoints.clear()
                await self.pool.refresh()
            return await super().velocity(expert, x, t, cond)

    async def generate():
        settings = PoolSettings(attempt_s=60.0, health_interval_s=60.0, refresh_s=60.0)
        async with ExpertPool(sources, settings) as pool:
            missing = MissingExperts(MissingExpert("wait", 30.0), pool,
                                     DemandMeter(("up", "down"), CollectorRegistry()), "top1")
            held = Held()
            network = RouterNetwork(route, calls_ahead=lambda rows: True)
            mixture = RemoteMixture(("up", "down"), (ALL, ALL), network, SHAPE, 10)
            caller = ScaledAfterItsStep(pool)
            await generate_remote(mixture, caller, _request("top1", steps=4, labels=(3,)),
                                  Guard(missing, held, wakes=True))
            return caller.requests, held, missing.demand.window

    try:
        requests, held, window = asyncio.run(generate())
    finally:
        listener.close()
    assert [expert for _, expert, _ in requests] == ["down", "up", "up", "up"]
    assert held.waited_s == {}  # nothing waited for down
    assert window.summary(time.monotonic())["down"].waited_s_per_s == 0.0
