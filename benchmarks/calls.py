"""``python -m benchmarks calls TREE...``: one batch-1 velocity call's cost beyond the model,
for experts on both sides of any time budget, with the expert servers of several source trees
side by side (e.g. main's checkout and a branch's), calls alternated between them so that a
shared machine's load hits every tree alike.

Per tree and model, one expert process (``OMP_NUM_THREADS=1``, as ``ddm up`` runs a CPU expert)
serves: the digits expert (fast), an MNIST expert (32x32, slower), and the digits expert made
slower on purpose (it spins :data:`SLOW_SPIN_S` more per batch). Per round, each server gets
:data:`CALLS` velocity calls and as many ``GET /healthz`` (the HTTP floor: uvicorn and FastAPI
with no model) on a kept-alive aiohttp connection. The model's own time is read from the
server's ``ddm_expert_model_seconds`` (measured on the thread that runs it), so the overhead is
the call's median minus the model's mean, and ``above_floor`` subtracts the floor's median.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from ddm.runtime.local import REPOSITORY_ROOT, free_port
from ddm.serving.protocol import CONTENT_TYPE, VelocityRequest, decode_response, encode_request
from benchmarks.fleet import HOST, READY_S

CALLS = 40
ROUNDS = 6
SLOW_SPIN_S = 0.010
#: name -> (checkpoint under the repository, image shape, label, extra seconds per batch)
MODELS = {"digits-0-4": ("checkpoints/digits/expert-0-4", (1, 16, 16), 0, 0.0),
          "mnist-cluster-0": ("checkpoints/mnist/expert-0", (1, 32, 32), 0, 0.0),
          "digits-0-4+10ms": ("checkpoints/digits/expert-0-4", (1, 16, 16), 0, SLOW_SPIN_S)}

#: The server process: the tree's own create_expert_app, with a loader that spins on top of
#: the real model when asked to (a bigger model, as the server sees it).
_SERVER = """
import sys, time
from ddm.serving.expert.backends import load_backend
from ddm.serving.expert.server import create_expert_app
from ddm.serving.http import run_server
checkpoint, port, spin = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])

def loader(ckpt, backend, device, max_batch, cache):
    real = load_backend(ckpt, backend, device, max_batch, cache)
    if spin:
        def velocity(x, t, y, _velocity=real.velocity):
            end = time.perf_counter() + spin
            while time.perf_counter() < end:
                pass
            return _velocity(x, t, y)
        real.velocity = velocity
    return real

run_server(lambda control: create_expert_app(checkpoint, loader=loader,
                                              start_up=control.start_up),
           "127.0.0.1", port, "warning")
"""


def _start(tree: Path, checkpoint: Path, spin: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", _SERVER, str(checkpoint), str(port),
                                str(spin)], env=env)
    return process, f"http://{HOST}:{port}"


async def _wait_ready(session: aiohttp.ClientSession, url: str) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        try:
            async with session.get(f"{url}/readyz") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready in {READY_S} s")


async def _model_seconds(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(sum, count) of the server's model-time histogram."""
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("ddm_expert_model_seconds_")}
    return values["ddm_expert_model_seconds_sum"], values["ddm_expert_model_seconds_count"]


async def _round(session: aiohttp.ClientSession, url: str, body: bytes,
                 shape: tuple[int, ...]) -> tuple[list[float], list[float], float]:
    """(call seconds, floor seconds, mean model seconds) of one round on one server."""
    before = await _model_seconds(session, url)
    calls, floors = [], []
    for _ in range(CALLS):
        started = time.perf_counter()
        async with session.post(f"{url}/v1/velocity", data=body,
                                headers={"Content-Type": CONTENT_TYPE}) as response:
            decode_response(await response.read(), 1, shape)
        calls.append(time.perf_counter() - started)
        started = time.perf_counter()
        async with session.get(f"{url}/healthz") as response:
            await response.read()
        floors.append(time.perf_counter() - started)
    after = await _model_seconds(session, url)
    return calls, floors, (after[0] - before[0]) / (after[1] - before[1])


async def measure(trees: list[Path]) -> dict[str, Any]:
    """Every tree's call overhead per model, rounds alternated between the trees."""
    load = list(os.getloadavg())
    servers: dict[tuple[str, str], str] = {}
    with ExitStack() as stack:
        for name, (checkpoint, _, _, spin) in MODELS.items():
            for tree in trees:
                process, url = _start(tree, REPOSITORY_ROOT / checkpoint, spin)
                stack.callback(process.wait)
                stack.callback(process.terminate)
                servers[name, str(tree)] = url
        async with aiohttp.ClientSession() as session:
            for url in servers.values():
                await _wait_ready(session, url)
            runs: dict[tuple[str, str], tuple[list[float], list[float], list[float]]] = {
                key: ([], [], []) for key in servers}
            for round_index in range(ROUNDS + 1):  # round 0 warms up and is dropped
                for name, (_, shape, label, _) in MODELS.items():
                    x = np.random.default_rng(0).standard_normal((1, *shape), np.float32)
                    body = encode_request(VelocityRequest(1, x, np.full(1, 0.5, np.float32),
                                                          np.full(1, label, np.int64)))
                    for tree in trees:
                        key = (name, str(tree))
                        calls, floors, model = await _round(session, servers[key], body,
                                                            (1, *shape))
                        if round_index > 0:
                            runs[key][0].extend(calls)
                            runs[key][1].extend(floors)
                            runs[key][2].append(model)
    figures: dict[str, Any] = {}
    for (name, tree), (calls, floors, models) in runs.items():
        call, floor = statistics.median(calls) * 1e3, statistics.median(floors) * 1e3
        model = statistics.mean(models) * 1e3
        figures.setdefault(name, {})[tree] = {
            "call_ms": round(call, 3), "model_ms": round(model, 3),
            "http_floor_ms": round(floor, 3), "overhead_ms": round(call - model, 3),
            "above_floor_ms": round(call - model - floor, 3)}
    return {"calls_per_round": CALLS, "rounds": ROUNDS, "load_average_before": load,
            "load_average_after": list(os.getloadavg()),
            "models": figures}


def bench_calls_command(trees: list[str]) -> int:
    """Print the figures as JSON; every tree must be a checkout of this project."""
    paths = [Path(tree).resolve() for tree in trees]
    for path in paths:
        if not (path / "src" / "ddm").is_dir():
            raise SystemExit(f"{path} is not a checkout of this project (no src/ddm)")
    print(json.dumps(asyncio.run(measure(paths)), indent=2))
    return 0
