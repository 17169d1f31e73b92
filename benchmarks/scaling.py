"""``python -m benchmarks scale-to-zero``: a skewed, bursty trace against ``ddm up`` with one
expert at ``minReplicas: 0``.

The shipped digits DDM (``examples/digits.yaml``: one expert per label half, the learned
router) runs under ``ddm up`` with ``digits-0-4`` at ``minReplicas: 0`` (scale-down delay
``delay_s``) and the ``wait`` policy (a label partition has nothing to reroute to), the other
expert fixed at one process. The trace (:func:`skewed_trace`, seeded) keeps ``digits-5-9`` hot
(a request every ``hot_gap_s`` on average, with a burst) while ``digits-0-4`` is rarely chosen:
a few bursts of requests, far enough apart for it to scale to zero in between. Each request is
sent at its time whatever the others do, so a cold start delays only those needing it; they
come from 16 clients in turn (loopback addresses of their own), as users would.

The result: requests, failed requests (target: none), latency percentiles overall and of the
requests that needed the scaled expert, cold starts, and expert process-seconds used (sampled:
a process counts while it listens on its port) against fixed provisioning (every expert's
process for the whole run). This is ``ddm up`` on one machine, not a cluster: a cold start here
is a process loading its checkpoint from a warm page cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from ddm.runtime.local import REPOSITORY_ROOT
from tests.support.local_runtime import ddm_up
from tests.support.processes import listening_pid

MANIFEST = REPOSITORY_ROOT / "examples" / "digits.yaml"
SCALED = "digits-0-4"
RARE_LABELS, HOT_LABELS = (0, 1, 2, 3, 4), (5, 6, 7, 8, 9)
#: Distinct clients (loopback addresses 127.0.0.2 and on) the requests come from in turn.
CLIENTS = 16
#: Seconds between two looks at which expert processes are up.
SAMPLE_S = 0.25


@dataclass(frozen=True)
class Arrival:
    at_s: float
    label: int


def skewed_trace(duration_s: float, hot_gap_s: float, rare_bursts: int, burst_size: int,
                 seed: int) -> list[Arrival]:
    """Hot labels as a Poisson stream (mean gap ``hot_gap_s``) plus one burst of 8 at mid-run;
    rare labels in ``rare_bursts`` bursts of ``burst_size`` (within 1 s), evenly spread."""
    rng = np.random.default_rng(seed)
    arrivals, t = [], float(rng.exponential(hot_gap_s))
    while t < duration_s:
        arrivals.append(Arrival(t, int(rng.choice(HOT_LABELS))))
        t += float(rng.exponential(hot_gap_s))
    arrivals += [Arrival(duration_s / 2 + i * 0.1, int(rng.choice(HOT_LABELS))) for i in range(8)]
    for burst in range(rare_bursts):
        start = duration_s * (burst + 0.5) / rare_bursts
        arrivals += [Arrival(start + float(rng.uniform(0, 1)), int(rng.choice(RARE_LABELS)))
                     for _ in range(burst_size)]
    return sorted(arrivals, key=lambda a: a.at_s)


async def _replay(url: str, trace: list[Arrival], steps: int) -> list[dict[str, Any]]:
    """Each request at its time, from one of ``CLIENTS`` clients in turn (each its own
    loopback address, so that the router's per-client limit sees many users, not one)."""
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(
            timeout=600, transport=httpx.AsyncHTTPTransport(local_address=f"127.0.0.{2 + i}")))
            for i in range(CLIENTS)]
        started = time.monotonic()

        async def one(index: int, arrival: Arrival) -> dict[str, Any]:
            client = clients[index % CLIENTS]
            await asyncio.sleep(max(0.0, started + arrival.at_s - time.monotonic()))
            sent = time.monotonic()
            try:
                answer = await client.post(f"{url}/v1/generate", json={
                    "labels": [arrival.label], "steps": steps, "seed": 0})
                status = answer.status_code
            except httpx.HTTPError as error:
                status = type(error).__name__
            return {"label": arrival.label, "status": status,
                    "latency_s": time.monotonic() - sent}

        return await asyncio.gather(*(one(i, a) for i, a in enumerate(trace)))


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    return {f"p{q}": round(float(np.percentile(values, q)), 3) for q in (50, 99)}


def bench_scale_to_zero(duration_s: float = 150.0, delay_s: float = 15.0, steps: int = 10,
                        hot_gap_s: float = 1.5, rare_bursts: int = 3, burst_size: int = 3,
                        seed: int = 0) -> dict[str, Any]:
    """Replay the trace against ``ddm up``; the figures as a dict."""
    trace = skewed_trace(duration_s, hot_gap_s, rare_bursts, burst_size, seed)
    document = yaml.safe_load(MANIFEST.read_text())
    document["spec"]["router"]["missingExpert"] = {"policy": "wait"}
    for expert in document["spec"]["experts"]:
        if expert["name"] == SCALED:
            expert["autoscaling"] = {"minReplicas": 0, "maxReplicas": 1,
                                     "scaleDownDelaySeconds": math.ceil(delay_s)}
    with tempfile.TemporaryDirectory(prefix="ddm-bench-scale-") as workdir:
        manifest = Path(workdir) / "digits.yaml"
        manifest.write_text(yaml.safe_dump(document))
        with ddm_up(manifest) as (plan, log, _):
            ports = {p.name.split("/")[0]: p.port for p in plan.experts}
            up_s = {name: 0.0 for name in ports}
            done = threading.Event()

            def sample() -> None:
                last = time.monotonic()
                while not done.wait(SAMPLE_S):
                    now = time.monotonic()
                    for name, port in ports.items():
                        if listening_pid(port) is not None:
                            up_s[name] += now - last
                    last = now

            sampler = threading.Thread(target=sample, daemon=True)
            began = time.monotonic()
            sampler.start()
            results = asyncio.run(_replay(plan.url, trace, steps))
            elapsed = time.monotonic() - began
            done.set()
            sampler.join()
            cold_starts = log.getvalue().count(f"scaling {SCALED} up from zero")
            scale_downs = log.getvalue().count(f"scaling {SCALED} to zero")
    failed = [r for r in results if r["status"] != 200]
    rare = [r["latency_s"] for r in results if r["label"] in RARE_LABELS and r["status"] == 200]
    used = sum(up_s.values())
    return {
        "where": "ddm up on one machine (processes on loopback), not a cluster",
        "ddm": "examples/digits.yaml", "scaled_expert": SCALED, "policy": "wait",
        "scale_down_delay_s": math.ceil(delay_s), "steps": steps, "seed": seed,
        "trace": {"duration_s": duration_s, "requests": len(trace),
                  "hot_requests": sum(a.label in HOT_LABELS for a in trace),
                  "rare_requests": sum(a.label in RARE_LABELS for a in trace),
                  "rare_bursts": rare_bursts, "burst_size": burst_size,
                  "hot_mean_gap_s": hot_gap_s},
        "elapsed_s": round(elapsed, 1),
        "failed_requests": len(failed), "failures": [r["status"] for r in failed],
        "latency_s": _percentiles([r["latency_s"] for r in results if r["status"] == 200]),
        "latency_needing_scaled_expert_s": _percentiles(rare),
        "cold_starts": cold_starts, "scale_downs": scale_downs,
        "expert_process_seconds": {name: round(s, 1) for name, s in up_s.items()},
        "process_seconds_used": round(used, 1),
        "process_seconds_fixed": round(len(ports) * elapsed, 1),
        "saving": round(1 - used / (len(ports) * elapsed), 3),
        "load_average": [round(v, 2) for v in os.getloadavg()],
    }


def bench_scale_to_zero_command(as_json: bool, **options: Any) -> int:
    result = bench_scale_to_zero(**options)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    print("scale-to-zero: done", file=sys.stderr)
    return 0 if result["failed_requests"] == 0 else 1
