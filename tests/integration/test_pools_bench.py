"""``python -m benchmarks pools`` (issue 37): its settings, its targets' arithmetic, and one quick
run end to end.

The quick run starts the shipped text-to-image DDM's real servers on loopback twice (every
component alone, then one pool) and in-process sampling in a fresh process, at 2 steps and 1
and 2 prompts; it checks the JSON's shape and that every process it started is gone after, not
the figures themselves, which depend on the machine.
"""

from __future__ import annotations

import io
import json
import os

import pytest

from benchmarks.pools import QUICK, PoolBenchSettings, bench_pools_command, targets


def _figures(pool_mib: float, pool_rate: float, local_mib: float, local_rate: float) -> dict:
    level = {"images_per_s": pool_rate}
    return {"settings": {"concurrency": [1, 32]},
            "deployments": {"pooled": {"total_mib": {"lifetime_peak": pool_mib},
                                       "levels": {"1": {"images_per_s": 99.0}, "32": level}}},
            "in_process": {"peak_rss_mib": local_mib,
                           "levels": {"1": {"images_per_s": 1.0},
                                      "32": {"images_per_s": local_rate}}}}


def test_the_targets_compare_the_pool_with_in_process_sampling_at_most_concurrency() -> None:
    met = targets(_figures(pool_mib=650, pool_rate=9, local_mib=500, local_rate=10))
    assert met["memory_pooled_to_in_process"] == {"value": 1.3, "target": 1.3,
                                                  "comparison": "<=", "met": True}
    assert met["images_per_s_pooled_to_in_process"] == {
        "concurrency": 32, "value": 0.9, "target": 0.9, "comparison": ">=", "met": True}
    missed = targets(_figures(pool_mib=700, pool_rate=8, local_mib=500, local_rate=10))
    assert not missed["memory_pooled_to_in_process"]["met"]
    assert not missed["images_per_s_pooled_to_in_process"]["met"]


def test_without_a_kernel_kept_peak_the_sampled_one_is_judged_or_none() -> None:
    """gVisor's /proc keeps no VmHWM: the pool's sampled peaks stand in; with neither, the
    memory target is reported unjudged rather than the run failing after its figures."""
    figures = _figures(pool_mib=650, pool_rate=9, local_mib=500, local_rate=10)
    figures["deployments"]["pooled"]["total_mib"] = {"lifetime_peak": None,
                                                     "sampled_peak": 600.0}
    assert targets(figures)["memory_pooled_to_in_process"] == {
        "value": 1.2, "target": 1.3, "comparison": "<=", "met": True}
    figures["deployments"]["pooled"]["total_mib"] = {"lifetime_peak": None,
                                                     "sampled_peak": None}
    assert targets(figures)["memory_pooled_to_in_process"] == {
        "value": None, "target": 1.3, "comparison": "<=", "met": None}


@pytest.mark.parametrize(("field", "value", "message"), [
    ("concurrency", (), "concurrency"), ("concurrency", (0, 8), "concurrency"),
    ("rounds", 0, "rounds"), ("steps", 0, "steps"), ("timeout_s", 0.0, "timeout_s"),
    ("threads", 0, "threads")])
def test_settings_out_of_range_are_refused_by_name(field: str, value: object,
                                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PoolBenchSettings(**{field: value})


@pytest.mark.slow
def test_a_quick_run_gives_every_figure_and_stops_its_processes() -> None:
    out, log = io.StringIO(), io.StringIO()
    assert bench_pools_command(QUICK, out=out, log=log) == 0
    result = json.loads(out.getvalue())
    assert "pools: in-process" in log.getvalue()
    assert result["sampling"]["steps"] == 2
    alone, pooled = result["deployments"]["alone"], result["deployments"]["pooled"]
    assert set(alone["processes"]) == {"expert-0/0", "expert-1/0", "expert-2/0", "expert-3/0",
                                       "text-encoder/0", "decoder/0", "router"}
    assert set(pooled["processes"]) == {"pool-models/0", "router"}
    for deployment in (alone, pooled):
        peaks = [p["lifetime_peak_mib"] for p in deployment["processes"].values()]
        assert all(20 < peak < 4096 for peak in peaks), deployment
        assert deployment["total_mib"]["lifetime_peak"] == pytest.approx(sum(peaks), abs=0.5)
        for process in deployment["processes"].values():
            with pytest.raises(ProcessLookupError):  # stopped
                os.kill(process["pid"], 0)
    for figures in (alone, pooled, result["in_process"]):
        assert set(figures["levels"]) == {"1", "2"}
        for concurrency, level in figures["levels"].items():
            assert level["images"] == int(concurrency)
            # elapsed_s is rounded to the millisecond: in-process levels at 2 steps take a few
            assert abs(level["images_per_s"] * level["elapsed_s"] - level["images"]) <= (
                5e-4 * level["images_per_s"] + 1e-3), level
            assert 0 < level["latency_s"]["p50"] <= level["latency_s"]["max"]
    assert 20 < result["in_process"]["peak_rss_mib"] < 4096
    assert set(result["targets"]) == {"memory_pooled_to_in_process",
                                      "images_per_s_pooled_to_in_process"}
    assert all(isinstance(t["met"], bool) for t in result["targets"].values())
    assert len(result["load_average_after"]) == 3
