"""A text DDM's router over real HTTP on loopback: its text encoder, decoder and router
network loaded in the router process from a tiny Paris release's stage checkpoints.

First what a client hears before any expert is called (the experts' addresses are nobody's):
the OpenAI image API's schema and its refusals, each a 4xx naming the field (issue 22, item 9),
and the page's inputs in ``/v1/info``. Then, with each expert on an expert server of its own
(guidance inside): a generation equals ``generate_text`` in-process for the same request (RGB
PNGs within 1/255), guidance 1 and 7.5 differ, the same seed gives the same image, given
latents are the initial noise, a prompt past CLIP's 77 tokens is cut and the answer says by
how much, and the stream previews each step's predicted latent, decoded, before the image."""

from __future__ import annotations

import base64
import io
import json
import time
from pathlib import Path
from typing import Iterator

import httpx
import jsonschema
import numpy as np
import pytest
from PIL import Image

from ddm.deploy.limits import MAX_PROMPT_BYTES
from ddm.models.ddm import load_ddm
from ddm.sampling.pipeline import generate_text
from ddm.serving.router.api.requests import STREAM_EVENT_SCHEMA

from ddm.serving.router.api.server import create_router_app
from tests.integration.servers import running
from tests.support.text_router import EXPERTS, paris_stages, served_text_ddm, text_config

NOBODY = "127.0.0.1:9"
IMAGES = "/v1/images/generations"
GENERATION_S = 120.0  # a few steps of tiny models on two busy cores

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
    error = reply.json()["error"]  # OpenAI's shape, for its clients
    assert error["message"].startswith(problem), error
    assert error["type"] == "invalid_request_error" and problem.startswith(error["param"])


def test_a_stage_that_cannot_load_is_named_by_the_probes(tmp_path):
    # No stage checkpoint under tmp_path: the router's text encoder fails to load, and the
    # probes say that a stage failed (naming it), not the router network.
    config = text_config(tmp_path, {f"expert_{k}": NOBODY for k in range(EXPERTS)})
    with running(create_router_app(config)) as base:
        deadline = time.monotonic() + 60
        while (health := httpx.get(f"{base}/healthz")).status_code != 500:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.05)
        ready = httpx.get(f"{base}/readyz").json()
    assert health.json()["error"].startswith("a stage failed to load: ")
    assert "text_encoder stage" in health.json()["error"]
    assert health.json()["error"] in ready["problems"]
    assert not any("router network" in problem for problem in ready["problems"])


def test_generate_and_its_stream_take_prompts_and_guidance(router):
    reply = httpx.post(f"{router}/v1/generate", json={"prompts": ["a"], "guidance_scale": 99})
    assert reply.status_code == 422
    assert reply.json()["detail"] == "guidance_scale: Input should be less than or equal to 50"
    stream = httpx.get(f"{router}/v1/generate/stream",
                       params={"prompt": "a", "guidance_cutoff": 0})
    assert stream.status_code == 422
    assert stream.json()["detail"] == "guidance_cutoff: Input should be greater than 0"


def test_a_stream_query_with_the_longest_prompts_is_read_not_refused_for_its_size(router):
    """The stream takes its prompt and negative prompt in the query, each up to
    ``MAX_PROMPT_BYTES`` of UTF-8, percent-encoded at three characters per byte outside ASCII:
    the router reads that request line (here, to refuse another field) rather than answer 431
    to a request its own schema takes."""
    longest = "\u00e9" * (MAX_PROMPT_BYTES // 2)
    stream = httpx.get(f"{router}/v1/generate/stream", params={
        "prompt": longest, "negative_prompt": longest, "guidance_cutoff": 0})
    assert stream.status_code == 422, stream.text
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
    # what the schema says is what the router takes: prompts, never labels
    generate = document["components"]["schemas"]["GenerateRequest"]
    assert "prompts" in generate["required"] and "labels" not in generate.get("required", [])
    assert generate["properties"]["labels"]["not"] == {}
    assert generate["properties"]["prompts"]["minItems"] == 1


# ------------------------------------------------- served: the experts on their own servers


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    with served_text_ddm(tmp_path_factory.mktemp("served")) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def in_process(served):
    return load_ddm(served[1])


def _png(encoded: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(encoded))))


def test_a_generation_through_the_router_equals_the_in_process_one(served, in_process):
    router, _ = served
    prompts = ["a photo of a red car", "a cat on the beach"]
    reply = httpx.post(f"{router}/v1/generate", timeout=GENERATION_S, json={
        "prompts": prompts, "steps": 4, "seed": 3, "strategy": "top2", "guidance_scale": 7.5})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    local = generate_text(in_process, prompts, steps=4, seed=3, strategy="top2",
                          guidance_scale=7.5)
    images = np.stack([_png(image) for image in body["images"]])
    assert images.shape == (2, 16, 16, 3) == local.images.shape  # RGB PNGs
    assert np.abs(images.astype(int) - local.images).max() <= 1
    assert (body["prompts"], body["labels"], body["truncated"]) == (prompts, [], [0, 0])
    assert body["routing"] == local.usage.step_masks(4).tolist()


def test_stages_served_on_their_own_give_the_same_image(served, tmp_path_factory):
    """The text encoder, decoder and router network on stage servers (``ddm serve stage``),
    the null prompt's embeddings sent with the guided rows: the image the router makes with
    them in its own process."""
    body = {"prompts": ["a photo of a red car"], "steps": 3, "seed": 2, "strategy": "top2"}
    with served_text_ddm(tmp_path_factory.mktemp("apart"), stages_apart=True) as (apart, _):
        remote = httpx.post(f"{apart}/v1/generate", json=body, timeout=GENERATION_S)
    local = httpx.post(f"{served[0]}/v1/generate", json=body, timeout=GENERATION_S)
    assert remote.status_code == local.status_code == 200, (remote.text, local.text)
    assert np.abs(_png(remote.json()["images"][0]).astype(int)
                  - _png(local.json()["images"][0])).max() <= 1
    assert remote.json()["routing"] == local.json()["routing"]


def test_a_router_with_a_text_prior_routes_served_as_in_process(tmp_path):
    """The router network on a stage server, its text prior weighing in each prompt's pooled
    vector sent with ROUTE: the images and routing ``ddm sample`` makes in-process, which
    differ from the network's alone."""
    prompts = ["a photo of a red car", ""]
    body = {"prompts": prompts, "steps": 3, "seed": 2, "strategy": "top2"}
    with served_text_ddm(tmp_path, stages_apart=True, text_prior=True) as (apart, stages):
        remote = httpx.post(f"{apart}/v1/generate", json=body, timeout=GENERATION_S)
    assert remote.status_code == 200, remote.text
    settings = {"steps": 3, "seed": 2, "strategy": "top2"}
    local = generate_text(load_ddm(stages), prompts, **settings)
    alone = generate_text(load_ddm(stages, text_prior=False), prompts, **settings)
    images = np.stack([_png(image) for image in remote.json()["images"]])
    assert np.abs(images.astype(int) - local.images).max() <= 1
    assert remote.json()["routing"] == local.usage.step_masks(3).tolist()
    assert np.abs(local.state[0] - alone.state[0]).max() > 1e-4  # the prompt moved it
    np.testing.assert_allclose(local.state[1], alone.state[1], atol=1e-5)  # "": no evidence


def test_the_openai_image_api_answers_its_schema(served):
    router, _ = served
    long = " ".join(["photo"] * 100)  # 100 tokens and the start and end ones: 25 past 77
    reply = httpx.post(f"{router}{IMAGES}", timeout=GENERATION_S, json={
        "prompt": long, "n": 2, "size": "16x16", "response_format": "b64_json", "seed": 1,
        "steps": 3, "model": "dall-e-2"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert set(body) == {"created", "data", "truncated", "warnings", "expert_names", "routing",
                         "seed", "steps", "strategy", "guidance_scale"}
    assert abs(body["created"] - time.time()) < GENERATION_S
    assert [set(item) for item in body["data"]] == [{"b64_json"}] * 2
    first, second = (_png(item["b64_json"]) for item in body["data"])
    assert first.shape == (16, 16, 3) and np.abs(first.astype(int) - second).max() > 0
    assert body["truncated"] == [25, 25] and body["guidance_scale"] == 7.5  # the default
    assert body["warnings"] == [f"{long!r}: longer than the text encoder takes; its last 25 "
                                "token(s) ignored"]  # once: the n images share the prompt
    assert len(body["routing"]) == 2 and len(body["routing"][0]) == 3


def test_guidance_changes_the_image_and_the_seed_decides_it(served):
    router, _ = served

    def image(guidance: float, seed: int = 0) -> np.ndarray:
        reply = httpx.post(f"{router}{IMAGES}", timeout=GENERATION_S, json={
            "prompt": "a red car", "steps": 3, "seed": seed, "guidance_scale": guidance})
        assert reply.status_code == 200, reply.text
        return _png(reply.json()["data"][0]["b64_json"]).astype(int)

    guided = image(7.5)
    assert np.abs(guided - image(1.0)).max() > 0
    np.testing.assert_array_equal(guided, image(7.5))
    assert np.abs(guided - image(7.5, seed=1)).max() > 0


def test_given_latents_are_the_initial_noise(served, in_process):
    router, _ = served
    latents = np.random.default_rng(4).standard_normal((1, 4, 8, 8)).astype(np.float32)
    reply = httpx.post(f"{router}{IMAGES}", timeout=GENERATION_S, json={
        "prompt": "a red car", "steps": 3, "latents": _npy(latents), "strategy": "top2"})
    assert reply.status_code == 200, reply.text
    local = generate_text(in_process, ["a red car"], steps=3, strategy="top2",
                          guidance_scale=7.5, latents=latents)
    assert np.abs(_png(reply.json()["data"][0]["b64_json"]).astype(int)
                  - local.images[0]).max() <= 1


@pytest.mark.parametrize("route,body,problem", [
    ("/v1/generate", {"labels": [1]}, "prompts: Field required"),
    ("/v1/generate", {"labels": [1], "prompts": ["a"]},
     "this DDM is conditioned on text: send prompts, not labels"),
    (IMAGES, {"prompt": "a", "latents": _npy(np.zeros((1, 4, 4, 4), np.float32))},
     "latents must be float32 of shape (1, 4, 8, 8), got float32 (1, 4, 4, 4)"),
    (IMAGES, {"prompt": "a", "n": 2, "latents": _npy(np.zeros((1, 4, 8, 8), np.float32))},
     "latents must be float32 of shape (2, 4, 8, 8)"),
    (IMAGES, {"prompt": "a", "size": "256x256"},
     "size 256x256 is not this DDM's; it makes 16x16 images only"),
    (IMAGES, {"prompt": "a", "strategy": "oracle"}, "the oracle strategy routes by label"),
])
def test_what_the_text_ddm_cannot_do_is_a_422_naming_it(served, route, body, problem):
    reply = httpx.post(f"{served[0]}{route}", json=body, timeout=GENERATION_S)
    assert reply.status_code == 422, reply.text
    reason = reply.json()["error"]["message"] if route == IMAGES else reply.json()["detail"]
    assert reason.startswith(problem), reason


def test_the_stream_previews_decoded_predictions_then_sends_the_decoded_image(served):
    router, _ = served
    with httpx.stream("GET", f"{router}/v1/generate/stream", timeout=GENERATION_S,
                      params={"prompt": "a red car", "steps": 3}) as response:
        assert response.status_code == 200
        events = list(_events(response))
    assert [name for name, _ in events] == ["encoded", "step", "step", "step", "done"]
    assert events[0][1] == {"truncated": [0], "warnings": []}
    # each step's frame is the decoder's image of the latent the step predicts
    assert all(_png(data["image"]).shape == (16, 16, 3) for _, data in events[1:4])
    for name, data in events:  # as the OpenAPI document says (schemathesis reads it so)
        (schema,) = [e["properties"]["data"]["contentSchema"] for e in STREAM_EVENT_SCHEMA["oneOf"]
                     if e["properties"]["event"]["const"] == name]
        jsonschema.validate(data, schema)
    done = events[-1][1]
    assert done["prompt"] == "a red car" and "label" not in done
    assert _png(done["image"]).shape == (16, 16, 3)
    # at t = 1 the prediction is the state itself: the last frame is the image
    np.testing.assert_array_equal(_png(events[3][1]["image"]), _png(done["image"]))


def _events(response: httpx.Response) -> Iterator[tuple[str, dict]]:
    name, data = None, []
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data.append(line[len("data: "):])
        elif not line and name is not None:
            yield name, json.loads("\n".join(data))
            name, data = None, []
