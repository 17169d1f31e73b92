"""The ``reroute`` policy's rule (probabilities + availability -> weights) and the sampling
loop's handling of a :class:`~ddm.sampling.loop.Missing` expert, with closed-form experts."""

from __future__ import annotations

import numpy as np

from ddm.sampling.loop import (Calls, Missing, Mixture, Route, SamplingRequest, StepEvent,
                               Velocity, denoise)
from ddm.sampling.routing import available_weights, parse_strategy, servable_labels

PROBS = np.array([[0.6, 0.3, 0.1],
                  [0.1, 0.2, 0.7]])
EVERY_LABEL = np.ones((2, 3), bool)


def test_top1_moves_a_missing_experts_rows_to_the_next_best_and_keeps_the_others() -> None:
    routed = available_weights(PROBS, EVERY_LABEL, np.array([False, True, True]),
                               parse_strategy("top1"))
    np.testing.assert_array_equal(routed.weights, [[0, 1, 0], [0, 0, 1]])
    assert routed.rerouted.tolist() == [True, False]
    assert routed.stranded.tolist() == [False, False]


def test_top2_renormalises_over_the_best_available_experts() -> None:
    routed = available_weights(PROBS, EVERY_LABEL, np.array([True, False, True]),
                               parse_strategy("top2"))
    # row 0 wanted experts 0 and 1 (0.6, 0.3); without 1: 0 and 2, 0.6 / 0.7 and 0.1 / 0.7.
    np.testing.assert_allclose(routed.weights[0], [6 / 7, 0, 1 / 7], rtol=1e-6)
    # row 1 wanted 2 and 1; without 1: 2 and 0, 0.7 / 0.8 and 0.1 / 0.8.
    np.testing.assert_allclose(routed.weights[1], [1 / 8, 0, 7 / 8], rtol=1e-6)
    assert routed.rerouted.tolist() == [True, True]


def test_a_row_no_available_expert_serves_is_stranded_with_the_weights_it_wanted() -> None:
    servable = servable_labels(((0, 1), (2, 3), ()), 4)[[0, 2]]  # labels 0 and 2
    routed = available_weights(PROBS, servable, np.array([False, True, False]),
                               parse_strategy("top1"))
    # label 0: only experts 0 and 2 serve it, both missing; label 2: expert 1 serves it.
    assert routed.stranded.tolist() == [True, False]
    assert routed.rerouted.tolist() == [False, True]
    np.testing.assert_array_equal(routed.weights, [[1, 0, 0], [0, 1, 0]])


def test_with_every_expert_available_nothing_changes() -> None:
    routed = available_weights(PROBS, EVERY_LABEL, np.ones(3, bool), parse_strategy("top2"))
    assert not routed.rerouted.any() and not routed.stranded.any()


def _run(strategy: str, missing: set[int], steps: int = 4) -> tuple[list[StepEvent], list]:
    """The loop over two experts of constant velocity 1 and 3 (everywhere), a router that
    prefers expert 0 with 0.7; experts in ``missing`` answer Missing to fallback calls."""
    mixture = Mixture(("one", "three"), ((), ()), (1, 2, 2), 10, routed=True)
    request = SamplingRequest(labels=(4, 5), steps=steps, seed=0,
                              strategy=parse_strategy(strategy))
    loop, answer, events, calls = denoise(mixture, request), None, [], []
    while True:
        try:
            query = loop.send(answer)
        except StopIteration:
            return events, calls
        if isinstance(query, StepEvent):
            events.append(query)
            answer = None
        elif isinstance(query, Route):
            answer = np.tile([0.7, 0.3], (len(query.x), 1))
        else:
            assert isinstance(query, Calls)
            calls.append(query.calls)
            answer = [Missing(c.expert) if c.expert in missing and c.fallback
                      else np.full_like(c.x, 1.0 + 2.0 * c.expert)
                      for c in query.calls if isinstance(c, Velocity)]


def test_the_loop_reroutes_a_missing_expert_and_reports_each_step() -> None:
    events, calls = _run("top1", missing={0})
    x0 = _run("top1", missing=set())[0][-1].x
    # Velocity 3 instead of 1 over t in [0, 1]: the end state moved by exactly 2.
    np.testing.assert_allclose(events[-1].x - x0, 2.0, rtol=1e-5)
    assert all(e.rerouted.tolist() == [True, True] for e in events)
    # The demand stays the strategy's: both rows wanted expert 0 at every step.
    assert all(e.wanted_rows.tolist() == [2, 0] for e in events)
    np.testing.assert_allclose(events[0].wanted_weight, [2.0, 0.0])
    # Per step: the missing expert was asked once, then the other once.
    assert [[c.expert for c in step] for step in calls] == [[0], [1]] * 4


def test_top2_keeps_the_answered_expert_and_renormalises() -> None:
    events, calls = _run("top2", missing={1})
    x0 = _run("top1", missing=set())[0][-1].x  # expert 0 alone
    np.testing.assert_allclose(events[-1].x, x0, rtol=1e-6)
    assert [[c.expert for c in step] for step in calls] == [[0, 1]] * 4  # no second round
    np.testing.assert_allclose(events[0].wanted_weight, [1.4, 0.6], rtol=1e-6)
