"""Requests at Paris's sizes (4 x 32 x 32 latents, CLIP's 77 x 768 per prompt) over real HTTP
on loopback, with the experts on servers of their own: the largest request the router would
serve is read, whatever carries its size (64 images' initial latents, 64 prompts of
``MAX_PROMPT_BYTES`` JSON-escaped), and the experts take what it sends them at their declared
max batch (a generation's guided context, its rows split by forward rows); a body over the
router's limit gets a 413 naming it, and one over an expert's a refusal naming the limit."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest

from ddm.deploy.limits import MAX_CONTEXT_BODY_BYTES, MAX_PROMPT_BYTES, SERVER_MAX_BATCH
from ddm.models.paris import ParisExpertConfig, ParisRouterConfig
from ddm.serving.wire.protocol import (CONTENT_TYPE, Context, RemoteExpertError,
                                       VelocityRequest, context_id, decode_response,
                                       encode_request)
from tests.support.paris_release import TinyParis
from tests.support.text_router import served_text_ddm

#: Paris's state and text sizes, in tiny networks.
LATENT = (4, 32, 32)
TEXT_WIDTH, TOKENS = 768, 77
PARIS_SIZED = TinyParis(
    text_width=TEXT_WIDTH,
    expert=ParisExpertConfig(input_size=32, hidden_size=32, depth=1, num_heads=4,
                             text_embed_dim=TEXT_WIDTH),
    router=ParisRouterConfig(input_size=32, hidden_size=32, depth=1, num_heads=4,
                             num_clusters=2))
IMAGES = "/v1/images/generations"
GENERATION_S = 300.0  # 64 images of tiny models on two busy cores

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    with served_text_ddm(tmp_path_factory.mktemp("paris"), sizes=PARIS_SIZED,
                         max_batch=SERVER_MAX_BATCH) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def limits(served) -> dict:
    return httpx.get(f"{served[0]}/v1/info").json()["limits"]


def _npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url, content=json.dumps(body).encode(), timeout=GENERATION_S,
                      headers={"content-type": "application/json"})


def test_the_router_reads_64_images_initial_latents(served, limits):
    router, _ = served
    n = limits["max_batch"]
    latents = np.random.default_rng(0).standard_normal((n, *LATENT)).astype(np.float32)
    body = {"prompt": "a red car", "n": n, "steps": 1, "strategy": "top1",
            "guidance_scale": 1.0, "latents": _npy(latents)}
    assert len(json.dumps(body)) > 1024 * 1024  # 1.4 MB: 21 times the old 64 KiB limit
    reply = _post(f"{router}{IMAGES}", body)
    assert reply.status_code == 200, reply.text[:300]
    assert len(reply.json()["data"]) == n


def test_the_router_reads_64_escaped_prompts_and_the_experts_their_guided_context(served,
                                                                                   limits):
    # Every byte of each prompt a control character, which JSON writes as \u00XX (6 bytes),
    # and guidance on: the experts get a context of 64 rows and their negatives (30 MB), then
    # steps of 64 rows costing 128 forward rows, split to their max batch of 64.
    router, _ = served
    n = limits["max_batch"]
    prompts = [chr(0x10 + i % 16) * MAX_PROMPT_BYTES for i in range(n)]  # none is \n or \t
    body = {"prompts": prompts, "negative_prompt": "\x1f" * MAX_PROMPT_BYTES, "steps": 1,
            "strategy": "top1", "guidance_scale": 7.5}
    assert len(json.dumps(body)) > 6 * n * MAX_PROMPT_BYTES
    reply = _post(f"{router}/v1/generate", body)
    assert reply.status_code == 200, reply.text[:300]
    assert len(reply.json()["images"]) == n


def test_a_body_over_the_routers_limit_gets_413_naming_it(served, limits):
    router, _ = served
    n = limits["max_batch"]
    too_many = np.zeros((n * 2, *LATENT), np.float32)  # twice the latents any request takes
    body = {"prompt": "a red car", "n": n, "latents": _npy(too_many)}
    assert len(json.dumps(body)) > limits["max_body_bytes"]
    reply = _post(f"{router}{IMAGES}", body)
    assert reply.status_code == 413
    assert reply.json()["error"]["message"].endswith(  # OpenAI's shape, from the body limit
        f"exceeds the limit of {limits['max_body_bytes']}")


def _expert_post(base: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{base}/v1/velocity", content=body, timeout=GENERATION_S,
                      headers={"content-type": CONTENT_TYPE})


def _refusal(reply: httpx.Response) -> str:
    with pytest.raises(RemoteExpertError) as info:
        decode_response(reply.content, int.from_bytes(reply.content[8:16], "little"))
    return info.value.message


@pytest.fixture(scope="module")
def expert(served) -> str:
    info = httpx.get(f"{served[0]}/v1/info").json()
    endpoint = next(iter(info["experts"][0]["replicas"]))
    return f"http://{endpoint}"


def test_an_expert_refuses_what_is_over_its_declared_limits_naming_them(expert):
    rows = MAX_CONTEXT_BODY_BYTES // (2 * 4 * TOKENS * TEXT_WIDTH) + 1  # one row past the cap
    embeddings = np.zeros((rows, TOKENS, TEXT_WIDTH), np.float32)
    over = encode_request(Context(1, embeddings, np.ones((rows, TOKENS), np.uint8),
                                       embeddings))
    reply = _expert_post(expert, over)
    assert reply.status_code == 413
    assert _refusal(reply).endswith(f"exceeds the limit of {MAX_CONTEXT_BODY_BYTES}")
    one = np.zeros((1, TOKENS, TEXT_WIDTH), np.float32)
    context = encode_request(Context(2, one, np.ones((1, TOKENS), np.uint8), one))
    assert _expert_post(expert, context).status_code == 200
    batch = SERVER_MAX_BATCH + 1
    reply = _expert_post(expert, encode_request(VelocityRequest(
        3, np.zeros((batch, *LATENT), np.float32), np.zeros(batch, np.float32),
        context_id(context), np.zeros(batch, np.int32), np.ones(batch, np.float32))))
    assert reply.status_code == 422
    assert _refusal(reply) == f"batch of {batch} exceeds the limit of {SERVER_MAX_BATCH}"
