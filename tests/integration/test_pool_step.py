"""One request per pool per step (issue 37) over real HTTP on loopback, on a pool of a tiny
Paris DDM's two experts and its decoder: ``POST /v1/pool/velocity`` answers each member's rows
as its own route does, a member's calls of several contexts as one forward, a call's failure
stays that call's (412, 422, a decoder named as an expert) while the others answer, an
unknown member refuses the request naming it; the router's :class:`ExpertPool` sends the
experts' calls of one turn as one request, concurrent generations' included, re-sends a
context a member evicted within the same call, and sees a dead pool as every member missing;
hostile bodies get a 4xx or a reply, never a 5xx."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import httpx
import hypothesis
import numpy as np
import pytest

from ddm.conditioning import Conditioning
from ddm.deploy.router_config import StaticDiscovery
from ddm.serving.model.contexts import ENTRY_BYTES
from ddm.serving.model.options import ServingOptions
from ddm.serving.model.server import create_model_app
from ddm.runtime.local import REPOSITORY_ROOT
from ddm.serving.wire.protocol import (CONTENT_TYPE, Context, LabelContext, Limits,
                                       PoolVelocityRequest,
                                       UNKNOWN_CONTEXT, RemoteExpertError, VelocityRequest,
                                       context_id,
                                       decode_pool_response, decode_request, decode_response,
                                       encode_pool_request, encode_request)
from ddm.serving.router.fleet.pool import ExpertPool
from ddm.serving.router.fleet.servers import ExpertUnavailable, PoolSettings
from protocol_strategies import Target, request_bodies
from tests.integration.servers import running, wait_ready
from tests.integration.test_pool_server import batches
from tests.support.paris_release import TinyParis
from tests.support.text_router import paris_stages

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RNG = np.random.default_rng(0)
READY_S = 120.0
WIDTH, LATENT, TOKENS = TinyParis().text_width, (4, 8, 8), 5
ROUTE = "/v1/pool/velocity"
#: Hostile bodies sent to the pool's route.
HOSTILE = 1000


@pytest.fixture(scope="module")
def stages(tmp_path_factory) -> Path:
    return paris_stages(tmp_path_factory.mktemp("paris"))


def members(stages: Path) -> dict[str, Path]:
    return {"expert-0": stages / "expert_0", "expert-1": stages / "expert_1",
            "decoder": stages / "decoder"}


@pytest.fixture(scope="module")
def pool(stages) -> Iterator[str]:
    with running(create_model_app(members(stages), ServingOptions(max_batch=8))) as base:
        wait_ready(base)
        yield base


def post(base: str, path: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{base}{path}", content=body, headers={"content-type": CONTENT_TYPE},
                      timeout=READY_S)


def context(rows: int) -> bytes:
    embeddings = RNG.standard_normal((rows, TOKENS, WIDTH)).astype(np.float32)
    return encode_request(Context(1, embeddings, np.ones((rows, TOKENS), np.uint8),
                                       np.zeros_like(embeddings)))


def call(body: bytes, rows: int, guidance: float = 7.5) -> VelocityRequest:
    return VelocityRequest(9, RNG.standard_normal((rows, *LATENT)).astype(np.float32),
                               RNG.uniform(0, 1, rows).astype(np.float32), context_id(body),
                               np.arange(rows, dtype=np.int32) % 2,
                               np.full(rows, guidance, np.float32))


def pool_requests(base: str) -> dict[str, float]:
    """``ddm_pool_requests`` by status."""
    return {status: float(value) for status, value in re.findall(
        r'^ddm_pool_requests_total{kind="[^"]*",route="/v1/pool/velocity",status="(\d+)"} (\S+)$',
        httpx.get(f"{base}/metrics").text, re.M)}


def test_a_pool_request_answers_each_member_s_rows_as_its_own_route(pool):
    shared = context(2)
    for name in ("expert-0", "expert-1"):
        assert post(pool, f"/v1/members/{name}/velocity", shared).status_code == 200
    calls = (("expert-1", call(shared, 3)), ("expert-0", call(shared, 1, guidance=1.0)))
    request = PoolVelocityRequest(21, calls)
    reply = post(pool, ROUTE, encode_pool_request(request))
    assert reply.status_code == 200, reply.content
    outs = decode_pool_response(reply.content, request)
    for (name, part), out in zip(calls, outs):
        own = post(pool, f"/v1/members/{name}/velocity", encode_request(part))
        np.testing.assert_array_equal(out, decode_response(own.content, 9, part.x.shape))


def test_a_context_sent_to_one_expert_serves_every_expert_of_the_pool(pool):
    held = context(1)  # sent to expert-1 only: the pool's experts share one cache
    assert post(pool, "/v1/members/expert-1/velocity", held).status_code == 200
    request = PoolVelocityRequest(24, (("expert-0", call(held, 1)),))
    (out,) = decode_pool_response(post(pool, ROUTE, encode_pool_request(request)).content,
                                  request)
    assert not isinstance(out, RemoteExpertError) and np.isfinite(out).all()


def test_a_member_s_failure_is_its_own_and_the_others_answer(pool):
    held, never = context(1), context(1)  # the second sent to nobody
    assert post(pool, "/v1/members/expert-0/velocity", held).status_code == 200
    before = pool_requests(pool)
    request = PoolVelocityRequest(22, (("expert-0", call(held, 1)), ("expert-1", call(never, 1)),
                                       ("decoder", call(held, 1))))
    reply = post(pool, ROUTE, encode_pool_request(request))
    assert reply.status_code == 200
    rows, unknown, decoder = decode_pool_response(reply.content, request)
    assert rows.shape == (1, *LATENT) and np.isfinite(rows).all()
    assert isinstance(unknown, RemoteExpertError) and unknown.code == 412
    assert "member expert-1: unknown context" in unknown.message
    assert isinstance(decoder, RemoteExpertError) and decoder.code == 422
    assert "member decoder is a decoder" in decoder.message
    # Five guided rows run ten forward rows, over expert-0's max_batch of 8: its own 422.
    held_2 = context(2)
    post(pool, "/v1/members/expert-0/velocity", held_2)
    post(pool, "/v1/members/expert-1/velocity", held_2)
    request = PoolVelocityRequest(23, (("expert-0", call(held_2, 5)),
                                       ("expert-1", call(held_2, 2))))
    over, fine = decode_pool_response(post(pool, ROUTE, encode_pool_request(request)).content,
                                      request)
    assert isinstance(over, RemoteExpertError) and over.code == 422
    assert "run 10 forward rows; the limit is 8" in over.message
    assert fine.shape == (2, *LATENT)
    assert pool_requests(pool)["200"] == before.get("200", 0.0) + 2


def test_a_label_member_s_share_over_its_batch_limit_is_its_own_422():
    """A pool's limit on a request is the sum of its members' (16 here); one member's share of
    it over that member's own 8 is refused as its own route refuses it, not a 500."""
    digits = REPOSITORY_ROOT / "checkpoints" / "digits"
    experts = {name: digits / name for name in ("expert-0-4", "expert-5-9")}
    with running(create_model_app(experts, ServingOptions(max_batch=8))) as base:
        wait_ready(base)
        labels = encode_request(LabelContext(1, np.arange(5, dtype=np.int64)))
        assert post(base, "/v1/members/expert-0-4/velocity", labels).status_code == 200

        def velocity(rows: int) -> VelocityRequest:
            return VelocityRequest(7, np.zeros((rows, 1, 16, 16), np.float32),
                                   np.full(rows, 0.5, np.float32), context_id(labels),
                                   np.zeros(rows, np.int32), np.ones(rows, np.float32))

        request = PoolVelocityRequest(7, (("expert-0-4", velocity(9)),))
        reply = post(base, ROUTE, encode_pool_request(request))
        own = post(base, "/v1/members/expert-0-4/velocity", encode_request(velocity(9)))
        request_8 = PoolVelocityRequest(8, (("expert-0-4", velocity(8)),))
        (fine,) = decode_pool_response(
            post(base, ROUTE, encode_pool_request(request_8)).content, request_8)
        metrics = httpx.get(f"{base}/metrics").text
    assert reply.status_code == 200
    (over,) = decode_pool_response(reply.content, request)
    assert isinstance(over, RemoteExpertError) and over.code == 422
    assert over.message == "member expert-0-4: batch of 9 exceeds the limit of 8"
    assert own.status_code == 422 and b"batch of 9 exceeds the limit of 8" in own.content
    assert fine.shape == (8, 1, 16, 16)
    assert 'status="500"' not in metrics


def test_a_member_s_calls_of_two_contexts_run_as_one_forward_each_answered_as_alone(stages,
                                                                                    pool):
    # The member's batches dispatch when full (2 rows) and would otherwise wait a minute: the
    # two calls reach its batcher together, or the first would wait alone.
    first, second = context(1), context(1)
    expert = {"expert-0": members(stages)["expert-0"]}
    with running(create_model_app(expert, ServingOptions(max_batch=2,
                                                         max_delay_ms=60_000.0))) as base:
        wait_ready(base)
        for body in (first, second):
            assert post(base, "/v1/members/expert-0/velocity", body).status_code == 200
        calls = (("expert-0", call(first, 1, guidance=1.0)),
                 ("expert-0", call(second, 1, guidance=1.0)))
        request = PoolVelocityRequest(31, calls)
        reply = post(base, ROUTE, encode_pool_request(request))
        metrics = httpx.get(f"{base}/metrics").text
    assert reply.status_code == 200, reply.content
    assert batches(metrics, "expert-0") == (1, 2.0)
    outs = decode_pool_response(reply.content, request)
    assert not np.array_equal(outs[0], outs[1])
    # Each call alone (a batch of 1 on the module's pool) gives its rows, to float32's
    # rounding: the batch of 2 sums in another order.
    for body in (first, second):
        assert post(pool, "/v1/members/expert-0/velocity", body).status_code == 200
    for (name, part), out in zip(calls, outs):
        own = post(pool, f"/v1/members/{name}/velocity", encode_request(part))
        np.testing.assert_allclose(out, decode_response(own.content, 9, part.x.shape),
                                   atol=1e-5)


def test_a_call_s_unknown_context_fails_it_alone_and_the_member_s_other_call_answers(pool):
    held, unknown = context(1), context(1)  # the second is never sent
    assert post(pool, "/v1/members/expert-1/velocity", held).status_code == 200
    calls = (("expert-1", call(unknown, 1)), ("expert-1", call(held, 1)))
    request = PoolVelocityRequest(32, calls)
    reply = post(pool, ROUTE, encode_pool_request(request))
    assert reply.status_code == 200, reply.content
    missing, answered = decode_pool_response(reply.content, request)
    assert isinstance(missing, RemoteExpertError) and missing.code == UNKNOWN_CONTEXT
    assert "member expert-1: unknown context" in missing.message
    own = post(pool, "/v1/members/expert-1/velocity", encode_request(calls[1][1]))
    np.testing.assert_array_equal(answered, decode_response(own.content, 9, (1, *LATENT)))


def test_an_unknown_member_refuses_the_request_naming_it(pool):
    before = pool_requests(pool)
    body = encode_pool_request(PoolVelocityRequest(
        24, (("expert-0", call(context(1), 1)), ("expert-7", call(context(1), 1)))))
    reply = post(pool, ROUTE, body)
    assert reply.status_code == 404
    with pytest.raises(RemoteExpertError, match="unknown member 'expert-7'; this pool holds "
                                                "expert-0, expert-1, decoder"):
        decode_response(reply.content, 24)
    assert pool_requests(pool)["404"] == before.get("404", 0.0) + 1
    # A member's own kind sent to the pool's route: refused, naming where it goes.
    reply = post(pool, ROUTE, encode_request(call(context(1), 1)))
    assert reply.status_code == 422
    assert b"/v1/members/NAME/velocity" in reply.content


@pytest.mark.slow
def test_hostile_pool_bodies_get_a_4xx_or_a_reply_and_leave_the_pool_serving(pool):
    """Bodies built from pool requests sized for this pool, then mutated (the decoder's fuzz
    strategies): each is answered 200 with a pool response, or a 4xx error reply echoing its
    id; never a 5xx, and the pool still answers its members afterwards."""
    held = context(4)  # the rows well-formed calls name
    for name in ("expert-0", "expert-1"):
        assert post(pool, f"/v1/members/{name}/velocity", held).status_code == 200
    target = Target(image_shape=LATENT, labels=(), max_batch=16, max_steps=1,
                    pool_members=("expert-0", "expert-1", "expert-7"),  # one unknown
                    pool_contexts=(context_id(held),))
    answered: Counter[int] = Counter()  # the calls of 200 replies, by their own status
    statuses: Counter[int] = Counter()

    with httpx.Client(timeout=READY_S) as client:
        @hypothesis.settings(max_examples=HOSTILE, deadline=None, derandomize=True,
                             database=None, suppress_health_check=list(hypothesis.HealthCheck))
        @hypothesis.given(request_bodies(target, pool=True))
        def hostile(body: bytes) -> None:
            answer = client.post(f"{pool}{ROUTE}", content=body,
                                 headers={"content-type": CONTENT_TYPE})
            assert answer.status_code in (200, 400, 404, 413, 422), (answer.status_code,
                                                                     body[:80])
            assert answer.headers["content-type"] == CONTENT_TYPE
            if answer.status_code == 200:
                request = decode_request(body, Limits(image_shape=LATENT))
                assert isinstance(request, PoolVelocityRequest)
                for out in decode_pool_response(answer.content, request):
                    # A call's own failure too is the caller's mistake, never the pool's.
                    assert not isinstance(out, RemoteExpertError) or out.code < 500, out
                    answered[out.code if isinstance(out, RemoteExpertError) else 200] += 1
            else:
                with pytest.raises(RemoteExpertError) as refused:
                    decode_response(answer.content, int.from_bytes(body[8:16], "little")
                                    if len(body) >= 16 else 0)
                assert refused.value.code == answer.status_code
            statuses[answer.status_code] += 1

        hostile()
    assert statuses[200] and statuses[404] and statuses[400] and statuses[422], statuses
    # Calls reached the members' forwards, and their refusals: not only unknown contexts.
    assert answered[200] and answered[422] and answered[UNKNOWN_CONTEXT], answered
    assert httpx.get(f"{pool}/readyz").status_code == 200


def settings() -> PoolSettings:
    return PoolSettings(connect_s=2.0, attempt_s=30.0, deadline_s=READY_S, attempts=2,
                        health_interval_s=0.2)


async def probed(pool: ExpertPool, *experts: str) -> None:
    deadline = time.monotonic() + READY_S
    while any(pool.info(e) is None for e in experts):
        assert time.monotonic() < deadline, "the members were never probed ready"
        await asyncio.sleep(0.02)


def test_the_router_re_sends_a_context_a_member_evicted_within_the_call(stages):
    # Each member's budget is one context of one unguided row, and the pool's experts share
    # theirs: a third context evicts the first.
    one = TOKENS * WIDTH * 4 + ENTRY_BYTES
    with running(create_model_app({k: v for k, v in members(stages).items() if k != "decoder"},
                                  ServingOptions(max_batch=8, context_cache_bytes=one))) as base:
        wait_ready(base)
        discoveries = {e: StaticDiscovery((base.removeprefix("http://"),), f"expert-{k}")
                       for k, e in enumerate("ab")}
        x = RNG.standard_normal((1, *LATENT)).astype(np.float32)
        t = np.full(1, 0.5, np.float32)
        first, second, third = (Conditioning(embeddings=RNG.standard_normal(
            (1, TOKENS, WIDTH)).astype(np.float32)) for _ in range(3))

        async def scenario() -> list[list[np.ndarray]]:
            async with ExpertPool.discovered(discoveries, settings()) as router:
                await probed(router, "a", "b")
                outs = []
                for cond in (first, second, third, first):  # the last: evicted
                    outs.append(await asyncio.gather(router.velocity("a", x, t, cond),
                                                     router.velocity("b", x, t, cond)))
                return outs

        outs = asyncio.run(scenario())
        metrics = httpx.get(f"{base}/metrics").text
    for before, again in zip(outs[0], outs[3]):
        np.testing.assert_array_equal(before, again)
    assert not np.array_equal(outs[0][0], outs[0][1])  # two experts, two answers

    def count(pattern: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{pattern} (\S+)$", metrics, re.M))

    # Four steps, one request each, and one more for the last's re-sent contexts; each
    # context sent to the pool once, the evicted one again to each member that asked.
    assert count(r'ddm_pool_requests_total{kind="pool_velocity",route="[^"]+",'
                 r'status="200"}') == 5
    for member in ("expert-0", "expert-1"):
        assert count(rf'ddm_expert_requests_total{{kind="pool_velocity",'
                     rf'member="{member}",status="412"}}') == 1
    assert count(r'ddm_expert_requests_total{kind="context",member="[^"]+",'
                 r'status="200"}') == 3 + 2


def generations(count: int) -> list[Conditioning]:
    """``count`` generations' conditioning: one prompt each, so a context each."""
    return [Conditioning(embeddings=RNG.standard_normal((1, TOKENS, WIDTH)).astype(np.float32))
            for _ in range(count)]


def concurrently(base: str, experts: str, conds: list[Conditioning]
                 ) -> tuple[list[np.ndarray], dict[str, float], list[np.ndarray]]:
    """A router calls each of ``experts`` (``a`` is the pool's expert-0, ``b`` expert-1)
    with every one of ``conds`` at once, then each such call alone: the outputs of both, and
    the pool requests the first made, by status."""
    discoveries = {e: StaticDiscovery((base.removeprefix("http://"),), f"expert-{k}")
                   for k, e in enumerate(experts)}
    x = RNG.standard_normal((1, *LATENT)).astype(np.float32)
    t = np.full(1, 0.5, np.float32)

    async def scenario() -> tuple[list[np.ndarray], dict[str, float], list[np.ndarray]]:
        async with ExpertPool.discovered(discoveries, settings()) as router:
            await probed(router, *experts)
            before = pool_requests(base)
            together = await asyncio.gather(*(router.velocity(e, x, t, cond)
                                              for e in experts for cond in conds))
            after = pool_requests(base)
            alone = [await router.velocity(e, x, t, cond) for e in experts for cond in conds]
        return together, {s: n - before.get(s, 0.0) for s, n in after.items()
                          if n != before.get(s)}, alone

    return asyncio.run(scenario())


def test_concurrent_generations_calls_to_a_pool_make_one_request_per_step(pool):
    """Three generations (each its own context) call each of two members at once: one pool
    request carries all six calls, each answered as its own call alone (to float32's
    rounding: a member runs the three as one batch)."""
    together, requests, alone = concurrently(pool, "ab", generations(3))
    assert requests == {"200": 1.0}
    for out, own in zip(together, alone):
        np.testing.assert_allclose(out, own, atol=1e-5)


def test_a_member_s_rows_past_its_max_batch_go_in_the_turn_s_next_request(stages):
    app = create_model_app({"expert-0": stages / "expert_0"}, ServingOptions(max_batch=2))
    with running(app) as base:
        wait_ready(base)
        together, requests, alone = concurrently(base, "a", generations(3))
    assert requests == {"200": 2.0}  # two rows, then the third
    for out, own in zip(together, alone):
        np.testing.assert_allclose(out, own, atol=1e-5)


def test_a_dead_pool_is_every_member_missing(stages):
    app = create_model_app({"expert-0": stages / "expert_0", "expert-1": stages / "expert_1"},
                           ServingOptions(max_batch=8))
    cond = Conditioning(embeddings=np.ones((1, TOKENS, WIDTH), np.float32))
    x, t = np.zeros((1, *LATENT), np.float32), np.full(1, 0.5, np.float32)

    async def scenario(base: str, stop: Callable[[], None]
                       ) -> tuple[list[BaseException], list[bool]]:
        discoveries = {e: StaticDiscovery((base.removeprefix("http://"),), f"expert-{k}")
                       for k, e in enumerate("ab")}
        quick = PoolSettings(connect_s=2.0, attempt_s=5.0, deadline_s=1.0, attempts=2,
                             health_interval_s=0.2)
        async with ExpertPool.discovered(discoveries, quick) as router:
            await probed(router, "a", "b")
            await asyncio.gather(router.velocity("a", x, t, cond),
                                 router.velocity("b", x, t, cond))
            await asyncio.to_thread(stop)
            failures = await asyncio.gather(router.velocity("a", x, t, cond),
                                            router.velocity("b", x, t, cond),
                                            return_exceptions=True)
            return failures, [router.usable(e) for e in "ab"]

    with contextlib.ExitStack() as server:
        base = server.enter_context(running(app))
        wait_ready(base)
        failures, usable = asyncio.run(scenario(base, server.close))
    assert usable == [False, False]
    for expert, failure in zip("ab", failures):
        assert isinstance(failure, ExpertUnavailable) and failure.expert == expert, failure
