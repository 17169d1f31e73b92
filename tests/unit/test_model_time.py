"""Where a benchmark level's time went (benchmarks/model_time.py): each model server's counts
read from its Prometheus text, their differences over a level, and the GPU's utilisation as
nvidia-smi samples it."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from benchmarks.gpu_check import summary, time_went
from prometheus_client import CollectorRegistry, generate_latest

from benchmarks.model_time import (ModelTime, RoundTrips, calls_ahead, gpu_utilisation,
                                   level_model_time, level_round_trips, model_times,
                                   round_trips)
from ddm.serving.router.fleet.servers import PoolMetrics

#: A pool's exposition as prometheus_client writes it (buckets cut short: only the
#: counts and sums are read), two members, one of which ran nothing yet.
POOL_TEXT = """\
# HELP ddm_expert_batch_images Images per model call (after coalescing requests).
# TYPE ddm_expert_batch_images histogram
ddm_expert_batch_images_bucket{le="1.0",member="expert-0"} 0.0
ddm_expert_batch_images_bucket{le="+Inf",member="expert-0"} 3.0
ddm_expert_batch_images_count{member="expert-0"} 3.0
ddm_expert_batch_images_sum{member="expert-0"} 48.0
ddm_expert_batch_images_bucket{le="+Inf",member="decoder"} 0.0
ddm_expert_batch_images_count{member="decoder"} 0.0
ddm_expert_batch_images_sum{member="decoder"} 0.0
# HELP ddm_expert_model_seconds Time of one batch in the model.
# TYPE ddm_expert_model_seconds histogram
ddm_expert_model_seconds_bucket{le="+Inf",member="expert-0"} 3.0
ddm_expert_model_seconds_count{member="expert-0"} 3.0
ddm_expert_model_seconds_sum{member="expert-0"} 0.75
ddm_expert_model_seconds_bucket{le="+Inf",member="decoder"} 0.0
ddm_expert_model_seconds_count{member="decoder"} 0.0
ddm_expert_model_seconds_sum{member="decoder"} 0.0
# HELP ddm_expert_requests_total Requests answered.
# TYPE ddm_expert_requests_total counter
ddm_expert_requests_total{kind="VelocityRequest",member="expert-0",status="200"} 3.0
"""

#: A server of one expert: its series carry no member label.
EXPERT_TEXT = """\
# TYPE ddm_expert_batch_images histogram
ddm_expert_batch_images_count 2.0
ddm_expert_batch_images_sum 5.0
# TYPE ddm_expert_model_seconds histogram
ddm_expert_model_seconds_count 2.0
ddm_expert_model_seconds_sum 0.5
"""


def test_a_pools_counts_are_read_per_member() -> None:
    assert model_times(POOL_TEXT) == {"expert-0": ModelTime(3, 48, 0.75),
                                      "decoder": ModelTime(0, 0, 0.0)}


def test_a_single_servers_counts_are_read_under_no_member_name() -> None:
    assert model_times(EXPERT_TEXT) == {"": ModelTime(2, 5, 0.5)}


def test_a_level_counts_what_ran_during_it_and_how_busy_each_server_was() -> None:
    before = {"pool/0": {"expert-0": ModelTime(1, 16, 0.25), "decoder": ModelTime()},
              "expert-1/0": {"": ModelTime(2, 4, 0.1)}}
    after = {"pool/0": {"expert-0": ModelTime(3, 48, 0.75), "decoder": ModelTime(1, 2, 0.25)},
             "expert-1/0": {"": ModelTime(2, 4, 0.1)}}
    assert level_model_time(before, after, elapsed_s=2.0) == {
        "pool/0": {"model_s": 0.75, "busy": 0.375, "members": {
            "decoder": {"batches": 1, "rows_per_batch": 2.0, "model_s": 0.25},
            "expert-0": {"batches": 2, "rows_per_batch": 16.0, "model_s": 0.5}}},
        "expert-1/0": {"model_s": 0, "busy": 0.0, "members": {}}}


def _fake_nvidia_smi(directory: Path, body: str) -> None:
    script = directory / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


async def _sampled() -> dict[str, object]:
    async with gpu_utilisation() as figures:
        await asyncio.sleep(0)  # the block's work
    return figures


def test_without_nvidia_smi_nothing_is_sampled(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert asyncio.run(_sampled()) == {"percent": None, "samples": 0}


def test_the_gpus_samples_during_the_block_are_averaged(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    # What nvidia-smi --loop-ms prints: a figure per line until it is stopped.
    marker = tmp_path / "printed"
    _fake_nvidia_smi(tmp_path, f'echo 20; echo 40; echo 90; touch {marker}; '
                               'while true; do sleep 0.05; done')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    async def sampled() -> dict[str, object]:
        async with gpu_utilisation() as figures:
            while not marker.exists():  # the block runs until the three samples are out
                await asyncio.sleep(0.01)
        return figures

    assert asyncio.run(sampled()) == {"percent": 50.0, "samples": 3}


def test_a_failed_nvidia_smi_is_recorded_not_raised(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    _fake_nvidia_smi(tmp_path, "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    figures = asyncio.run(_sampled())
    assert figures["percent"] is None and figures["samples"] == 0
    assert "no sample" in str(figures["error"])


def test_the_gpu_checks_summary_says_where_a_levels_time_went() -> None:
    level = {"model_time": {
        "pool/0": {"busy": 0.5, "members": {
            "expert-0": {"batches": 3, "rows_per_batch": 16.0, "model_s": 0.6},
            "expert-1": {"batches": 1, "rows_per_batch": 4.0, "model_s": 0.1},
            "router-network": {"batches": 9, "rows_per_batch": 1.0, "model_s": 0.2}}},
        "expert-2/0": {"busy": 0.25, "members": {
            "expert-2/0": {"batches": 1, "rows_per_batch": 8.0, "model_s": 0.5}}}},
        "gpu_utilisation": {"percent": 61.5, "samples": 40}}
    assert time_went(level) == ("model time 0.75 s per s, 5 expert batches of 12.0 rows, "
                                "GPU busy 61.5%")
    assert time_went({"images_per_s": 3.0}) == ""  # in-process levels have none
    level["round_trips"] = {"expert velocity": {"calls": 40, "mean_ms": 6.25},
                            "stage router": {"calls": 20, "mean_ms": 3.0}}
    assert time_went(level) == ("model time 0.75 s per s, 5 expert batches of 12.0 rows, "
                                "round trips expert velocity 6.2 ms x40, stage router 3.0 ms "
                                "x20, GPU busy 61.5%")


def _router_exposition(velocity_s: list[float], route_s: list[float]) -> str:
    """A router's ``/metrics`` after those expert and router-network round trips, written by
    the router's own metrics (two experts share the velocity calls)."""
    registry = CollectorRegistry()
    experts, stages = PoolMetrics(registry), PoolMetrics(registry, subject="stage")
    for index, seconds in enumerate(velocity_s):
        experts.seconds.labels(f"expert-{index % 2}", "velocity").observe(seconds)
    for seconds in route_s:
        stages.seconds.labels("router", "router").observe(seconds)
    stages.seconds.labels("decoder", "decoder").observe(0.5)
    return generate_latest(registry).decode()


def test_a_routers_round_trips_are_read_by_what_they_called() -> None:
    read = round_trips(_router_exposition([0.004, 0.006, 0.002], [0.003]))
    assert read.keys() == {"expert velocity", "stage router", "stage decoder"}
    assert read["expert velocity"].calls == 3
    assert read["expert velocity"].seconds == pytest.approx(0.012)
    assert read["stage router"] == RoundTrips(1, 0.003)
    assert round_trips(POOL_TEXT) == {}  # a model server makes none


def test_a_levels_round_trips_are_those_it_made_and_their_mean() -> None:
    before = round_trips(_router_exposition([0.004], [0.003]))
    after = round_trips(_router_exposition([0.004, 0.006, 0.002], [0.003, 0.005]))
    assert level_round_trips(before, after) == {
        "expert velocity": {"calls": 2, "mean_ms": 4.0},
        "stage router": {"calls": 1, "mean_ms": 5.0}}  # the decoder made no call meanwhile


ROUTER_TEXT = """\
# HELP ddm_router_calls_ahead_total Expert calls started beside a routing.
# TYPE ddm_router_calls_ahead_total counter
ddm_router_calls_ahead_total{outcome="used"} 58.0
ddm_router_calls_ahead_total{outcome="unused"} 2.0
# HELP ddm_router_calls_ahead_created Expert calls started beside a routing.
# TYPE ddm_router_calls_ahead_created gauge
ddm_router_calls_ahead_created{outcome="used"} 1.7e+09
"""


def test_a_routers_calls_ahead_are_read_by_outcome() -> None:
    assert calls_ahead(ROUTER_TEXT) == {"used": 58, "unused": 2}
    # A router that started none has no samples yet (a labelled counter's children).
    assert calls_ahead(POOL_TEXT) == {"used": 0, "unused": 0}


def test_the_gpu_checks_summary_compares_the_routers_over_one_pool() -> None:
    def level(images_per_s: float, p50: float) -> dict:
        return {"images_per_s": images_per_s, "latency_s": {"p50": p50}}

    result = {"deployments": {"pooled-reduce-overhead": {
        "levels": {"1": level(1.5, 0.66), "32": level(3.0, 10.0)},
        "calls_ahead_off": {"levels": {"1": level(1.0, 1.0), "32": level(2.5, 12.0)}},
        "calls_ahead": {"router": {"used": 98, "unused": 2},
                        "calls_ahead_off": {"used": 0, "unused": 0}}}}}
    assert summary(result) == [
        "pooled-reduce-overhead: 1 prompts 1.50 images/s p50 0.660 s, 32 prompts 3.00 "
        "images/s p50 10.000 s",
        "pooled-reduce-overhead through a router with calls_ahead_off: 1 prompts 1.00 "
        "images/s p50 1.000 s, 32 prompts 2.50 images/s p50 12.000 s",
        "  pooled-reduce-overhead calls ahead by router: router 98 used, 2 unused; "
        "calls_ahead_off 0 used, 0 unused"]


def test_the_gpu_checks_summary_says_how_each_pool_grouped_its_experts() -> None:
    measured = [{"rows_per_member": 1, "member_by_member_ms": 8.4, "grouped_ms": 4.6},
                {"rows_per_member": 2, "member_by_member_ms": 9.0, "grouped_ms": 9.5}]
    result = {"deployments": {"pooled-none": {
        "levels": {"1": {"images_per_s": 0.5, "latency_s": {"p50": 2.0}}},
        "groups": {"pool-gpu": [
            {"members": ["expert-0", "expert-1"], "grouped_up_to_rows": 1,
             "calibration": measured, "failure": None},
            {"members": ["expert-2", "expert-3"], "grouped_up_to_rows": 0,
             "calibration": [], "failure": "RuntimeError: no kernel"}]}}}}
    assert summary(result)[1:] == [
        "  pooled-none pool-gpu: expert-0, expert-1 grouped up to 1 rows of one member; "
        "measured 1 rows each 4.6 ms grouped, 8.4 ms member by member, 2 rows each 9.5 ms "
        "grouped, 9.0 ms member by member",
        "  pooled-none pool-gpu: expert-2, expert-3 not grouped (RuntimeError: no kernel)"]
