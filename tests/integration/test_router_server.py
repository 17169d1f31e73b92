"""The router server over real HTTP on loopback, with real (random-init smoke) expert servers.

Two small DDMs are written per module: ``split`` (experts for labels 0-4 and 5-9, as a label
partition trains them) and ``shared`` (two experts that both serve every label, as k-means
clusters may). Expert and router servers run in-process on uvicorn threads; the failover tests
run expert replicas (and the router, through ``serve_router``) as subprocesses they can kill.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from html.parser import HTMLParser
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest
import torch
import uvicorn
from PIL import Image

from ddm.conditioning import Conditioning
from ddm.checkpoints.format import CheckpointMeta, save_checkpoint
from ddm.models.config import UNET_CONFIGS, RouterNetworkConfig, UNetConfig
from ddm.models.router_net import RouterNet
from ddm.models.torch_io import canonical_weights
from ddm.models.torch_unet import UNet
from ddm.models.ddm import load_ddm
from ddm.runtime.local import free_port
from ddm.sampling.pipeline import generate
from ddm.sampling.routing import parse_strategy
from ddm.sampling.solvers import initial_noise
from ddm.serving.router.fleet.pool import ExpertPool
from ddm.serving.router.fleet.servers import PoolSettings
from ddm.serving.http.server import build_server
from ddm.serving.router.fleet.remote import RemoteMixture, SamplingRequest, generate_remote
from ddm.serving.router.fleet.replicas import static_endpoints
from ddm.deploy.router_config import Auth, RouterConfigFile, RouterLimits
from ddm.sampling_params import STRATEGY_PATTERN
from ddm.serving.model.server import create_model_app
from ddm.serving.model.options import ServingOptions
from ddm.serving.router.api.server import create_router_app

# the models run on two cores shared with everything else
pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMOKE = UNET_CONFIGS["smoke"]
SHAPE = (1, SMOKE.image_size, SMOKE.image_size)
LOW, HIGH, ALL = list(range(5)), list(range(5, 10)), list(range(10))
WAIT_S = 90.0  # subprocesses import torch on a busy machine




@pytest.fixture(scope="module")
def ddms(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ddms")
    return {"split": _write_ddm(root / "split", [LOW, HIGH], "labels", seed=0),
            "shared": _write_ddm(root / "shared", [ALL, ALL], "kmeans", seed=10)}


@pytest.fixture(scope="module")
def experts(ddms: dict[str, Path]) -> Iterator[dict[str, str]]:
    """``host:port`` of one in-process server per expert: e0, e1 (split), f0, f1 (shared)."""
    names = {"e0": ddms["split"] / "e0", "e1": ddms["split"] / "e1",
             "f0": ddms["shared"] / "e0", "f1": ddms["shared"] / "e1"}
    with _servers({name: create_model_app(path, ServingOptions(max_batch=8))
                   for name, path in names.items()}
                  ) as endpoints:
        yield endpoints


@pytest.fixture(scope="module")
def routers(ddms, experts) -> Iterator[dict[str, str]]:
    """Base URLs of a router over the split DDM (e1 found through DNS) and one over the shared."""
    split = _config({"e0": {"endpoints": [experts["e0"]]},
                     "e1": {"dns": "localhost", "port": _port(experts["e1"])}},
                    [LOW, HIGH], ddms["split"] / "router", strategy="oracle")
    shared = _config({"e0": {"endpoints": [experts["f0"]]}, "e1": {"endpoints": [experts["f1"]]}},
                     [ALL, ALL], ddms["shared"] / "router", strategy="top1")
    apps = {"split": create_router_app(split), "shared": create_router_app(shared)}
    with _servers(apps) as endpoints:
        bases = {name: f"http://{endpoint}" for name, endpoint in endpoints.items()}
        for base in bases.values():
            _wait(lambda: httpx.get(f"{base}/readyz").status_code == 200, f"{base} ready")
        yield bases


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("ddm,strategy,solver", [("split", "oracle", "euler"),
                                                 ("shared", "top1", "euler"),
                                                 ("shared", "top2", "heun")])
def test_generation_equals_in_process_sampling(ddms, routers, ddm, strategy, solver):
    labels = [0, 3, 7, 9]
    reply = httpx.post(f"{routers[ddm]}/v1/generate", timeout=60, json={
        "labels": labels, "steps": 6, "seed": 5, "strategy": strategy, "solver": solver})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    local = generate(load_ddm(ddms[ddm], backends=("torch",)), labels, 6, seed=5,
                     strategy=strategy, solver=solver)
    images = np.stack([_image(png) for png in body["images"]])
    assert np.abs(images.astype(int) - local.images).max() <= 1
    assert body["expert_calls"] == local.expert_calls.tolist()
    assert body["round_trips"] == body["expert_calls"]  # one request per call, per step
    names = local.usage.expert_names
    calls = local.usage.calls_per_expert()
    assert body["experts"] == [[n for k, n in enumerate(names) if calls[i, k]]
                               for i in range(len(labels))]
    assert (body["labels"], body["steps"], body["strategy"]) == (labels, 6, strategy)


@pytest.mark.parametrize("solver", ["euler", "heun"])
def test_delegation_over_http_equals_per_step_sampling(ddms, experts, solver):
    """Model space, through the pool alone: per step within 1e-4 of in-process sampling,
    delegated exactly equal to per step, in ceil(steps / delegate) round trips."""
    mixture = RemoteMixture(("e0", "e1"), (tuple(LOW), tuple(HIGH)), None, SHAPE, 10)
    labels = (1, 4, 6, 8)

    async def sample(delegate: int):
        sources = {n: static_endpoints([experts[n]]) for n in ("e0", "e1")}
        async with ExpertPool(sources, PoolSettings()) as pool:
            request = SamplingRequest(labels, 10, 2, parse_strategy("oracle"), solver, delegate)
            return await generate_remote(mixture, pool, request)

    per_step, delegated = asyncio.run(sample(0)), asyncio.run(sample(4))
    ddm = load_ddm(ddms["split"], backends=("torch",))
    local = generate(ddm, labels, 10, seed=2, strategy="oracle", solver=solver)
    assert np.abs(per_step.images.astype(int) - local.images).max() <= 1
    np.testing.assert_array_equal(delegated.state, per_step.state)
    np.testing.assert_array_equal(delegated.round_trips, 3)
    np.testing.assert_array_equal(delegated.expert_calls, local.expert_calls)


def test_stream_yields_an_event_per_step_then_done(routers):
    events = _stream(routers["split"], label=3, steps=5, strategy="oracle")
    assert [name for name, _ in events] == ["step"] * 5 + ["done"]
    assert [data["step"] for _, data in events[:-1]] == [1, 2, 3, 4, 5]
    assert all(data["experts"] == ["e0"] for _, data in events[:-1])
    assert all(data["probs"] == [1, 0] for _, data in events[:-1])  # the oracle's one-hot
    assert _image(events[-2][1]["image"]).shape == SHAPE[1:]
    done = events[-1][1]
    np.testing.assert_array_equal(_image(done["image"]), _image(events[-2][1]["image"]))
    assert (done["label"], done["expert_calls"], done["round_trips"]) == (3, 5, 5)

    delegated = _stream(routers["split"], label=8, steps=5, strategy="oracle", delegate_steps=2)
    assert [data.get("step") for _, data in delegated] == [2, 4, 5, None]
    assert delegated[-1][1]["round_trips"] == 3 and delegated[0][1]["delegated"]


def test_stream_frames_carry_the_router_networks_probabilities(ddms, routers):
    """Each step's p(k | x_t, t, y): the first from the router network at the request's noise,
    and every step run by the expert top1 picks from them."""
    steps = _stream(routers["shared"], label=7, steps=4, seed=3, strategy="top1")[:-1]
    network = load_ddm(ddms["shared"], backends=("torch",)).router
    first = network(initial_noise(1, SHAPE, 3), np.zeros(1, np.float32),
                    Conditioning.from_labels([7]))
    np.testing.assert_allclose(steps[0][1]["probs"], first[0], atol=1e-4)
    for _, data in steps:
        assert sum(data["probs"]) == pytest.approx(1, abs=1e-3)
        assert data["experts"] == [["e0", "e1"][int(np.argmax(data["probs"]))]]


def test_the_page_and_the_api_description_are_served(routers):
    page = httpx.get(f"{routers['split']}/")
    assert page.status_code == 200 and "v1/generate/stream" in page.text and "://" not in re.sub(
        r"<!--.*?-->", "", page.text, flags=re.S)  # no CDN: the page works offline
    info = httpx.get(f"{routers['split']}/v1/info").json()
    assert [e["name"] for e in info["experts"]] == ["e0", "e1"]
    assert info["image_shape"] == list(SHAPE) and info["num_classes"] == 10
    assert info["conditioning"] == "labels"
    assert all(e["ready_replicas"] == 1 for e in info["experts"])
    assert httpx.get(f"{routers['split']}/docs").status_code == 404  # off by default


def test_the_info_offers_only_what_the_ddm_can_do_and_says_what_each_expert_is(routers):
    """A label partition can be routed by the oracle, clusters cannot; each expert's card says
    what runs it (as the expert says, here torch on this CPU) and what it learned from."""
    split, shared = (httpx.get(f"{routers[d]}/v1/info").json() for d in ("split", "shared"))
    assert split["strategies"] == ["oracle", "top1", "top2", "threshold:0.2", "ensemble"]
    assert shared["strategies"] == ["top1", "top2", "threshold:0.2", "ensemble"]
    assert [e["trained_on"] for e in split["experts"]] == [
        {"partition": "labels", "part": k, "parts": 2, "features": None, "labels": labels,
         "data": None, "images": None, "summary": None} for k, labels in enumerate([LOW, HIGH])]
    assert [(e["trained_on"]["partition"], e["trained_on"]["part"]) for e in shared["experts"]
            ] == [("kmeans", 0), ("kmeans", 1)]
    for card in split["experts"] + shared["experts"]:
        assert "classes" not in card
        assert (card["framework"], card["device"]) == ("torch", "cpu")
        assert card["runtime"] == f"torch {torch.__version__}" and card["hardware"]


def test_the_page_and_the_api_docs_forbid_framing_and_run_only_their_own_code(ddms, experts):
    config = _config({"e0": {"endpoints": [experts["e0"]]}, "e1": {"endpoints": [experts["e1"]]}},
                     [LOW, HIGH], None, strategy="oracle")
    with _servers({"router": create_router_app(config, api_docs=True)}) as endpoints:
        base = f"http://{endpoints['router']}"
        page, docs = httpx.get(f"{base}/"), httpx.get(f"{base}/docs")
    for answer in (page, docs):
        assert answer.status_code == 200
        assert answer.headers["x-frame-options"] == "DENY"
        assert answer.headers["x-content-type-options"] == "nosniff"
        policy = dict(d.strip().split(" ", 1) for d in
                      answer.headers["content-security-policy"].split(";"))
        assert policy["default-src"] == "'none'" and policy["frame-ancestors"] == "'none'"
        assert policy["connect-src"] == "'self'" and "'unsafe-inline'" not in str(policy)
        for tag in ("script", "style"):  # every inline element, and nothing else inline, runs
            blocks = _inline_elements(answer.text, tag)
            assert blocks or answer is docs
            digests = {f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
                       for b in blocks}
            assert {s for s in policy[f"{tag}-src"].split() if s.startswith("'sha256-")
                    } == digests
    page_policy = page.headers["content-security-policy"]
    assert "https:" not in page_policy  # the page loads nothing from elsewhere
    assert " style=" not in page.text  # a style attribute would be refused
    assert "https://cdn.jsdelivr.net" in docs.headers["content-security-policy"]


#: Every operation the router documents; the web page at / is served but not documented.
DOCUMENTED = {("POST", "/v1/generate"), ("GET", "/v1/generate/stream"), ("GET", "/v1/info"),
              ("GET", "/v1/demand"), ("GET", "/v1/models"),
              ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics")}
ERROR = {"$ref": "#/components/schemas/ErrorDetail"}
#: The errors of OpenAI's paths (/v1/models, /v1/images/*), in its shape.
OPENAI_ERROR = {"$ref": "#/components/schemas/OpenAIError"}


def _document(base: str, **kwargs) -> dict:
    document = httpx.get(f"{base}/openapi.json", **kwargs).json()
    assert {(m.upper(), p) for p, ops in document["paths"].items() for m in ops} == DOCUMENTED
    for method, path in DOCUMENTED:  # served, each with a status the document lists
        reply = httpx.request(method, f"{base}{path}", json={"labels": [99]}
                              if method == "POST" else None, **kwargs)
        assert str(reply.status_code) in document["paths"][path][method.lower()]["responses"]
    return document


def _error_statuses(operation: dict) -> set[str]:
    return {status for status, response in operation["responses"].items()
            if response.get("content", {}).get("application/json", {}).get("schema") in (
                ERROR, OPENAI_ERROR)}


def test_the_openapi_document_says_what_the_router_enforces(routers):
    document = _document(routers["split"])
    generate = document["paths"]["/v1/generate"]["post"]
    assert _error_statuses(generate) == {"400", "413", "415", "422", "429", "502", "503"}
    assert "HTTPValidationError" not in json.dumps(document)  # FastAPI's default 422 is wrong
    body = document["components"]["schemas"]["GenerateRequest"]["properties"]
    assert body["labels"]["items"] == {"type": "integer", "minimum": 0, "maximum": 9}
    assert (body["labels"]["maxItems"], body["steps"]["maximum"]) == (64, 200)
    assert body["strategy"]["pattern"] == STRATEGY_PATTERN
    assert body["solver"]["enum"] == ["euler", "heun"]
    query = {p["name"]: p["schema"] for p in document["paths"]["/v1/generate/stream"]["get"][
        "parameters"]}
    assert (query["label"]["minimum"], query["label"]["maximum"]) == (0, 9)
    assert "security" not in generate and "securitySchemes" not in document["components"]
    for body, status in (({"labels": [9], "steps": 2.0, "strategy": "topk:2"}, 200),
                         ({"labels": [9], "steps": "2"}, 422),  # the schema's integers
                         ({"labels": [True]}, 422), ({"labels": [1], "steps": 2.5}, 422),
                         ({"labels": [1], "strategy": "Top1"}, 422),  # the schema's pattern
                         ({"labels": [1], "strategy": "top1 "}, 422)):
        reply = httpx.post(f"{routers['split']}/v1/generate", json=body, timeout=60)
        assert reply.status_code == status, (body, reply.text)
    garbled = httpx.post(f"{routers['split']}/v1/generate", content=b'{"labels": [1\xff]}',
                         headers={"content-type": "application/json"})
    assert garbled.status_code == 400 and garbled.json()["detail"], garbled.text


@pytest.mark.parametrize("ddm,body,message", [
    ("shared", {"labels": [1], "strategy": "random"}, r"strategy: unknown routing strategy"),
    ("shared", {"labels": [3, 12]}, r"labels \[12\] are outside the model's classes 0\.\.9"),
    ("shared", {"labels": [1], "steps": 201}, r"steps: .*less than or equal to 200"),
    ("shared", {"labels": [1] * 65}, r"labels: .*at most 64"),
    ("shared", {"labels": [1], "temperature": 0.7}, r"unknown field 'temperature'"),
    ("shared", {"labels": []}, r"labels: .*at least 1"),
    ("shared", {"labels": [1], "strategy": "oracle"}, r"label 0 is owned by experts 0 and 1"),
    # a label DDM takes no text and no guidance (issue 22, item 9)
    ("split", {"labels": [1], "prompts": ["a red car"]},
     r"conditioned on labels; it takes no prompts"),
    ("split", {"labels": [1], "negative_prompt": "blur"}, r"it takes no negative_prompt"),
    ("split", {"labels": [1], "guidance_scale": 7.5},
     r"guidance_scale must be 1 for a label DDM \(got 7\.5\)"),
])
def test_bad_requests_get_a_4xx_naming_the_problem(routers, ddm, body, message):
    reply = httpx.post(f"{routers[ddm]}/v1/generate", json=body)
    assert reply.status_code == 422, reply.text
    assert re.search(message, reply.json()["detail"]), reply.json()["detail"]
    assert httpx.get(f"{routers[ddm]}/healthz").status_code == 200


def test_the_openai_image_api_refuses_a_label_ddm_naming_why(routers):
    reply = httpx.post(f"{routers['split']}/v1/images/generations",
                       json={"prompt": "a red car", "n": 2})
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["message"] == ("this DDM is conditioned on labels; it takes "
                                                "no prompts")
    assert reply.json()["error"]["param"] == "prompt"  # the field by its name in this API


def test_a_refusal_after_the_schema_names_the_field_as_each_route_calls_it(routers):
    base = routers["split"]
    for path, body, param in (("/v1/generate", {"labels": [1], "prompts": ["a red car"]},
                               "prompts"),
                              ("/v1/generate", {"labels": [3, 12]}, "labels"),
                              ("/v1/generate", {"labels": [1], "guidance_scale": 7.5},
                               "guidance_scale")):
        reply = httpx.post(f"{base}{path}", json=body)
        assert (reply.status_code, reply.json()["param"]) == (422, param), reply.text
    for query, param in (("label=11", "label"), ("label=1&prompt=a+red+car", "prompt")):
        reply = httpx.get(f"{base}/v1/generate/stream?{query}")
        assert (reply.status_code, reply.json()["param"]) == (422, param), reply.text


def test_bad_stream_queries_get_a_4xx_before_streaming(routers):
    base = routers["split"]
    for query, message in (("label=3&steps=0", "steps: .*greater than or equal to 1"),
                           ("label=11", r"labels \[11\] are outside"),
                           ("label=3&colour=red", "unknown field 'colour'"),
                           ("steps=3", "label: Field required"),
                           ("label=1&prompt=a+red+car",
                            "conditioned on labels; it takes no prompts")):
        reply = httpx.get(f"{base}/v1/generate/stream?{query}")
        assert reply.status_code == 422 and re.search(message, reply.json()["detail"]), reply.text


def test_generations_beyond_the_limit_get_429_and_a_hung_expert_503(ddms, experts):
    """e1's only replica accepts connections and never answers."""
    with _hanging() as hanging:
        config = _config({"e0": {"endpoints": [experts["e0"]]}, "e1": {"endpoints": [hanging]}},
                         [LOW, HIGH], None, strategy="oracle",
                         timeouts={"connect_s": 0.5, "request_s": 0.5})
        config = dataclasses.replace(config, limits=RouterLimits(max_concurrent=1))
        app = create_router_app(config, deadline_s=2.0)
        with _servers({"router": app}) as endpoints:
            base = f"http://{endpoints['router']}"
            _wait(lambda: httpx.get(f"{base}/v1/info").json()["image_shape"], "e0 seen")

            async def scenario():
                async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                    stuck = asyncio.create_task(client.post("/v1/generate", json={
                        "labels": [7], "steps": 3}))
                    while _metric((await client.get("/metrics")).text,
                                  "ddm_router_generations_in_flight") < 1:
                        await asyncio.sleep(0.01)
                    busy = await client.post("/v1/generate", json={"labels": [1], "steps": 3})
                    started = time.monotonic()
                    return busy, await stuck, time.monotonic() - started

            busy, stuck, waited = asyncio.run(scenario())
            assert busy.status_code == 429 and "the limit is 1" in busy.json()["detail"]
            assert stuck.status_code == 503, stuck.text
            assert stuck.json()["expert"] == "e1" and "expert e1: unavailable" in stuck.text
            assert waited < 2.0 + 1.0
            assert httpx.get(f"{base}/healthz").status_code == 200
            readyz = httpx.get(f"{base}/readyz")  # it still serves e0's labels: degraded
            assert readyz.status_code == 200, readyz.text
            assert readyz.json() == {"status": "degraded", "missing_experts": ["e1"]}
            ok = httpx.post(f"{base}/v1/generate", json={"labels": [2], "steps": 3}, timeout=30)
            assert ok.status_code == 200, ok.text  # e0's labels are unaffected
            metrics = httpx.get(f"{base}/metrics").text
            busy_total = 'ddm_router_requests_total{route="/v1/generate",status="429"}'
            assert _metric(metrics, busy_total) == 1
            assert _metric(metrics, 'ddm_router_expert_unavailable_total{expert="e1"}') == 1


#: A client's budget in the budget test: two generations of 2 labels x 3 steps.
BUDGET = 12


@pytest.mark.parametrize("per_s", [1e-6, 1e9], ids=["refilled-never", "refilled-at-once"])
def test_a_clients_budget_of_rows_x_steps_is_charged_before_it_runs(ddms, experts, per_s):
    """Issue 35, item 8: each client's generations are charged their rows x steps (labels x
    steps) from a bucket of ``limits.client_row_steps``, refilled at
    ``limits.client_row_steps_per_s``. A refill far too slow to matter during the test: two
    generations of 6 empty the bucket of 12, the third gets 429 whose Retry-After is when the
    bucket will hold 6 (6 / 1e-6 s), another client is served meanwhile; a refill far too fast
    to notice: every one is served. A generation costing more than the whole bucket is a 422
    naming the limit either way."""
    config = _config({"e0": {"endpoints": [experts["e0"]]}, "e1": {"endpoints": [experts["e1"]]}},
                     [LOW, HIGH], None, strategy="oracle")
    config = dataclasses.replace(config, limits=RouterLimits(client_row_steps=BUDGET,
                                                             client_row_steps_per_s=per_s))
    with _servers({"router": create_router_app(config)}) as endpoints:
        base = f"http://{endpoints['router']}"
        _wait(lambda: httpx.get(f"{base}/v1/info").json()["image_shape"], "experts seen")
        a, b = (httpx.Client(base_url=base, timeout=60, transport=httpx.HTTPTransport(
            local_address=address)) for address in ("127.0.0.2", "127.0.0.3"))
        with a, b:
            def generate(client: httpx.Client, labels: list[int]) -> httpx.Response:
                return client.post("/v1/generate", json={"labels": labels, "steps": 3})

            answers = [generate(a, [1, 7]) for _ in range(3)]
            other = generate(b, [1, 7])
            too_big = generate(a, [1, 2, 3, 7, 8])  # 15 rows x steps
            metrics = a.get("/metrics").text
    assert too_big.status_code == 422 and too_big.json()["detail"] == (
        "this generation costs 15 rows x steps (images x steps, guided steps twice), more than "
        "a client's whole budget of 12 (limits.client_row_steps); ask for fewer images or "
        "steps"), too_big.text
    assert other.status_code == 200, other.text
    if per_s > 1:
        assert [r.status_code for r in answers] == [200] * 3, [r.text for r in answers]
        return
    assert [r.status_code for r in answers] == [200, 200, 429], [r.text for r in answers]
    refused = answers[2]
    assert 6e6 - 600 < int(refused.headers["Retry-After"]) <= 6e6, refused.headers
    assert refused.json()["detail"].startswith(
        "client 127.0.0.2 has 0 of the 6 rows x steps this generation costs left in its "
        "budget (limits.client_row_steps 12, refilled at limits.client_row_steps_per_s 1e-06); "
        "retry in "), refused.text
    assert _metric(metrics, "ddm_router_client_limited_total") == 1


#: How long a generation that needs the hung expert stays in flight (the router's deadline).
HOLD_S = 10.0


def test_one_client_cannot_take_the_router_and_a_forwarded_client_is_its_own(ddms, experts):
    """Clients on distinct loopback source addresses, each limited to 2 generations at once:
    a client holding 2 gets 429 naming it and the limit (for a JSON or a streamed
    generation), another client is served meanwhile.
    Through a trusted proxy (127.0.0.4) the client is the right-most X-Forwarded-For entry,
    which a client cannot escape by writing entries of its own to its left; an untrusted
    peer (127.0.0.5) is its own address whatever the header says. Held generations need e1,
    which never answers, so they stay in flight until the router's deadline."""
    with _hanging() as hanging:
        config = _config({"e0": {"endpoints": [experts["e0"]]}, "e1": {"endpoints": [hanging]}},
                         [LOW, HIGH], None, strategy="oracle",
                         timeouts={"connect_s": 0.5, "request_s": 0.5})
        config = dataclasses.replace(
            config, limits=RouterLimits(max_concurrent=8, max_concurrent_per_client=2),
            trusted_proxies=("127.0.0.4/32",))
        with _servers({"router": create_router_app(config, deadline_s=HOLD_S)}) as endpoints:
            base = f"http://{endpoints['router']}"
            _wait(lambda: httpx.get(f"{base}/v1/info").json()["image_shape"], "e0 seen")

            async def scenario():
                clients = {address: httpx.AsyncClient(
                    base_url=base, timeout=30,
                    transport=httpx.AsyncHTTPTransport(local_address=address))
                    for address in ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")}
                a, b, proxy, untrusted = clients.values()

                def generate(client, label, forwarded=None):
                    headers = {"X-Forwarded-For": forwarded} if forwarded else {}
                    return client.post("/v1/generate", json={"labels": [label], "steps": 3},
                                       headers=headers)

                held = [asyncio.create_task(generate(client, 7, forwarded))
                        for client, forwarded in (
                            (a, None), (a, None), (proxy, "203.0.113.7"),
                            (proxy, "203.0.113.7"), (untrusted, "203.0.113.50"),
                            (untrusted, "203.0.113.51"))]
                while _metric((await b.get("/metrics")).text,
                              "ddm_router_generations_in_flight") < len(held):
                    await asyncio.sleep(0.01)
                started = time.monotonic()
                answers = {
                    "a again": await generate(a, 1),
                    "a streaming": await a.get("/v1/generate/stream",
                                               params={"label": 1, "steps": 3}),
                    "b": await generate(b, 1),
                    "forwarded 203.0.113.7": await generate(proxy, 1, "203.0.113.7"),
                    "203.0.113.7 spoofing": await generate(proxy, 1, "198.51.100.9, 203.0.113.7"),
                    "forwarded 203.0.113.8": await generate(proxy, 1, "203.0.113.8"),
                    "untrusted, new header": await generate(untrusted, 1, "203.0.113.52")}
                quick_s = time.monotonic() - started
                held_answers = await asyncio.gather(*held)
                after = await generate(a, 1)
                for client in clients.values():
                    await client.aclose()
                return answers, quick_s, held_answers, after

            answers, quick_s, held_answers, after = asyncio.run(scenario())
            statuses = {what: reply.status_code for what, reply in answers.items()}
            assert statuses == {"a again": 429, "a streaming": 429, "b": 200,
                                "forwarded 203.0.113.7": 429,
                                "203.0.113.7 spoofing": 429, "forwarded 203.0.113.8": 200,
                                "untrusted, new header": 429}, {
                what: reply.text for what, reply in answers.items()}
            assert quick_s < HOLD_S  # all of them answered while the held ones were in flight
            for what, client in (("a again", "127.0.0.2"), ("a streaming", "127.0.0.2"),
                                 ("forwarded 203.0.113.7", "203.0.113.7"),
                                 ("203.0.113.7 spoofing", "203.0.113.7"),
                                 ("untrusted, new header", "127.0.0.5")):
                reply = answers[what]
                assert reply.headers["Retry-After"] == "1"
                assert reply.json()["detail"] == (
                    f"client {client} has 2 generations in flight, the limit per client is 2 "
                    "(limits.max_concurrent_per_client); retry when one ends"), reply.text
            assert [r.status_code for r in held_answers] == [503] * len(held_answers)
            assert after.status_code == 200, after.text  # the slots were given back
            metrics = httpx.get(f"{base}/metrics").text
            assert _metric(metrics, "ddm_router_client_limited_total") == 5
            assert _metric(metrics, "ddm_router_generations_in_flight") == 0


def test_a_router_with_no_expert_ready_is_not_ready_and_says_so(ddms):
    dead = {name: {"endpoints": [f"127.0.0.1:{free_port()}"]} for name in ("e0", "e1")}
    config = _config(dead, [LOW, HIGH], None, strategy="oracle")
    with _servers({"router": create_router_app(config)}) as endpoints:
        readyz = httpx.get(f"http://{endpoints['router']}/readyz")
    assert readyz.status_code == 503
    assert readyz.json()["missing_experts"] == ["e0", "e1"]
    assert "no expert has a ready replica (e0, e1)" in readyz.json()["problems"]


def test_a_draining_router_is_not_ready(ddms, experts):
    config = _config({"e0": {"endpoints": [experts["e0"]]}, "e1": {"endpoints": [experts["e1"]]}},
                     [LOW, HIGH], None, strategy="oracle")
    draining = False
    with _servers({"router": create_router_app(config, draining=lambda: draining)}) as endpoints:
        base = f"http://{endpoints['router']}"
        _wait(lambda: httpx.get(f"{base}/readyz").status_code == 200, "router ready")
        draining = True
        readyz = httpx.get(f"{base}/readyz")
        generated = httpx.post(f"{base}/v1/generate", json={"labels": [1], "steps": 2})
    assert (readyz.status_code, readyz.json()) == (503, {"status": "draining"})
    assert generated.status_code == 200, generated.text  # still serving meanwhile


# ---------------------------------------------------------------------------- failover


@pytest.fixture(scope="module")
def replicated(ddms, experts, tmp_path_factory) -> Iterator[dict]:
    """Two subprocess replicas of e0, and a subprocess router started by ``serve_router``."""
    directory = tmp_path_factory.mktemp("router")
    ports = [free_port() for _ in range(3)]
    config = _config({"e0": {"endpoints": [f"127.0.0.1:{p}" for p in ports[:2]]},
                      "e1": {"endpoints": [experts["e1"]]}}, [LOW, HIGH], "router",
                     strategy="oracle", timeouts={"connect_s": 1.0, "request_s": 2.0})
    (directory / "router").symlink_to(ddms["split"] / "router")  # relative to the config
    (directory / "router.yaml").write_text(config.to_yaml())
    replicas = {port: _start_expert(ddms["split"] / "e0", port) for port in ports[:2]}
    router = _spawn(["-c", "from ddm.serving.router.api.server import serve_router; "
                           f"serve_router({str(directory / 'router.yaml')!r}, port={ports[2]}, "
                           "log_level='warning', deadline_s=3.0)"])
    state = {"base": f"http://127.0.0.1:{ports[2]}", "replicas": replicas,
             "checkpoint": ddms["split"] / "e0"}
    try:
        _wait(lambda: _status(f"{state['base']}/readyz") == 200, "router ready")
        yield state
    finally:
        for process in [router, *state["replicas"].values()]:
            process.kill()
            process.wait(timeout=30)


def test_killing_a_replica_mid_generation_does_not_fail_it(replicated):
    base = replicated["base"]
    killed = next(iter(replicated["replicas"]))
    with httpx.stream("GET", f"{base}/v1/generate/stream", timeout=60,
                      params={"label": 2, "steps": 200, "strategy": "oracle"}) as response:
        events = _events(response)
        first = next(events)
        assert first[0] == "step" and first[1]["step"] == 1
        replicated["replicas"][killed].send_signal(signal.SIGKILL)
        rest = list(events)
    assert [name for name, _ in rest] == ["step"] * 199 + ["done"], rest[-1]
    assert rest[-1][1]["expert_calls"] == 200
    metrics = httpx.get(f"{base}/metrics").text
    assert _metric(metrics, 'ddm_router_expert_failovers_total{expert="e0"}') >= 1
    states = httpx.get(f"{base}/v1/info").json()["experts"][0]["replicas"]
    assert states[f"127.0.0.1:{killed}"] == "down"


def test_every_replica_down_is_a_503_naming_the_expert_until_it_comes_back(replicated):
    base = replicated["base"]
    for process in replicated["replicas"].values():
        process.kill()
        process.wait(timeout=30)
    started = time.monotonic()
    reply = httpx.post(f"{base}/v1/generate", json={"labels": [2], "steps": 4}, timeout=30)
    assert reply.status_code == 503 and reply.json()["expert"] == "e0", reply.text
    assert "expert e0: unavailable" in reply.json()["detail"]
    assert time.monotonic() - started < 3.0 + 5.0  # the router's deadline, not the client's
    assert httpx.get(f"{base}/healthz").status_code == 200
    readyz = httpx.get(f"{base}/readyz")
    assert readyz.status_code == 200 and readyz.json()["status"] == "degraded", readyz.text
    assert readyz.json()["missing_experts"] == ["e0"]
    # e1 still serves its labels meanwhile.
    assert httpx.post(f"{base}/v1/generate", json={"labels": [8], "steps": 2}).status_code == 200

    port = next(iter(replicated["replicas"]))
    replicated["replicas"][port] = _start_expert(replicated["checkpoint"], port)
    _wait(lambda: httpx.get(f"{base}/readyz").json()["status"] == "ready", "router ready again")
    reply = httpx.post(f"{base}/v1/generate", json={"labels": [2], "steps": 4}, timeout=30)
    assert reply.status_code == 200, reply.text


# ----------------------------------------------------------------------- limits and auth

TOKEN, ROTATED = "first-secret-token-7f3a", "rotated-secret-token-91bc"


@pytest.fixture(scope="module")
def guarded(ddms, experts, tmp_path_factory) -> Iterator[dict]:
    """A router with small limits and a bearer token in a file laid out as Kubernetes mounts
    a Secret: ``token -> ..data/token``, ``..data -> ..<version>`` (swapped on update)."""
    secret = tmp_path_factory.mktemp("secret")
    _mount_secret(secret, "v1", TOKEN)
    (secret / "token").symlink_to("..data/token")
    config = dataclasses.replace(
        _config({"e0": {"endpoints": [experts["e0"]]}, "e1": {"endpoints": [experts["e1"]]}},
                [LOW, HIGH], None, strategy="oracle"),
        limits=RouterLimits(max_batch=4, max_steps=8, max_concurrent=4, max_body_bytes=1024),
        auth=Auth(str(secret / "token")))
    with _servers({"router": create_router_app(config)}) as endpoints:
        base = f"http://{endpoints['router']}"
        _wait(lambda: _status(f"{base}/readyz") == 200, "guarded router ready")
        yield {"base": base, "secret": secret}


def test_the_api_needs_the_bearer_token_and_the_probes_do_not(guarded, caplog):
    base = guarded["base"]
    for name in (None, "uvicorn", "uvicorn.access", "uvicorn.error", "ddm"):
        caplog.set_level(logging.DEBUG, logger=name)  # every logger, the access log included
    refusals = [({}, "missing Authorization header", 'Bearer realm="ddm"'),
                ({"Authorization": f"Basic {TOKEN}"}, "scheme must be Bearer",
                 'Bearer realm="ddm"'),
                ({"Authorization": f"Bearer {TOKEN}x"}, "bad token",
                 'Bearer realm="ddm", error="invalid_token"')]
    replies = []
    for headers, detail, challenge in refusals:
        for reply in (httpx.get(f"{base}/v1/info", headers=headers),
                      httpx.post(f"{base}/v1/generate", headers=headers,
                                 json={"labels": [1], "steps": 2}),
                      httpx.get(f"{base}/v1/generate/stream?label=1", headers=headers)):
            assert reply.status_code == 401, reply.text
            assert detail in reply.json()["detail"]
            assert reply.headers["www-authenticate"] == challenge
            replies.append(reply.text)
    for path in ("/healthz", "/readyz", "/metrics", "/"):
        assert httpx.get(f"{base}{path}").status_code == 200, path
    good = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(f"{base}/v1/info", headers=good).json()["auth"] is True
    reply = httpx.post(f"{base}/v1/generate", headers=good, json={"labels": [1], "steps": 2},
                       timeout=60)
    assert reply.status_code == 200, reply.text
    with httpx.stream("GET", f"{base}/v1/generate/stream?label=7&steps=2", headers=good,
                      timeout=60) as stream:
        assert [name for name, _ in _events(stream)] == ["step", "step", "done"]
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert TOKEN not in logged and TOKEN not in "".join(replies)
    metrics = httpx.get(f"{base}/metrics").text
    assert _metric(metrics, 'ddm_router_requests_total{route="/v1/info",status="401"}') >= 3


def test_the_openapi_document_declares_the_bearer_token(guarded):
    good = {"Authorization": f"Bearer {TOKEN}"}
    document = _document(guarded["base"], headers=good)
    assert document["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer"}}
    refused = httpx.get(f"{guarded['base']}/v1/models")  # OpenAI's path: OpenAI's shape
    assert refused.status_code == 401 and refused.json()["error"]["type"] == (
        "authentication_error"), refused.text
    for path, operations in document["paths"].items():
        for operation in operations.values():
            secured = path.startswith("/v1/")
            assert (operation.get("security") == [{"bearer": []}]) is secured, path
            assert ("401" in _error_statuses(operation)) is secured, path
    body = document["components"]["schemas"]["GenerateRequest"]["properties"]
    assert (body["labels"]["maxItems"], body["steps"]["maximum"]) == (4, 8)
    assert body["strategy"]["pattern"] == "^oracle$"  # no router network: nothing else works
    reply = httpx.post(f"{guarded['base']}/v1/generate", headers=good,
                       json={"labels": [1], "strategy": "top1"})
    assert reply.status_code == 422 and "needs the router network" in reply.json()["detail"]


def test_a_rotated_secret_is_picked_up_without_a_restart(guarded):
    base, secret = guarded["base"], guarded["secret"]
    assert httpx.get(f"{base}/v1/info", headers={"Authorization": f"Bearer {TOKEN}"}
                     ).status_code == 200
    _mount_secret(secret, "v2", ROTATED + "\n")  # as the kubelet does: a new dir, one rename
    try:
        assert httpx.get(f"{base}/v1/info", headers={"Authorization": f"Bearer {TOKEN}"}
                         ).status_code == 401
        assert httpx.get(f"{base}/v1/info", headers={"Authorization": f"Bearer {ROTATED}"}
                         ).status_code == 200
    finally:
        _mount_secret(secret, "v1", TOKEN)


def test_limits_get_413_and_422_with_the_problem_named(guarded):
    base, good = guarded["base"], {"Authorization": f"Bearer {TOKEN}"}

    def post(**kwargs) -> httpx.Response:
        return httpx.post(f"{base}/v1/generate", headers=good, timeout=60, **kwargs)

    padded = {"labels": [1], "steps": 2, "seed": 0, "strategy": "oracle" + " " * 2000}
    declared = post(content=json.dumps(padded))
    assert declared.status_code == 413, declared.text
    assert "exceeds the limit of 1024" in declared.json()["detail"]
    streamed = post(content=iter([b'{"labels": [1], "seed": 0', b" " * 2000, b"}"]))
    assert streamed.status_code == 413, streamed.text  # chunked: no length to check first
    for body, message in (({"labels": [1] * 5}, "labels: List should have at most 4 items"),
                          ({"labels": [1], "steps": 9}, "steps: .*less than or equal to 8"),
                          ({"labels": [12]}, r"labels \[12\] are outside"),
                          ({"labels": [1], "strategy": "best"}, "strategy")):
        reply = post(json=body)
        assert reply.status_code == 422 and re.search(message, reply.json()["detail"]), reply.text
    assert httpx.get(f"{base}/v1/info", headers=good).json()["limits"]["max_body_bytes"] == 1024


def test_a_router_that_cannot_start_exits_1_and_says_why(ddms, experts, tmp_path):
    """Kubernetes shows the termination message in the pod's lastState."""
    config = _config({"e0": {"endpoints": [experts["e0"]]}, "e1": {"endpoints": [experts["e1"]]}},
                     [LOW, HIGH], ddms["split"] / "e0", strategy="top1")  # not a router
    oracle = dataclasses.replace(config, router_checkpoint=None,
                                 sampling=dataclasses.replace(config.sampling, strategy="oracle"))
    missing = tmp_path / "no-token"
    cases = {"network": (config.to_yaml(), [], "e0 is a expert checkpoint, not a router"),
             "config": ("experts: []\n", [], "experts must list at least one expert"),
             "token": (dataclasses.replace(oracle, auth=Auth(str(missing))).to_yaml(), [],
                       f"auth.token_file {missing}: No such file"),
             "flag": (oracle.to_yaml(), ["--auth-token-file", str(missing)],
                      f"auth.token_file {missing}: No such file"),
             "limit": (oracle.to_yaml(), ["--max-steps", "2"],
                       "sampling.steps 6 exceeds limits.max_steps 2"),
             "per client": (oracle.to_yaml(), ["--max-concurrent-per-client", "0"],
                            "limits.max_concurrent_per_client must be an integer >= 1, got 0"),
             "proxy": (oracle.to_yaml(), ["--trusted-proxy", "10.0.0.0/8",
                                          "--trusted-proxy", "10.0.0.1/8"],
                       "trusted_proxies: network '10.0.0.1/8' is not an address or a CIDR")}
    with socket.create_server(("127.0.0.1", 0)) as taken:  # another server's port
        held = taken.getsockname()[1]
        cases |= {"port": (oracle.to_yaml(), ["--port", str(held)],
                           f"cannot listen on 127.0.0.1:{held}: Address already in use"),
                  "metrics port": (oracle.to_yaml(), ["--metrics-port", str(held)],
                                   f"cannot listen on 127.0.0.1:{held}: Address already in use")}
        for name, (text, flags, reason) in cases.items():
            (tmp_path / f"{name}.yaml").write_text(text)
            log = tmp_path / f"{name}.termination-log"
            router = subprocess.Popen(
                [sys.executable, "-c", SERVE, "serve", "router", "--config",
                 str(tmp_path / f"{name}.yaml"), "--port", str(free_port()),
                 "--log-level", "error", *flags],
                env={**os.environ, "OMP_NUM_THREADS": "1", "DDM_TERMINATION_LOG": str(log)})
            assert router.wait(timeout=WAIT_S) == 1, name
            message = log.read_text()
            assert reason in message and message.count("\n") == 1, (name, message)


#: ``ddm serve ...`` through the serving commands' own parser.
SERVE = ("import argparse, sys; from ddm.serving.commands import add_serve_commands; "
         "parser = argparse.ArgumentParser(); add_serve_commands(parser.add_subparsers()); "
         "args = parser.parse_args(); sys.exit(args.handler(args))")


def _mount_secret(directory: Path, version: str, token: str) -> None:
    """Point ``directory/..data`` at a fresh ``..<version>/token`` with one atomic rename."""
    (directory / f"..{version}").mkdir(exist_ok=True)
    (directory / f"..{version}" / "token").write_text(token)
    (directory / "..data_tmp").symlink_to(f"..{version}")
    os.replace(directory / "..data_tmp", directory / "..data")


# ----------------------------------------------------------------------------- helpers


def _write_ddm(root: Path, groups: list[list[int]], method: str, seed: int,
               architecture: UNetConfig = SMOKE) -> Path:
    scheme = {"method": method, "groups": groups}
    for index, classes in enumerate(groups):
        torch.manual_seed(seed + index)
        meta = CheckpointMeta(kind="expert", name=f"e{index}",
                              architecture=architecture.to_dict(), framework="torch",
                              classes=classes, partition={"scheme": scheme, "index": index})
        save_checkpoint(root / f"e{index}", meta, canonical_weights(UNet(architecture)))
    torch.manual_seed(seed + 99)
    router = RouterNetworkConfig(image_size=architecture.image_size, num_experts=len(groups))
    save_checkpoint(root / "router",
                    CheckpointMeta(kind="router", name="router", architecture=router.to_dict(),
                                   framework="torch", classes=range(10),
                                   partition={"scheme": scheme}),
                    canonical_weights(RouterNet(router)))
    return root


def _config(discovery: dict[str, dict], classes: list[list[int]], router: Path | str | None,
            strategy: str, timeouts: dict | None = None) -> RouterConfigFile:
    raw = {"experts": [{"name": name, "classes": c, "discovery": d}
                       for (name, d), c in zip(discovery.items(), classes)],
           "sampling": {"steps": 6, "strategy": strategy},
           "router_checkpoint": None if router is None else str(router),
           "dns_refresh_s": 1.0}
    if timeouts:
        raw["timeouts"] = timeouts
    return RouterConfigFile.from_dict(raw)


@contextmanager
def _servers(apps: dict) -> Iterator[dict[str, str]]:
    """Serve each app on a free loopback port in a thread; yields ``host:port`` by name."""
    with _uvicorn_servers(apps) as running:
        yield {name: endpoint for name, (endpoint, _) in running.items()}


@contextmanager
def _uvicorn_servers(apps: dict, send_buffer_bytes: int | None = None
                     ) -> Iterator[dict[str, tuple[str, uvicorn.Server]]]:
    """:func:`_servers`, yielding each server with its ``host:port`` (for a test that watches
    a server's connections); with ``send_buffer_bytes``, every connection a server accepts has
    that kernel send buffer (inherited from the listening socket), not one autotuned to MBs."""
    running = {}
    try:
        for name, app in apps.items():
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            if send_buffer_bytes is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
            sock.bind(("127.0.0.1", 0))
            server = build_server(app, "127.0.0.1", sock.getsockname()[1], log_level="warning")
            thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
            thread.start()
            running[name] = (sock, server, thread)
        endpoints = {name: f"127.0.0.1:{sock.getsockname()[1]}"
                     for name, (sock, _, _) in running.items()}
        for endpoint in endpoints.values():
            _wait(lambda: _status(f"http://{endpoint}/healthz") == 200, f"{endpoint} up")
        yield {name: (endpoints[name], server) for name, (_, server, _) in running.items()}
    finally:
        for sock, server, thread in running.values():
            server.should_exit = True
            thread.join(timeout=10)
            sock.close()


def _start_expert(checkpoint: Path, port: int) -> subprocess.Popen:
    process = _spawn(["-m", "ddm.cli", "serve", "expert", "--checkpoint", str(checkpoint),
                      "--port", str(port), "--max-batch", "8", "--log-level", "warning"])
    _wait(lambda: _status(f"http://127.0.0.1:{port}/readyz") == 200, f"replica {port} ready",
          process)
    return process


def _spawn(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, *args], env=env)


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


def _stream(base: str, **params) -> list[tuple[str, dict]]:
    with httpx.stream("GET", f"{base}/v1/generate/stream", params=params, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(_events(response))


def _events(response: httpx.Response) -> Iterator[tuple[str, dict]]:
    """Parse Server-Sent Events: ``(event name, JSON data)`` in order."""
    name, data = None, []
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data.append(line[len("data: "):])
        elif not line and name is not None:
            yield name, json.loads("\n".join(data))
            name, data = None, []


class _Elements(HTMLParser):
    """The text of every ``<tag>`` element without a ``src``, as a browser reads it."""

    def __init__(self, tag: str) -> None:
        super().__init__(convert_charrefs=False)
        self.tag, self.found, self.inside = tag, [], False

    def handle_starttag(self, tag, attrs):
        if tag == self.tag and "src" not in dict(attrs):
            self.inside = True
            self.found.append("")

    def handle_data(self, data):
        if self.inside:
            self.found[-1] += data

    def handle_endtag(self, tag):
        self.inside = self.inside and tag != self.tag


def _inline_elements(html: str, tag: str) -> list[str]:
    parser = _Elements(tag)
    parser.feed(html)
    parser.close()
    return parser.found


def _image(png: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(png))))


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.TransportError:
        return None


def _wait(condition, what: str, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {WAIT_S} s")
        time.sleep(0.05)


def _metric(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (or of one labelled sample)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(text))


def _port(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])




@contextmanager
def _router_of_one_slot(experts: dict[str, str]) -> Iterator[tuple[str, str]]:
    """A ready router over e0 and e1 (oracle) that runs one generation at a time, of up to
    1000 steps: its endpoint and base URL."""
    config = _config({"e0": {"endpoints": [experts["e0"]]}, "e1": {"endpoints": [experts["e1"]]}},
                     [LOW, HIGH], None, strategy="oracle")
    config = dataclasses.replace(config, limits=RouterLimits(max_concurrent=1, max_steps=1000))
    with _servers({"router": create_router_app(config)}) as endpoints:
        base = f"http://{endpoints['router']}"
        _wait(lambda: httpx.get(f"{base}/readyz").status_code == 200, "router ready")
        yield endpoints["router"], base


def test_a_stream_whose_client_disconnects_is_closed_and_frees_its_slot(ddms, experts):
    with _router_of_one_slot(experts) as (router, base):
        with socket.create_connection(tuple(_split(router))) as sock:
            sock.sendall(b"GET /v1/generate/stream?label=1&steps=1000 HTTP/1.1\r\nHost: x\r\n\r\n")
            received = b""
            while b"event: step" not in received:
                received += sock.recv(65536)
            in_flight = _metric(httpx.get(f"{base}/metrics").text,
                                "ddm_router_generations_in_flight")
        assert in_flight == 1
        _wait(lambda: _metric(httpx.get(f"{base}/metrics").text,
                              "ddm_router_generations_in_flight") == 0, "the slot freed")
        ok = httpx.post(f"{base}/v1/generate", json={"labels": [2], "steps": 3}, timeout=30)
        assert ok.status_code == 200, ok.text


def test_a_json_generation_whose_client_disconnects_stops_and_frees_its_slot(ddms, experts):
    """A client that leaves before its answer (curl interrupted, a proxy's timeout) ends its
    generation: its slot is freed and its expert gets no more calls, rather than the router
    running every step for nobody while the client's retries get 429."""
    with _router_of_one_slot(experts) as (router, base):
        before = _velocity_calls(experts["e0"])
        body = json.dumps({"labels": [1], "steps": 1000}).encode()
        with socket.create_connection(_split(router)) as sock:
            sock.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            _wait(lambda: _velocity_calls(experts["e0"]) > before, "the generation started")
        _wait(lambda: _metric(_metrics(base), "ddm_router_generations_in_flight") == 0,
              "the slot freed")
        assert _velocity_calls(experts["e0"]) - before < 1000  # it stopped before its end
        assert _metric(_metrics(base), 'ddm_router_requests_total{route="/v1/generate",'
                                       'status="499"}') == 1
        ok = httpx.post(f"{base}/v1/generate", json={"labels": [2], "steps": 3}, timeout=30)
        assert ok.status_code == 200, ok.text


def test_a_stream_whose_client_stopped_reading_is_closed_when_it_disconnects(tmp_path):
    """A client that stops reading fills the socket buffers until the router's writes block,
    the stream's generator suspended at a ``yield`` until its frame is written. When the client
    then goes away, the generation stops all the same: its slot is freed and its expert gets no
    more calls.

    The experts serve 64x64 images, so that a step's preview is about 5 KB (noise as PNG), and
    the router's send buffer is held at 16 KiB: a few dozen steps of the 1000 fill the buffers.
    (The disconnect releases the blocked write, so the stream's cancellation reaches the
    generator at its next expert call: this holds on the code before the stream closed its
    generator explicitly too, 8790abd.)
    """
    wide = _write_ddm(tmp_path, [LOW, HIGH], "labels", seed=0,
                      architecture=dataclasses.replace(SMOKE, image_size=64))
    with _servers({name: create_model_app(wide / name, ServingOptions(max_batch=8))
                   for name in ("e0", "e1")}) as experts:
        config = _config({name: {"endpoints": [experts[name]]} for name in ("e0", "e1")},
                         [LOW, HIGH], None, strategy="oracle")
        config = dataclasses.replace(config, limits=RouterLimits(max_concurrent=1,
                                                                 max_steps=1000))
        apps = {"router": create_router_app(config)}
        with _uvicorn_servers(apps, send_buffer_bytes=16 * 1024) as running:
            endpoint, server = running["router"]
            router = f"http://{endpoint}"
            _wait(lambda: _status(f"{router}/readyz") == 200, "router ready")
            client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window
            client.settimeout(WAIT_S)
            client.connect(_split(endpoint))
            client.sendall(b"GET /v1/generate/stream?label=1&steps=1000&seed=3 HTTP/1.1\r\n"
                           b"Host: x\r\n\r\n")
            received = b""
            while b"event: step" not in received:  # the first step, then no more reading
                chunk = client.recv(4096)
                assert chunk, f"the router ended the stream: {received!r}"
                received += chunk
            _wait(lambda: _writes_paused(server), "the router's writes to the client blocked")
            assert _metric(_metrics(router), "ddm_router_generations_in_flight") == 1
            client.close()
            _wait(lambda: _metric(_metrics(router), "ddm_router_generations_in_flight") == 0,
                  "the generation's slot freed")
            calls = _velocity_calls(experts["e0"])
            assert calls < 1000  # it stopped before its end
            ok = httpx.post(f"{router}/v1/generate", json={"labels": [7], "steps": 3},
                            timeout=30)  # e1's label, in the one slot, free again
            assert ok.status_code == 200, ok.text
            assert _velocity_calls(experts["e1"]) == 3
            assert _velocity_calls(experts["e0"]) == calls


def _metrics(base: str) -> str:
    return httpx.get(f"{base}/metrics", timeout=10).text


def _velocity_calls(expert: str) -> float:
    """Velocity requests the expert at ``host:port`` has answered."""
    return _metric(_metrics(f"http://{expert}"),
                   'ddm_expert_requests_total{kind="velocity",status="200"}')


def _writes_paused(server: uvicorn.Server) -> bool:
    """Whether ``server`` holds a reply it cannot write: a connection's transport buffer is
    over its high-water mark (uvicorn's flow control), its client not reading."""
    return any(c.flow is not None and c.flow.write_paused
               for c in list(server.server_state.connections))


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def test_a_stopped_router_closes_its_router_networks_coalescer(ddms, experts):
    config = _config({"e0": {"endpoints": [experts["f0"]]}, "e1": {"endpoints": [experts["f1"]]}},
                     [ALL, ALL], ddms["shared"] / "router", strategy="top1")
    app = create_router_app(config)
    with _servers({"router": app}) as endpoints:
        _wait(lambda: _status(f"http://{endpoints['router']}/readyz") == 200, "router ready")
        network = app.state.router.network
        assert network is not None
    x = np.zeros((1, *SHAPE), np.float32)
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(network(x, np.zeros(1, np.float32), np.zeros(1, np.int64)))


def test_experts_with_a_token_answer_only_the_router_that_sends_it(ddms, tmp_path):
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "other").write_text("another-ddms-token")
    apps = {name: create_model_app(ddms["split"] / name, ServingOptions(
                max_batch=8, auth_token_file=tmp_path / "token")) for name in ("e0", "e1")}
    with _servers(apps) as experts:
        expert = f"http://{experts['e0']}"
        assert httpx.post(f"{expert}/v1/velocity", content=b"x").status_code == 401
        assert httpx.get(f"{expert}/v1/info").status_code == 401
        assert all(httpx.get(f"{expert}{path}").status_code == 200
                   for path in ("/healthz", "/readyz", "/metrics"))
        discovery = {name: {"endpoints": [endpoint]} for name, endpoint in experts.items()}
        for token, status in (("token", 200), ("other", 503)):
            config = dataclasses.replace(
                _config(discovery, [LOW, HIGH], None, strategy="oracle",
                        timeouts={"connect_s": 0.5, "request_s": 0.5}),
                auth=Auth(str(tmp_path / token)))
            with _servers({"router": create_router_app(config, deadline_s=2.0)}) as router:
                base = f"http://{router['router']}"
                bearer = {"Authorization": f"Bearer {(tmp_path / token).read_text().strip()}"}
                reply = httpx.post(f"{base}/v1/generate", json={"labels": [1], "steps": 2},
                                   headers=bearer, timeout=30)
                assert reply.status_code == status, reply.text
                if status == 503:  # its probes cannot read the experts' /v1/info
                    assert httpx.get(f"{base}/readyz").json()["missing_experts"] == ["e0",
                                                                                     "e1"]
