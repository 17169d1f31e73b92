"""A text DDM's stages served over real HTTP on loopback (``ddm serve expert`` / ``ddm serve
stage``), with tiny real models: a text expert answers guided velocities equal to its network's
own conditional and unconditional outputs combined; a generation's context crosses once and a
miss (eviction, restart) is recovered without the caller noticing; replies travel in float16
or bfloat16 where the expert runs in it; bad bodies get a 4xx naming the problem; the text
encoder, decoder and router network answer over the wire what they answer in process."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from ddm.conditioning import Conditioning
from ddm.models.stages import load_stage
from ddm.serving.expert.server import create_expert_app
from ddm.serving.http import build_server
from ddm.serving.protocol import (Context, encode_text_request)
from ddm.serving.router.pool import ExpertPool, PoolSettings
from ddm.serving.router.replicas import static_endpoints
from tests.integration.servers import running, wait_ready
from tests.support.text_stages import LATENT_SHAPE, write_text_ddm

FAST = PoolSettings(connect_s=1.0, attempt_s=10.0, deadline_s=20.0, attempts=2, backoff_s=0.05,
                    max_backoff_s=0.2, health_interval_s=0.5, refresh_s=0.1)
PROMPTS = ["a red car", "a blue cat on the beach", "a photo"]
GUIDANCE = np.array([7.5, 1.0, 3.0], np.float32)
RNG = np.random.default_rng(0)
X = RNG.standard_normal((3, *LATENT_SHAPE)).astype(np.float32)
T = np.array([0.1, 0.5, 0.9], np.float32)


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
    with running(create_expert_app(root / "expert_0", max_batch=8)) as base:
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


def test_integrate_runs_the_guided_velocity_over_the_grid(root, expert, cond):
    grid = np.linspace(0.0, 0.5, 4, dtype=np.float32)
    out = with_pool(endpoint_of(expert),
                    lambda pool: pool.integrate("e", X, cond, grid, "euler"))
    stage, x = load_stage(root / "expert_0"), X.copy()
    for a, b in zip(grid, grid[1:]):
        x = x + (b - a) * expected_guided(stage, x, np.full(3, a, np.float32), cond)
    np.testing.assert_allclose(out, x, atol=1e-4)


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
        self.server = build_server(create_expert_app(self.directory, max_batch=8,
                                                     **self.options),
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
    return len(encode_text_request(Context(0, cond.embeddings, cond.mask.astype(np.uint8),
                                           cond.negative.embeddings)))


def test_a_context_evicted_by_another_is_sent_again_transparently(root, cond, encoder):
    other = encoder.forward(["a green bird", "a red bird", "a cat at sunset"]).with_guidance(
        GUIDANCE, cond.negative)
    one_context = cond.embeddings.nbytes * 2  # its embeddings and negative rows, float32
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
