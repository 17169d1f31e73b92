"""``python -m benchmarks serve``: the byte counts it reports, its settings, and one quick run end
to end.

The quick run starts the real servers on loopback with the shipped checkpoints; it checks the
shape of the JSON (every figure with a target says whether it met it) and that every process it
started is stopped afterwards, not the figures themselves, which depend on the machine.
"""

from __future__ import annotations

import io
import json
import os
import socket
import threading
import time

import numpy as np
import pytest

from benchmarks.serve import BenchSettings, run_bench
from ddm.runtime.local import REPOSITORY_ROOT
from benchmarks.figures import cpu_per_step, summary_lines, wire_bytes
from benchmarks.fleet import cpu_seconds
from benchmarks.reference_protocol import decode_npz, encode_npz

FIGURES_WITH_TARGETS = ("step_overhead", "reference_baseline", "wire", "quality")


def test_wire_bytes_of_a_16x16_step():
    """Batch 1: 1036 raw request bytes (x 1024, t 4, y 8) travel as a velocity call naming rows
    of a label context in a 1148-byte body (header, descriptors, alignment, the 32-byte context
    id, rows and guidance for y); the reply's 1024 in 1064. Batch 64 amortises both headers."""
    one = wire_bytes((1, 16, 16), 1)
    assert (one["raw_request"], one["raw_reply"]) == (1036, 1024)
    assert (one["body_request"], one["body_reply"]) == (1148, 1064)
    assert one["ratio"] == round(2212 / 2060, 4)
    big = wire_bytes((1, 16, 16), 64)
    assert big["raw_request"] == 64 * 1036 and big["body_request"] == 66408
    assert big["ratio"] < 1.002 and big["ratio"] < one["ratio"]
    assert one["reference_npz_request"] > one["body_request"]  # zip headers per array


def test_npz_round_trip():
    x = np.random.default_rng(0).standard_normal((2, 1, 4, 4), np.float32)
    arrays = decode_npz(encode_npz(x=x, y=np.arange(2)))
    np.testing.assert_array_equal(arrays["x"], x)
    np.testing.assert_array_equal(arrays["y"], np.arange(2))


@pytest.mark.parametrize("steps", [0, 201, 2.5])
def test_settings_refuse_steps_the_router_refuses(steps):
    with pytest.raises(ValueError, match="steps"):
        BenchSettings(steps=steps)


def test_quick_settings_repeat_less():
    quick, full = BenchSettings(quick=True), BenchSettings()
    assert quick.repeats < full.repeats and quick.per_digit < full.per_digit
    assert BenchSettings(steps=4).delegations == (0, 4)
    assert BenchSettings().delegations == (0, 10, 40)


def test_cpu_seconds_count_every_live_thread_of_the_processes():
    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    spun, read = threading.Event(), threading.Event()

    def worker() -> None:
        spin(0.2)
        spun.set()
        read.wait()  # alive while counted: an ended thread's time is gone from /proc

    before = cpu_seconds((os.getpid(),))
    thread = threading.Thread(target=worker)
    thread.start()
    spin(0.1)
    spun.wait()
    after = cpu_seconds((os.getpid(),))
    read.set()
    thread.join()
    assert 0.3 <= after - before < 2.0
    assert cpu_seconds((2 ** 22 + 1,)) is None  # no such process


def test_cpu_per_step_is_the_difference_per_step_in_milliseconds():
    assert cpu_per_step({"in_process": 0.8, "router_and_experts": 1.2}, 400) == {
        "in_process": 2.0, "router_and_experts": 3.0, "overhead": 1.0}
    assert cpu_per_step({"in_process": 0.8, "router_and_experts": float("nan")}, 400) == {
        "in_process": 2.0, "router_and_experts": None, "overhead": None}


@pytest.mark.slow
def test_quick_run_reports_every_figure_and_stops_every_server():
    log = io.StringIO()
    result = run_bench(BenchSettings(steps=4, quick=True), log)
    json.dumps(result)  # JSON-ready as it is

    assert {"platform", "cpu_count", "versions"} <= set(result["machine"])
    assert result["settings"]["steps"] == 4 and result["settings"]["quick"] is True
    figures = [result["throughput"]["batch_64"], *(result[k] for k in FIGURES_WITH_TARGETS),
               result["concurrency"]["router"], *result["concurrency"]["expert"].values(),
               *(models[REPOSITORY_ROOT.name]  # trees are keyed by their directory's name
                 for models in result["expert_call"]["models"].values())]
    for figure in figures:
        assert {"value", "target", "comparison", "met"} <= set(figure)
        assert isinstance(figure["met"], bool)
    assert result["reference_baseline"]["same_images_as_in_process"] is True
    # The model thread's wake-ups, both ways, with this tree's Batcher.
    handoff = result["expert_call"]["handoff"][REPOSITORY_ROOT.name]
    assert set(handoff) == {"to_model_thread_ms", "back_to_loop_ms"}
    assert all(0 < times["p10"] <= times["median"] for times in handoff.values())
    # The client's side of a call past the bound, with this tree's HttpClient.
    reply_wait = result["expert_call"]["reply_wait"][REPOSITORY_ROOT.name]
    assert 0 < reply_wait["p10"] <= reply_wait["median"]
    cold = result["expert_call"]["cold_code"]  # the same Python after each idle gap
    assert list(cold) == ["after_0_ms_idle_us", "after_1_ms_idle_us", "after_5_ms_idle_us",
                          "after_20_ms_idle_us", "after_60_ms_idle_us"]
    assert all(microseconds > 0 for microseconds in cold.values())
    cpu = result["step_overhead"]["cpu_ms_per_step"]
    assert cpu["in_process"] > 0 and cpu["router_and_experts"] > 0
    assert [run["round_trips_per_image"] for run in result["delegation"]["runs"]] == [4, 1]
    assert len(summary_lines(result)) == len(figures)

    # Two deployments of two experts and a router, and two reference servers.
    assert len(result["servers"]) == 8
    for server in result["servers"]:
        assert server["exit_code"] is not None, server
        with pytest.raises(ChildProcessError):  # exited and reaped: no longer our child
            os.waitpid(server["pid"], os.WNOHANG)
        with socket.socket() as probe, pytest.raises(OSError):
            probe.settimeout(1.0)
            probe.connect(("127.0.0.1", server["port"]))
