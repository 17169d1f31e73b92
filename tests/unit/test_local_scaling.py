"""``ddm up``'s scale-to-zero decision from the router's demand, and the benchmark's trace."""

from __future__ import annotations

import pytest

from benchmarks.scaling import HOT_LABELS, RARE_LABELS, skewed_trace
from ddm.runtime.scaling import wanted


@pytest.mark.parametrize("demand, expected", [
    ({"waiting": 1, "idle_s": 0.0}, True),         # a generation waits for it
    ({"waiting": 0, "idle_s": 2.9}, True),         # demand within the delay
    ({"waiting": 0, "idle_s": 3.0}, False),        # the delay has passed without demand
    ({"waiting": 0, "idle_s": None}, False),       # never had demand
    ({"waiting": "1", "idle_s": 0.0}, None),       # not what the router writes: no change
    ({"idle_s": 1.0}, None),
    (None, None),
])
def test_an_expert_runs_while_waited_for_or_within_its_delay(demand, expected) -> None:
    assert wanted(demand, delay_s=3.0) is expected


def test_the_trace_is_skewed_bursty_and_seeded() -> None:
    trace = skewed_trace(duration_s=120, hot_gap_s=2.0, rare_bursts=3, burst_size=4, seed=1)
    assert trace == skewed_trace(duration_s=120, hot_gap_s=2.0, rare_bursts=3, burst_size=4,
                                 seed=1)
    rare = [a.at_s for a in trace if a.label in RARE_LABELS]
    hot = [a for a in trace if a.label in HOT_LABELS]
    assert len(rare) == 12 and len(hot) > 3 * len(rare)
    # Bursts at 20, 60 and 100 s, each within one second.
    assert [min(rare[i:i + 4]) // 1 for i in (0, 4, 8)] == [20, 60, 100]
    assert all(max(rare[i:i + 4]) - min(rare[i:i + 4]) < 1 for i in (0, 4, 8))
    assert [a.at_s for a in trace] == sorted(a.at_s for a in trace)
