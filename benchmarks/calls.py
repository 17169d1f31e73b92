"""``python -m benchmarks calls TREE...``: one batch-1 velocity call's cost beyond the model,
for experts on both sides of the event loop's bound (``ddm.serving.batching.INLINE_MAX_S``),
with the expert servers of several source trees side by side (e.g. main's checkout and a
branch's), calls alternated between them so that a shared machine's load hits every tree alike.
Every tree must speak label contexts (``docs/protocol.md`` version 4: a label call names rows
of a context the expert holds): the calls are this tree's bodies, and an older tree's expert,
whose ``/v1/info`` reports no ``context_cache_bytes``, is refused by name before any round.

Per tree and model, one expert process (``OMP_NUM_THREADS=1``, as ``ddm up`` runs a CPU expert)
serves, as ``ddm serve expert`` serves it (the tree's event loops and batcher): the digits
expert (fast), an MNIST expert (32x32, slower), the digits expert made slower on purpose by
10 ms (within the bound) and by :data:`BEYOND_BOUND_S` (over it: on a server with one event loop,
the model thread; on one with a second loop serving, still the loop the request came on). The
extra time is a sleep per batch (the GIL released and the core idle, as a model waiting for
an accelerator may leave it), or, for the model marked ``busy``, a loop of small matrix
products (the core busy and the GIL released in each product, as a bigger CPU model's kernels
do).

Per round, each server gets :data:`CALLS` velocity calls, each followed by a ``GET /healthz``
(the HTTP floor: uvicorn and FastAPI with no model), both through the router's own HTTP client
(``ddm.serving.http.client``) on a kept-alive connection, and the same model runs as many
times in this process (one torch thread). Two model times are subtracted:

- ``model_ms``: the model alone in this process, called back to back (its caches warm);
- ``served_model_ms``: the model as it ran inside the server, timed around the backend's
  velocity by this benchmark's own loader (written to a file when the server stops). A model
  called once after an HTTP exchange runs slower than back to back, with its caches cold
  (0.3-0.9 ms for these models here), which is the model's cost, not the server's.

``above_floor_ms`` is the call minus ``model_ms`` minus the floor; ``server_above_floor_ms``
uses ``served_model_ms`` instead: what the server adds to the model and the floor. Rounds are
short, so that a loaded machine's swings hit every tree alike; the tenth percentiles
(``p10``) approach what each costs when it keeps its core.

``handoff`` is what a batch past the bound pays for the model thread on this machine, per
tree, with the tree's own :class:`~ddm.serving.batching.Batcher` on uvloop (as the servers run
it) and a sleep of :data:`BEYOND_BOUND_S` as the model, in processes alternated between the
trees: from a lone request's submission to its batch starting on the thread, and from the
batch's end to the submitting task running again.

``reply_wait`` is the client's side of a call past the bound, per tree, with the tree's own
:class:`~ddm.serving.http.client.HttpClient` on uvloop (as the router runs it), in processes
alternated between the trees, against one small server process that answers every request
after a sleep of :data:`BEYOND_BOUND_S`: from the server writing the reply (its timestamp is in
the reply, on the clock every process shares) to ``post`` returning it.

``cold_code`` is why a wake-up costs more than its primitive: one small fixed piece of Python
(a 20-item list comprehension), timed right after this thread slept :data:`COLD_GAPS_S`. On a
virtual machine whose vCPU sat idle, the same code runs up to a hundred times slower than
warm, so every step a request takes after an idle gap (a model's run on the other thread, a
router's step) is priced by how little Python it runs.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ddm.checkpoints.format import load_checkpoint
from ddm.deploy.accelerators import DEFAULT_STARTUP_BUDGET_S
from ddm.models.loading import expert_velocity
from ddm.runtime.local import REPOSITORY_ROOT, free_port
from ddm.serving.batching import INLINE_MAX_S
from ddm.serving.http.client import HttpClient
from ddm.serving.wire.protocol import (CONTENT_TYPE, decode_context_ack, decode_response,
                                       max_error_reply_bytes, max_reply_bytes)
from tests.support.label_wire import LabelCall, velocity_call
from benchmarks.figures import CALL_ABOVE_FLOOR_MS, verdict
from benchmarks.fleet import HOST, checkouts

CALLS = 5
ROUNDS = 40
SLOW_SLEEP_S = 0.010
#: A model this much slower than the digits expert runs on the model thread.
BEYOND_BOUND_S = 1.2 * INLINE_MAX_S
#: name -> (checkpoint under the repository, image shape, label, extra seconds per batch, how
#: they are spent: ``sleep`` or ``busy``, :data:`_EXTRA`)
MODELS = {"digits-0-4": ("checkpoints/digits/expert-0-4", (1, 16, 16), 0, 0.0, "sleep"),
          "mnist-cluster-0": ("checkpoints/mnist/expert-0", (1, 32, 32), 0, 0.0, "sleep"),
          "digits-0-4+10ms": ("checkpoints/digits/expert-0-4", (1, 16, 16), 0, SLOW_SLEEP_S,
                              "sleep"),
          f"digits-0-4+{BEYOND_BOUND_S * 1e3:.0f}ms": ("checkpoints/digits/expert-0-4",
                                                       (1, 16, 16), 0, BEYOND_BOUND_S, "sleep"),
          f"digits-0-4+{BEYOND_BOUND_S * 1e3:.0f}ms busy": (
              "checkpoints/digits/expert-0-4", (1, 16, 16), 0, BEYOND_BOUND_S, "busy")}
#: ``extra(seconds, how)``: the time a model is made slower by, as the servers and this
#: process spend it (one source for both: the servers run it from their own script).
_EXTRA = """
def extra(seconds, how):
    import time
    import numpy as np
    if how == "sleep":
        time.sleep(seconds)
        return
    product, end = np.ones((96, 96), np.float32), time.perf_counter() + seconds
    while time.perf_counter() < end:
        product @ product
"""
#: Processes per tree that time ``handoff``, alternated between the trees.
HANDOFF_RUNS = 3
#: Idle gaps, in seconds, before each timing of ``cold_code``.
COLD_GAPS_S = (0.0, 0.001, 0.005, 0.02, 0.06)
_TIMEOUT_S = 30.0
_STOP_S = 30.0

#: The server process: the tree's own model server (create_model_app, or create_expert_app
#: before it) on as many event loops as its ``ddm serve expert`` runs (one before
#: SERVING_LOOPS existed), with a loader that adds argv[3]
#: seconds spent as argv[5] says on top of the real model (a bigger model, as the server sees
#: it) and times every batch of the model; the times go to the file named by argv[4] when the
#: server stops. The loader wraps the stage's forward (its velocity before one member served
#: every stage: a label expert's backend).
_SERVER = _EXTRA + """
import dataclasses, json, sys, time
from ddm.serving.http.server import run_server
try:
    from ddm.serving.model import routes
    from ddm.serving.model.options import Hooks
    from ddm.serving.model.server import create_model_app
except ImportError:  # a tree from before the one model server (ddm.serving.model)
    from ddm.serving.expert import routes, server
    create_model_app = None
try:
    from ddm.serving.model.backends import load_backend
except ImportError:
    try:
        from ddm.serving.expert.backends import load_backend
    except ImportError:  # one member for every stage: its loader loads a Stage
        from ddm.models.stages import load_stage
        load_backend = None
checkpoint, port, seconds, times_file, how = (sys.argv[1], int(sys.argv[2]), float(sys.argv[3]),
                                              sys.argv[4], sys.argv[5])
loops = getattr(routes, "SERVING_LOOPS", 1)
times = []

def timed(run):
    def call(*args):
        started = time.perf_counter()
        if seconds:
            extra(seconds, how)
        out = run(*args)
        times.append(time.perf_counter() - started)
        return out

    return call

def loader(*args):
    if load_backend is None:
        real = load_stage(*args)
        return dataclasses.replace(real, forward=timed(real.forward))
    real = load_backend(*args)  # (ckpt, backend, device, max_batch, cache[, compile mode])
    real.velocity = timed(real.velocity)
    return real

def make_app(control):
    if create_model_app is not None:
        return create_model_app(checkpoint, hooks=Hooks(loader=loader, start_up=control.start_up,
                                                        serving_loops=loops))
    app_loops = {"serving_loops": loops} if loops > 1 else {}
    return server.create_expert_app(checkpoint, loader=loader, start_up=control.start_up,
                                    **app_loops)

server_loops = {"loops": loops} if loops > 1 else {}
run_server(make_app, "127.0.0.1", port, "warning", **server_loops)
with open(times_file, "w") as out:
    json.dump(times, out)
"""


#: One process timing ``handoff`` with the tree's own Batcher on uvloop: a lone request every
#: 20 ms (idle, as between a router's steps), a sleep of argv[2] as the model; it prints the
#: seconds from each submission to its batch starting on the thread, and from the batch's end
#: to the submitting task running again (the first request, of a key not seen yet, dropped),
#: as a JSON object of lists (:func:`_alternated`).
_HANDOFF = """
import asyncio, json, sys, time
import numpy as np, uvloop
from ddm.serving.batching import Batcher
rounds, model_s = int(sys.argv[1]), float(sys.argv[2])
marks = {}

def model(key, inputs):
    marks["started"] = time.perf_counter()
    time.sleep(model_s)
    marks["ended"] = time.perf_counter()
    return inputs[0]

async def lone_requests():
    batcher = Batcher(model, max_batch=1, max_delay_ms=0.0)
    batcher.start()
    to_thread, to_loop = [], []
    for index in range(rounds + 1):
        await asyncio.sleep(0.02)
        submitted = time.perf_counter()
        await batcher.submit("velocity", (np.zeros((1, 1), np.float32),))
        resumed = time.perf_counter()
        if index:
            to_thread.append(marks["started"] - submitted)
            to_loop.append(resumed - marks["ended"])
    await batcher.close()
    return {"to_model_thread_ms": to_thread, "back_to_loop_ms": to_loop}

with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
    print(json.dumps(runner.run(lone_requests())))
"""

#: The server ``reply_wait`` calls: it answers each request after a sleep of argv[2] seconds,
#: with the ``perf_counter`` of its write (CLOCK_MONOTONIC: one clock for every process) as the
#: reply's first 8 bytes; "ready" on stdout once it listens on port argv[1].
_SLOW_SERVER = """
import asyncio, struct, sys, time, uvloop
port, sleep_s = int(sys.argv[1]), float(sys.argv[2])

async def answer(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\\r\\n\\r\\n")
            length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\\r\\n")
                          if line.startswith(b"content-length"))
            await reader.readexactly(length)
            await asyncio.sleep(sleep_s)
            body = struct.pack("d", time.perf_counter()) + bytes(1024)
            writer.write(b"HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n" % len(body)
                         + body)
    except (asyncio.IncompleteReadError, ConnectionError):  # the client closed
        writer.close()

async def main():
    server = await asyncio.start_server(answer, "127.0.0.1", port)
    print("ready", flush=True)
    await server.serve_forever()

uvloop.run(main())
"""

#: One process timing ``reply_wait`` with the tree's own HttpClient on uvloop: argv[1] calls
#: (after two that make the call's time known) to the server at argv[2]; it prints the seconds
#: from each reply's write to ``post`` returning it, as :data:`_HANDOFF` does.
_REPLY_WAIT = """
import asyncio, json, struct, sys, time
import uvloop
from ddm.serving.http.client import HttpClient
calls, endpoint = int(sys.argv[1]), sys.argv[2]

async def main():
    client, waits = HttpClient(60.0), []
    for index in range(calls + 2):
        reply = await client.post(endpoint, "/v1/velocity", bytes(600), "application/x", 30.0,
                                  30.0, max_reply_bytes=1 << 16, max_error_bytes=4096)
        returned = time.perf_counter()
        if index >= 2:
            waits.append(returned - struct.unpack("d", reply.body[:8])[0])
    client.close()
    return {"reply_wait": waits}

with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
    print(json.dumps(runner.run(main())))
"""


def _start(tree: Path, checkpoint: Path, seconds: float, how: str, times_file: Path
           ) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", _SERVER, str(checkpoint), str(port),
                                str(seconds), str(times_file), how], env=env)
    return process, f"{HOST}:{port}"


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    process.wait(_STOP_S)


async def _wait_ready(client: HttpClient, endpoint: str) -> None:
    deadline = time.monotonic() + DEFAULT_STARTUP_BUDGET_S  # one eager server's
    while time.monotonic() < deadline:
        try:
            reply = await client.get(endpoint, "/readyz", _TIMEOUT_S, _TIMEOUT_S,
                                     max_reply_bytes=4096)
            if reply.status == 200:
                return
        except (OSError, TimeoutError):
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{endpoint} did not become ready in {DEFAULT_STARTUP_BUDGET_S} s")


def _local_model(checkpoint: Path, seconds: float, how: str) -> Callable[..., np.ndarray]:
    """The same model in this process, made slower as its server makes it."""
    model = expert_velocity(load_checkpoint(checkpoint), "torch")
    namespace: dict[str, Any] = {}
    exec(_EXTRA, namespace)  # noqa: S102 - this module's own source text
    extra = namespace["extra"]

    def velocity(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        if seconds:
            extra(seconds, how)
        return model(x, t, y)

    return velocity


async def _hold_context(client: HttpClient, endpoint: str, tree: str, call: LabelCall
                        ) -> None:
    """Have the expert at ``endpoint`` (of ``tree``) hold ``call``'s label context."""
    info = await client.get(endpoint, "/v1/info", _TIMEOUT_S, _TIMEOUT_S,
                            max_reply_bytes=65536)
    if "context_cache_bytes" not in json.loads(info.body):
        raise RuntimeError(f"the expert of {tree} takes no label contexts (a tree older than "
                           "docs/protocol.md version 4): calls compares trees that do")
    reply = await client.post(endpoint, "/v1/velocity", call.context, CONTENT_TYPE, _TIMEOUT_S,
                              _TIMEOUT_S, max_reply_bytes=4096,
                              max_error_bytes=max_error_reply_bytes())
    decode_context_ack(reply.body, 1)


async def _round(client: HttpClient, endpoint: str, body: bytes,
                 shape: tuple[int, ...]) -> tuple[list[float], list[float]]:
    """(call seconds, floor seconds) of one round on one server."""
    calls, floors = [], []
    for _ in range(CALLS):
        started = time.perf_counter()
        reply = await client.post(endpoint, "/v1/velocity", body, CONTENT_TYPE, _TIMEOUT_S,
                                  _TIMEOUT_S, max_reply_bytes=max_reply_bytes(shape),
                                  max_error_bytes=max_error_reply_bytes())
        decode_response(reply.body, 1, shape)
        calls.append(time.perf_counter() - started)
        started = time.perf_counter()
        await client.get(endpoint, "/healthz", _TIMEOUT_S, _TIMEOUT_S, max_reply_bytes=4096)
        floors.append(time.perf_counter() - started)
    return calls, floors


async def measure(trees: list[Path], rounds: int = ROUNDS) -> dict[str, Any]:
    """Every tree's call overhead per model, ``rounds`` alternated between the trees; each
    median ``server_above_floor_ms`` against :data:`~benchmarks.figures.CALL_ABOVE_FLOOR_MS`."""
    load = list(os.getloadavg())
    torch.set_num_threads(1)
    local = {name: _local_model(REPOSITORY_ROOT / checkpoint, seconds, how)
             for name, (checkpoint, _, _, seconds, how) in MODELS.items()}
    servers: dict[tuple[str, str], tuple[str, Path]] = {}
    models: dict[str, list[float]] = {name: [] for name in MODELS}
    with tempfile.TemporaryDirectory(prefix="ddm-calls-") as scratch:
        with ExitStack() as stack:  # stops every server, so that each writes its times
            for name, (checkpoint, _, _, seconds, how) in MODELS.items():
                for index, tree in enumerate(trees):
                    times_file = Path(scratch) / f"{name}-{index}.json"
                    process, endpoint = _start(tree, REPOSITORY_ROOT / checkpoint, seconds, how,
                                               times_file)
                    stack.callback(_stop, process)
                    servers[name, tree.name] = (endpoint, times_file)
            runs: dict[tuple[str, str], tuple[list[float], list[float]]] = {
                key: ([], []) for key in servers}
            client = HttpClient(keep_alive_s=_TIMEOUT_S)
            stack.callback(client.close)
            for endpoint, _ in servers.values():
                await _wait_ready(client, endpoint)
            inputs = {name: (np.random.default_rng(0).standard_normal((1, *shape), np.float32),
                             np.full(1, 0.5, np.float32), np.full(1, label, np.int64))
                      for name, (_, shape, label, _, _) in MODELS.items()}
            label_calls = {name: velocity_call(1, *inputs[name]) for name in MODELS}
            for (name, tree_name), (endpoint, _) in servers.items():
                await _hold_context(client, endpoint, tree_name, label_calls[name])
            for round_index in range(rounds + 1):  # round 0 warms up and is dropped
                for name, (_, shape, _, _, _) in MODELS.items():
                    x, t, y = inputs[name]
                    body = label_calls[name].call
                    for tree in trees:
                        key = (name, tree.name)
                        calls, floors = await _round(client, servers[key][0], body,
                                                     (1, *shape))
                        if round_index > 0:
                            runs[key][0].extend(calls)
                            runs[key][1].extend(floors)
                    for _ in range(CALLS):
                        started = time.perf_counter()
                        local[name](x, t, y)
                        if round_index > 0:
                            models[name].append(time.perf_counter() - started)
        served = {key: json.loads(times_file.read_text())[-len(runs[key][0]):]
                  for key, (_, times_file) in servers.items()}
    figures: dict[str, Any] = {}
    for (name, tree), (calls, floors) in runs.items():
        for statistic, pick in (("median", statistics.median), ("p10", _p10)):
            call, floor, model, in_server = (pick(values) * 1e3 for values in (
                calls, floors, models[name], served[name, tree]))
            figures.setdefault(name, {}).setdefault(tree, {})[statistic] = {
                "call_ms": round(call, 3), "model_ms": round(model, 3),
                "served_model_ms": round(in_server, 3), "http_floor_ms": round(floor, 3),
                "overhead_ms": round(call - model, 3),
                "above_floor_ms": round(call - model - floor, 3),
                "server_above_floor_ms": round(call - in_server - floor, 3)}
        figures[name][tree].update(verdict(figures[name][tree]["median"][
            "server_above_floor_ms"], CALL_ABOVE_FLOOR_MS, at_least=False))
    return {"calls_per_round": CALLS, "rounds": rounds, "inline_max_s": INLINE_MAX_S,
            "load_average_before": load, "load_average_after": list(os.getloadavg()),
            "models": figures, "handoff": await asyncio.to_thread(_handoff, trees, rounds),
            "reply_wait": await asyncio.to_thread(_reply_wait, trees, rounds),
            "cold_code": _cold_code(rounds)}


def _alternated(trees: list[Path], rounds: int, script: str, *args: str
                ) -> dict[str, dict[str, list[float]]]:
    """Per tree, what ``script`` measured (a JSON object of lists of seconds) with the tree's
    code, over :data:`HANDOFF_RUNS` processes alternated between the trees, so that a shared
    machine's load hits every tree alike."""
    runs: dict[str, dict[str, list[float]]] = {tree.name: {} for tree in trees}
    for _ in range(HANDOFF_RUNS):
        for tree in trees:
            env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}", "OMP_NUM_THREADS": "1"}
            done = subprocess.run([sys.executable, "-c", script, str(rounds), *args], env=env,
                                  check=True, capture_output=True, timeout=_STOP_S + rounds)
            for name, seconds in json.loads(done.stdout).items():
                runs[tree.name].setdefault(name, []).extend(seconds)
    return runs


def _ms(seconds: list[float]) -> dict[str, float]:
    """The median and tenth percentile of ``seconds``, in ms."""
    return {"median": round(statistics.median(seconds) * 1e3, 3),
            "p10": round(_p10(seconds) * 1e3, 3)}


def _handoff(trees: list[Path], rounds: int) -> dict[str, dict[str, dict[str, float]]]:
    """Per tree, the model thread's two hand-offs (the module's ``handoff``)."""
    runs = _alternated(trees, rounds, _HANDOFF, str(BEYOND_BOUND_S))
    return {tree: {name: _ms(seconds) for name, seconds in times.items()}
            for tree, times in runs.items()}


def _reply_wait(trees: list[Path], rounds: int) -> dict[str, dict[str, float]]:
    """Per tree, ``reply_wait`` (the module's docstring), against one server for all."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", _SLOW_SERVER, str(port),
                               str(BEYOND_BOUND_S)], stdout=subprocess.PIPE)
    try:
        if server.stdout is None or server.stdout.readline() != b"ready\n":
            raise RuntimeError("the reply_wait server did not start")
        runs = _alternated(trees, rounds, _REPLY_WAIT, f"{HOST}:{port}")
    finally:
        _stop(server)
    return {tree: _ms(times["reply_wait"]) for tree, times in runs.items()}


def _cold_code(rounds: int) -> dict[str, float]:
    """``cold_code``: per idle gap, the median microseconds of one small piece of Python run
    right after it."""
    figures = {}
    for gap in COLD_GAPS_S:
        times = []
        for _ in range(rounds):
            if gap:
                time.sleep(gap)
            started = time.perf_counter()
            _ = [index for index in range(20)]
            times.append(time.perf_counter() - started)
        figures[f"after_{gap * 1e3:g}_ms_idle_us"] = round(statistics.median(times) * 1e6, 2)
    return figures


def _p10(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[0]


def bench_calls_command(trees: list[str]) -> int:
    """Print the figures as JSON; every tree must be a checkout of this project."""
    print(json.dumps(asyncio.run(measure(checkouts(trees))), indent=2))
    return 0
