"""``ddm up``'s scale-to-zero decision from the router's demand, and the scale-to-zero
benchmark's trace and accounting (``benchmarks/scaling.py``)."""

from __future__ import annotations

import pytest

from benchmarks.__main__ import main
from benchmarks.scaling import (HOT_LABELS, RARE_LABEL_GROUPS, ReplicaEvent, TraceShape,
                                bench_scale_to_zero, bursty_trace, cold_start_seconds,
                                replica_events, replica_seconds, routed_rows)
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


def test_the_trace_is_bursts_of_hot_labels_with_rare_groups_in_turn() -> None:
    shape = TraceShape(bursts=4, burst_s=5.0, gap_s=10.0, hot_per_burst=3, rare_every=2,
                       rare_per_burst=2)
    trace = bursty_trace(shape, seed=1)
    assert trace == bursty_trace(shape, seed=1) != bursty_trace(shape, seed=2)
    assert shape.duration_s == 60.0 and len(trace) == 4 * 3 + 2 * 2
    assert [a.at_s for a in trace] == sorted(a.at_s for a in trace)
    assert [a.seed for a in trace] == list(range(16))  # each request its own seed
    by_burst = [[a for a in trace if 15 * b <= a.at_s < 15 * b + 5] for b in range(4)]
    assert sum(map(len, by_burst)) == len(trace)  # nothing in the idle gaps
    hot = [[a.label for a in burst if a.label in HOT_LABELS] for burst in by_burst]
    rare = [[a.label for a in burst if a.label not in HOT_LABELS] for burst in by_burst]
    assert list(map(len, hot)) == [3, 3, 3, 3]
    # every second burst carries rare labels, their groups in turn: 1 and 4, then 8
    assert rare[0] == rare[2] == [] and len(rare[1]) == len(rare[3]) == 2
    assert set(rare[1]) <= {1, 4} and rare[3] == [8, 8]
    assert RARE_LABEL_GROUPS == ((1, 4), (8,))


def test_replica_seconds_integrate_running_processes_over_the_window() -> None:
    events = [ReplicaEvent(0.0, "a", 1), ReplicaEvent(5.0, "b", 1), ReplicaEvent(8.0, "b", -1),
              ReplicaEvent(12.0, "b", 1), ReplicaEvent(13.0, "a", 1),
              ReplicaEvent(20.0, "a", -2), ReplicaEvent(20.0, "b", -1)]
    # window 2..14: a 1 from 2 to 13 and 2 from 13 to 14; b 5..8 and 12..14
    assert replica_seconds(events, 2.0, 14.0) == {"a": 11.0 + 2.0, "b": 3.0 + 2.0}
    # a window after everything stopped holds nothing
    assert replica_seconds(events, 25.0, 30.0) == {"a": 0.0, "b": 0.0}
    # a window before b started: b holds nothing yet
    assert replica_seconds(events, 1.0, 4.0) == {"a": 3.0, "b": 0.0}


def test_replica_events_and_cold_starts_come_from_ddm_ups_log() -> None:
    lines = [
        (0.0, "started hot/0 (pid 11, port 5001); loading..."),
        (0.5, "started hot/1 (pid 12, port 5002); loading..."),
        (1.0, "[hot/0] started hot/0 (pid 99, port 1); a process's own line"),
        (2.0, "started router (pid 13, port 5003); loading..."),
        (10.0, "scaling rare up from zero: a generation needs it"),
        (14.5, "rare is ready (4.5 s after scaling up from zero)"),
        (20.0, "scaling rare to zero: no demand for 5 s"),
        (30.0, "scaling rare up from zero: a generation needs it"),
        (31.5, "rare is ready (1.5 s after scaling up from zero)"),
        (40.0, "stopping 4 process(es)..."),
    ]
    assert replica_events(lines) == [
        ReplicaEvent(0.0, "hot", 1), ReplicaEvent(0.5, "hot", 1), ReplicaEvent(10.0, "rare", 1),
        ReplicaEvent(20.0, "rare", -1), ReplicaEvent(30.0, "rare", 1),
        ReplicaEvent(40.0, "hot", -2), ReplicaEvent(40.0, "rare", -1)]
    assert replica_seconds(replica_events(lines), 5.0, 45.0) == {"hot": 70.0, "rare": 20.0}
    assert cold_start_seconds(lines) == [4.5, 1.5]


def test_routed_rows_count_each_experts_image_steps_from_the_routing_bits() -> None:
    names = ["a", "b", "c"]
    answers = [{"routing": [1, 1, 2], "expert_names": names},   # a, a, b
               {"routing": [3, 4], "expert_names": names},      # a and b, then c
               {"status": 503}]                                 # no answer: no rows
    assert routed_rows(answers) == {"a": 3, "b": 2, "c": 1}


def test_the_benchmark_refuses_policies_it_does_not_know(capsys) -> None:
    assert main(["scale-to-zero", "--policies", "wait,drop"]) == 2
    assert "--policies 'wait,drop'" in capsys.readouterr().err


def test_a_delay_as_long_as_the_gaps_is_refused() -> None:
    with pytest.raises(ValueError, match="shorter than the idle gaps"):
        bench_scale_to_zero(TraceShape(gap_s=8.0), delay_s=8)
