"""``python -m benchmarks calls TREE...``: one batch-1 velocity call's cost beyond the model,
for experts on both sides of any time budget, with the expert servers of several source trees
side by side (e.g. main's checkout and a branch's), calls alternated between them so that a
shared machine's load hits every tree alike.

Per tree and model, one expert process (``OMP_NUM_THREADS=1``, as ``ddm up`` runs a CPU expert)
serves: the digits expert (fast), an MNIST expert (32x32, slower), and the digits expert made
slower on purpose (it sleeps :data:`SLOW_SLEEP_S` more per batch, releasing the GIL as torch
does). Per round, each server gets :data:`CALLS` velocity calls, each followed by a
``GET /healthz`` (the HTTP floor: uvicorn and FastAPI with no model) on a kept-alive aiohttp
connection, and the same model runs as many times in this process (one torch thread). The
overhead is the call's median minus the model's median; ``above_floor`` subtracts the floor's
median too. Rounds are short, so that a loaded machine's swings hit every tree alike; the tenth
percentiles (``p10``) approach what each costs when it keeps its core.
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
from typing import Any, Callable

import aiohttp
import numpy as np
import torch

from ddm.checkpoints.format import load_checkpoint
from ddm.runtime.local import REPOSITORY_ROOT, free_port
from ddm.serving.expert.backends import load_backend
from ddm.serving.protocol import CONTENT_TYPE, VelocityRequest, decode_response, encode_request
from benchmarks.fleet import HOST, READY_S

CALLS = 5
ROUNDS = 40
SLOW_SLEEP_S = 0.010
#: name -> (checkpoint under the repository, image shape, label, extra seconds per batch)
MODELS = {"digits-0-4": ("checkpoints/digits/expert-0-4", (1, 16, 16), 0, 0.0),
          "mnist-cluster-0": ("checkpoints/mnist/expert-0", (1, 32, 32), 0, 0.0),
          "digits-0-4+10ms": ("checkpoints/digits/expert-0-4", (1, 16, 16), 0, SLOW_SLEEP_S)}

#: The server process: the tree's own create_expert_app, with a loader that sleeps on top of
#: the real model when asked to (a bigger model, as the server sees it).
_SERVER = """
import sys, time
from ddm.serving.expert.backends import load_backend
from ddm.serving.expert.server import create_expert_app
from ddm.serving.http import run_server
checkpoint, port, sleep = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])

def loader(ckpt, backend, device, max_batch, cache):
    real = load_backend(ckpt, backend, device, max_batch, cache)
    if sleep:
        def velocity(x, t, y, _velocity=real.velocity):
            time.sleep(sleep)
            return _velocity(x, t, y)
        real.velocity = velocity
    return real

run_server(lambda control: create_expert_app(checkpoint, loader=loader,
                                              start_up=control.start_up),
           "127.0.0.1", port, "warning")
"""


def _start(tree: Path, checkpoint: Path, sleep: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", _SERVER, str(checkpoint), str(port),
                                str(sleep)], env=env)
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


def _local_model(checkpoint: Path, sleep: float) -> Callable[..., np.ndarray]:
    """The same model in this process, sleeping as its server does."""
    backend = load_backend(load_checkpoint(checkpoint), "torch", None, 1, None)

    def velocity(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        if sleep:
            time.sleep(sleep)
        return backend.velocity(x, t, y)

    return velocity


async def _round(session: aiohttp.ClientSession, url: str, body: bytes,
                 shape: tuple[int, ...]) -> tuple[list[float], list[float]]:
    """(call seconds, floor seconds) of one round on one server."""
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
    return calls, floors


async def measure(trees: list[Path]) -> dict[str, Any]:
    """Every tree's call overhead per model, rounds alternated between the trees."""
    load = list(os.getloadavg())
    torch.set_num_threads(1)
    local = {name: _local_model(REPOSITORY_ROOT / checkpoint, sleep)
             for name, (checkpoint, _, _, sleep) in MODELS.items()}
    servers: dict[tuple[str, str], str] = {}
    with ExitStack() as stack:
        for name, (checkpoint, _, _, sleep) in MODELS.items():
            for tree in trees:
                process, url = _start(tree, REPOSITORY_ROOT / checkpoint, sleep)
                stack.callback(process.wait)
                stack.callback(process.terminate)
                servers[name, str(tree)] = url
        async with aiohttp.ClientSession() as session:
            for url in servers.values():
                await _wait_ready(session, url)
            runs: dict[tuple[str, str], tuple[list[float], list[float]]] = {
                key: ([], []) for key in servers}
            models: dict[str, list[float]] = {name: [] for name in MODELS}
            for round_index in range(ROUNDS + 1):  # round 0 warms up and is dropped
                for name, (_, shape, label, _) in MODELS.items():
                    x = np.random.default_rng(0).standard_normal((1, *shape), np.float32)
                    t, y = np.full(1, 0.5, np.float32), np.full(1, label, np.int64)
                    body = encode_request(VelocityRequest(1, x, t, y))
                    for tree in trees:
                        key = (name, str(tree))
                        calls, floors = await _round(session, servers[key], body, (1, *shape))
                        if round_index > 0:
                            runs[key][0].extend(calls)
                            runs[key][1].extend(floors)
                    for _ in range(CALLS):
                        started = time.perf_counter()
                        local[name](x, t, y)
                        if round_index > 0:
                            models[name].append(time.perf_counter() - started)
    figures: dict[str, Any] = {}
    for (name, tree), (calls, floors) in runs.items():
        for statistic, pick in (("median", statistics.median), ("p10", _p10)):
            call, floor, model = (pick(values) * 1e3 for values in (calls, floors, models[name]))
            figures.setdefault(name, {}).setdefault(tree, {})[statistic] = {
                "call_ms": round(call, 3), "model_ms": round(model, 3),
                "http_floor_ms": round(floor, 3), "overhead_ms": round(call - model, 3),
                "above_floor_ms": round(call - model - floor, 3)}
    return {"calls_per_round": CALLS, "rounds": ROUNDS, "load_average_before": load,
            "load_average_after": list(os.getloadavg()),
            "models": figures}


def _p10(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[0]


def bench_calls_command(trees: list[str]) -> int:
    """Print the figures as JSON; every tree must be a checkout of this project."""
    paths = [Path(tree).resolve() for tree in trees]
    for path in paths:
        if not (path / "src" / "ddm").is_dir():
            raise SystemExit(f"{path} is not a checkout of this project (no src/ddm)")
    print(json.dumps(asyncio.run(measure(paths)), indent=2))
    return 0
