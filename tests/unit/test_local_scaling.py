"""``ddm up``'s scale-to-zero decision from the router's demand, and the benchmark's trace."""

from __future__ import annotations

import pytest

from benchmarks.scaling import HOT_LABELS, RARE_LABELS, skewed_trace
from ddm.deploy.autoscaler import Demand
from ddm.runtime.scaling import demand_of


def _entry(rows: object = 0.0, waiting: object = 0, idle: object = None) -> dict:
    return {"rows_per_s": rows, "weight_per_s": 0.0, "rerouted_rows_per_s": 0.0,
            "waited_s_per_s": 0.0, "waiting": waiting, "idle_s": idle}


@pytest.mark.parametrize("entry, expected", [
    (_entry(waiting=1, idle=0.0), Demand(0.0, 1, True)),   # a generation waits for it
    (_entry(rows=2.5, idle=0.3), Demand(2.5, 0, True)),    # demand since the last reading
    (_entry(rows=2.5, idle=0.7), Demand(2.5, 0, False)),   # only before it: the window's rate
    (_entry(), Demand(0.0, 0, False)),                     # never had demand
    (_entry(waiting="1"), None),                           # not what the router writes
    (_entry(rows=-1.0), None),
    (_entry(rows=float("nan")), None),                     # Python's json reads NaN
    (_entry(waiting=float("inf")), None),                  # and Infinity
    ({"idle_s": 1.0}, None),
    (None, None),
])
def test_an_entry_of_v1_demand_reads_as_the_operators_demand(entry, expected) -> None:
    assert demand_of(entry, since_s=0.5) == expected


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
