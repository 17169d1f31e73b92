"""Hostile input against real servers on loopback: the router's JSON API, the expert's binary
endpoint, and both OpenAPI documents.

One module-scoped DDM runs as real processes (``ddm serve expert`` twice, ``ddm serve router``,
through ``ddm.runtime.local``'s supervisor): random-init ``smoke`` experts for labels 0-4 and
5-9 and a random-init router network, the router with small limits (4 labels, 4 steps) so that
a request valid by chance costs a few milliseconds. Then:

- ten thousand ``POST /v1/generate`` bodies and ``GET /v1/generate/stream`` queries: never a
  5xx; every refusal a 4xx whose JSON ``detail`` says what is wrong; every acceptance a result;
- ten thousand expert bodies (``tests/protocol_strategies.py``) through HTTP: each answered
  exactly as the decoder decides (200 with a finite result, or an error reply whose code is the
  HTTP status and which echoes the request id);
- schemathesis from each server's ``/openapi.json``: no 5xx, answers as documented.

After each, the server is still healthy and its peak resident memory (``VmHWM`` in
``/proc/PID/status``) grew by less than a bound over its size after warming up.
"""

from __future__ import annotations

import io
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol_strategies import Target, request_bodies
from ddm.runtime.local import HeldPorts, ProcessSpec, Supervisor
from ddm.serving.wire.protocol import (CONTENT_TYPE, UNKNOWN_CONTEXT, IntegrateRequest, Limits,
                                       ProtocolError, RemoteExpertError, Solver, VelocityRequest,
                                       decode_request, decode_response, encode_request)
from ddm.deploy.router_config import (ExpertEntry, RouterConfigFile, SamplingDefaults,
                                       StaticDiscovery)

HOST = "127.0.0.1"
CASES = 10_000
FUZZ = settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
#: The router's limits: a valid request is at most 4 images of 4 steps.
MAX_LABELS, MAX_STEPS = 4, 4
#: How much a server's peak resident memory may grow over ten thousand hostile requests.
RSS_GROWTH_MIB = 64
ENV = (("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"), ("PYTHONUNBUFFERED", "1"))
GROUPS = ((0, 1, 2, 3, 4), (5, 6, 7, 8, 9))


@dataclass(frozen=True)
class Server:
    url: str
    pid: int

    def memory_kib(self, field: str) -> int:
        """``VmRSS`` (now) or ``VmHWM`` (peak) of the process, in KiB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
        raise AssertionError(f"no {field} in /proc/{self.pid}/status")


@dataclass(frozen=True)
class Fleet:
    router: Server
    experts: tuple[Server, ...]


def _write_ddm(root: Path) -> tuple[list[Path], Path]:
    import torch

    from ddm.checkpoints.format import CheckpointMeta, save_checkpoint
    from ddm.models.config import UNET_CONFIGS, RouterNetworkConfig
    from ddm.models.router_net import RouterNet
    from ddm.models.torch_io import canonical_weights
    from ddm.models.torch_unet import UNet

    smoke = UNET_CONFIGS["smoke"]
    scheme = {"method": "labels", "groups": [list(g) for g in GROUPS]}
    experts = []
    for index, classes in enumerate(GROUPS):
        torch.manual_seed(index)
        meta = CheckpointMeta(kind="expert", name=f"smoke-{index}", architecture=smoke.to_dict(),
                              framework="torch", classes=classes,
                              partition={"scheme": scheme, "index": index})
        experts.append(save_checkpoint(root / f"e{index}", meta, canonical_weights(UNet(smoke))))
    torch.manual_seed(99)
    arch = RouterNetworkConfig(image_size=smoke.image_size, num_experts=len(GROUPS))
    router = save_checkpoint(root / "router", CheckpointMeta(
        kind="router", name="router", architecture=arch.to_dict(), framework="torch",
        classes=range(10), partition={"scheme": scheme}), canonical_weights(RouterNet(arch)))
    return experts, router


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fuzz-ddm")
    checkpoints, router_checkpoint = _write_ddm(root)
    ddm = (sys.executable, "-m", "ddm")
    held = HeldPorts(HOST)  # as ddm up: the router's port is not taken while experts load
    experts = [ProcessSpec(f"e{i}", (*ddm, "serve", "expert", "--checkpoint", str(path),
                                     "--host", HOST, "--port", str(port), "--max-batch",
                                     str(MAX_LABELS), "--log-level", "warning"), port, ENV)
               for i, (path, port) in enumerate((p, held.draw()) for p in checkpoints)]
    config = RouterConfigFile(
        experts=tuple(ExpertEntry(f"e{i}", StaticDiscovery((f"{HOST}:{spec.port}",)), classes)
                      for i, (spec, classes) in enumerate(zip(experts, GROUPS))),
        num_classes=10, sampling=SamplingDefaults(2, "euler", "oracle"),
        router_checkpoint=str(router_checkpoint))
    (root / "router.yaml").write_text(config.to_yaml())
    port = held.draw()
    router = ProcessSpec("router", (*ddm, "serve", "router", "--config", str(root / "router.yaml"),
                                    "--host", HOST, "--port", str(port), "--max-batch",
                                    str(MAX_LABELS), "--max-steps", str(MAX_STEPS),
                                    "--log-level", "warning"), port, ENV)
    log = io.StringIO()
    supervisor = Supervisor(log, held=held)
    try:
        supervisor.start_ready(experts, HOST)
        supervisor.start_ready([router], HOST)

        def server(spec: ProcessSpec) -> Server:
            return Server(f"http://{HOST}:{spec.port}", supervisor.processes[spec.name].pid)

        yield Fleet(server(router), tuple(map(server, experts)))
    finally:
        supervisor.stop()
        held.close()
    assert all(p.returncode in (0, -15) for p in supervisor.processes.values()), log.getvalue()


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as c:
        yield c


def _assert_healthy_and_bounded(server: Server, client: httpx.Client, baseline_kib: int) -> None:
    assert client.get(f"{server.url}/healthz").status_code == 200
    assert client.get(f"{server.url}/readyz").status_code == 200
    growth_mib = (server.memory_kib("VmHWM") - baseline_kib) / 1024
    assert growth_mib <= RSS_GROWTH_MIB, f"peak RSS grew by {growth_mib:.0f} MiB"


# ------------------------------------------------------------------ the router's JSON API

# Hypothesis draws the form of a request and a seed; a generator seeded by it fills the fields
# from pools of near-valid and hostile values. Drawing every field through Hypothesis costs a
# dozen draws per request, several seconds per thousand requests on a shared two-core machine.
_HOSTILE = (None, True, False, 0, -1, 1.5, -0.0, 2**31, 2**63, 2**64, 2**70, -2**70, 1e308,
            float("nan"), float("inf"), "", "0", "1", "4", " 2", "x" * 300, "\u0000", "\ud800",
            "\u202e", "<script>", "${jndi:x}", [], [0], [[1]], [None], {}, {"labels": [1]},
            {"$ref": "#"}, "oracle")
_NEAR_VALID = {
    "labels": [[], [0], [9], [0, 5], [4, 5, 9, 1], [0] * (MAX_LABELS + 1), [-1], [10], [3, 11],
               [True], [1.0], ["1"]],
    "label": [0, 4, 5, 9, -1, 10, 2**64, "1"],
    "steps": [1, 2, MAX_STEPS, 0, -1, MAX_STEPS + 1, 2.0, "2"],
    "seed": [0, 1, 2**63 - 1, 2**63, -1, 2**64],
    "strategy": ["oracle", "top1", "top2", "topk:2", "topk:0", "topk:-1", "threshold:0.2",
                 "threshold:2", "threshold:nan", "ensemble", "random", "", "TOP1",
                 "topk:99999999999999999999", "top1 ", "threshold:", "topk:1e3"],
    "solver": ["euler", "heun", "rk4", "Euler"],
    "delegate_steps": [0, 1, 2, MAX_STEPS, MAX_STEPS + 1, -1],
    "extra": [1],
}
_BROKEN_JSON = ("", "{", "[]", "null", '{"labels": [1]', '{"labels": [1]}{}', "\ufeff{}",
                '{"labels": [1], "labels": [2]}', "{'labels': [1]}", '{"labels": [1e999]}')
_FORMS = ("generate", "generate", "generate", "generate: any JSON", "generate: broken",
          "generate: bytes", "stream", "stream")


def _value(rng: random.Random, field: str) -> Any:
    pool = _NEAR_VALID[field] if rng.random() < 0.7 else _HOSTILE
    return rng.choice(pool)


def _router_request(form: str, seed: int) -> tuple[str, Any, str]:
    """(method, JSON body or query, content type) of one hostile request."""
    rng = random.Random(seed)
    content_type = rng.choice(["application/json"] * 3 + ["text/plain", ""])
    fields = [f for f in _NEAR_VALID if f != "label" and rng.random() < 0.4]
    if form == "generate":
        body = {f: _value(rng, f) for f in ["labels", *fields] if f != "labels" or
                rng.random() < 0.9}
        return "POST", json.dumps(body), content_type
    if form == "generate: any JSON":
        return "POST", json.dumps(rng.choice(_HOSTILE)), content_type
    if form == "generate: broken":
        return "POST", rng.choice(_BROKEN_JSON), content_type
    if form == "generate: bytes":
        return "POST", rng.randbytes(rng.randrange(64)), content_type
    query = {f: _value(rng, f) for f in ["label", *fields] if f != "label" or rng.random() < 0.9}
    return "GET", {k: [_text(v) for v in value] if isinstance(value, list) else _text(value)
                   for k, value in query.items()}, ""


def _text(value: Any) -> str:
    """A query value: a lone surrogate cannot be sent, its escape can."""
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")


_router_requests = st.builds(_router_request, st.sampled_from(_FORMS), st.integers(0, 2**32 - 1))


def _check_router_answer(answer: httpx.Response, method: str, sent: Any) -> int:
    assert answer.status_code < 500, (answer.status_code, sent, answer.text[:500])
    if answer.status_code == 200:
        if method == "POST":
            reply = answer.json()
            assert len(reply["images"]) == len(json.loads(sent)["labels"]), sent
        else:
            assert answer.headers["content-type"].startswith("text/event-stream")
            assert "event: done" in answer.text and "event: failure" not in answer.text, sent
        return 200
    assert 400 <= answer.status_code < 500, (answer.status_code, sent)
    detail = answer.json()["detail"]
    assert isinstance(detail, str) and detail.strip(), (sent, answer.text)
    return answer.status_code


@pytest.mark.slow
def test_the_router_answers_10000_hostile_requests_with_4xx_or_a_result(
        fleet: Fleet, client: httpx.Client) -> None:
    router = fleet.router
    warm = client.post(f"{router.url}/v1/generate", json={"labels": [0, 9]})
    assert warm.status_code == 200, warm.text
    baseline = router.memory_kib("VmRSS")
    statuses: dict[int, int] = {}

    @FUZZ
    @given(_router_requests)
    def hostile(request: tuple[str, Any, str]) -> None:
        method, sent, content_type = request
        if method == "POST":
            headers = {"content-type": content_type} if content_type else {}
            answer = client.post(f"{router.url}/v1/generate", content=sent, headers=headers)
        else:
            answer = client.get(f"{router.url}/v1/generate/stream", params=sent)
        status = _check_router_answer(answer, method, sent)
        statuses[status] = statuses.get(status, 0) + 1

    hostile()
    assert sum(statuses.values()) >= CASES
    # refused as malformed JSON (400), not sent as JSON (415) or invalid (422): most of them
    refused = sum(statuses.get(status, 0) for status in (400, 415, 422))
    assert statuses.get(200, 0) >= CASES // 50 and refused >= CASES // 2, statuses
    assert statuses.get(415, 0) >= CASES // 50, statuses  # text/plain and no content type
    _assert_healthy_and_bounded(router, client, baseline)


# ------------------------------------------------------------- the expert's binary endpoint

def _expert_limits(client: httpx.Client, expert: Server) -> Limits:
    info = client.get(f"{expert.url}/v1/info").json()
    return Limits(max_batch=info["max_batch"], max_body_bytes=info["max_body_bytes"],
                  max_steps=info["max_steps"], image_shape=tuple(info["image_shape"]),
                  allowed_labels=frozenset(info["classes"]))


@pytest.mark.slow
def test_an_expert_answers_10000_hostile_bodies_as_its_decoder_decides(
        fleet: Fleet, client: httpx.Client) -> None:
    expert = fleet.experts[0]
    limits = _expert_limits(client, expert)
    target = _target(limits)
    url = f"{expert.url}/v1/velocity"
    headers = {"content-type": CONTENT_TYPE}
    assert client.post(url, content=target.context, headers=headers).status_code == 200
    baseline = expert.memory_kib("VmRSS")
    statuses: dict[int, int] = {}

    @FUZZ
    @given(request_bodies(target))
    def hostile(body: bytes) -> None:
        try:  # what the expert must answer; a non-ProtocolError here is a decoder bug
            request = decode_request(body, limits)
            expected, request_id = _held_rows_verdict(request, target), request.request_id
        except ProtocolError as error:
            expected, request_id = error.status, error.request_id or 0
        answer = client.post(url, content=body, headers=headers)
        assert answer.status_code == expected, (answer.status_code, expected, body[:80])
        assert answer.headers["content-type"] == CONTENT_TYPE
        if expected == 200:  # states beyond MAX_STATE_MAGNITUDE, which overflowed, are 422s
            decode_response(answer.content, request_id, request.x.shape)
        else:
            with pytest.raises(RemoteExpertError) as refused:
                decode_response(answer.content, request_id)
            assert refused.value.code == expected and refused.value.message.strip()
            assert refused.value.request_id == request_id
        statuses[expected] = statuses.get(expected, 0) + 1

    hostile()
    assert sum(statuses.values()) >= CASES
    assert statuses.get(200, 0) >= CASES // 50 and statuses.get(422, 0) >= CASES // 50, statuses
    _assert_healthy_and_bounded(expert, client, baseline)


# ------------------------------------------------------------------ the OpenAPI documents

def _operations(url: str) -> list[Any]:
    """Every operation of the OpenAPI document at ``url``, as schemathesis reads it."""
    schema = schemathesis.openapi.from_url(url)
    return [result.ok() for result in schema.get_all_operations()]


def _call_and_validate(operation: Any, examples: int, **checks: Any) -> None:
    """schemathesis' generated requests for ``operation``, each answer checked (by default
    with every check: no 5xx, documented status, content type, headers and schema).
    Driven here rather than by schemathesis' pytest plugin, which does not run under pytest 9."""

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy())
    def conforms(case: Any) -> None:
        case.call_and_validate(**checks)

    conforms()


ROUTER_OPERATIONS = {("POST", "/v1/generate"), ("GET", "/v1/generate/stream"), ("GET", "/v1/info"),
                     ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics")}


@pytest.mark.slow
def test_schemathesis_gets_no_server_error_from_the_router(
        fleet: Fleet, client: httpx.Client) -> None:
    operations = _operations(f"{fleet.router.url}/openapi.json")
    assert {(o.method.upper(), o.path) for o in operations} >= ROUTER_OPERATIONS
    for operation in operations:
        _call_and_validate(operation, 100, checks=[not_a_server_error])
    assert client.get(f"{fleet.router.url}/healthz").status_code == 200


@pytest.mark.slow
def test_the_router_answers_as_its_openapi_document_says(fleet: Fleet) -> None:
    for operation in _operations(f"{fleet.router.url}/openapi.json"):
        _call_and_validate(operation, 100)


def _target(limits: Limits) -> Target:
    """The hostile bodies' target: the expert's shapes and labels, and grids of 8 steps."""
    return Target(limits.image_shape, tuple(sorted(limits.allowed_labels)), limits.max_batch,
                  max_steps=8)


def _held_rows_verdict(request: Any, target: Target) -> int:
    """What the expert answers a request its decoder accepted: it must hold the context the
    request names (the target's, posted first: 412 otherwise) and the rows must be rows of it,
    unguided (422 otherwise; every label of it is served)."""
    if request.context != target.context_id:
        return UNKNOWN_CONTEXT
    if request.rows.max() >= len(target.labels) or (request.guidance != 1.0).any():
        return 422
    return 200


def _request_messages(limits: Limits, target: Target) -> st.SearchStrategy[bytes]:
    """Velocity and integrate requests the expert accepts, from the real encoder: rows of the
    label context of every label it serves (``target.context``, posted first)."""
    context, labels = target.context_id, len(target.labels)

    def message(seed: int) -> bytes:
        rng = np.random.default_rng(seed)
        batch = int(rng.integers(1, limits.max_batch + 1))
        x = rng.standard_normal((batch, *limits.image_shape)).astype(np.float32)
        rows = rng.integers(0, labels, batch).astype(np.int32)
        unguided = np.ones(batch, np.float32)
        if rng.integers(2):
            t = rng.uniform(0.0, 1.0, batch).astype(np.float32)
            return encode_request(VelocityRequest(seed, x, t, context, rows, unguided))
        grid = np.linspace(0.0, 1.0, int(rng.integers(2, 6)), dtype=np.float32)
        return encode_request(IntegrateRequest(seed, x, context, rows, unguided, grid,
                                                        Solver(1 + seed % 2)))

    return st.integers(0, 2**32 - 1).map(message)


def test_the_expert_answers_as_its_openapi_document_says(
        fleet: Fleet, client: httpx.Client) -> None:
    # The document can say only that a body is binary (docs/protocol.md), which schemathesis
    # can neither serialise nor fill: told nothing, it would send random bytes as "valid" and
    # count the expert's 400 against it. So it is told what a request message is; hostile
    # bodies are the 10000-body test's.
    limits = _expert_limits(client, fleet.experts[0])
    target = _target(limits)
    held = client.post(f"{fleet.experts[0].url}/v1/velocity", content=target.context,
                       headers={"content-type": CONTENT_TYPE})
    assert held.status_code == 200
    schemathesis.openapi.media_type(CONTENT_TYPE, _request_messages(limits, target))
    operations = _operations(f"{fleet.experts[0].url}/openapi.json")
    assert {(o.method.upper(), o.path) for o in operations} >= {
        ("POST", "/v1/velocity"), ("GET", "/v1/info"), ("GET", "/healthz"), ("GET", "/readyz"),
        ("GET", "/metrics")}
    for operation in operations:
        _call_and_validate(operation, 100)
