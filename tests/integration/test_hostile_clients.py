"""Slow, idle and oversized connections against real servers on loopback (raw sockets): a normal
call still succeeds while they are open, and each of them is closed by its deadline
(``ddm.serving.http.connections``; figures in docs/reliability.md, "Hostile clients").

The deadlines are shortened to 4 s so that the tests take seconds; the defaults only change how
long an attacker lasts, not what it can do meanwhile.

Then requests whose values would make sound replicas look broken (issue 35): each is that
request's 4xx, and the router's ``/readyz`` stays 200 throughout.
"""

from __future__ import annotations

import asyncio
import base64
import io
import statistics
import threading
import time
from pathlib import Path
from typing import Callable

import httpx
import numpy as np
import pytest

from ddm.deploy.limits import MAX_STATE_MAGNITUDE
from ddm.deploy.router_config import RouterConfigFile
from ddm.serving.http.connections import ConnectionLimits
from ddm.serving.model.server import create_model_app
from ddm.serving.model.options import Hooks, ServingOptions
from ddm.serving.model.routes import SERVING_LOOPS
from ddm.serving.wire.protocol import (CONTENT_TYPE, RemoteExpertError, VelocityRequest,
                                       decode_response, encode_request)
from ddm.serving.router.api.server import create_router_app
from tests.support.label_wire import LabelCall, post_call, velocity_call
from hostile import Attacker, check_closed_in_time, swarm
from servers import running, wait_ready
from tests.support.text_router import served_text_ddm

LIMITS = ConnectionLimits(head_timeout_s=4.0, body_timeout_s=4.0, send_timeout_s=4.0,
                          keep_alive_s=4.0)
#: Timer lateness tolerated on a machine whose two cores run other tests too.
SLACK_S = 1.5
#: 300 connections, as issue 13 asks; 120 slow bodies are more than max_pending below.
PER_KIND = {"idle": 50, "partial-line": 30, "trickled-head": 40, "slow-body": 120,
            "huge-head": 20, "idle-keep-alive": 40}
CALLS = 5


def _velocity_call() -> LabelCall:
    rng = np.random.default_rng(0)
    return velocity_call(7, rng.standard_normal((1, 1, 8, 8), dtype=np.float32),
                         np.asarray([0.5], np.float32), np.asarray([1]))


def _timed(call: Callable[[], httpx.Response]) -> float:
    started = time.perf_counter()
    reply = call()
    assert reply.status_code == 200, reply.text[:300]
    return time.perf_counter() - started


async def _under_attack(targets: list[tuple[int, str]], call: Callable[[], httpx.Response]
                        ) -> tuple[list[Attacker], list[float], int]:
    """Open PER_KIND attackers on each ``(port, path)``, make CALLS normal calls meanwhile, then
    wait for the server to close every attacker. Returns the attackers, the calls' seconds and
    how many attackers were still open when the first call was answered."""
    attackers, tasks = [], []
    for port, path in targets:
        opened, running_ = await swarm("127.0.0.1", port, path, PER_KIND)
        attackers += opened
        tasks += running_
    seconds = [await asyncio.to_thread(_timed, call)]
    still_open = sum(a.closed is None for a in attackers)
    seconds += [await asyncio.to_thread(_timed, call) for _ in range(CALLS - 1)]
    longest = max(LIMITS.head_timeout_s, LIMITS.body_timeout_s, LIMITS.keep_alive_s)
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=longest + SLACK_S + 10)
    return attackers, seconds, still_open


def _report(what: str, attackers: list[Attacker], baseline: list[float], attacked: list[float],
            longest: dict[str, float]) -> None:
    print(f"\n{what}: {len(attackers)} attackers, {sum(a.sent for a in attackers)} bytes sent; "
          f"normal call median {statistics.median(baseline) * 1e3:.1f} ms alone, "
          f"{statistics.median(attacked) * 1e3:.1f} ms under attack (max "
          f"{max(attacked) * 1e3:.1f} ms); longest-lived attacker per kind: "
          + ", ".join(f"{kind} {seconds:.2f} s" for kind, seconds in longest.items())
          + f"; huge heads answered 431: {sum(a.status == 431 for a in attackers)}, reset: "
            f"{sum(a.reset for a in attackers)}")


def test_an_expert_serves_through_300_hostile_connections_and_closes_them(
        smoke_expert_checkpoint: Path):
    # max_pending below the number of slow bodies: they must not count as pending.
    app = create_model_app(smoke_expert_checkpoint, ServingOptions(max_batch=8, max_pending=16))
    with running(app, LIMITS) as base:
        wait_ready(base)
        assert post_call(base, _velocity_call()).status_code == 200  # its context, held
        body = _velocity_call().call

        def call() -> httpx.Response:
            reply = httpx.post(f"{base}/v1/velocity", content=body,
                               headers={"Content-Type": CONTENT_TYPE})
            if reply.status_code == 200:
                assert decode_response(reply.content, 7).shape == (1, 1, 8, 8)
            return reply

        baseline = [_timed(call) for _ in range(CALLS)]
        port = int(base.rsplit(":", 1)[1])
        attackers, attacked, still_open = asyncio.run(
            _under_attack([(port, "/v1/velocity")], call))
        assert still_open > 250, "the call was answered only once the attackers were cut off"
        assert max(attacked) < LIMITS.head_timeout_s
        longest = check_closed_in_time(attackers, LIMITS, SLACK_S)
        _report("expert", attackers, baseline, attacked, longest)
        assert _timed(call) < LIMITS.head_timeout_s  # and it serves on afterwards


def test_a_router_generates_through_300_hostile_connections_on_it_and_its_expert(
        smoke_expert_checkpoint: Path):
    expert_app = create_model_app(smoke_expert_checkpoint, ServingOptions(max_batch=8))
    with running(expert_app, LIMITS) as expert:
        wait_ready(expert)
        expert_port = int(expert.rsplit(":", 1)[1])
        config = RouterConfigFile.from_dict({
            "experts": [{"name": "e0", "classes": [0, 1, 2, 3, 4],
                         "discovery": {"endpoints": [f"127.0.0.1:{expert_port}"]}}],
            "sampling": {"steps": 4, "strategy": "oracle"}, "router_checkpoint": None})
        with running(create_router_app(config), LIMITS) as router:
            wait_ready(router)

            def call() -> httpx.Response:
                return httpx.post(f"{router}/v1/generate", json={"labels": [0, 3], "seed": 1},
                                  timeout=10)

            baseline = [_timed(call) for _ in range(CALLS)]
            router_port = int(router.rsplit(":", 1)[1])
            attackers, attacked, still_open = asyncio.run(_under_attack(
                [(router_port, "/v1/generate"), (expert_port, "/v1/velocity")], call))
            assert still_open > 500
            assert max(attacked) < LIMITS.head_timeout_s
            longest = check_closed_in_time(attackers, LIMITS, SLACK_S)
            _report("router and its expert", attackers, baseline, attacked, longest)
            assert _timed(call) < LIMITS.head_timeout_s


@pytest.mark.parametrize("cap,opened,loops", [(50, 120, 1), (50, 120, SERVING_LOOPS)])
def test_connections_over_the_cap_evict_the_longest_waiting_and_normal_calls_get_in(
        smoke_expert_checkpoint: Path, cap: int, opened: int, loops: int):
    """The cap holds for the whole server: on several event loops, each loop holds its share
    and evicts its own longest waiting (so the oldest go first within a loop)."""
    limits = ConnectionLimits(max_connections=cap)  # the default deadlines: 10 s and more
    app = create_model_app(smoke_expert_checkpoint, ServingOptions(max_batch=8),
                           Hooks(serving_loops=loops))
    with running(app, limits, loops) as base:
        wait_ready(base)
        port = int(base.rsplit(":", 1)[1])

        async def scenario() -> list[Attacker]:
            attackers, tasks = await swarm("127.0.0.1", port, "/", {"idle": opened})
            deadline = time.monotonic() + limits.head_timeout_s / 2
            while sum(a.closed is not None for a in attackers) < opened - cap:
                assert time.monotonic() < deadline, "connections over the cap stayed open"
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED, timeout=0.5)
                tasks = [task for task in tasks if not task.done()]
            reply = await asyncio.to_thread(httpx.get, f"{base}/v1/info")
            assert reply.status_code == 200
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED, timeout=5)
            for task in tasks:
                task.cancel()
            return attackers

        attackers = asyncio.run(scenario())
        closed = [a.closed is not None for a in attackers]
        assert sum(closed) >= opened - cap + 1  # the normal call evicted one more
        if loops == 1:  # the oldest went first: every evicted one was opened before every kept
            assert closed[:opened - cap] == [True] * (opened - cap)


async def _endless(scope, receive, send) -> None:
    """An app whose replies never end (1 MiB at a time, as fast as the client reads), but for
    ``/readyz``."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await receive()  # the empty body of a GET; the next message is the disconnect
    gone = asyncio.ensure_future(receive())
    await send({"type": "http.response.start", "status": 200, "headers": []})
    while scope["path"] != "/readyz" and not gone.done():
        await send({"type": "http.response.body", "body": b"x" * (1 << 20), "more_body": True})
        await asyncio.sleep(0)  # a send to a gone client returns at once
    gone.cancel()
    await send({"type": "http.response.body", "body": b"ready"})


def test_a_client_that_stops_reading_is_cut_off_after_the_send_deadline():
    limits = ConnectionLimits(send_timeout_s=1.0)
    with running(_endless, limits) as base:
        wait_ready(base)
        port = int(base.rsplit(":", 1)[1])

        async def scenario() -> int:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await reader.readexactly(1)  # the reply started
            await asyncio.sleep(limits.send_timeout_s + SLACK_S)  # the attack: reading nothing
            received = 1
            try:
                while received < 256 << 20 and (chunk := await reader.read(1 << 20)):
                    received += len(chunk)
            except ConnectionResetError:
                pass
            writer.close()
            return received

        received = asyncio.run(scenario())
        assert received < 64 << 20  # what the buffers held, then the server let go


def test_a_pipelined_request_is_not_read_and_the_connection_closes_after_the_reply(
        smoke_expert_checkpoint: Path):
    with running(create_model_app(smoke_expert_checkpoint, ServingOptions(max_batch=8)),
                 LIMITS) as base:
        wait_ready(base)
        port = int(base.rsplit(":", 1)[1])

        async def scenario() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 2)
            return await asyncio.wait_for(reader.read(-1), LIMITS.keep_alive_s / 2)

        answered = asyncio.run(scenario())
        assert answered.count(b"HTTP/1.1 200") == 1
        assert b"connection: close" in answered


def test_a_reply_before_the_body_is_in_says_close_and_closes(smoke_expert_checkpoint: Path):
    """A body declared over the limit gets its 413 at once, marked ``connection: close``, so
    that a client does not send its next request on a connection about to close."""
    with running(create_model_app(smoke_expert_checkpoint, ServingOptions(max_batch=8)),
                 LIMITS) as base:
        wait_ready(base)
        port = int(base.rsplit(":", 1)[1])

        async def scenario() -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/velocity HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Length: 1000000000\r\n\r\n" + b"x" * 1000)
            return await asyncio.wait_for(reader.read(-1), LIMITS.body_timeout_s / 2)

        answered = asyncio.run(scenario())
        assert answered.startswith(b"HTTP/1.1 413") and b"connection: close" in answered


# ------------------------------------------------- requests that would make replicas look broken

#: What a model server answers a state of 3e38, whoever sends it.
HUGE_X = "'x' has values beyond +-10000 (MAX_STATE_MAGNITUDE): magnitude 3e+38"
#: Attack requests sent in a row (issue 35 sent one a second for 30 s; the outcome of each is
#: what matters, not their rate).
ATTACKS = 12


def _npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


class _ReadinessPoller:
    """``GET /readyz`` again and again on a thread until stopped; every status seen, in order."""

    def __init__(self, base: str) -> None:
        self.base, self.statuses = base, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                self.statuses.append(client.get(f"{self.base}/readyz").status_code)

    def __enter__(self) -> _ReadinessPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


@pytest.mark.usefixtures("one_torch_thread")
def test_huge_latents_are_the_requests_4xx_and_never_take_the_router_out(tmp_path: Path):
    """Issue 35, item 1: latents of 3e38 made every expert answer infinities, the router mark
    its replicas down and answer 503, and ``/readyz`` go 503 for every client. Now the router
    refuses them (422 naming the field and the bound); latents at the bound pass it, grow past
    it in the first step and the expert refuses them, which is that request's 422 too; neither
    touches a replica's health: ``/readyz`` stays 200 throughout and a normal generation right
    after succeeds. An expert called directly refuses such a state itself."""
    huge = {"prompt": "a", "steps": 2, "latents": _npy(np.full((1, 4, 8, 8), 3e38, np.float32))}
    at_bound = {"prompt": "a", "steps": 2, "guidance_scale": 50.0,
                "latents": _npy(np.full((1, 4, 8, 8), -MAX_STATE_MAGNITUDE, np.float32))}
    with served_text_ddm(tmp_path) as (router, _):
        with _ReadinessPoller(router) as poller, httpx.Client(timeout=120) as client:
            answers = [client.post(f"{router}/v1/images/generations",
                                   json=huge if i % 2 == 0 else at_bound)
                       for i in range(ATTACKS)]
            normal = client.post(f"{router}/v1/images/generations",
                                 json={"prompt": "a", "steps": 2})
        assert [a.status_code for a in answers] == [422] * ATTACKS, [a.text for a in answers]
        for answer in answers[::2]:  # the router's own check (OpenAI's error shape)
            assert answer.json()["error"]["message"] == (
                "latents must lie within +-10000 (MAX_STATE_MAGNITUDE), got a value of "
                "magnitude 3e+38")
        for answer in answers[1::2]:  # an expert's 422, in the router's words
            assert "refused this request's values (422" in answer.json()["error"]["message"], \
                answer.text
        assert normal.status_code == 200, normal.text
        assert poller.statuses and set(poller.statuses) == {200}, poller.statuses
        experts = httpx.get(f"{router}/v1/info").json()["experts"]
        assert all(set(e["replicas"].values()) == {"ready"} for e in experts), experts
        print(f"\n{ATTACKS} attacks ({ATTACKS // 2} refused by the router, {ATTACKS // 2} by "
              f"an expert), all 422; /readyz polled {len(poller.statuses)} times meanwhile, "
              "every answer 200; a normal generation after them 200")

        expert = f"http://{next(iter(experts[0]['replicas']))}"
        status, message = _direct_call(expert, encode_request(VelocityRequest(
            7, np.full((1, 4, 8, 8), 3e38, np.float32), np.asarray([0.5], np.float32),
            bytes(32), np.zeros(1, np.int32), np.ones(1, np.float32))))
        assert (status, message) == (422, HUGE_X)


def _direct_call(base: str, body: bytes) -> tuple[int, str]:
    """POST ``body`` to a model server's ``/v1/velocity``; its status and error message."""
    reply = httpx.post(f"{base}/v1/velocity", content=body,
                       headers={"content-type": CONTENT_TYPE}, timeout=30)
    try:
        decode_response(reply.content, 7)
    except RemoteExpertError as error:
        return reply.status_code, error.message
    return reply.status_code, ""


def test_an_expert_refuses_a_huge_state_from_anyone_with_a_422_naming_the_bound(
        smoke_expert_checkpoint: Path):
    """A client talking to an expert directly is bounded as the router is (the wire's check of
    ``x``), and the expert serves on."""
    with running(create_model_app(smoke_expert_checkpoint, ServingOptions(max_batch=8)),
                 LIMITS) as base:
        wait_ready(base)
        x = np.full((1, 1, 8, 8), 3e38, np.float32)
        huge = velocity_call(7, x, np.asarray([0.5], np.float32), np.asarray([1]))
        assert httpx.post(f"{base}/v1/velocity", content=huge.context, timeout=30,
                          headers={"content-type": CONTENT_TYPE}).status_code == 200
        status, message = _direct_call(base, huge.call)
        assert (status, message) == (422, HUGE_X)
        assert httpx.get(f"{base}/readyz").status_code == 200
        assert _direct_call(base, _velocity_call().call) == (200, "")
