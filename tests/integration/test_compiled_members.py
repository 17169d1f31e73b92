"""``--compile`` on the CPU (inductor; issue 37's GPU path, tested where there is no GPU): a
pool of a tiny text DDM's pixart expert, latent-router network and text encoder compiled in
``default`` mode answers, over real HTTP on loopback, the velocities and routing
probabilities of the same pool run eagerly within 1e-4 (float32; compiled kernels reorder
sums), for a batch padded to its bucket; its ``/v1/info`` says which members run compiled
(the text encoder stays eager). Our label UNet, served compiled, gives its eager velocities
too, and a compiled group of two Paris experts (``--grouped-forward on``) each expert's.

Compiling is slow on a shared CPU (about a minute per network and batch-size family), so
the servers take ``max_batch`` 4: buckets 1, 2 and 4, two compiles per network (one row, then
the batch made dynamic)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest

from ddm.checkpoints.declared import PLAN_NAMES, ROUTER, TEXT_ENCODER
from ddm.checkpoints.format import load_checkpoint
from ddm.models.loading import expert_image_shape, expert_velocity
from ddm.serving.model.compiled import WARM_TEXT_TOKENS
from ddm.serving.model.options import ServingOptions
from ddm.serving.model.server import create_model_app
from ddm.serving.wire.paths import POOL_VELOCITY_PATH
from ddm.serving.wire.protocol import (CONTENT_TYPE, Context, PoolVelocityRequest,
                                       RouteRequest, VelocityRequest, context_id,
                                       decode_pool_response, decode_probabilities,
                                       decode_response, encode_pool_request, encode_request)
from tests.integration.servers import running, wait_ready
from tests.support.label_wire import LabelVelocity, post_call
from tests.support.text_router import paris_stages
from tests.support.text_stages import write_text_ddm

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

MAX_BATCH = 4
#: How long a compiled pool may take to become ready on a shared, loaded CPU.
COMPILE_DEADLINE_S = 1800.0
#: Compiled against eager, float32: the largest difference allowed.
TOLERANCE = 1e-4
#: The same in bfloat16 (8 bits of mantissa; outputs of about 1).
BFLOAT16_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def members(tmp_path_factory) -> dict[str, Path]:
    root = write_text_ddm(tmp_path_factory.mktemp("text2img"), experts=2)
    return {"expert-0": root / "expert_0", PLAN_NAMES[ROUTER]: root / "router",
            PLAN_NAMES[TEXT_ENCODER]: root / "text_encoder"}


@pytest.fixture(scope="module")
def pools(members) -> Iterator[dict[str, str]]:
    """``none`` and ``default``: the base URL of the pool run in that mode, ready."""
    with running(create_model_app(members, ServingOptions(max_batch=MAX_BATCH))) as eager, \
            running(create_model_app(members, ServingOptions(max_batch=MAX_BATCH,
                                                              compile="default"))) as compiled:
        wait_ready(eager)
        # It compiles every bucket before it is ready: minutes on a loaded CPU.
        wait_ready(compiled, COMPILE_DEADLINE_S, fail_when_unhealthy=True)
        yield {"none": eager, "default": compiled}


def _post(base: str, member: str, body: bytes) -> bytes:
    reply = httpx.post(f"{base}/v1/members/{member}/velocity", content=body,
                       headers={"content-type": CONTENT_TYPE}, timeout=600.0)
    assert reply.status_code == 200, reply.content
    return reply.content


def test_info_says_which_members_run_compiled(pools) -> None:
    for mode, base in pools.items():
        members = httpx.get(f"{base}/v1/info").json()["members"]
        assert {name: m["compile"] for name, m in members.items()} == {
            "expert-0": mode, PLAN_NAMES[ROUTER]: mode, PLAN_NAMES[TEXT_ENCODER]: "none"}


def test_a_compiled_pool_answers_the_eager_pool_s_velocities_and_routes(pools) -> None:
    info = httpx.get(f"{pools['none']}/v1/members/expert-0/info").json()
    clusters = httpx.get(f"{pools['none']}/v1/members/{PLAN_NAMES[ROUTER]}/info").json()[
        "clusters"]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, *info["latent_shape"])).astype(np.float32)
    t = np.array([0.3, 0.8], np.float32)
    embeddings = rng.standard_normal((2, WARM_TEXT_TOKENS, info["text_width"]))
    context = encode_request(Context(
        1, embeddings.astype(np.float32), np.ones((2, WARM_TEXT_TOKENS), np.uint8),
        np.zeros((2, WARM_TEXT_TOKENS, info["text_width"]), np.float32)))
    # One guided row and one not: three forward rows, padded to the bucket of four.
    velocity = encode_request(VelocityRequest(
        2, x, t, context_id(context), np.array([1, 0], np.int32),
        np.array([7.5, 1.0], np.float32)))
    route = encode_request(RouteRequest(3, np.concatenate([x, x[:1]]),
                                             np.array([0.3, 0.8, 0.5], np.float32),
                                             np.zeros((3, 0), np.float32)))
    answers = {}
    for mode, base in pools.items():
        _post(base, "expert-0", context)
        answers[mode] = (
            decode_response(_post(base, "expert-0", velocity), 2),
            decode_probabilities(_post(base, PLAN_NAMES[ROUTER], route), 3, 3, clusters))
    for eager, compiled in zip(answers["none"], answers["default"]):
        assert compiled.shape == eager.shape
        np.testing.assert_allclose(compiled, eager, rtol=0, atol=TOLERANCE)
        assert not np.array_equal(eager, np.zeros_like(eager))


def test_our_label_unet_compiled_gives_its_eager_velocities(smoke_expert_checkpoint) -> None:
    checkpoint = load_checkpoint(smoke_expert_checkpoint)
    rng = np.random.default_rng(1)
    request = LabelVelocity(
        5, rng.standard_normal((3, *expert_image_shape(checkpoint.meta))).astype(np.float32),
        np.array([0.1, 0.5, 0.9], np.float32), np.array([0, 2, 4], np.int64))
    app = create_model_app(smoke_expert_checkpoint,
                           ServingOptions(max_batch=MAX_BATCH, compile="default"))
    with running(app) as base:
        wait_ready(base, COMPILE_DEADLINE_S, fail_when_unhealthy=True)
        assert httpx.get(f"{base}/v1/info").json()["compile"] == "default"
        reply = post_call(base, request)  # three rows, padded to the bucket of four
    assert reply.status_code == 200, reply.content
    eager = expert_velocity(checkpoint, "torch")(request.x, request.t, request.y)
    np.testing.assert_allclose(decode_response(reply.content, 5), eager, rtol=0,
                               atol=TOLERANCE)


def test_a_compiled_group_of_paris_experts_gives_each_expert_s_eager_velocity(
        tmp_path_factory) -> None:
    """--grouped-forward on under --compile default (bfloat16: what a compiled grouped matrix
    product takes): a step's pool request, a row for each expert, runs through the group's
    compiled forward and gives each row its own expert's eager velocity, to bfloat16's
    rounding."""
    stages = paris_stages(tmp_path_factory.mktemp("paris"))
    experts = {f"expert-{k}": stages / f"expert_{k}" for k in range(2)}
    common = {"max_batch": 2, "precision": "bfloat16"}
    with running(create_model_app(experts, ServingOptions(**common, grouped_forward="off"))
                 ) as eager, \
            running(create_model_app(experts, ServingOptions(
                **common, compile="default", grouped_forward="on"))) as grouped:
        wait_ready(eager)
        wait_ready(grouped, COMPILE_DEADLINE_S, fail_when_unhealthy=True)
        (group,) = httpx.get(f"{grouped}/v1/info").json()["pool"]["groups"]
        assert (group["grouped_up_to_rows"], group["failure"]) == (2, None)
        info = httpx.get(f"{eager}/v1/members/expert-0/info").json()
        rng = np.random.default_rng(2)
        embeddings = rng.standard_normal((1, WARM_TEXT_TOKENS, info["text_width"]))
        context = encode_request(Context(
            1, embeddings.astype(np.float32), np.ones((1, WARM_TEXT_TOKENS), np.uint8),
            np.zeros((0, WARM_TEXT_TOKENS, info["text_width"]), np.float32)))
        request = PoolVelocityRequest(2, tuple((name, VelocityRequest(
            2, rng.standard_normal((1, *info["latent_shape"])).astype(np.float32),
            np.array([0.4], np.float32), context_id(context), np.zeros(1, np.int32),
            np.ones(1, np.float32))) for name in experts))
        for name in experts:
            _post(eager, name, context)
            _post(grouped, name, context)
        own = [decode_response(_post(eager, name, encode_request(call)), 2)
               for name, call in request.calls]
        reply = httpx.post(f"{grouped}{POOL_VELOCITY_PATH}", content=encode_pool_request(request),
                           headers={"content-type": CONTENT_TYPE}, timeout=600.0)
        assert reply.status_code == 200, reply.content
    for alone, together in zip(own, decode_pool_response(reply.content, request)):
        np.testing.assert_allclose(together, alone, rtol=0, atol=BFLOAT16_TOLERANCE)
    assert np.abs(own[0] - own[1]).max() > 10 * BFLOAT16_TOLERANCE
