"""Missing experts and scale to zero under ``ddm up``, real processes on loopback (issue 24).

* ``reroute``: with the MNIST DDM (every expert draws every digit), an expert killed for good
  leaves generations at 200; the answers name the rerouted steps, the killed expert runs no
  step, and the shipped MNIST classifier still reads the asked digits.
* ``wait``: with the digits DDM (label partition: nothing to reroute to), a request arriving
  while an expert is down waits for ``ddm up`` to restart it, succeeds, and says how long it
  waited.
* ``minReplicas: 0``: no process of that expert while idle; a request needing it starts one
  (a cold start) and succeeds; after the scale-down delay without demand it is stopped.
* A client's strategy wakes nothing (issue 35): an ``ensemble`` request, which would call
  every expert at every step, is served by the experts that are up and leaves no demand on
  those at zero; the DDM's own strategy still starts them.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml
from PIL import Image

from benchmarks.scaling import (HOT_EXPERTS, RARE_EXPERTS, TraceShape,
                                bench_scale_to_zero)
from ddm.evaluation.classifier import load_classifier
from ddm.runtime.local import Backoff
from tests.support.local_runtime import Log, ddm_up
from tests.support.processes import listening_pid

ROOT = Path(__file__).resolve().parents[2]
DIGITS, MNIST = ROOT / "examples" / "digits.yaml", ROOT / "examples" / "mnist.yaml"
NEVER = Backoff(first_s=3600.0)  # a killed process stays dead for the test
EVENT_TIMEOUT_S = 120.0


def _manifest(example: Path, tmp_path: Path, missing: dict[str, Any],
              autoscaling: dict[str, dict[str, Any]] | None = None) -> Path:
    document = yaml.safe_load(example.read_text())
    document["spec"]["router"]["missingExpert"] = missing
    for expert in document["spec"]["experts"]:
        if expert["name"] in (autoscaling or {}):
            expert["autoscaling"] = autoscaling[expert["name"]]
    path = tmp_path / example.name
    path.write_text(yaml.safe_dump(document))
    return path


def _generate(url: str, labels: list[int], steps: int, log: Log) -> dict[str, Any]:
    answer = httpx.post(f"{url}/v1/generate", timeout=300,
                        json={"labels": labels, "steps": steps, "seed": 0})
    assert answer.status_code == 200, f"{answer.text}\n{log.getvalue()[-3000:]}"
    return answer.json()


def _until(condition, what: str, log: Log) -> None:
    """Poll ``condition()`` until true (the processes are external: nothing else to wait on)."""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen:\n{log.getvalue()[-3000:]}"
        time.sleep(0.2)


def _replica_states(url: str, expert: str) -> list[str]:
    info = httpx.get(f"{url}/v1/info", timeout=30).json()
    return list(next(e for e in info["experts"] if e["name"] == expert)["replicas"].values())


def _kill(port: int) -> None:
    pid = listening_pid(port)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)


def test_with_reroute_a_killed_expert_keeps_answers_200_and_the_digits_right(
        tmp_path: Path) -> None:
    labels = list(range(10)) * 2
    manifest = _manifest(MNIST, tmp_path, {"policy": "reroute"})
    with ddm_up(manifest, backoff=NEVER) as (plan, log, _):
        before = _generate(plan.url, labels, 20, log)
        names = before["expert_names"]
        uses = [sum(bool(mask >> k & 1) for image in before["routing"] for mask in image)
                for k in range(len(names))]
        victim = int(np.argmax(uses))  # the expert these digits need most
        _kill(next(p for p in plan.experts if p.name == f"{names[victim]}/0").port)

        after = _generate(plan.url, labels, 20, log)  # the expert is gone from the start
        rerouted = [steps for steps in after["rerouted"] if steps]
        assert rerouted, after["rerouted"]
        assert not any(mask >> victim & 1 for image in after["routing"] for mask in image)
        assert all(names[victim] not in used for used in after["experts"])
        images = np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(b))))
                           for b in after["images"]])
        read = load_classifier(ROOT / "checkpoints" / "mnist" / "classifier").predict(images)
        accuracy = float(np.mean(read == np.array(labels)))
        print(f"\nreroute: {names[victim]} killed ({uses[victim]} of the image-steps before); "
              f"{len(rerouted)} of {len(labels)} images rerouted on "
              f"{sum(map(len, rerouted))} steps; classifier accuracy {accuracy:.2f}")
        assert accuracy >= 0.9, read
        metrics = httpx.get(f"http://127.0.0.1:{plan.router.metrics_port}/metrics").text
        assert f'ddm_router_expert_rerouted_rows_total{{expert="{names[victim]}"}}' in metrics
        assert "ddm_router_rerouted_steps_total " in metrics


def test_with_wait_a_request_for_a_down_expert_waits_until_it_is_back(tmp_path: Path) -> None:
    manifest = _manifest(DIGITS, tmp_path, {"policy": "wait", "waitSeconds": 120})
    with ddm_up(manifest, backoff=Backoff(first_s=8.0)) as (plan, log, _):
        assert _generate(plan.url, [1], 4, log)["waited_s"] == 0.0
        expert = next(p for p in plan.experts if p.name == "digits-0-4/0")
        _kill(expert.port)
        _until(lambda: _replica_states(plan.url, "digits-0-4") == ["down"],
               "the router seeing digits-0-4 down", log)
        answer = _generate(plan.url, [1, 7], 4, log)  # arrives while it is down
        assert f"restarted {expert.name}" in log.getvalue()
        print(f"\nwait: the request waited {answer['waited_s']:.1f} s for digits-0-4")
        assert answer["waited_s"] > 0.5, answer
        assert answer["experts"] == [["digits-0-4"], ["digits-5-9"]]


def test_an_expert_at_min_replicas_0_starts_on_demand_and_stops_after_the_delay(
        tmp_path: Path) -> None:
    manifest = _manifest(DIGITS, tmp_path, {"policy": "wait"}, {"digits-0-4": {
        "minReplicas": 0, "maxReplicas": 1, "scaleDownDelaySeconds": 3}})
    with ddm_up(manifest) as (plan, log, _):
        expert = next(p for p in plan.experts if p.name == "digits-0-4/0")
        assert listening_pid(expert.port) is None  # idle: no process
        assert _generate(plan.url, [7], 4, log)["waited_s"] == 0.0  # the other expert's
        assert listening_pid(expert.port) is None
        demand = httpx.get(f"{plan.url}/v1/demand", timeout=30).json()
        assert demand["experts"]["digits-0-4"]["idle_s"] is None, demand
        assert demand["experts"]["digits-5-9"]["rows_per_s"] > 0, demand

        answer = _generate(plan.url, [1], 4, log)  # needs it: a cold start
        assert answer["experts"] == [["digits-0-4"]] and answer["waited_s"] > 0, answer
        assert listening_pid(expert.port) is not None
        assert "scaling digits-0-4 up from zero" in log.getvalue()
        _until(lambda: "digits-0-4 is ready (" in log.getvalue(),
               "ddm up saying the cold start is over", log)
        print(f"\nscale to zero: cold start answered after {answer['seconds']:.1f} s "
              f"(waited {answer['waited_s']:.1f} s)")

        _until(lambda: listening_pid(expert.port) is None, "scaling digits-0-4 to zero", log)
        assert "scaling digits-0-4 to zero: no demand for 3 s" in log.getvalue()
        assert f"{expert.name} exited" not in log.getvalue()  # stopped, not crashed


def test_the_scale_to_zero_benchmark_replays_its_trace_fixed_and_autoscaled() -> None:
    """A smoke run of ``python -m benchmarks scale-to-zero`` on a short trace: no request
    fails, fixed provisioning holds every expert for the whole window, and the autoscaled run
    holds the rare experts only after their cold starts (they are at zero before the first
    rare burst), so less."""
    shape = TraceShape(bursts=2, burst_s=3.0, gap_s=8.0, hot_per_burst=3, rare_every=2,
                       rare_per_burst=1)
    result = bench_scale_to_zero(shape, delay_s=3, steps=4, policies=("wait",))
    fixed, scaled = result["runs"]
    assert result["failed_requests"] == 0 and result["trace"]["requests"] == 7
    assert fixed["process_deaths"] == scaled["process_deaths"] == 0
    assert set(fixed["replica_seconds"]) == {*HOT_EXPERTS, *RARE_EXPERTS}
    assert all(abs(held - fixed["window_s"]) <= 0.1 for held in fixed["replica_seconds"].values())
    assert fixed["cold_starts"] == {}
    assert sum(scaled["cold_starts"].values()) >= 1
    assert set(scaled["cold_starts"]) <= set(RARE_EXPERTS)
    assert scaled["cold_start_s"]["max"] > 0
    assert scaled["replica_seconds_vs_fixed"] < 1
    assert all(abs(scaled["replica_seconds"][hot] - scaled["window_s"]) <= 0.1
               for hot in HOT_EXPERTS)


def test_an_expert_started_for_rerouted_steps_is_not_stopped_before_it_is_ready(
        tmp_path: Path) -> None:
    """With ``reroute`` the rows of an expert at zero go elsewhere, and count as its demand, so
    it starts; a scale-down delay shorter than its cold start must not stop it before it ever
    serves (it was stopped, unready, one delay after the rerouted generation): the delay runs
    from when it is ready."""
    manifest = _manifest(MNIST, tmp_path, {"policy": "reroute"}, {"mnist-cluster-3": {
        "minReplicas": 0, "maxReplicas": 1, "scaleDownDelaySeconds": 1}})
    with ddm_up(manifest) as (plan, log, _):
        answer = _generate(plan.url, [8, 8, 8, 8], 10, log)  # 8s: mostly mnist-cluster-3's
        assert any(answer["rerouted"]), answer
        _until(lambda: "scaling mnist-cluster-3 up from zero" in log.getvalue(),
               "the rerouted rows starting mnist-cluster-3", log)
        _until(lambda: "mnist-cluster-3 is ready (" in log.getvalue(),
               "mnist-cluster-3 becoming ready", log)
        _until(lambda: "scaling mnist-cluster-3 to zero" in log.getvalue(),
               "mnist-cluster-3 scaling to zero after the delay", log)
        text = log.getvalue()
        assert text.index("mnist-cluster-3 is ready (") < text.index(
            "scaling mnist-cluster-3 to zero")


def test_a_clients_ensemble_is_served_by_the_experts_up_and_wakes_none(tmp_path: Path) -> None:
    """Issue 35: one ``{"n": 1, "steps": 1, "strategy": "ensemble"}`` per scale-down delay
    kept every expert from scaling to zero and woke those at zero (under ``wait`` it waited
    for both cold starts). Only the DDM's strategy (top1) may start an expert."""
    asleep = ("mnist-cluster-2", "mnist-cluster-3")
    manifest = _manifest(MNIST, tmp_path, {"policy": "wait", "waitSeconds": 120}, {
        name: {"minReplicas": 0, "maxReplicas": 1, "scaleDownDelaySeconds": 600}
        for name in asleep})
    with ddm_up(manifest) as (plan, log, _):
        ports = {name: next(p for p in plan.experts if p.name == f"{name}/0").port
                 for name in asleep}
        answer = httpx.post(f"{plan.url}/v1/generate", timeout=300, json={
            "labels": [1], "steps": 1, "seed": 0, "strategy": "ensemble"})
        assert answer.status_code == 200, f"{answer.text}\n{log.getvalue()[-3000:]}"
        body = answer.json()
        assert body["waited_s"] == 0.0 and body["rerouted"] == [[1]], body
        assert not set(asleep) & set(body["experts"][0]), body
        demand = httpx.get(f"{plan.url}/v1/demand", timeout=30).json()["experts"]
        for name in asleep:
            assert (demand[name]["rows_per_s"], demand[name]["idle_s"]) == (0, None), demand
            assert listening_pid(ports[name]) is None
        up = [name for name in demand if name not in asleep]
        assert all(demand[name]["rows_per_s"] > 0 for name in up), demand

        # The DDM's own strategy, on a digit the sleeping experts draw, still wakes them.
        answer = _generate(plan.url, [8, 8, 8, 8, 0, 0, 0, 0], 10, log)
        woken = {name for image in answer["experts"] for name in image} & set(asleep)
        assert woken, answer
        _until(lambda: all(f"{name} is ready (" in log.getvalue() for name in woken),
               "the DDM's own strategy waking the experts it needs", log)
