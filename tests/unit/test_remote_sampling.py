"""The router's driver of the sampling loop against the in-process driver, with closed-form
experts in this process.

``LocalExperts`` answers the caller interface from plain NumPy velocities (no HTTP: the HTTP path
is covered by ``tests/integration/test_sampling_parity.py`` and ``test_router_server.py``), so
these tests check the drivers' routing, delegation, concurrency and bookkeeping exactly.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from ddm.models.ddm import DDM
from ddm.sampling.pipeline import generate
from ddm.sampling.routing import parse_strategy
from ddm.sampling.solvers import VelocityFn, iterate
from ddm.serving.router.fleet.remote import (RemoteMixture, RouterNetwork, SamplingRequest,
                                             check_request, denoise, generate_remote,
                                             local_network)

SHAPE = (1, 4, 4)
LOW, HIGH = tuple(range(5)), tuple(range(5, 10))
ALL = tuple(range(10))
LABELS = (0, 3, 7, 9)


def _up(x, t, y):
    return (1.0 + 0.1 * y[:, None, None, None] + 0.5 * np.sin(x)).astype(np.float32)


def _down(x, t, y):
    return (-1.5 + t[:, None, None, None] * np.cos(x)).astype(np.float32)


def _router(x, t, y):
    """Prefers the expert that pushes the sample's mean back towards 0, so top-1 switches."""
    logit = 4.0 * x.mean(axis=(1, 2, 3)) + 0.05 * y
    p_up = 1.0 / (1.0 + np.exp(logit))
    return np.stack([p_up, 1.0 - p_up], axis=1).astype(np.float32)


VELOCITIES: dict[str, VelocityFn] = {"up": _up, "down": _down}


class LocalExperts:
    """The caller interface over in-process velocities, logging every request it answers."""

    def __init__(self, classes: dict[str, tuple[int, ...]]) -> None:
        self.classes = classes
        self.requests: list[tuple[str, str, tuple[int, ...]]] = []

    async def velocity(self, expert, x, t, cond):
        self._log("velocity", expert, cond.labels)
        await asyncio.sleep(0)  # let concurrent generations interleave
        return VELOCITIES[expert](x, t, cond.labels)

    async def integrate(self, expert, x, cond, grid, solver):
        self._log("integrate", expert, cond.labels)
        await asyncio.sleep(0)
        for _, x in iterate(VELOCITIES[expert], x, cond.labels, grid, solver):
            pass
        return x

    def _log(self, kind, expert, y):
        assert set(y.tolist()) <= set(self.classes[expert]), f"{expert} was sent labels {y}"
        self.requests.append((kind, expert, tuple(y.tolist())))


def _mixture(classes=(ALL, ALL), router=_router) -> RemoteMixture:
    network = RouterNetwork(local_network(router)) if router is not None else None
    return RemoteMixture(("up", "down"), classes, network, SHAPE, 10)


def _in_process(classes=(ALL, ALL)) -> DDM:
    return DDM(expert_names=tuple(VELOCITIES),
               experts=tuple(lambda x, t, cond, v=v: v(x, t, cond.labels)
                             for v in VELOCITIES.values()),
               expert_classes=tuple(classes),
               router=lambda x, t, cond: _router(x, t, cond.labels), latent_shape=SHAPE,
               num_classes=10)


def _request(strategy="top1", steps=12, solver="euler", delegate=0, labels=LABELS, seed=3):
    return SamplingRequest(labels=labels, steps=steps, seed=seed,
                           strategy=parse_strategy(strategy), solver=solver,
                           delegate_steps=delegate)


def _run(request, mixture=None, caller=None):
    caller = caller or LocalExperts({"up": ALL, "down": ALL})
    return asyncio.run(generate_remote(mixture or _mixture(), caller, request))


@pytest.mark.parametrize("solver", ["euler", "heun"])
@pytest.mark.parametrize("strategy", ["top1", "top2", "threshold:0.3", "ensemble"])
def test_per_step_sampling_equals_in_process_generate(strategy, solver):
    remote = _run(_request(strategy, solver=solver))
    local = generate(_in_process(), LABELS, 12, seed=3, strategy=strategy, solver=solver)
    np.testing.assert_array_equal(remote.images, local.images)
    np.testing.assert_array_equal(remote.usage.selections, local.usage.selections)
    np.testing.assert_array_equal(remote.expert_calls, local.expert_calls)
    # Per step, every expert call is a round trip of its own.
    np.testing.assert_array_equal(remote.round_trips, remote.expert_calls)


def test_oracle_equals_in_process_generate():
    classes = (LOW, HIGH)
    caller = LocalExperts({"up": LOW, "down": HIGH})
    remote = _run(_request("oracle"), _mixture(classes, router=None), caller)
    local = generate(_in_process(classes), LABELS, 12, seed=3, strategy="oracle")
    np.testing.assert_array_equal(remote.images, local.images)
    assert remote.experts_used() == [["up"], ["up"], ["down"], ["down"]]


@pytest.mark.parametrize("solver", ["euler", "heun"])
@pytest.mark.parametrize("delegate", [2, 5, 12, 40])
def test_delegated_oracle_sampling_equals_per_step_sampling_exactly(delegate, solver):
    mixture = _mixture((LOW, HIGH), router=None)
    caller = LocalExperts({"up": LOW, "down": HIGH})
    per_step = _run(_request("oracle", solver=solver), mixture, caller)
    caller.requests.clear()
    delegated = _run(_request("oracle", solver=solver, delegate=delegate), mixture, caller)
    np.testing.assert_array_equal(delegated.state, per_step.state)
    np.testing.assert_array_equal(delegated.expert_calls, per_step.expert_calls)
    chunks = math.ceil(12 / delegate)
    np.testing.assert_array_equal(delegated.round_trips, chunks)
    # Samples of one expert and one chunk travel together: one request per expert and chunk.
    assert [kind for kind, _, _ in caller.requests] == ["integrate"] * 2 * chunks


@pytest.mark.parametrize("solver", ["euler", "heun"])
@pytest.mark.parametrize("strategy", ["oracle", "top1", "threshold:0.4"])
def test_both_drivers_delegate_alike(strategy, solver):
    """Delegation is decided by the loop, so in-process and remote drivers agree exactly."""
    classes = (LOW, HIGH) if strategy == "oracle" else (ALL, ALL)
    caller = LocalExperts(dict(zip(VELOCITIES, classes)))
    mixture = _mixture(classes, router=None if strategy == "oracle" else _router)
    labels = tuple(range(10))
    remote = _run(_request(strategy, solver=solver, delegate=5, labels=labels), mixture, caller)
    local = generate(_in_process(classes), labels, 12, seed=3, strategy=strategy, solver=solver,
                     delegate_steps=5)
    np.testing.assert_array_equal(remote.state, local.state)
    np.testing.assert_array_equal(remote.round_trips, local.round_trips)


def test_delegation_changes_only_samples_whose_routing_switches_within_a_chunk():
    """The documented approximation: a sample that per-step top-1 keeps on one expert all the
    way is delegated exactly; one that switches may differ, in at most one round trip a chunk."""
    def steady_for_low_labels(x, t, y):
        probs = _router(x, t, y)
        probs[y < 5] = [0.9, 0.1]
        return probs

    labels, mixture = tuple(range(10)), _mixture(router=steady_for_low_labels)
    per_step = _run(_request("top1", steps=20, labels=labels), mixture)
    delegated = _run(_request("top1", steps=20, delegate=4, labels=labels), mixture)
    steady = per_step.usage.switches() == 0
    assert steady.any() and not steady.all(), "want samples of both kinds"
    np.testing.assert_array_equal(delegated.state[steady], per_step.state[steady])
    np.testing.assert_array_equal(delegated.round_trips, 5)


def test_delegation_bounds_round_trips_by_routing_switches():
    per_step = _run(_request("top1", steps=20))
    switches = per_step.usage.switches()
    assert switches.max() > 0, "the router should switch experts for this test to mean much"
    delegated = _run(_request("top1", steps=20, delegate=4))
    bound = (delegated.usage.switches() + 1) * math.ceil(20 / 4)
    assert (delegated.round_trips <= bound).all()
    np.testing.assert_array_equal(delegated.round_trips, 5)  # top-1 always has one expert
    assert per_step.round_trips.min() == 20


def test_samples_with_several_experts_step_while_the_others_are_delegated():
    request = _request("threshold:0.4", steps=8, delegate=4, labels=tuple(range(10)))
    result = _run(request)
    events = asyncio.run(_events(_mixture(), request))
    assert [e.step for e in events] == [4, 8]
    single = np.stack([e.delegated for e in events])
    assert single.any() and not single.all(), "want a batch with both kinds of samples"
    for event in events:
        used = np.stack(event.selections).sum(axis=2)  # experts per evaluation and sample
        assert (used[:, event.delegated] == 1).all()
        np.testing.assert_array_equal(event.round_trips[event.delegated], 1)
        np.testing.assert_array_equal(event.round_trips[~event.delegated],
                                      used[:, ~event.delegated].sum(axis=0))
    np.testing.assert_array_equal(result.round_trips, sum(e.round_trips for e in events))


def test_events_follow_the_grid_in_order():
    events = asyncio.run(_events(_mixture(), _request(steps=5)))
    assert [e.step for e in events] == [1, 2, 3, 4, 5]
    assert [e.t for e in events] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert all(e.x.shape == (len(LABELS), *SHAPE) for e in events)


def test_labels_only_go_to_experts_that_serve_them():
    caller = LocalExperts({"up": LOW, "down": HIGH})  # asserts on every request
    result = _run(_request("top2"), _mixture((LOW, HIGH)), caller)
    assert result.experts_used() == [["up"], ["up"], ["down"], ["down"]]


def test_interleaved_generations_equal_sequential_ones():
    requests = [_request("top2", seed=s, solver="heun") for s in range(3)]
    sequential = [_run(r) for r in requests]

    async def together():
        caller = LocalExperts({"up": ALL, "down": ALL})
        return await asyncio.gather(*(generate_remote(_mixture(), caller, r) for r in requests))

    for alone, interleaved in zip(sequential, asyncio.run(together())):
        np.testing.assert_array_equal(alone.state, interleaved.state)
        np.testing.assert_array_equal(alone.round_trips, interleaved.round_trips)


def test_concurrent_generations_share_router_network_passes():
    passes: list[int] = []

    def counted(x, t, y):
        passes.append(len(y))
        return _router(x, t, y)

    requests = [_request("top1", seed=s, labels=(s,)) for s in range(8)]
    sequential = [_run(r) for r in requests]

    async def together():
        mixture = _mixture(router=counted)
        caller = LocalExperts({"up": ALL, "down": ALL})
        return await asyncio.gather(*(generate_remote(mixture, caller, r) for r in requests))

    for alone, interleaved in zip(sequential, asyncio.run(together())):
        np.testing.assert_array_equal(alone.state, interleaved.state)
    steps = requests[0].steps
    assert sum(passes) == 8 * steps  # every generation's rows went through the network
    assert len(passes) <= 2 * steps, passes  # in few passes


@pytest.mark.parametrize("mixture,request_,message", [
    (_mixture(), _request(labels=(3, 12)), r"labels \[12\] are outside the model's classes 0..9"),
    (_mixture(), _request(labels=()), "no labels"),
    (_mixture(), _request(solver="rk4"), "unknown solver 'rk4'"),
    (_mixture(), _request(delegate=-1), "delegate_steps must be an integer >= 0"),
    (_mixture(), _request(steps=1001), r"steps must be an integer in \[1, 1000\]"),
    (_mixture(router=None), _request("top1"), "needs the router network"),
    (_mixture((LOW, (5, 6))), _request(labels=(1, 8)), r"labels \[8\] are served by no expert"),
    (_mixture((LOW, (5, 6)), None), _request("oracle", labels=(9,)), "not covered by any expert"),
])
def test_requests_the_mixture_cannot_serve_are_refused_before_sampling(mixture, request_,
                                                                        message):
    with pytest.raises(ValueError, match=message):
        check_request(mixture, request_)


async def _events(mixture, request):
    caller = LocalExperts({"up": ALL, "down": ALL})
    return [event async for event in denoise(mixture, caller, request)]


def test_labels_beyond_int64_are_outside_the_classes_not_an_overflow():
    with pytest.raises(ValueError, match=r"labels \[18446744073709551616\] are outside"):
        check_request(_mixture(), _request(labels=(2**64,)))
