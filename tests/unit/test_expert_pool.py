"""The expert pool: replica choice and backoff (pure), then real expert servers on loopback.

Servers are in-process uvicorn threads with the smoke checkpoint; dead replicas are ports with
nothing listening, hanging ones are sockets that listen but never answer. Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import httpx
import numpy as np
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from ddm.conditioning import Conditioning
from ddm.checkpoints.format import load_checkpoint
from ddm.models.loading import expert_velocity
from ddm.serving.router.fleet.pool import ExpertPool
from ddm.serving.router.fleet.servers import ExpertRejected, ExpertUnavailable, PoolSettings
from ddm.serving.router.fleet.replicas import (ExpertInfo, ReplicaSet, ReplicaState, dns_endpoints,
                                               static_endpoints)
from ddm.serving.http.server import build_server, send_bytes
from ddm.serving.model.server import create_model_app
from ddm.serving.model.options import ServingOptions
from ddm.serving.wire.protocol import CONTENT_TYPE, encode_error

SHAPE = (1, 8, 8)
FAST = PoolSettings(connect_s=1.0, attempt_s=2.0, deadline_s=3.0, attempts=2, backoff_s=0.05,
                    max_backoff_s=0.2, health_interval_s=0.5, refresh_s=0.1)
WAIT_S = 30.0


# ------------------------------------------------------------------------ replica choice


def test_least_outstanding_replica_wins_and_ties_go_round_robin():
    replicas = ReplicaSet(0.1, 1.0, 5.0)
    replicas.update(["a:1", "b:1", "c:1"])
    for r in replicas.replicas:
        replicas.mark_ready(r, now=0.0)
    assert {replicas.choose().endpoint for _ in range(3)} == {"a:1", "b:1", "c:1"}
    a, b, c = replicas.replicas
    a.outstanding, b.outstanding, c.outstanding = 2, 0, 1
    assert all(replicas.choose() is b for _ in range(4))
    replicas.mark_down(b, "refused", now=0.0)
    assert replicas.choose() is c


def test_a_preferred_replica_breaks_ties_but_never_the_load_balance():
    """A pool member's call joins its step's request on a replica where it ties: ``prefer``
    (pool_calls) names the endpoints with a request of this turn."""
    replicas = ReplicaSet(0.1, 1.0, 5.0)
    replicas.update(["a:1", "b:1", "c:1"])
    for r in replicas.replicas:
        replicas.mark_ready(r, now=0.0)
    a, b, c = replicas.replicas
    assert all(replicas.choose(prefer=lambda r: r is c) is c for _ in range(4))
    c.outstanding = 1  # busier: the least loaded wins, round-robin between a and b
    assert {replicas.choose(prefer=lambda r: r is c).endpoint for _ in range(4)} == {"a:1",
                                                                                   "b:1"}


def test_ready_replicas_go_before_unprobed_ones_and_down_ones_never():
    replicas = ReplicaSet(0.1, 1.0, 5.0)
    replicas.update(["new:1", "ok:1", "dead:1"])
    new, ok, dead = replicas.replicas
    replicas.mark_ready(ok, now=0.0)
    replicas.mark_down(dead, "refused", now=0.0)
    assert all(replicas.choose() is ok for _ in range(3))
    replicas.mark_down(ok, "reset", now=0.0)
    assert replicas.choose() is new
    replicas.mark_down(new, "refused", now=0.0)
    assert replicas.choose() is None


def test_updates_keep_what_is_known_of_listed_replicas():
    replicas = ReplicaSet(0.1, 1.0, 5.0)
    replicas.update(["a:1", "b:1"])
    a = replicas.replicas[0]
    replicas.mark_down(a, "refused", now=0.0)
    replicas.update(["b:1", "a:1", "c:1", "c:1"])
    assert [r.endpoint for r in replicas.replicas] == ["b:1", "a:1", "c:1"]
    assert replicas.replicas[1] is a and a.state is ReplicaState.DOWN
    assert replicas.replicas[2].state is ReplicaState.UNKNOWN


def test_failed_replicas_are_probed_with_a_doubling_capped_backoff():
    replicas = ReplicaSet(0.1, 1.0, 5.0)
    replicas.update(["a:1"])
    (a,) = replicas.replicas
    assert replicas.due_for_probe(now=0.0) == [a]  # new replicas are probed at once
    replicas.mark_down(a, "refused", now=10.0)
    replicas.mark_down(a, "refused again, same outage", now=10.0)  # counts once
    assert a.failures == 1 and a.next_probe == pytest.approx(10.1)
    delays = []
    for _ in range(5):
        replicas.probe_failed(a, "refused", now=0.0)
        delays.append(a.next_probe)
    assert delays == pytest.approx([0.2, 0.4, 0.8, 1.0, 1.0])
    replicas.mark_ready(a, now=0.0)
    assert a.failures == 0 and a.next_probe == 5.0  # then health-checked now and then


def test_waiting_for_a_usable_replica_times_out_or_wakes_on_recovery():
    async def scenario() -> tuple[bool, bool]:
        replicas = ReplicaSet(0.1, 1.0, 5.0)
        replicas.update(["a:1"])
        replicas.mark_down(replicas.replicas[0], "refused", now=0.0)
        timed_out = await replicas.wait_usable(0.05)
        asyncio.get_running_loop().call_later(0.01, replicas.mark_ready,
                                              replicas.replicas[0], 0.0)
        return timed_out, await replicas.wait_usable(5.0)

    assert asyncio.run(scenario()) == (False, True)


# ----------------------------------------------------------------------------- discovery


def test_the_experts_batch_limit_is_the_smallest_of_its_live_replicas():
    replicas = ReplicaSet(0.1, 1.0, 5.0)
    replicas.update(["a:1", "b:1", "c:1"])
    assert replicas.info() is None  # nothing probed yet
    a, b, c = replicas.replicas
    for replica, max_batch in ((a, 64), (b, 16)):
        replica.info = ExpertInfo((1, 16, 16), (0, 1), max_batch)
        replicas.mark_ready(replica, now=0.0)
    assert replicas.info() == ExpertInfo((1, 16, 16), (0, 1), 16)
    replicas.mark_down(b, "refused", now=0.0)
    assert replicas.info().max_batch == 64  # b gets no request while down
    replicas.mark_down(a, "refused", now=0.0)
    assert replicas.info().max_batch == 16  # all down: what they said last


def test_static_and_dns_sources():
    async def resolve() -> tuple[list[str], list[str]]:
        return (list(await static_endpoints(["10.0.0.1:8000", "10.0.0.2:8000"])()),
                list(await dns_endpoints("localhost", 8000)()))

    static, dns = asyncio.run(resolve())
    assert static == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert dns == ["127.0.0.1:8000"]  # A records only


def test_endpoints_follow_their_source_while_running():
    listed = ["127.0.0.1:1"]

    async def source() -> list[str]:
        return list(listed)

    async def scenario() -> list[str]:
        async with ExpertPool({"e": source}, FAST) as pool:
            assert [r.endpoint for r in pool.replicas("e")] == ["127.0.0.1:1"]
            listed[:] = ["127.0.0.1:2", "127.0.0.1:3"]
            await _until(lambda: len(pool.replicas("e")) == 2)  # refreshed every 0.1 s
            return [r.endpoint for r in pool.replicas("e")]

    assert asyncio.run(scenario()) == ["127.0.0.1:2", "127.0.0.1:3"]


# ------------------------------------------------------------------- over real servers


@pytest.fixture(scope="module")
def expert_a(smoke_expert_checkpoint: Path) -> Iterator[str]:
    with _expert(smoke_expert_checkpoint) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def expert_b(smoke_expert_checkpoint: Path) -> Iterator[str]:
    with _expert(smoke_expert_checkpoint) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def local_velocity(smoke_expert_checkpoint: Path):
    velocity = expert_velocity(load_checkpoint(smoke_expert_checkpoint), "torch")
    return lambda x, t, cond: velocity(x, t, cond.labels)


def test_dns_discovered_replica_answers_like_the_local_model(expert_a, local_velocity):
    port = int(expert_a.rpartition(":")[2])
    x, t, y = _inputs(20, seed=0)

    async def scenario():
        async with ExpertPool({"e": dns_endpoints("localhost", port)}, FAST) as pool:
            await _until(lambda: pool.info("e") is not None)
            v = await pool.velocity("e", x, t, y)  # 20 rows: split into the expert's 8
            return v, pool.info("e"), [r.endpoint for r in pool.replicas("e")]

    v, info, endpoints = asyncio.run(scenario())
    assert endpoints == [f"127.0.0.1:{port}"]
    assert (info.image_shape, info.max_batch, info.classes) == (SHAPE, 8, (0, 1, 2, 3, 4))
    np.testing.assert_allclose(v, local_velocity(x, t, y), atol=1e-5)


def test_calls_are_balanced_over_replicas(expert_a, expert_b):
    before = {e: _served(e) for e in (expert_a, expert_b)}

    async def scenario() -> None:
        async with ExpertPool({"e": static_endpoints([expert_a, expert_b])}, FAST) as pool:
            for _ in range(10):
                await pool.velocity("e", *_inputs(1, seed=1))
            await asyncio.gather(*(pool.velocity("e", *_inputs(1, seed=i)) for i in range(10)))

    asyncio.run(scenario())
    served = [_served(e) - before[e] for e in (expert_a, expert_b)]
    assert sum(served) == 20 and min(served) >= 5, served


def test_concurrent_calls_merge_into_few_requests_and_each_gets_its_own_answer(
        expert_a, local_velocity):
    inputs = [_inputs(1, seed=i) for i in range(12)]
    grid, other_grid = np.linspace(0, 0.5, 4, dtype=np.float32), np.array([0.5, 1], np.float32)

    async def scenario():
        async with ExpertPool({"e": static_endpoints([expert_a])}, FAST) as pool:
            await _until(lambda: pool.info("e") is not None)
            velocities = await asyncio.gather(*(pool.velocity("e", *i) for i in inputs))
            velocity_requests = _count(pool.metrics.request_rows)
            integrations = await asyncio.gather(
                *(pool.integrate("e", x, y, g, "euler") for g in (grid, other_grid)
                  for x, _, y in inputs[:4]))
            alone = [await pool.integrate("e", x, y, g, "euler") for g in (grid, other_grid)
                     for x, _, y in inputs[:4]]
            return velocities, velocity_requests, integrations, alone

    velocities, velocity_requests, integrations, alone = asyncio.run(scenario())
    for v, (x, t, y) in zip(velocities, inputs):
        np.testing.assert_allclose(v, local_velocity(x, t, y), atol=1e-5)
    assert velocity_requests <= 3, velocity_requests  # 12 calls; the expert takes 8 rows
    for merged, single in zip(integrations, alone):
        np.testing.assert_allclose(merged, single, atol=1e-5)


def test_without_coalescing_every_call_is_its_own_request(expert_a):
    settings = PoolSettings(**{**FAST.__dict__, "in_flight_per_replica": 0})

    async def scenario() -> float:
        async with ExpertPool({"e": static_endpoints([expert_a])}, settings) as pool:
            await _until(lambda: pool.info("e") is not None)
            await asyncio.gather(*(pool.velocity("e", *_inputs(1, seed=i)) for i in range(6)))
            return _count(pool.metrics.request_rows)

    assert asyncio.run(scenario()) == 6


def test_a_dead_or_hanging_replica_fails_over_to_a_live_one(expert_a, local_velocity):
    x, t, y = _inputs(2, seed=2)
    with _hanging() as hanging:
        async def scenario():
            sources = {"e": static_endpoints([_dead(), hanging, expert_a])}
            settings = PoolSettings(connect_s=0.5, attempt_s=0.5, deadline_s=5.0, attempts=3,
                                    health_interval_s=60.0)
            async with ExpertPool(sources, settings) as pool:
                outs = [await pool.velocity("e", x, t, y) for _ in range(4)]
                # the first call waited for a probe (the batch limit), which found the live one
                await _until(lambda: sum(r.state is ReplicaState.DOWN
                                         for r in pool.replicas("e")) == 2, timeout=5)
                states = {r.endpoint: r.state for r in pool.replicas("e")}
                return outs, states

        outs, states = asyncio.run(scenario())
    for v in outs:
        np.testing.assert_allclose(v, local_velocity(x, t, y), atol=1e-5)
    assert states[expert_a] is ReplicaState.READY
    assert [s for e, s in states.items() if e != expert_a] == [ReplicaState.DOWN] * 2


def test_no_answering_replica_raises_unavailable_within_the_deadline():
    # 100 attempts would take 15 s or more against the hanging replica: only the deadline
    # can end it within a few seconds
    settings = PoolSettings(connect_s=0.3, attempt_s=0.3, deadline_s=1.0, attempts=100,
                            backoff_s=0.05, max_backoff_s=0.1)
    with _hanging() as hanging:
        async def scenario():
            async with ExpertPool({"e0": static_endpoints([_dead(), hanging])}, settings) as pool:
                started = time.monotonic()
                with pytest.raises(ExpertUnavailable) as caught:
                    await pool.velocity("e0", *_inputs(1, seed=0))
                return caught.value, time.monotonic() - started

        error, elapsed = asyncio.run(scenario())
    assert error.expert == "e0" and error.status == 503
    assert re.search(r"expert e0: unavailable: .*(within 1 s|attempt)", str(error)), str(error)
    assert elapsed < 1.0 + 3.0


def test_a_4xx_is_the_callers_fault_and_is_not_retried(expert_a, expert_b):
    async def scenario():
        async with ExpertPool({"e": static_endpoints([expert_a, expert_b])}, FAST) as pool:
            with pytest.raises(ExpertRejected) as caught:
                x, t, _ = _inputs(2, seed=0)
                await pool.velocity("e", x, t, Conditioning.from_labels([1, 7]))  # it serves 0-4
            return caught.value, pool.metrics

    error, metrics = asyncio.run(scenario())
    assert (error.code, error.status, error.expert) == (422, 422, "e")
    assert "labels [7] are not served by this expert" in str(error)
    assert metrics.retries.labels("e")._value.get() == 0


def _answering(status: int, body: bytes | None = None) -> Callable[[ASGIApp], ASGIApp]:
    """The expert, except that every call (``POST /v1/velocity``) gets ``status`` with
    ``body`` (None: an error reply of that code); its probes are answered as they are."""

    def wrap(app: ASGIApp) -> ASGIApp:
        async def answer(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope["path"] != "/v1/velocity":
                return await app(scope, receive, send)
            while (await receive()).get("more_body"):
                pass
            await send_bytes(send, status, encode_error(0, status, "no") if body is None
                             else body, CONTENT_TYPE.encode())

        return answer

    return wrap


@pytest.mark.parametrize("status,body,down", [
    (500, None, False), (200, b"DDMT garbage", False), (429, None, False), (503, None, True)],
    ids=["500", "malformed", "429", "503"])
def test_only_a_replica_saying_it_is_unwell_is_marked_down(
        smoke_expert_checkpoint, expert_a, local_velocity, status, body, down):
    """An answer a request may provoke (a 500, a malformed reply: issue 35's non-finite
    'out' was one) is retried on another replica and leaves the replica's health to the probes,
    so that no request can take replicas down; a 503 (loading, closing) marks it down. No
    probe runs in between (a minute's backoff and interval): the state is the calls' doing."""
    settings = PoolSettings(connect_s=1.0, attempt_s=2.0, deadline_s=5.0, attempts=2,
                            backoff_s=60.0, max_backoff_s=60.0, health_interval_s=60.0)
    x, t, y = _inputs(1, seed=5)
    with _expert(smoke_expert_checkpoint, wrap=_answering(status, body)) as failing:
        async def scenario():
            async with ExpertPool({"e": static_endpoints([failing, expert_a])}, settings) as pool:
                await _until(lambda: pool.ready_count("e") == 2)
                outs = [await pool.velocity("e", x, t, y) for _ in range(4)]
                failed = pool.metrics.attempts.labels("e", "velocity", "failed")._value.get()
                return outs, pool.replicas("e")[0].state, failed

        outs, state, failed = asyncio.run(scenario())
    for v in outs:
        np.testing.assert_allclose(v, local_velocity(x, t, y), atol=1e-5)
    assert failed >= 1
    assert state is (ReplicaState.DOWN if down else ReplicaState.READY)


def test_a_replica_that_comes_back_is_used_again(smoke_expert_checkpoint):
    port = _free_port()

    async def scenario() -> int:
        async with ExpertPool({"e": static_endpoints([f"127.0.0.1:{port}"])}, FAST) as pool:
            await _until(lambda: pool.replicas("e")[0].failures >= 2)  # probes keep failing
            with _expert(smoke_expert_checkpoint, port):
                await _until(lambda: pool.ready_count("e") == 1)
                v = await pool.velocity("e", *_inputs(1, seed=0))
            return v.shape[0]

    assert asyncio.run(scenario()) == 1


def test_a_replica_restarted_with_another_batch_limit_is_followed(smoke_expert_checkpoint):
    """A rolling update may change --max-batch: merged requests must fit the new limit."""
    port = _free_port()

    async def scenario() -> tuple[int, int, list[int]]:
        async with ExpertPool({"e": static_endpoints([f"127.0.0.1:{port}"])}, FAST) as pool:
            with _expert(smoke_expert_checkpoint, port, max_batch=8):
                await _until(lambda: pool.info("e") is not None)
                before = pool.info("e").max_batch
            await _until(lambda: pool.ready_count("e") == 0)  # the prober saw it go
            with _expert(smoke_expert_checkpoint, port, max_batch=2):
                await _until(lambda: pool.ready_count("e") == 1)
                outs = await asyncio.gather(*(pool.velocity("e", *_inputs(1, seed=i))
                                              for i in range(6)))
                return before, pool.info("e").max_batch, [len(v) for v in outs]

    before, after, rows = asyncio.run(scenario())
    assert (before, after, rows) == (8, 2, [1] * 6)


def test_calls_queued_behind_a_dead_expert_fail_within_one_deadline(smoke_expert_checkpoint):
    """A call's deadline runs from when the generation makes it, time spent waiting to be
    merged included: with every replica gone, no call waits two deadlines."""
    port = _free_port()
    settings = PoolSettings(**{**FAST.__dict__, "deadline_s": 1.0, "in_flight_per_replica": 1})

    async def scenario() -> list[tuple[BaseException | None, float]]:
        async with ExpertPool({"e": static_endpoints([f"127.0.0.1:{port}"])}, settings) as pool:
            with _expert(smoke_expert_checkpoint, port):
                await _until(lambda: pool.info("e") is not None)  # its batch limit is known
            await _until(lambda: pool.ready_count("e") == 0)

            async def call(seed: int) -> tuple[BaseException | None, float]:
                started = time.monotonic()
                try:
                    await pool.velocity("e", *_inputs(1, seed=seed))
                except ExpertUnavailable as error:
                    return error, time.monotonic() - started
                return None, time.monotonic() - started

            first = asyncio.ensure_future(call(0))
            await asyncio.sleep(0.3)  # the first call holds the one request slot meanwhile
            return await asyncio.gather(first, *(call(i) for i in range(1, 6)))

    outcomes = asyncio.run(scenario())
    assert all(isinstance(error, ExpertUnavailable) for error, _ in outcomes), outcomes
    assert max(waited for _, waited in outcomes) < 1.0 + 0.5, outcomes


# ----------------------------------------------------------------------------- helpers


@contextmanager
def _expert(checkpoint: Path, port: int = 0, max_batch: int = 8,
            wrap: Callable[[ASGIApp], ASGIApp] = lambda app: app) -> Iterator[str]:
    """An expert server on loopback (``port`` 0: any free one), its app seen through ``wrap``;
    yields ``host:port``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
    server = build_server(wrap(create_model_app(checkpoint, ServingOptions(max_batch=max_batch))),
                          "127.0.0.1",
                          sock.getsockname()[1], log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while not _ready(endpoint):
            assert time.monotonic() < deadline, f"{endpoint} not ready after {WAIT_S} s"
            time.sleep(0.05)
        yield endpoint
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@contextmanager
def _hanging() -> Iterator[str]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def _dead() -> str:
    return f"127.0.0.1:{_free_port()}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ready(endpoint: str) -> bool:
    try:
        return httpx.get(f"http://{endpoint}/readyz").status_code == 200
    except httpx.TransportError:
        return False


def _count(histogram) -> float:
    """Observations of a labelled histogram, over every label value."""
    return sum(sample.value for metric in histogram.collect() for sample in metric.samples
               if sample.name.endswith("_count"))


def _served(endpoint: str) -> float:
    text = httpx.get(f"http://{endpoint}/metrics").text
    return sum(float(v) for v in re.findall(
        r'^ddm_expert_images_total\{kind="velocity"\} (\S+)$', text, re.MULTILINE))


def _inputs(batch: int, seed: int) -> tuple[np.ndarray, np.ndarray, Conditioning]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, *SHAPE), dtype=np.float32),
            rng.uniform(0, 1, batch).astype(np.float32),
            Conditioning.from_labels(rng.integers(0, 5, batch)))


async def _until(condition: Callable[[], bool], timeout: float = WAIT_S) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


def test_a_batch_over_the_limit_before_any_probe_waits_for_one_and_is_split(
        expert_a, local_velocity):
    """Straight after start no replica has been probed, so the expert's batch limit (8) is
    unknown; sent whole, 20 rows would be refused with 422."""
    x, t, y = _inputs(20, seed=4)

    async def scenario():
        async with ExpertPool({"e": static_endpoints([expert_a])}, FAST) as pool:
            assert pool.info("e") is None
            return await pool.velocity("e", x, t, y), _count(pool.metrics.request_rows)

    v, requests = asyncio.run(scenario())
    np.testing.assert_allclose(v, local_velocity(x, t, y), atol=1e-5)
    assert requests == 3
