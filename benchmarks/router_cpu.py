"""``python -m benchmarks router TREE...``: the router's own CPU per request, with the routers
of several source trees side by side (e.g. main's checkout and a branch's) over the same
experts, requests alternated between them so that a shared machine's load hits every tree
alike.

The experts are the shipped MNIST DDM's four (its k-means partition is what the router's
checks hash: 12.9 KB of JSON per report), each a ``ddm serve expert`` process of this checkout
on PyTorch (``OMP_NUM_THREADS=1``), started as ``ddm up`` starts them. Each tree gets one
``ddm serve router`` process of its own code over them. Per round, each router answers
:data:`REQUESTS` one-step, one-image ``POST /v1/generate`` (strategy ``top1``: the router
network runs once, one expert once) and as many ``GET /readyz``, one at a time; the router
process's CPU time (every thread's, from the scheduler: :func:`benchmarks.fleet.cpu_seconds`)
over each batch of requests, divided by their number, is the figure. The prober's own work
(a ``/readyz`` per expert every few seconds) falls into the rounds alike for every tree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from ddm.deploy.spec import load_manifest
from ddm.runtime.local import REPOSITORY_ROOT, Supervisor, plan_local
from benchmarks.fleet import HOST, checkouts, port_source, cpu_seconds, say

MANIFEST = REPOSITORY_ROOT / "examples" / "mnist.yaml"
REQUESTS = 10
ROUNDS = 30
GENERATE = {"labels": [3], "steps": 1, "seed": 0, "strategy": "top1"}


def measure(trees: list[Path], log: Any = sys.stderr) -> dict[str, Any]:
    """Per tree, the router's CPU milliseconds per generation and per probe (medians and
    tenth percentiles over the rounds)."""
    load = list(os.getloadavg())
    manifest = load_manifest(MANIFEST)
    torch_only = tuple(dataclasses.replace(e, framework="torch") for e in manifest.spec.experts)
    manifest = dataclasses.replace(manifest, spec=dataclasses.replace(manifest.spec,
                                                                      experts=torch_only))
    ports = port_source()
    with tempfile.TemporaryDirectory() as workdir:
        config = Path(workdir) / "router.yaml"
        plan = plan_local(manifest, ports, ports(), HOST, config_path=config)
        config.write_text(plan.router_config.to_yaml())
        routers = {}
        for index, tree in enumerate(trees):
            port = ports()
            argv = [*plan.router.argv]
            argv[argv.index("--port") + 1] = str(port)
            argv[argv.index("--metrics-port") + 1] = str(ports())
            routers[tree.name] = dataclasses.replace(
                plan.router, name=f"router-{index}", argv=tuple(argv), port=port,
                env=(*plan.router.env, ("PYTHONPATH", str(tree / "src"))))
        supervisor = Supervisor(log)
        try:
            say(log, f"starting {len(plan.experts)} experts and {len(routers)} routers")
            supervisor.start_ready(list(plan.experts), HOST)
            supervisor.start_ready(list(routers.values()), HOST)
            figures = _rounds({tree: (spec.port, supervisor.processes[spec.name].pid)
                               for tree, spec in routers.items()}, log)
        finally:
            supervisor.stop()
    return {"requests_per_round": REQUESTS, "rounds": ROUNDS, "generate": GENERATE,
            "load_average_before": load, "load_average_after": list(os.getloadavg()),
            "routers": figures}


def _rounds(routers: dict[str, tuple[int, int]], log: Any) -> dict[str, Any]:
    spent: dict[str, dict[str, list[float]]] = {
        tree: {"generate": [], "readyz": []} for tree in routers}
    with httpx.Client(timeout=60.0) as client:
        for round_index in range(ROUNDS + 1):  # round 0 warms up and is dropped
            for tree, (port, pid) in routers.items():
                base = f"http://{HOST}:{port}"
                for what, send in (
                        ("generate", lambda: client.post(f"{base}/v1/generate", json=GENERATE)),
                        ("readyz", lambda: client.get(f"{base}/readyz"))):
                    before = cpu_seconds((pid,))
                    for _ in range(REQUESTS):
                        reply = send()
                        if reply.status_code != 200:
                            raise RuntimeError(f"{tree}: {what} answered {reply.status_code}: "
                                               f"{reply.text[:200]}")
                    after = cpu_seconds((pid,))
                    if round_index > 0 and before is not None and after is not None:
                        spent[tree][what].append((after - before) / REQUESTS * 1e3)
            if round_index % 10 == 0:
                say(log, f"round {round_index} of {ROUNDS}")
    return {tree: {what: {"cpu_ms_median": round(statistics.median(values), 3),
                          "cpu_ms_p10": round(statistics.quantiles(values, n=10)[0], 3)}
                   for what, values in figures.items()}
            for tree, figures in spent.items()}


def bench_router_command(trees: list[str]) -> int:
    """Print the figures as JSON; every tree must be a checkout of this project."""
    print(json.dumps(measure(checkouts(trees)), indent=2))
    return 0
