"""The expert server over real HTTP on loopback, with real (random-init smoke) models.

Each server runs in-process on a uvicorn thread over a socket bound to port 0, and tests wait
for readiness by polling ``/readyz`` against a deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Awaitable, Iterator

import aiohttp
import httpx
import numpy as np
import pytest

from ddm.checkpoints.format import CheckpointError, load_checkpoint
from ddm.models.backends import BackendUnavailable, check_backend
from ddm.models.loading import expert_velocity
from ddm.models.stages import load_stage
from ddm.sampling.solvers import iterate
from ddm.serving.model.server import create_model_app
from ddm.serving.model.options import Hooks, ServingOptions
from ddm.serving.wire.protocol import CONTENT_TYPE, RemoteExpertError, Solver, decode_response
from ddm.runtime.local import free_port
from ddm.termination import write_termination_message
from tests.support.label_wire import (LabelCall, LabelVelocity, integrate_call, post_call,
                                      send_async)
from servers import READY_DEADLINE_S, ready_server, running, wait_ready
from waiting import wait_for

SHAPE = (1, 8, 8)  # the smoke config's images
HEADERS = {"Content-Type": CONTENT_TYPE}


def post(base: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{base}/v1/velocity", content=body, headers=HEADERS)


def velocity_request(batch: int, seed: int, request_id: int = 1,
                     labels: list[int] | None = None) -> LabelVelocity:
    rng = np.random.default_rng(seed)
    return LabelVelocity(request_id, rng.standard_normal((batch, *SHAPE), dtype=np.float32),
                           rng.uniform(0, 1, batch).astype(np.float32),
                           np.asarray(labels if labels is not None else rng.integers(0, 5, batch)))


def remote_error(response: httpx.Response, request_id: int) -> RemoteExpertError:
    with pytest.raises(RemoteExpertError) as caught:
        decode_response(response.content, request_id)
    assert caught.value.code == response.status_code
    return caught.value


def metric(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (all label sets)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


@pytest.fixture(scope="module")
def torch_server(smoke_expert_checkpoint: Path) -> Iterator[str]:
    with ready_server(smoke_expert_checkpoint, max_batch=8) as base:
        yield base


@pytest.fixture(scope="module")
def torch_velocity(smoke_expert_checkpoint: Path):
    return expert_velocity(load_checkpoint(smoke_expert_checkpoint), "torch")


@pytest.mark.parametrize("backend", ["torch", pytest.param("jax", marks=pytest.mark.slow)])
def test_velocity_over_http_equals_in_process(backend, smoke_expert_checkpoint,
                                              smoke_jax_expert_checkpoint):
    checkpoint = smoke_expert_checkpoint if backend == "torch" else smoke_jax_expert_checkpoint
    request = velocity_request(batch=3, seed=0, request_id=42)
    expected = expert_velocity(load_checkpoint(checkpoint), backend)(request.x, request.t,
                                                                     request.y)
    with ready_server(checkpoint, backend, device="cpu", max_batch=4) as base:  # pads 3 -> 4
        reply = post_call(base, request)
        info = httpx.get(f"{base}/v1/info").json()
    assert reply.status_code == 200, reply.content
    out = decode_response(reply.content, 42, expected_shape=(3, *SHAPE))
    np.testing.assert_allclose(out, expected, atol=1e-5)
    assert info["backend"] == backend and info["framework"] == backend
    assert info["device"] in ("cpu", "cpu:0") and info["runtime"].startswith(backend)
    assert info["classes"] == [0, 1, 2, 3, 4] and info["image_shape"] == list(SHAPE)
    assert info["max_batch"] == 4 and info["ready"] and info["convention"].startswith("linear-fm")


def test_integrate_equals_local_solver(torch_server, torch_velocity):
    velocity = velocity_request(batch=2, seed=1)
    grid = np.array([0.0, 0.1, 0.35, 0.7, 1.0], np.float32)
    reply = post_call(torch_server, integrate_call(7, velocity.x, velocity.y, grid, Solver.HEUN))
    assert reply.status_code == 200, reply.content
    expected = velocity.x
    for _, expected in iterate(torch_velocity, velocity.x, velocity.y, grid, "heun"):
        pass
    np.testing.assert_allclose(decode_response(reply.content, 7), expected, atol=1e-5)


def test_concurrent_single_image_requests_are_batched_and_get_their_own_answers(
        smoke_expert_checkpoint, torch_velocity):
    requests = [velocity_request(batch=1, seed=100 + i, request_id=i + 1) for i in range(32)]

    async def send_all(base: str) -> list[bytes]:
        async with aiohttp.ClientSession() as session:
            async def one(request: LabelVelocity) -> bytes:
                for body in request.call().bodies:
                    async with session.post(f"{base}/v1/velocity", data=body,
                                            headers=HEADERS) as response:
                        assert response.status == 200
                        reply = await response.read()
                return reply
            return await asyncio.gather(*(one(r) for r in requests))

    # A long delay makes coalescing certain; the batch dispatches as soon as it holds 32.
    with ready_server(smoke_expert_checkpoint, max_batch=32, max_delay_ms=2000) as base:
        replies = asyncio.run(send_all(base))
        metrics = httpx.get(f"{base}/metrics").text
    for request, reply in zip(requests, replies):
        expected = torch_velocity(request.x, request.t, request.y)
        np.testing.assert_allclose(decode_response(reply, request.request_id), expected,
                                   atol=1e-5)
    assert metric(metrics, "ddm_expert_batch_images_sum") == 32
    assert metric(metrics, "ddm_expert_batch_images_count") < 32  # some batches held several
    assert metric(metrics, 'ddm_expert_images_total{kind="velocity"}') == 32
    assert metric(metrics, "ddm_expert_queue_delay_seconds_count") == 32


def test_bad_requests_get_4xx_with_a_message_and_the_server_keeps_serving(torch_server,
                                                                          torch_velocity):
    good = velocity_request(batch=2, seed=3, request_id=9)
    wrong_dtype = bytearray(good.call().call)
    wrong_dtype[19] = 3  # the dtype code of 'x' (after the 18-byte header and its name code)
    # (body, status, message pattern, request id echoed: 0 where the header was unreadable)
    cases = [
        (b"", 400, "truncated header: 0 bytes", 0),
        (b"GET / HTTP/1.1\r\n\r\n garbage" * 10, 400, "magic", 0),
        (bytes(wrong_dtype), 422, "int32", 9),
        (LabelVelocity(9, np.zeros((1, 1, 4, 4), np.float32), np.zeros(1, np.float32),
                       np.zeros(1, np.int64)).call(),
         422, r"this expert serves \(1, 8, 8\)", 9),
        (velocity_request(batch=9, seed=0, request_id=9).call(), 422,
         "batch of 9 exceeds the limit of 8", 9),
        (velocity_request(batch=2, seed=0, request_id=9, labels=[1, 7]).call(), 422,
         r"labels \[7\] are not served by this expert \(serves \[0, 1, 2, 3, 4\]\)", 9),
    ]
    for body, status, message, echoed in cases:
        reply = (post_call(torch_server, body) if isinstance(body, LabelCall)
                 else post(torch_server, body))
        assert reply.status_code == status, (message, reply.content)
        assert re.search(message, remote_error(reply, echoed).message)
    reply = post_call(torch_server, good)
    assert reply.status_code == 200
    np.testing.assert_allclose(decode_response(reply.content, 9),
                               torch_velocity(good.x, good.t, good.y), atol=1e-5)
    metrics = httpx.get(f"{torch_server}/metrics").text
    # Labels it does not serve are refused once their context's rows are read: a velocity 422.
    assert sum(metric(metrics, f'ddm_expert_requests_total{{kind="{kind}",status="422"}}')
               for kind in ("invalid", "velocity")) >= 4
    assert httpx.get(f"{torch_server}/healthz").status_code == 200


def test_readyz_is_503_until_warm_up_completes(smoke_expert_checkpoint):
    release = threading.Event()

    def slow_loader(*args):
        release.wait(timeout=30)  # hold loading here until the test has looked
        return load_stage(*args)

    app = create_model_app(smoke_expert_checkpoint, ServingOptions(max_batch=2),
                           Hooks(loader=slow_loader))
    with running(app) as base:
        deadline = time.monotonic() + READY_DEADLINE_S
        while not _listening(base) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{base}/healthz").status_code == 200
        readyz = httpx.get(f"{base}/readyz")
        assert (readyz.status_code, readyz.json()["status"]) == (503, "loading")
        reply = post_call(base, velocity_request(batch=1, seed=0, request_id=5))
        assert reply.status_code == 503
        assert "still loading" in remote_error(reply, 5).message
        assert httpx.get(f"{base}/v1/info").json()["ready"] is False
        release.set()
        wait_ready(base)
        assert post_call(base, velocity_request(1, 0, request_id=5)).status_code == 200


def test_a_failed_load_is_reported_by_the_probes(smoke_expert_checkpoint):
    def broken_loader(*args):
        raise RuntimeError("no such accelerator")

    app = create_model_app(smoke_expert_checkpoint, hooks=Hooks(loader=broken_loader))
    with running(app) as base:
        deadline = time.monotonic() + READY_DEADLINE_S
        while time.monotonic() < deadline:
            if _listening(base) and httpx.get(f"{base}/healthz").status_code == 500:
                break
            time.sleep(0.05)
        health = httpx.get(f"{base}/healthz")
        assert health.status_code == 500 and "no such accelerator" in health.json()["error"]
        assert httpx.get(f"{base}/readyz").status_code == 503
        reply = post_call(base, velocity_request(batch=1, seed=0, request_id=3))
        assert "failed to load" in remote_error(reply, 3).message


def test_bodies_over_the_limit_get_413_and_requests_beyond_max_pending_429(
        smoke_expert_checkpoint):
    """One request holds the model; with max_pending 1 the next is refused at once."""
    entered, gate = threading.Event(), threading.Event()

    def gated_loader(*args):
        real = load_stage(*args)

        def forward(x, t, cond):
            if x.shape[0] == 5:
                entered.set()
                assert gate.wait(timeout=60)
            return real.forward(x, t, cond)

        return dataclasses.replace(real, forward=forward)

    app = create_model_app(smoke_expert_checkpoint, ServingOptions(max_batch=8, max_pending=1),
                           Hooks(loader=gated_loader))
    with running(app) as base:
        wait_ready(base)
        limit = httpx.get(f"{base}/v1/info").json()["max_body_bytes"]
        over = velocity_request(batch=1, seed=0, request_id=4).call().call + bytes(limit)
        for content in (over, iter([over[:100], over[100:]])):  # declared, then chunked
            reply = post(base, content)
            assert reply.status_code == 413
            assert f"exceeds the limit of {limit}" in remote_error(reply, 0).message

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=base, timeout=60, headers=HEADERS) as client:
                def post_async(body: bytes) -> Awaitable[httpx.Response]:
                    return client.post("/v1/velocity", content=body)

                held = asyncio.create_task(send_async(
                    post_async, velocity_request(batch=5, seed=1, request_id=5).call()))
                assert await asyncio.to_thread(entered.wait, 60)  # it holds the model now
                refused = await send_async(
                    post_async, velocity_request(batch=1, seed=2, request_id=6).call())
                gate.set()
                return refused, await held

        refused, held = asyncio.run(scenario())
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert "the limit is 1" in remote_error(refused, 0).message
        assert held.status_code == 200
        assert post_call(base, velocity_request(1, 3, request_id=7)).status_code == 200


@pytest.mark.parametrize("damage, reason", [
    ("weights", r"weights.safetensors is corrupt \(sha256"),
    ("config", "config.json"),
])
def test_an_expert_that_cannot_load_exits_1_and_says_why(smoke_expert_checkpoint, tmp_path,
                                                         damage, reason):
    """Kubernetes shows the termination message in the pod's lastState."""
    checkpoint = tmp_path / "broken"
    shutil.copytree(smoke_expert_checkpoint, checkpoint)
    if damage == "weights":
        weights = bytearray((checkpoint / "weights.safetensors").read_bytes())
        weights[-1] ^= 0xFF
        (checkpoint / "weights.safetensors").write_bytes(bytes(weights))
    else:
        (checkpoint / "config.json").write_text("{not json")
    log = tmp_path / "termination-log"
    port = free_port()
    expert = subprocess.Popen(
        [sys.executable, "-m", "ddm.cli", "serve", "expert", "--checkpoint", str(checkpoint),
         "--port", str(port), "--log-level", "error"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "DDM_TERMINATION_LOG": str(log)})
    assert expert.wait(timeout=READY_DEADLINE_S) == 1
    message = log.read_text()
    assert re.search(reason, message) and str(checkpoint) in message, message
    assert message.count("\n") == 1


def test_on_sigterm_the_expert_drains_then_stops(smoke_expert_checkpoint):
    """Not ready but still serving (new connections included) for --drain-s, then gone;
    its log tells its life once, though it serves on two event loops."""
    drain_s = 5.0  # long enough that a loaded machine still answers within it
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    expert = subprocess.Popen(
        [sys.executable, "-m", "ddm.cli", "serve", "expert", "--checkpoint",
         str(smoke_expert_checkpoint), "--port", str(port), "--drain-s", str(drain_s)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(base)
        expert.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while (readyz := httpx.get(f"{base}/readyz")).status_code == 200:
            assert time.monotonic() < signalled + drain_s, "still ready after the drain"
        assert readyz.status_code == 503 and readyz.json() == {"status": "draining"}
        served = post_call(base, velocity_request(2, seed=0))  # a new connection
        assert served.status_code == 200 and time.monotonic() - signalled < drain_s
        _, log = expert.communicate(timeout=30)
        assert time.monotonic() - signalled >= drain_s
        assert expert.returncode == 0  # stopping on SIGTERM is a server's normal end
        for line in ("Started server process", f"SIGTERM: draining for {drain_s:g} s",
                     "Shutting down", "Finished server process"):
            assert log.count(line) == 1, (line, log)
    finally:
        expert.kill()
        expert.wait()


#: An expert process as ``ddm serve expert`` runs it (its event loops, its batcher), whose model
#: holds a request with t = GATED_T until the file argv[3]/go exists, after writing the name of
#: the thread it runs on to argv[3]/thread.
_GATED_EXPERT = """
import dataclasses, pathlib, sys, time, threading
from ddm.models.stages import load_stage
from ddm.serving.model.options import Hooks
from ddm.serving.model.routes import SERVING_LOOPS
from ddm.serving.model.server import create_model_app
from ddm.serving.http.server import run_server
checkpoint, port, gate = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3])

def loader(*args):
    real = load_stage(*args)

    def forward(x, t, cond, _forward=real.forward):
        if float(t[0]) == %r:
            (gate / "thread").write_text(threading.current_thread().name)
            while not (gate / "go").exists():
                time.sleep(0.01)
        return _forward(x, t, cond)

    return dataclasses.replace(real, forward=forward)

run_server(lambda control: create_model_app(checkpoint, hooks=Hooks(
               loader=loader, start_up=control.start_up, serving_loops=SERVING_LOOPS)),
           "127.0.0.1", port, "warning", loops=SERVING_LOOPS)
"""
GATED_T = 0.375  # exact in float32


def test_a_long_lone_batch_runs_on_its_event_loop_while_another_answers(
        smoke_expert_checkpoint, tmp_path):
    """An expert serves on two event loops: a lone request runs on the loop it came on
    however long its model takes (no hand-off to the model thread and back), and meanwhile
    the other loop answers probes and queues other clients' requests; SIGTERM stops both."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    expert = subprocess.Popen(
        [sys.executable, "-c", _GATED_EXPERT % GATED_T, str(smoke_expert_checkpoint), str(port),
         str(tmp_path)], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_ready(base)
        held = velocity_request(1, seed=0)
        held = LabelVelocity(1, held.x, np.full(1, GATED_T, np.float32), held.y)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(post_call, base, held)
            wait_for(lambda: (tmp_path / "thread").exists(), READY_DEADLINE_S,
                     "the held request to reach the model", interval_s=0.05)
            ran_on = (tmp_path / "thread").read_text()
            assert ran_on == "MainThread" or ran_on.startswith("ddm-loop-"), ran_on
            assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200
            second = pool.submit(post_call, base, velocity_request(2, seed=1, request_id=2))
            assert httpx.get(f"{base}/metrics", timeout=10).status_code == 200
            assert not first.done() and not second.done()
            (tmp_path / "go").touch()
            replies = [first.result(30), second.result(30)]
        assert [reply.status_code for reply in replies] == [200, 200]
        assert decode_response(replies[0].content, 1).shape == (1, *SHAPE)
        assert decode_response(replies[1].content, 2).shape == (2, *SHAPE)
        expert.send_signal(signal.SIGTERM)
        assert expert.wait(timeout=30) == 0
    finally:
        expert.kill()
        expert.wait()


def test_the_termination_message_is_one_line_kubernetes_keeps_or_nothing(tmp_path):
    reason = "line one\nline two é" + "x" * 5000
    assert write_termination_message(reason, tmp_path / "log")
    written = (tmp_path / "log").read_bytes()
    assert written.startswith(b"line one line two \xc3\xa9x") and written.endswith(b"x\n")
    assert len(written) == 4096 + 1
    assert not write_termination_message(reason, tmp_path / "no-such-dir" / "log")


def test_neuron_backend_without_torch_neuronx_fails_clearly(smoke_expert_checkpoint):
    with pytest.raises(BackendUnavailable, match="backend 'neuron' needs torch_neuronx"):
        create_model_app(smoke_expert_checkpoint, ServingOptions(backend="neuron"))
    with pytest.raises(BackendUnavailable, match="pip.repos.neuron.amazonaws.com"):
        load_stage(smoke_expert_checkpoint, backend="neuron", batch_sizes=(1, 2, 4))
    with pytest.raises(ValueError, match="unknown backend 'tensorflow'"):
        check_backend("tensorflow")


def test_sequential_requests_are_not_held_by_nagle(torch_server):
    """A reply held for a delayed ACK costs 40 ms; a batch-1 step of the smoke model is ~1 ms."""
    call = velocity_request(batch=1, seed=0).call()
    assert post(torch_server, call.context).status_code == 200  # held: each call names it
    body = call.call

    async def latencies() -> list[float]:
        async with aiohttp.ClientSession() as session:
            times = []
            for _ in range(30):
                started = time.perf_counter()
                async with session.post(f"{torch_server}/v1/velocity", data=body,
                                        headers=HEADERS) as response:
                    await response.read()
                times.append(time.perf_counter() - started)
            return times

    assert statistics.median(asyncio.run(latencies())) < 0.02


#: Every operation the expert serves; /openapi.json and /docs describe them, and are not listed.
SERVED = {("POST", "/v1/velocity"), ("GET", "/v1/info"), ("GET", "/healthz"), ("GET", "/readyz"),
          ("GET", "/metrics")}


def test_the_openapi_document_describes_exactly_the_served_operations(torch_server):
    document = httpx.get(f"{torch_server}/openapi.json").json()
    paths = document["paths"]
    assert {(m.upper(), p) for p, operations in paths.items() for m in operations} == SERVED
    velocity = paths["/v1/velocity"]["post"]  # bare ASGI: merged into FastAPI's document
    binary = {CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}}
    assert velocity["requestBody"]["content"] == binary
    assert {s for s, r in velocity["responses"].items() if r["content"] == binary} >= {
        "200", "400", "413", "422", "429", "503"}
    for method, path in SERVED:  # each documented operation is served, as documented
        body = velocity_request(batch=1, seed=0).call() if method == "POST" else None
        if body is not None:
            assert post(torch_server, body.context).status_code == 200
            body = body.call
        reply = httpx.request(method, f"{torch_server}{path}", content=body, headers=HEADERS)
        assert str(reply.status_code) in paths[path][method.lower()]["responses"], (path, reply)
        assert reply.status_code == 200, (path, reply.text)
    assert httpx.get(f"{torch_server}/docs").status_code == 404  # --api-docs turns it on
    assert httpx.get(f"{torch_server}/v1/nothing").status_code == 404


def _listening(base: str) -> bool:
    try:
        httpx.get(f"{base}/healthz")
    except httpx.TransportError:
        return False
    return True


def test_velocity_calls_run_between_the_slices_of_a_long_integration(torch_server,
                                                                     torch_velocity):
    """A delegated integration of 1000 steps does not hold the model for all of them: velocity
    calls sent meanwhile are answered before it ends, and its result is unchanged."""
    start = velocity_request(batch=8, seed=3)
    grid = np.linspace(0, 1, 1001, dtype=np.float32)
    integrate = integrate_call(9, start.x, start.y, grid, Solver.EULER)
    single = velocity_request(batch=1, seed=4, request_id=5).call()
    for context in (integrate.context, single.context):  # held: the calls name them
        assert post(torch_server, context).status_code == 200
    integrate, single = integrate.call, single.call

    async def scenario() -> tuple[bytes, int]:
        async with httpx.AsyncClient(headers=HEADERS, timeout=120) as client:
            long = asyncio.ensure_future(client.post(f"{torch_server}/v1/velocity",
                                                     content=integrate))
            answered = 0
            while not long.done():
                reply = await client.post(f"{torch_server}/v1/velocity", content=single)
                assert reply.status_code == 200
                answered += not long.done()
            return (await long).content, answered

    content, answered = asyncio.run(scenario())
    assert answered >= 3, answered
    expected = start.x
    for _, expected in iterate(torch_velocity, start.x, start.y, grid, "euler"):
        pass
    np.testing.assert_allclose(decode_response(content, 9), expected, atol=1e-4)


def test_a_batch_of_one_holding_the_model_does_not_hold_the_probes(smoke_expert_checkpoint):
    """Every batch, however small or quick the model, runs on the model thread: the event
    loop answers probes while a batch-1 call is held (it once ran small batches on the loop)."""
    serving, entered, gate = threading.Event(), threading.Event(), threading.Event()

    def gated_loader(*args):
        real = load_stage(*args)

        def forward(x, t, cond):
            if serving.is_set():
                entered.set()
                assert gate.wait(timeout=60)
            return real.forward(x, t, cond)

        return dataclasses.replace(real, forward=forward)

    with running(create_model_app(smoke_expert_checkpoint,
                                  hooks=Hooks(loader=gated_loader))) as base:
        wait_ready(base)
        serving.set()

        async def scenario() -> tuple[int, int]:
            async with httpx.AsyncClient(base_url=base, timeout=60, headers=HEADERS) as client:
                held = asyncio.create_task(send_async(
                    lambda body: client.post("/v1/velocity", content=body),
                    velocity_request(batch=1, seed=0, request_id=2).call()))
                assert await asyncio.to_thread(entered.wait, 60)
                probe = await client.get("/healthz", timeout=5)
                gate.set()
                return probe.status_code, (await held).status_code

        assert asyncio.run(scenario()) == (200, 200)


def test_with_a_metrics_port_metrics_are_there_only_and_the_api_is_not(smoke_expert_checkpoint):
    ports = [free_port(), free_port()]
    base, scrape = (f"http://127.0.0.1:{port}" for port in ports)
    expert = subprocess.Popen(
        [sys.executable, "-m", "ddm.cli", "serve", "expert", "--checkpoint",
         str(smoke_expert_checkpoint), "--port", str(ports[0]), "--metrics-port",
         str(ports[1]), "--log-level", "warning"], env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_ready(base)
        assert post_call(base, velocity_request(1, seed=0)).status_code == 200
        metrics = httpx.get(f"{scrape}/metrics")
        assert metrics.status_code == 200 and metric(metrics.text, "ddm_expert_images_total") == 1
        assert httpx.get(f"{base}/metrics").status_code == 404
        for path in ("/v1/info", "/readyz", "/openapi.json"):
            assert httpx.get(f"{scrape}{path}").status_code == 404
        assert post_call(scrape, velocity_request(1, seed=0)).status_code == 404
    finally:
        expert.kill()
        expert.wait()


@pytest.mark.parametrize("max_batch", [1, 3])
def test_a_jax_expert_with_a_small_batch_limit_starts_and_serves_it(
        smoke_jax_expert_checkpoint, max_batch):
    """JAX compiles only the batch sizes up to ``--max-batch``: start-up must not ask for a
    bigger one (it once made ``--max-batch 1`` fail to start)."""
    app = create_model_app(smoke_jax_expert_checkpoint,
                           ServingOptions(backend="jax", max_batch=max_batch))
    with running(app) as base:
        wait_ready(base)
        info = httpx.get(f"{base}/v1/info").json()
        assert info["ready"] is True and info["max_batch"] == max_batch
        reply = post_call(base, velocity_request(batch=max_batch, seed=0))
        assert reply.status_code == 200


def _counting_loader(seen: list[int], changes):
    """A stage loader: the real stage with ``changes(real)`` applied, its forward appending
    each call's rows to ``seen``."""
    def load(*args):
        real = load_stage(*args)

        def forward(x, t, cond):
            seen.append(x.shape[0])
            return real.forward(x, t, cond)

        return dataclasses.replace(real, forward=forward, **changes(real))

    return load


def test_a_network_of_fixed_batch_sizes_is_warmed_at_each_and_runs_padded_to_one(
        smoke_expert_checkpoint, torch_velocity):
    """An exported program, JAX or a Neuron trace runs at a few batch sizes only
    (``Stage.batch_sizes``): the server warms every one before it is ready and pads each
    batch up to the smallest that holds it, answering the real rows."""
    seen: list[int] = []
    fixed_sizes = _counting_loader(seen, lambda real: {"batch_sizes": (1, 2, 4, 8)})
    with running(create_model_app(smoke_expert_checkpoint, ServingOptions(max_batch=8),
                                  Hooks(loader=fixed_sizes))) as base:
        wait_ready(base)
        assert seen == [1, 2, 4, 8]
        request = velocity_request(batch=3, seed=5, request_id=8)
        reply = post_call(base, request)
    assert reply.status_code == 200, reply.content
    assert seen[-1] == 4
    np.testing.assert_allclose(decode_response(reply.content, 8, (3, *SHAPE)),
                               torch_velocity(request.x, request.t, request.y), atol=1e-5)


@pytest.mark.parametrize(("device", "warmed"), [("cpu", [1]), ("cuda:0", [1, 8])])
def test_an_eager_network_is_warmed_at_a_full_batch_on_an_accelerator_only(
        smoke_expert_checkpoint, device, warmed):
    """On an accelerator the first full batch would pay the allocator's growth and kernel
    selection on a live request, so it is warmed there; on the CPU one row suffices. The
    stage here runs on the CPU and says it runs on ``device``."""
    seen: list[int] = []
    on_device = _counting_loader(seen, lambda real: {
        "runtime": dataclasses.replace(real.runtime, device=device)})
    with running(create_model_app(smoke_expert_checkpoint, ServingOptions(max_batch=8),
                                  Hooks(loader=on_device))) as base:
        wait_ready(base)
        assert seen == warmed


def test_a_compiled_network_is_warmed_at_every_bucket_twice_where_cuda_graphs_record(
        smoke_expert_checkpoint):
    """Compiled, every batch size compiles before the server is ready; under
    ``reduce-overhead`` CUDA graph trees record a shape at its second call, so each size runs
    twice: no graph is recorded during a live request."""
    seen: list[int] = []
    counting = _counting_loader(seen, lambda real: {})
    options = ServingOptions(max_batch=4, compile="reduce-overhead")
    with running(create_model_app(smoke_expert_checkpoint, options,
                                  Hooks(loader=counting))) as base:
        wait_ready(base, deadline_s=600)
        assert seen == [1, 2, 4, 1, 2, 4]


def test_a_label_expert_takes_its_stored_precision_only_and_refuses_another_before_start():
    """One rule with the loader (``label_precision``): a label checkpoint runs as stored, so
    ``--precision`` may name its stored dtype and nothing else, refused before the server
    starts (nothing loaded yet)."""
    checkpoint = Path(__file__).resolve().parents[2] / "checkpoints" / "digits" / "expert-0-4"
    with pytest.raises(CheckpointError, match=r"expert-0-4: a label checkpoint runs in its "
                                              r"stored dtype \(float32\), not bfloat16"):
        create_model_app(checkpoint, ServingOptions(precision="bfloat16"))
    with running(create_model_app(checkpoint, ServingOptions(precision="float32"))) as base:
        wait_ready(base)
        assert httpx.get(f"{base}/v1/info").json()["precision"] == "float32"
