"""``python -m benchmarks scale-to-zero``: a skewed, bursty trace replayed against ``ddm up``,
once with every expert provisioned and once autoscaled, to price scale to zero.

The DDM is the shipped MNIST one (``examples/mnist.yaml``: four experts, one per k-means
cluster, the learned router, top-1). The router picks the expert from the noisy image, so the
skew comes from the labels the trace asks for: measured on this DDM (16 images per label, 10
steps), every step of a 0, 3, 5 or 6 went to ``mnist-cluster-0`` or ``mnist-cluster-1``
(:data:`HOT_LABELS`), while a 1 or a 4 goes mostly to ``mnist-cluster-2`` and an 8 mostly to
``mnist-cluster-3`` (:data:`RARE_LABEL_GROUPS`, with some steps on the other clusters). The
trace (:func:`bursty_trace`, seeded) is bursts of hot-label requests separated by idle gaps
longer than the scale-down delay; some bursts also carry a few rare-label requests, their
group alternating. The routed rows per expert are counted from the answers' ``routing``, so
the skew the result reports is measured, not assumed.

The same trace runs against (a) fixed provisioning: every expert one process all the time;
(b) autoscaled: the hot experts at ``minReplicas: 1``, the rare ones at ``minReplicas: 0``
with ``router.missingExpert.policy: wait`` (and, asked for, (c) the same with ``reroute``).
Each request is sent at its time whatever the others do, from 16 clients in turn (loopback
addresses of their own), one label, its own seed.

Figures per run, from real events: expert replica-seconds (the integral of running expert
processes over the run's window, from the times ``ddm up`` logged starting, scaling up and
scaling down each one: :func:`replica_events`, :func:`replica_seconds`) and their ratio to
fixed provisioning over the same window (the fixed run's mean replicas times this run's
window), request latency p50/p99 (all, hot-label, rare-label), failed requests (target:
none), cold starts per expert and their durations (``ddm up``'s "is ready (N s after scaling
up from zero)"), scale-downs, and the time generations waited (the answers' ``waited_s``). A
run's window is from the first request's due time to the end of the trace (its last idle
gap, in which the last scaled-up experts scale down) or the last answer, whichever is later.
This is ``ddm up`` on one machine, not a cluster: a cold start is a process importing its
framework and loading its checkpoint from a warm page cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from benchmarks.figures import percentiles
from benchmarks.fleet import machine
from ddm.runtime.local import REPOSITORY_ROOT
from tests.support.local_runtime import ddm_up

MANIFEST = REPOSITORY_ROOT / "examples" / "mnist.yaml"
HOT_EXPERTS = ("mnist-cluster-0", "mnist-cluster-1")
RARE_EXPERTS = ("mnist-cluster-2", "mnist-cluster-3")
#: Labels whose every step the router sent to a hot expert (16 images each, measured).
HOT_LABELS = (0, 3, 5, 6)
#: Labels the router sends mostly to one rare expert each: 1 and 4 to mnist-cluster-2, 8 to
#: mnist-cluster-3; a rare burst asks for one group.
RARE_LABEL_GROUPS = ((1, 4), (8,))
#: Distinct clients (loopback addresses 127.0.0.2 and on) the requests come from in turn.
CLIENTS = 16
POLICIES = ("wait", "reroute")


@dataclass(frozen=True)
class TraceShape:
    """``bursts`` bursts of ``burst_s`` seconds, each followed by ``gap_s`` idle seconds;
    ``hot_per_burst`` hot-label requests in every burst, and ``rare_per_burst`` rare-label
    requests in every ``rare_every``-th burst (the 2nd, 4th, ... with 2)."""

    bursts: int = 4
    burst_s: float = 6.0
    gap_s: float = 30.0
    hot_per_burst: int = 12
    rare_every: int = 2
    rare_per_burst: int = 3

    @property
    def period_s(self) -> float:
        return self.burst_s + self.gap_s

    @property
    def duration_s(self) -> float:
        """The whole trace, its last idle gap included."""
        return self.bursts * self.period_s


#: The rare experts' scale-down delay: longer than a cold start here (15 to 30 s under load),
#: or an expert started for a rerouted step may be stopped before it is ready.
DELAY_S = 15
#: ``--quick``: a smoke run of about a minute per run, its delay shorter than its gaps.
QUICK = TraceShape(bursts=3, burst_s=4.0, gap_s=12.0, hot_per_burst=6, rare_every=2,
                   rare_per_burst=2)
QUICK_DELAY_S = 5


@dataclass(frozen=True)
class Arrival:
    at_s: float
    label: int
    seed: int


def bursty_trace(shape: TraceShape, seed: int) -> list[Arrival]:
    """The requests of ``shape``, at uniform random times within their bursts; rare bursts
    ask for :data:`RARE_LABEL_GROUPS` in turn. Sorted by time; each its own seed (its
    index)."""
    rng = np.random.default_rng(seed)
    times_labels: list[tuple[float, int]] = []
    for burst in range(shape.bursts):
        start = burst * shape.period_s
        labels = list(rng.choice(HOT_LABELS, shape.hot_per_burst))
        if burst % shape.rare_every == shape.rare_every - 1:
            group = RARE_LABEL_GROUPS[(burst // shape.rare_every) % len(RARE_LABEL_GROUPS)]
            labels += list(rng.choice(group, shape.rare_per_burst))
        times_labels += [(start + float(at), int(label)) for at, label
                         in zip(rng.uniform(0, shape.burst_s, len(labels)), labels)]
    return [Arrival(at, label, index) for index, (at, label) in enumerate(sorted(times_labels))]


@dataclass(frozen=True)
class ReplicaEvent:
    """At ``at`` (monotonic seconds) ``expert``'s running processes changed by ``change``."""

    at: float
    expert: str
    change: int


_STARTED = re.compile(r"started (?P<expert>[^/\s]+)/\d+ \(pid ")
_SCALED_UP = re.compile(r"scaling (?P<expert>\S+) up from zero")
_SCALED_DOWN = re.compile(r"scaling (?P<expert>\S+) to zero")
_READY = re.compile(r"(?P<expert>\S+) is ready \((?P<seconds>[0-9.]+) s after scaling up")
_STOPPING = re.compile(r"stopping \d+ process")


def replica_events(lines: Sequence[tuple[float, str]]) -> list[ReplicaEvent]:
    """Expert process starts and stops from ``ddm up``'s timed log lines: its first start of
    each process, an on-demand expert scaled up or down (one process each: ``minReplicas``
    0 runs at most one locally), and every process stopping at the end."""
    events: list[ReplicaEvent] = []
    running: Counter[str] = Counter()
    for at, line in lines:
        for pattern, change in ((_STARTED, 1), (_SCALED_UP, 1), (_SCALED_DOWN, -1)):
            if found := pattern.match(line):
                expert = found["expert"]
                events.append(ReplicaEvent(at, expert, change))
                running[expert] += change
        if _STOPPING.match(line):
            events += [ReplicaEvent(at, expert, -count) for expert, count in running.items()
                       if count]
            running.clear()
    return events


def replica_seconds(events: Sequence[ReplicaEvent], start: float, end: float
                    ) -> dict[str, float]:
    """Per expert, the integral of its running processes over ``[start, end]``."""
    totals: dict[str, float] = {}
    running: Counter[str] = Counter()
    since: dict[str, float] = {}
    for event in sorted(events, key=lambda e: e.at):
        expert = event.expert
        held_from = max(start, since.get(expert, start))
        held_to = min(end, event.at)
        totals[expert] = totals.get(expert, 0.0) + running[expert] * max(0.0, held_to - held_from)
        running[expert] += event.change
        since[expert] = event.at
    for expert, count in running.items():
        held_from = max(start, since[expert])
        totals[expert] += count * max(0.0, end - held_from)
    return totals


def cold_start_seconds(lines: Sequence[tuple[float, str]]) -> list[float]:
    """The cold starts ``ddm up`` reported: scaling up to every process ready."""
    return [float(found["seconds"]) for _, line in lines if (found := _READY.match(line))]


async def _replay(url: str, trace: list[Arrival], steps: int
                  ) -> tuple[float, list[dict[str, Any]]]:
    """Each request at its time, from one of ``CLIENTS`` clients in turn (each its own
    loopback address, so that the router's per-client limit sees many users, not one);
    returns when the trace began (monotonic) and each request's outcome."""
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(
            timeout=600, transport=httpx.AsyncHTTPTransport(local_address=f"127.0.0.{2 + i}")))
            for i in range(CLIENTS)]
        began = time.monotonic()

        async def one(index: int, arrival: Arrival) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, began + arrival.at_s - time.monotonic()))
            sent = time.monotonic()
            outcome: dict[str, Any] = {"label": arrival.label}
            try:
                answer = await clients[index % CLIENTS].post(f"{url}/v1/generate", json={
                    "labels": [arrival.label], "steps": steps, "seed": arrival.seed})
                outcome["status"] = answer.status_code
                if answer.status_code == 200:
                    body = answer.json()
                    outcome |= {"waited_s": body["waited_s"], "routing": body["routing"][0],
                                "expert_names": body["expert_names"],
                                "rerouted_steps": len(body["rerouted"][0])}
            except httpx.HTTPError as error:
                outcome["status"] = type(error).__name__
            outcome["answered"] = time.monotonic()
            outcome["latency_s"] = outcome["answered"] - sent
            return outcome

        return began, await asyncio.gather(*(one(i, a) for i, a in enumerate(trace)))


def manifest_for(policy: str | None, delay_s: int) -> dict[str, Any]:
    """The MNIST DDM: every expert fixed at one replica (``policy`` None), or autoscaled with
    the rare experts at ``minReplicas: 0`` and ``policy`` for a missing expert."""
    document = yaml.safe_load(MANIFEST.read_text())
    if policy is None:
        return document
    document["spec"]["router"]["missingExpert"] = {"policy": policy, "waitSeconds": 120}
    for expert in document["spec"]["experts"]:
        low = 0 if expert["name"] in RARE_EXPERTS else 1
        expert["autoscaling"] = {"minReplicas": low, "maxReplicas": 1,
                                 "scaleDownDelaySeconds": delay_s}
    return document


def routed_rows(results: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Image-steps each expert ran, from the answers' routing bitmasks."""
    rows: Counter[str] = Counter()
    for result in results:
        for mask in result.get("routing", ()):
            rows.update(name for k, name in enumerate(result["expert_names"]) if mask >> k & 1)
    return dict(sorted(rows.items()))


def run_once(policy: str | None, trace: list[Arrival], shape: TraceShape, delay_s: int,
             steps: int) -> dict[str, Any]:
    """One replay of ``trace`` under ``ddm up``; its figures."""
    with tempfile.TemporaryDirectory(prefix="ddm-bench-scale-") as workdir:
        manifest = Path(workdir) / "mnist.yaml"
        manifest.write_text(yaml.safe_dump(manifest_for(policy, delay_s)))
        with ddm_up(manifest) as (plan, log, _):
            began, results = asyncio.run(_replay(plan.url, trace, steps))
            end = max(began + shape.duration_s, *(r["answered"] for r in results))
            # the last idle gap is part of the trace: wait it out
            while time.monotonic() < end:
                time.sleep(end - time.monotonic())
        lines = list(log.lines)
    used = replica_seconds(replica_events(lines), began, end)
    failed = [r for r in results if r["status"] != 200]
    answered = [r for r in results if r["status"] == 200]
    rare_labels = {label for group in RARE_LABEL_GROUPS for label in group}
    waited = [r for r in answered if r["waited_s"] > 0]
    colds = cold_start_seconds(lines)
    return {
        "provisioning": "fixed" if policy is None else "autoscaled", "policy": policy,
        "window_s": round(end - began, 2),
        "requests": len(results), "failed_requests": len(failed),
        "failures": sorted({str(r["status"]) for r in failed}),
        "latency_s": percentiles([r["latency_s"] for r in answered]),
        "latency_hot_labels_s": percentiles([r["latency_s"] for r in answered
                                             if r["label"] not in rare_labels]),
        "latency_rare_labels_s": percentiles([r["latency_s"] for r in answered
                                              if r["label"] in rare_labels]),
        "routed_rows": routed_rows(answered),
        "rerouted_steps": sum(r["rerouted_steps"] for r in answered),
        "replica_seconds": {name: round(s, 1) for name, s in sorted(used.items())},
        "replica_seconds_total": round(sum(used.values()), 1),
        "mean_replicas": round(sum(used.values()) / (end - began), 3),
        "cold_starts": dict(Counter(found["expert"] for _, line in lines
                                    if (found := _SCALED_UP.match(line)))),
        "cold_start_s": percentiles(colds),
        "scale_downs": dict(Counter(found["expert"] for _, line in lines
                                    if (found := _SCALED_DOWN.match(line)))),
        "requests_that_waited": {
            "hot_labels": sum(r["label"] not in rare_labels for r in waited),
            "rare_labels": sum(r["label"] in rare_labels for r in waited)},
        "waited_s": percentiles([r["waited_s"] for r in waited]),
        "process_deaths": sum(" exited with status " in line for _, line in lines),
    }


def bench_scale_to_zero(shape: TraceShape = TraceShape(), delay_s: int = DELAY_S,
                        steps: int = 10,
                        seed: int = 0, policies: Sequence[str] = ("wait",),
                        progress: Any = sys.stderr) -> dict[str, Any]:
    """Replay the trace with fixed provisioning, then autoscaled under each of ``policies``;
    the figures as a dict."""
    if delay_s >= shape.gap_s:
        raise ValueError(f"the scale-down delay ({delay_s} s) must be shorter than the idle "
                         f"gaps ({shape.gap_s:g} s), or no expert ever scales to zero")
    trace = bursty_trace(shape, seed)
    where = machine()
    runs = []
    for policy in (None, *policies):
        print(f"scale-to-zero: replaying {len(trace)} requests over {shape.duration_s:g} s, "
              f"{'fixed' if policy is None else f'autoscaled ({policy})'}", file=progress,
              flush=True)
        runs.append(run_once(policy, trace, shape, delay_s, steps))
    fixed = runs[0]
    for run in runs[1:]:  # against fixed provisioning over this run's own window
        run["replica_seconds_vs_fixed"] = round(run["mean_replicas"] / fixed["mean_replicas"],
                                                3)
    rare_labels = {label for group in RARE_LABEL_GROUPS for label in group}
    return {
        "where": "ddm up on one machine (expert processes on loopback), not a cluster",
        "ddm": "examples/mnist.yaml", "hot_experts": list(HOT_EXPERTS),
        "rare_experts": list(RARE_EXPERTS), "scale_down_delay_s": delay_s, "steps": steps,
        "seed": seed,
        "trace": {**asdict(shape), "duration_s": shape.duration_s, "requests": len(trace),
                  "hot_label_requests": sum(a.label not in rare_labels for a in trace),
                  "rare_label_requests": sum(a.label in rare_labels for a in trace),
                  "hot_labels": list(HOT_LABELS),
                  "rare_label_groups": [list(g) for g in RARE_LABEL_GROUPS]},
        "runs": runs,
        "failed_requests": sum(run["failed_requests"] for run in runs),
        "machine": where | {"load_average_after": [round(v, 2) for v in os.getloadavg()]},
    }


def bench_scale_to_zero_command(as_json: bool, quick: bool, delay_s: int | None,
                                **options: Any) -> int:
    result = bench_scale_to_zero(
        shape=QUICK if quick else TraceShape(),
        delay_s=delay_s if delay_s is not None else QUICK_DELAY_S if quick else DELAY_S,
        **options)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    print("scale-to-zero: done", file=sys.stderr)
    return 0 if result["failed_requests"] == 0 else 1
