"""A text DDM's router over real HTTP on loopback: its text encoder, decoder and router
network loaded in the router process from a tiny Paris release's components. What a client
hears before any expert is called: the OpenAI image API's schema and its refusals, each a 4xx
naming the field (issue 22, item 9), and the page's inputs in ``/v1/info``.

The experts' addresses are nobody's: every request here is refused by its schema first."""

from __future__ import annotations

import base64
import io
from typing import Iterator

import httpx
import numpy as np
import pytest

from ddm.serving.router.server import create_router_app
from tests.integration.servers import running
from tests.support.text_router import EXPERTS, paris_stages, text_config

NOBODY = "127.0.0.1:9"
IMAGES = "/v1/images/generations"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def router(tmp_path_factory) -> Iterator[str]:
    stages = paris_stages(tmp_path_factory.mktemp("paris"))
    config = text_config(stages, {f"expert_{k}": NOBODY for k in range(EXPERTS)})
    with running(create_router_app(config)) as base:
        yield base


def _npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("body,problem", [
    ({"prompt": "a red car", "response_format": "url"},
     "response_format: response_format 'url' is not supported: this router stores no images "
     "to link to; use b64_json"),
    ({"prompt": "a red car", "guidance_scale": 51},
     "guidance_scale: Input should be less than or equal to 50"),
    ({"prompt": "a red car", "guidance_scale": -1},
     "guidance_scale: Input should be greater than or equal to 0"),
    ({"prompt": "a red car", "n": 65}, "n: Input should be less than or equal to 64"),
    ({"prompt": "a red car", "size": "big"}, "size: String should match pattern"),
    ({"prompt": "x" * 4097}, "prompt: String should have at most 4096 characters"),
    ({"n": 1}, "prompt: Field required"),
    ({"prompt": "a red car", "latents": "%%%"}, "latents must be base64 (of a .npy file)"),
    ({"prompt": "a red car", "latents": _npy(np.zeros((1, 4, 8, 8), np.float64))},
     "latents must be float32 (little-endian <f4), got <f8"),
])
def test_the_image_api_refuses_bad_input_naming_it(router, body, problem):
    reply = httpx.post(f"{router}{IMAGES}", json=body)
    assert reply.status_code == 422, reply.text
    assert reply.json()["detail"].startswith(problem), reply.json()["detail"]


def test_generate_and_its_stream_take_prompts_and_guidance(router):
    reply = httpx.post(f"{router}/v1/generate", json={"prompts": ["a"], "guidance_scale": 99})
    assert reply.status_code == 422
    assert reply.json()["detail"] == "guidance_scale: Input should be less than or equal to 50"
    stream = httpx.get(f"{router}/v1/generate/stream",
                       params={"prompt": "a", "guidance_cutoff": 0})
    assert stream.status_code == 422
    assert stream.json()["detail"] == "guidance_cutoff: Input should be greater than 0"


def test_the_info_tells_the_page_to_ask_for_prompts_and_guidance(router):
    info = httpx.get(f"{router}/v1/info").json()
    assert info["conditioning"] == "text" and info["max_guidance_scale"] == 50
    assert info["defaults"]["guidance_scale"] == 7.5 and info["router_network"] is True
    assert info["strategies"] == ["top1", "top2", "threshold:0.2", "ensemble"]  # no oracle
    document = httpx.get(f"{router}/openapi.json").json()
    body = document["components"]["schemas"]["ImagesRequest"]["properties"]
    assert body["guidance_scale"]["maximum"] == 50 and body["n"]["maximum"] == 64
    answer = document["components"]["schemas"]["ImagesResponse"]
    assert {"created", "data", "truncated"} <= set(answer["required"])
