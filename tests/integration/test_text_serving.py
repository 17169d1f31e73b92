"""A text DDM's stages served over real HTTP on loopback (``ddm serve expert`` / ``ddm serve
stage``), with tiny real models: a text expert answers guided velocities equal to its network's
own conditional and unconditional outputs combined; a generation's context crosses once and a
miss (eviction, restart) is recovered without the caller noticing; replies travel in float16
or bfloat16 where the expert runs in it; bad bodies get a 4xx naming the problem; the text
encoder, decoder and router network answer over the wire what they answer in process."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest

from ddm.conditioning import Conditioning
from ddm.deploy.limits import MAX_CONTEXT_ROWS
from ddm.models.ddm import load_ddm
from ddm.models.stages import load_stage
from ddm.models.text_prior import pooled_text
from ddm import termination
from ddm.serving.http.server import build_server
from ddm.serving.model.contexts import ENTRY_BYTES
from ddm.serving.model.server import create_model_app
from ddm.serving.model.options import ServingOptions
from ddm.serving.wire.protocol import (CONTENT_TYPE, Context, IntegrateRequest, RemoteExpertError,
                                       RouteRequest, Solver, VelocityRequest, context_id,
                                       decode_response, encode_request)
from ddm.serving.router.fleet.pool import ExpertPool
from ddm.serving.router.fleet.servers import PoolSettings
from ddm.serving.router.fleet.replicas import ExpertInfo, static_endpoints
from ddm.serving.router.fleet.stage_clients import LocalStages, StagePool
from tests.integration.servers import running, wait_ready
from tests.support.label_wire import label_context
from tests.support.text_stages import LATENT_SHAPE, hand_prior, with_prior, write_text_ddm

FAST = PoolSettings(connect_s=1.0, attempt_s=10.0, deadline_s=20.0, attempts=2, backoff_s=0.05,
                    max_backoff_s=0.2, health_interval_s=0.5, refresh_s=0.1)
PROMPTS = ["a red car", "a blue cat on the beach", "a photo"]
GUIDANCE = np.array([7.5, 1.0, 3.0], np.float32)
RNG = np.random.default_rng(0)
X = RNG.standard_normal((3, *LATENT_SHAPE)).astype(np.float32)
T = np.array([0.1, 0.5, 0.9], np.float32)
GRID = np.linspace(0.0, 0.5, 4, dtype=np.float32)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return write_text_ddm(tmp_path_factory.mktemp("text") / "ddm")


@pytest.fixture(scope="module")
def encoder(root):
    return load_stage(root / "text_encoder")


@pytest.fixture(scope="module")
def cond(encoder) -> Conditioning:
    """The prompts' rows guided per GUIDANCE against the empty prompt's embeddings."""
    empty = encoder.forward([""] * len(PROMPTS))
    return encoder.forward(PROMPTS).with_guidance(GUIDANCE, empty)


@pytest.fixture(scope="module")
def expert(root) -> Iterator[str]:
    with running(create_model_app(root / "expert_0", ServingOptions(max_batch=8))) as base:
        wait_ready(base)
        yield base


def expected_guided(stage, x, t, cond: Conditioning) -> np.ndarray:
    """CFG written out: the network's conditional and unconditional outputs, u + s (c - u)."""
    c = stage.forward(x, t, cond.unguided())
    u = stage.forward(x, t, cond.negative)
    scale = cond.guidance.reshape(-1, 1, 1, 1)
    return np.where(scale != 1.0, u + scale * (c - u), c)


def with_pool(endpoint: str, work, cls=ExpertPool, name: str = "e"):
    async def scenario():
        async with cls({name: static_endpoints([endpoint])}, FAST) as pool:
            return await work(pool)

    return asyncio.run(scenario())


def endpoint_of(base: str) -> str:
    return base.removeprefix("http://")


def test_a_served_text_expert_answers_guided_velocities_equal_to_its_network(root, expert,
                                                                              cond):
    v = with_pool(endpoint_of(expert), lambda pool: pool.velocity("e", X, T, cond))
    stage = load_stage(root / "expert_0")
    expected = expected_guided(stage, X, T, cond)
    np.testing.assert_allclose(v, expected, atol=1e-5)
    # Guidance matters: the unguided velocity differs on the guided rows only.
    plain = stage.forward(X, T, cond.unguided())
    assert np.abs(v[0] - plain[0]).max() > 1e-3 and np.abs(v[2] - plain[2]).max() > 1e-3
    np.testing.assert_allclose(v[1], plain[1], atol=1e-5)


def integrated_guided(stage, x, cond: Conditioning, grid: np.ndarray) -> np.ndarray:
    """Euler over ``grid`` with the guided velocity written out."""
    for a, b in zip(grid, grid[1:]):
        x = x + (b - a) * expected_guided(stage, x, np.full(len(x), a, np.float32), cond)
    return x


def test_integrate_runs_the_guided_velocity_over_the_grid(root, expert, cond):
    out = with_pool(endpoint_of(expert),
                    lambda pool: pool.integrate("e", X, cond, GRID, "euler"))
    stage = load_stage(root / "expert_0")
    np.testing.assert_allclose(out, integrated_guided(stage, X.copy(), cond, GRID), atol=1e-4)


def test_the_context_crosses_once_per_generation_and_steps_carry_only_the_latent(expert,
                                                                                  cond):
    steps = 10
    # Routing sends any subset of the rows at each step, and guidance is cut off after half
    # the steps (rows unguided, their negative dropped): every call names the first context.
    subsets = [[0, 1, 2] if i % 2 == 0 else [2, 0] for i in range(steps)]

    async def generation(pool: ExpertPool):
        for i, rows in enumerate(subsets):
            step = cond if i < steps // 2 else cond.with_guidance(1.0)
            await pool.velocity("e", X[rows], T[rows], step.take(rows))
        return dict(pool.bytes_sent), pool.replicas("e")[0].contexts

    sent, held = with_pool(endpoint_of(expert), generation)
    assert sent["context"] == context_size(cond) and len(held) == 1
    latents = sum(X[rows].nbytes for rows in subsets)
    # A step's body is its latent plus t, rows, guidance (12 bytes a row) and ~130 of header.
    assert latents < sent["call"] < latents + sum(12 * len(r) + 160 for r in subsets)


class Restartable:
    """An expert on a fixed loopback port that can stop and start again there (a replica's
    restart: same address, empty context cache)."""

    def __init__(self, directory: Path, **options) -> None:
        self.directory, self.options = directory, options
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self.endpoint = f"127.0.0.1:{self.port}"

    def start(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.server = build_server(create_model_app(self.directory,
                                                    ServingOptions(max_batch=8, **self.options)),
                                   "127.0.0.1", self.port, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        wait_ready(f"http://{self.endpoint}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()


def context_size(cond: Conditioning) -> int:
    return len(encode_request(Context(0, cond.embeddings, cond.mask.astype(np.uint8),
                                           cond.negative.embeddings)))


def test_a_context_evicted_by_another_is_sent_again_transparently(root, cond, encoder):
    other = encoder.forward(["a green bird", "a red bird", "a cat at sunset"]).with_guidance(
        GUIDANCE, cond.negative)
    # Its embeddings and negative rows, float32, and what holding it costs besides.
    one_context = cond.embeddings.nbytes * 2 + ENTRY_BYTES
    replica = Restartable(root / "expert_0", context_cache_bytes=one_context)
    replica.start()
    try:
        async def alternate(pool: ExpertPool):
            outs = [await pool.velocity("e", X, T, c) for c in (cond, other, cond)]
            return outs, pool.bytes_sent["context"]

        (first, second, third), context_sent = with_pool(replica.endpoint, alternate)
    finally:
        replica.stop()
    np.testing.assert_allclose(third, first)
    np.testing.assert_allclose(second, expected_guided(load_stage(root / "expert_0"), X, T,
                                                       other), atol=1e-5)
    # Each context evicted the other, so the third call's was sent again after a miss.
    assert context_sent == 2 * context_size(cond) + context_size(other)


def test_the_routers_context_store_keeps_its_configured_bytes(expert, cond, encoder):
    other = encoder.forward(["a green bird", "a red bird", "a cat at sunset"]).with_guidance(
        GUIDANCE, cond.negative)
    one_context = context_size(cond)
    assert context_size(other) == one_context

    async def two_generations(pool: ExpertPool):
        held = []
        for c in (cond, other):
            await pool.velocity("e", X, T, c)
            held.append(pool.context_bytes)
        return held

    async def scenario(settings: PoolSettings):
        async with ExpertPool({"e": static_endpoints([endpoint_of(expert)])}, settings) as pool:
            return await two_generations(pool)

    small = dataclasses.replace(FAST, context_cache_bytes=one_context)
    assert asyncio.run(scenario(small)) == [one_context, one_context]  # the first dropped
    assert asyncio.run(scenario(FAST)) == [one_context, 2 * one_context]  # 256 MiB: both


def test_contexts_stop_growing_at_the_rows_an_expert_takes(expert, cond):
    # A long-lived router: every request shares one prompt (a page's default) with the last,
    # so each call's context is the last one plus a row. Past MAX_CONTEXT_ROWS rows an expert
    # refuses a context (422): the pool must start a new one rather than fail the request.
    width = cond.embeddings.shape[2]
    rows = np.random.default_rng(1).standard_normal((MAX_CONTEXT_ROWS + 2, 1, width))
    shared = rows[0]

    async def requests(pool: ExpertPool):
        answered = 0
        for distinct in rows[1:]:
            step = Conditioning(embeddings=np.stack([shared, distinct]).astype(np.float32))
            answered += len(await pool.velocity("e", X[:2], T[:2], step))
        return answered

    assert with_pool(endpoint_of(expert), requests) == 2 * (MAX_CONTEXT_ROWS + 1)


def test_a_call_of_more_rows_than_a_context_holds_goes_as_several(root, expert, cond):
    # A router whose max_batch of prompts is past what one context holds (MAX_CONTEXT_ROWS
    # rows here; 141 guided rows of Paris's 77 x 768 by bytes): one context would be refused,
    # so the rows go in contexts that fit, and the answer is the rows' in order.
    rows = MAX_CONTEXT_ROWS + 3
    index = np.arange(rows) % len(PROMPTS)
    many = Conditioning(embeddings=RNG.standard_normal(
        (rows, *cond.embeddings.shape[1:])).astype(np.float32)).with_guidance(
        GUIDANCE[index], cond.negative.take(index))
    x = np.repeat(X, -(-rows // len(X)), axis=0)[:rows]
    t = np.repeat(T, -(-rows // len(T)), axis=0)[:rows]

    async def call(pool: ExpertPool):
        return await pool.velocity("e", x, t, many), pool.replicas("e")[0].contexts

    v, held = with_pool(endpoint_of(expert), call)
    assert len(held) == 2  # MAX_CONTEXT_ROWS rows, then 3
    expected = expected_guided(load_stage(root / "expert_0"), x, t, many)
    np.testing.assert_allclose(v, expected, atol=1e-5)


def test_a_restarted_replicas_miss_is_recovered_transparently(root, cond):
    replica = Restartable(root / "expert_0")
    replica.start()

    async def across_a_restart(pool: ExpertPool):
        before = await pool.velocity("e", X, T, cond)
        await asyncio.to_thread(replica.restart)
        after = await pool.velocity("e", X, T, cond)
        return before, after, pool.bytes_sent["context"]

    try:
        before, after, context_sent = with_pool(replica.endpoint, across_a_restart)
    finally:
        replica.stop()
    np.testing.assert_allclose(after, before, atol=1e-6)
    assert context_sent == 2 * context_size(cond)  # once, then again after its miss


@pytest.mark.parametrize("precision, code, tolerance", [("bfloat16", 6, 0.05),
                                                       ("float16", 2, 0.01)])
def test_replies_travel_in_the_dtype_the_expert_runs_in(root, cond, precision, code,
                                                       tolerance):
    stage = load_stage(root / "expert_0", dtype=precision)
    with running(create_model_app(root / "expert_0",
                                  ServingOptions(max_batch=8, precision=precision))) as base:
        wait_ready(base)
        info = httpx.get(f"{base}/v1/info").json()
        v = with_pool(endpoint_of(base), lambda pool: pool.velocity("e", X, T, cond))
        context = encode_request(Context(1, cond.embeddings, cond.mask.astype(np.uint8),
                                              cond.negative.embeddings))
        assert post(base, context).status_code == 200
        reply = post(base, encode_request(VelocityRequest(
            2, X, T, context_id(context), np.arange(3, dtype=np.int32), GUIDANCE)))
        integrated = post(base, encode_request(IntegrateRequest(
            3, X, context_id(context), np.arange(3, dtype=np.int32), GUIDANCE, GRID,
            Solver.EULER)))
        end = with_pool(endpoint_of(base),
                        lambda pool: pool.integrate("e", X, cond, GRID, "euler"))
    assert (info["wire_dtype"], info["precision"]) == (precision, precision)
    for answer in (reply, integrated):  # a velocity and an integrated state alike
        assert answer.status_code == 200 and answer.content[18 + 1] == code  # out's dtype
        assert len(answer.content) == 40 + X.size * 2  # half a float32 reply
    expected = expected_guided(stage, X, T, cond)
    assert v.dtype == np.float32 and end.dtype == np.float32
    assert np.abs(v - expected).max() <= tolerance * np.abs(expected).max()
    state = integrated_guided(stage, X, cond, GRID)
    assert np.abs(end - state).max() <= tolerance * np.abs(state).max()


def post(base: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{base}/v1/velocity", content=body,
                      headers={"content-type": CONTENT_TYPE})


def error_of(reply: httpx.Response) -> str:
    with pytest.raises(RemoteExpertError) as info:
        decode_response(reply.content, 0 if reply.content[8:16] == bytes(8) else
                        int.from_bytes(reply.content[8:16], "little"))
    assert info.value.code == reply.status_code
    return info.value.message


def test_bad_bodies_get_a_4xx_naming_the_problem(expert, cond):
    context = encode_request(Context(1, cond.embeddings, cond.mask.astype(np.uint8),
                                          cond.negative.embeddings))
    unguidable = encode_request(Context(1, cond.embeddings, cond.mask.astype(np.uint8),
                                             np.zeros((0, 12, 16), np.float32)))
    for body in (context, unguidable):
        assert post(expert, body).status_code == 200

    def velocity(identity: bytes, rows=(0, 1, 2), guidance=GUIDANCE) -> bytes:
        return encode_request(VelocityRequest(
            5, X, T, identity, np.array(rows, np.int32), np.asarray(guidance, np.float32)))

    cases = [
        (velocity(bytes(32)), 412, "unknown context 0000000000000000: send it, then retry"),
        (velocity(context_id(context), rows=(0, 1, 3)), 422,
         "'rows' name row 3 of a context of 3"),
        (velocity(context_id(unguidable)), 422, "guided rows need the context's negative rows"),
        (encode_request(Context(1, np.zeros((1, 12, 8), np.float32),
                                     np.ones((1, 12), np.uint8), np.zeros((0, 12, 8)))), 422,
         "'embeddings' are 8 wide; this stage takes 16"),
        (label_context(5, np.zeros(3, np.int64))[0], 422,
         "this expert stage takes VelocityRequest, IntegrateRequest, Context, not "
         "LabelContext"),
        (velocity(context_id(context), guidance=(60.0, 1.0, 1.0)), 422,
         r"'guidance' must be finite and in \[0, 50.0\]"),
    ]
    for body, status, message in cases:
        reply = post(expert, body)
        assert reply.status_code == status, reply.content
        assert re.search(message, error_of(reply)), error_of(reply)


def test_five_guided_rows_of_a_batch_of_eight_are_refused_by_their_forward_rows(expert, cond):
    context = encode_request(Context(1, cond.embeddings, cond.mask.astype(np.uint8),
                                          cond.negative.embeddings))
    post(expert, context)
    x = np.zeros((5, *LATENT_SHAPE), np.float32)
    reply = post(expert, encode_request(VelocityRequest(
        6, x, np.zeros(5, np.float32), context_id(context), np.zeros(5, np.int32),
        np.full(5, 2.0, np.float32))))
    assert reply.status_code == 422
    assert "5 rows, 5 of them guided, run 10 forward rows; the limit is 8" in error_of(reply)


def test_a_text_experts_info_is_what_the_router_reads(expert):
    raw = httpx.get(f"{expert}/v1/info").json()
    assert (raw["role"], raw["family"], raw["conditioning"], raw["text_width"],
            raw["latent_shape"], raw["wire_dtype"], raw["network_convention"],
            raw["cluster"]) == ("expert", "pixart", "text", 16, [4, 8, 8], "float32", "ours", 0)
    info = ExpertInfo.from_json(raw)
    assert (info.conditioning, info.text_width, info.image_shape, info.rows_per_call) == (
        "text", 16, (4, 8, 8), 4)


@pytest.fixture(scope="module")
def stages(root) -> Iterator[dict[str, str]]:
    with running(create_model_app(root / "text_encoder", ServingOptions(max_batch=4))) as encoder, \
            running(create_model_app(root / "decoder", ServingOptions(max_batch=2))) as decoder, \
            running(create_model_app(root / "router", ServingOptions(max_batch=8))) as router:
        for base in (encoder, decoder, router):
            wait_ready(base)
        yield {"text_encoder": endpoint_of(encoder), "decoder": endpoint_of(decoder),
               "router": endpoint_of(router)}


def test_stages_answer_over_the_wire_what_they_answer_in_process(root, stages):
    prompts = [*PROMPTS, "a red car " * 6, "a photo"]  # 5 prompts: two encode calls of <= 4

    async def calls():
        async with StagePool({role: static_endpoints([e]) for role, e in stages.items()},
                             FAST) as pool:
            return await pool.encode(prompts), await pool.decode(X), await pool.route(X, T, None)

    encoded, images, probabilities = asyncio.run(calls())
    encoder = load_stage(root / "text_encoder")
    expected = encoder.forward(prompts)
    np.testing.assert_allclose(encoded.cond.embeddings, expected.embeddings, atol=1e-6)
    np.testing.assert_array_equal(encoded.cond.mask, expected.mask)
    assert encoded.tokens_cut.tolist() == [0, 0, 0, 8, 0]  # 18 words + 2 special tokens, 12 kept
    np.testing.assert_allclose(images, load_stage(root / "decoder").forward(X), atol=1e-5)
    assert images.shape == (3, 3, 32, 32)  # three latents: two decode calls of <= 2
    np.testing.assert_allclose(probabilities, load_stage(root / "router").forward(X, T),
                               atol=1e-6)


def test_a_stage_refuses_what_another_role_serves(stages):
    reply = post(f"http://{stages['decoder']}",
                 encode_request(RouteRequest(3, X[:2], T[:2],
                                                     np.zeros((2, 0), np.float32))))
    assert reply.status_code == 422
    assert "this decoder stage takes DecodeRequest, not RouteRequest" in error_of(reply)
    info = httpx.get(f"http://{stages['decoder']}/v1/info").json()
    assert (info["role"], info["serves"], info["image_shape"]) == ("decoder", "decode",
                                                                   [3, 32, 32])


@pytest.mark.parametrize("command, directory, message", [
    ("stage", "expert_0", "is a stage of role expert; this command serves text_encoder or "
                          "decoder or router"),
    ("expert", "decoder", "is a stage of role decoder; this command serves expert"),
])
def test_serving_a_stage_under_the_wrong_command_exits_1_naming_it(root, tmp_path, command,
                                                                   directory, message):
    done = subprocess.run(
        [sys.executable, "-m", "ddm", "serve", command, "--checkpoint", str(root / directory),
         "--port", "0"], capture_output=True, text=True, timeout=120,
        env={**os.environ, termination.ENV: str(tmp_path / "termination")})
    assert done.returncode == 1, done.stderr
    assert message in done.stderr
    assert message in (tmp_path / "termination").read_text()


def test_a_text_expert_failing_a_structural_check_exits_1_naming_it(root, tmp_path):
    """As a label expert's server does: ``ddm expert check``'s structural checks (here, its
    velocities are NaN) run before the expert warms up, and the reason is the termination
    message."""
    from safetensors.numpy import load_file, save_file

    broken = tmp_path / "expert_0"
    shutil.copytree(root / "expert_0", broken)
    (weights,) = broken.glob("*.safetensors")
    tensors = {name: np.full_like(value, np.nan) if value.dtype.kind == "f" else value
               for name, value in load_file(weights).items()}
    save_file(tensors, weights)
    config = json.loads((broken / "config.json").read_text())
    if "weights_sha256" in config["_ddm"]:
        config["_ddm"]["weights_sha256"] = hashlib.sha256(weights.read_bytes()).hexdigest()
        (broken / "config.json").write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, "-m", "ddm", "serve", "expert", "--checkpoint", str(broken),
         "--port", "0"], capture_output=True, text=True, timeout=120,
        env={**os.environ, termination.ENV: str(tmp_path / "termination")})
    assert done.returncode == 1, done.stderr
    message = (tmp_path / "termination").read_text()
    assert "expert stage expert_0 failed ddm expert check: FAIL finite: " in message, message


def test_stages_in_the_routers_process_answer_the_same_calls(root):
    encoder, decoder, router = (load_stage(root / name)
                                for name in ("text_encoder", "decoder", "router"))
    local = LocalStages(encoder, decoder, router)

    async def calls():
        return await asyncio.gather(local.encode(["a red car " * 6]), local.decode(X[:1]),
                                    local.route(X, T, None))

    encoded, images, probabilities = asyncio.run(calls())
    assert encoded.tokens_cut.tolist() == [8]
    np.testing.assert_array_equal(encoded.cond.embeddings,
                                  encoder.forward(["a red car " * 6]).embeddings)
    np.testing.assert_array_equal(images, decoder.forward(X[:1]))
    np.testing.assert_array_equal(probabilities, router.forward(X, T))
    with pytest.raises(ValueError, match="this router has no decoder stage"):
        asyncio.run(LocalStages(encoder).decode(X))


def test_a_cancelled_call_keeps_its_stage_until_its_thread_is_done(root):
    # A client that leaves cancels its generation, not the model call running in a worker
    # thread: the next call must not run the same stage beside it.
    encoder = load_stage(root / "text_encoder")
    first_inside, release, second_inside = (threading.Event() for _ in range(3))
    inside, most = [0], [0]

    def forward(prompts):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        try:
            if prompts == ["first"]:
                first_inside.set()
                release.wait(timeout=30)
            else:
                second_inside.set()
            return encoder.forward(prompts)
        finally:
            inside[0] -= 1

    local = LocalStages(dataclasses.replace(encoder, forward=forward))

    async def cancel_then_call():
        first = asyncio.ensure_future(local.encode(["first"]))
        await asyncio.to_thread(first_inside.wait, 30)
        first.cancel()
        second = asyncio.ensure_future(local.encode(["second"]))
        # The second call's thread enters the stage at once unless it waits for the first.
        entered_early = await asyncio.to_thread(second_inside.wait, 1.0)
        release.set()
        return entered_early, await second

    entered_early, encoded = asyncio.run(cancel_then_call())
    assert not entered_early and most[0] == 1
    np.testing.assert_array_equal(encoded.cond.embeddings,
                                  encoder.forward(["second"]).embeddings)


def test_a_served_router_weighs_in_its_text_prior_as_the_ddm_does_in_process(tmp_path):
    root = with_prior(write_text_ddm(tmp_path / "ddm"), hand_prior())
    ddm = load_ddm(root)
    cond = ddm.encode(["a red car", "", "a photo"])
    in_process = ddm.router(X, T, cond)
    router = load_stage(root / "router")
    with running(create_model_app(root / "router", ServingOptions(max_batch=2))) as base:
        wait_ready(base)

        async def served():
            async with StagePool({"router": static_endpoints([endpoint_of(base)])},
                                 FAST) as pool:
                return (await pool.route(X, T, pooled_text(cond)),
                        await pool.route(X, T, None))

        with_text, without = asyncio.run(served())
        wrong = post(base, encode_request(RouteRequest(
            4, X[:1], T[:1], np.ones((1, 3), np.float32))))
    local = asyncio.run(LocalStages(router=router).route(X, T, pooled_text(cond)))
    np.testing.assert_allclose(with_text, in_process, atol=1e-6)  # two route calls of <= 2
    np.testing.assert_array_equal(local, in_process)
    np.testing.assert_allclose(without, router.forward(X, T), atol=1e-6)
    assert not np.allclose(in_process, router.forward(X, T))  # the prompts moved it
    np.testing.assert_allclose(in_process[1], router.forward(X, T)[1], atol=1e-6)  # ""
    assert wrong.status_code == 422
    assert "'pooled' is 3 wide; this router's text prior takes 16" in error_of(wrong)
