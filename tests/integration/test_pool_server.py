"""A pool server (``ddm serve pool``) over real HTTP on loopback, holding every stage of a
tiny Paris DDM (two experts, text encoder, decoder, router network) on one device: each
member answers the same bytes as its own stage server; ``/v1/info`` lists the members and
their memory; ``/readyz`` is 200 once every member is loaded; rows batch per member, never
across members; a router whose router.yaml points every expert and stage at the pool
(``member:``) gives the unpooled deployment's image, with one pool request per step; a pool
over its memory limit exits 1 before loading anything, naming each member's bytes, the sum and
the limit; with ``--grouped-forward on`` the two experts' rows run as one grouped forward,
each row still its own expert's."""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddm.checkpoints.declared import EXPERT, PLAN_NAMES
from ddm.conditioning import Conditioning
from ddm.deploy.router_config import RouterConfigFile, StaticDiscovery
from ddm.serving.http.auth import TokenFile
from ddm.serving.model.grouped import preload
from ddm.serving.model.server import create_model_app, load_member
from ddm.serving.model.stage import VelocityKey
from ddm.serving.model.options import Hooks, ServingOptions
from ddm.serving.wire.paths import POOL_VELOCITY_PATH
from ddm.serving.wire.protocol import (CONTENT_TYPE, Context, DecodeRequest, EncodeRequest,
                                       PoolVelocityRequest, RouteRequest, VelocityRequest,
                                       context_id, decode_pool_response, decode_response,
                                       encode_pool_request, encode_request)
from ddm.serving.router.fleet.lockstep import Lockstep
from ddm.serving.router.fleet.pool import ExpertPool
from ddm.serving.router.fleet.servers import PoolSettings
from ddm.serving.router.fleet.replicas import ExpertInfo
from ddm.serving.router.api.server import create_router_app
from tests.integration.servers import running, wait_ready
from tests.support.text_router import EXPERTS, STAGES, paris_stages, text_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: Pool member name -> its directory in the tiny Paris DDM's stages.
MEMBERS = {**{f"expert-{k}": f"expert_{k}" for k in range(EXPERTS)},
           **{PLAN_NAMES[role]: directory for role, directory in STAGES.items()}}
RNG = np.random.default_rng(0)
READY_S = 120.0


@pytest.fixture(scope="module")
def stages(tmp_path_factory) -> Path:
    return paris_stages(tmp_path_factory.mktemp("paris"))


def members_of(stages: Path) -> dict[str, Path]:
    return {name: stages / directory for name, directory in MEMBERS.items()}


@pytest.fixture(scope="module")
def pool(stages) -> Iterator[str]:
    with running(create_model_app(members_of(stages), ServingOptions(max_batch=8))) as base:
        wait_ready(base)
        yield base


def until(check, what: str) -> None:
    """Poll ``check()`` until it is true (an event on a server), failing after READY_S."""
    deadline = time.monotonic() + READY_S
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def post(base: str, path: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{base}{path}", content=body, headers={"content-type": CONTENT_TYPE},
                      timeout=READY_S)


def requests_for(name: str, info: dict) -> list[bytes]:
    """Bodies of every kind ``name``'s role serves, sized from its ``/v1/info``: a context
    then guided and unguided velocities (an expert), prompts, latents, routing inputs."""
    latent = tuple(info["latent_shape"])
    x = RNG.standard_normal((3, *latent)).astype(np.float32)
    t = np.array([0.2, 0.5, 0.9], np.float32)
    if info["role"] == EXPERT:
        width = info["text_width"]
        embeddings = RNG.standard_normal((3, 5, width)).astype(np.float32)
        context = encode_request(Context(1, embeddings, np.ones((3, 5), np.uint8),
                                              np.zeros_like(embeddings)))
        return [context, encode_request(VelocityRequest(
            2, x, t, context_id(context), np.array([2, 0, 1], np.int32),
            np.array([7.5, 1.0, 3.0], np.float32)))]
    if info["role"] == "text_encoder":
        return [encode_request(EncodeRequest(3, ("a red car", "a photo", "")))]
    if info["role"] == "decoder":
        return [encode_request(DecodeRequest(4, x))]
    return [encode_request(RouteRequest(5, x, t, np.zeros((3, 0), np.float32)))]


def test_each_member_answers_the_bytes_of_its_own_stage_server(stages, pool):
    info = httpx.get(f"{pool}/v1/info").json()
    assert list(info["members"]) == list(MEMBERS)
    figures = info["pool"]
    assert set(figures["members"]) == set(MEMBERS) and figures["ready"]
    assert figures["device"] == "cpu"
    assert figures["cpu_threads"] is None  # an app in this test's process: no share
    assert figures["groups"] == []  # grouped forwards are auto: on an accelerator only
    # No flag: the limit is this machine's cgroup's, where it sets one.
    assert (figures["limit_bytes"] is None) == (figures["limit_source"] is None)
    assert figures["total_bytes"] == sum(m["bytes"] for m in figures["members"].values())
    for name, directory in members_of(stages).items():
        member = httpx.get(f"{pool}/v1/members/{name}/info").json()
        assert info["members"][name] == member
        assert httpx.get(f"{pool}/v1/members/{name}/readyz").json() == {"status": "ready"}
        with running(create_model_app(directory, ServingOptions(max_batch=8))) as alone:
            wait_ready(alone)
            assert httpx.get(f"{alone}/v1/info").json() == member
            for body in requests_for(name, member):
                pooled = post(pool, f"/v1/members/{name}/velocity", body)
                own = post(alone, "/v1/velocity", body)
                assert pooled.status_code == own.status_code == 200, (name, pooled.content)
                assert pooled.content == own.content, name
    # No member is served at the root: a pool's velocity is always a member's.
    assert post(pool, "/v1/velocity", b"").status_code == 404


def test_readyz_turns_200_once_every_member_is_loaded(stages):
    gate, calls = threading.Event(), itertools.count()
    last = len(MEMBERS) - 1

    async def start_up(work):
        if next(calls) == last:  # the last member waits for the test's word
            await asyncio.to_thread(gate.wait, READY_S)
        return await asyncio.to_thread(work)

    names = list(MEMBERS)
    with running(create_model_app(members_of(stages), hooks=Hooks(start_up=start_up))) as base:
        def ready(name: str) -> bool:
            return httpx.get(f"{base}/v1/members/{name}/readyz").status_code == 200

        until(lambda: all(ready(name) for name in names[:last]), "the first members load")
        assert httpx.get(f"{base}/readyz").json() == {"status": "loading"}
        assert httpx.get(f"{base}/v1/members/{names[last]}/readyz").json() == {
            "status": "loading"}
        assert not httpx.get(f"{base}/v1/info").json()["pool"]["ready"]
        gate.set()
        wait_ready(base)
        assert all(ready(name) for name in names)


def batches(metrics: str, member: str) -> tuple[int, float]:
    """(batches, rows) the member ran, from its ``ddm_expert_batch_images`` histogram."""
    def value(series: str) -> float:
        match = re.search(rf'^{series}{{member="{member}"}} (\S+)$', metrics, re.M)
        assert match, f"{series} of {member} not in the metrics"
        return float(match.group(1))

    return int(value("ddm_expert_batch_images_count")), value("ddm_expert_batch_images_sum")


def test_rows_batch_per_member_and_never_across_members(stages):
    # Batches dispatch when full (2 rows) and would otherwise wait a minute: two requests
    # to each expert, all four at once, run as one batch per expert.
    experts = {name: stages / MEMBERS[name] for name in ("expert-0", "expert-1")}
    with running(create_model_app(experts, ServingOptions(max_batch=2, max_delay_ms=60_000.0)),
                 loops=2) as base:
        wait_ready(base)
        width = httpx.get(f"{base}/v1/members/expert-0/info").json()["text_width"]
        latent = tuple(httpx.get(f"{base}/v1/members/expert-0/info").json()["latent_shape"])
        embeddings = RNG.standard_normal((1, 5, width)).astype(np.float32)
        context = encode_request(Context(1, embeddings, np.ones((1, 5), np.uint8),
                                              np.zeros((0, 5, width), np.float32)))
        for name in experts:
            assert post(base, f"/v1/members/{name}/velocity", context).status_code == 200
        calls = [(name, encode_request(VelocityRequest(
            10 + i, RNG.standard_normal((1, *latent)).astype(np.float32),
            np.array([0.5], np.float32), context_id(context), np.zeros(1, np.int32),
            np.ones(1, np.float32))))
            for i, name in enumerate(["expert-0", "expert-1", "expert-0", "expert-1"])]

        async def all_at_once() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=READY_S) as client:
                return await asyncio.gather(*(client.post(
                    f"{base}/v1/members/{name}/velocity", content=body,
                    headers={"content-type": CONTENT_TYPE}) for name, body in calls))

        replies = asyncio.run(all_at_once())
        metrics = httpx.get(f"{base}/metrics").text
        assert [r.status_code for r in replies] == [200] * 4
    for name in experts:
        assert batches(metrics, name) == (1, 2.0)
    # Each row went through its own member's network: the same call alone gives its
    # velocity (to float32's rounding: a batch of 2 sums in another order than one of 1).
    with running(create_model_app(experts, ServingOptions(max_batch=2, max_delay_ms=0.0))) as alone:
        wait_ready(alone)
        for name in experts:
            post(alone, f"/v1/members/{name}/velocity", context)
        for i, ((name, body), reply) in enumerate(zip(calls, replies)):
            own = post(alone, f"/v1/members/{name}/velocity", body).content
            np.testing.assert_allclose(decode_response(reply.content, 10 + i, (1, *latent)),
                                       decode_response(own, 10 + i, (1, *latent)), atol=1e-5)


def test_the_router_reaches_a_member_behind_the_pool_s_token(stages, tmp_path):
    # A member's readyz is under /v1, which the token guards: the router probes it with its
    # token, then calls the member's velocity.
    (tmp_path / "token").write_text("pool-token-0123456789abcdef\n")
    token = TokenFile(tmp_path / "token")
    app = create_model_app({"expert-1": stages / MEMBERS["expert-1"]},
                           ServingOptions(max_batch=8, auth_token_file=tmp_path / "token"))
    with running(app) as base:
        wait_ready(base)
        assert httpx.get(f"{base}/v1/members/expert-1/readyz").status_code == 401
        settings = PoolSettings(connect_s=2.0, attempt_s=30.0, deadline_s=READY_S,
                                health_interval_s=0.2)
        discovery = StaticDiscovery((base.removeprefix("http://"),), "expert-1")

        async def scenario() -> tuple[ExpertInfo, np.ndarray]:
            async with ExpertPool.discovered({"e": discovery}, settings, token=token) as pool:
                deadline = time.monotonic() + READY_S
                while pool.info("e") is None:
                    assert time.monotonic() < deadline, "the member was never probed ready"
                    await asyncio.sleep(0.02)
                info = pool.info("e")
                width, latent = info.text_width, info.image_shape
                cond = Conditioning(embeddings=np.ones((2, 5, width), np.float32))
                x = RNG.standard_normal((2, *latent)).astype(np.float32)
                return info, await pool.velocity("e", x, np.full(2, 0.5, np.float32), cond)

        info, velocity = asyncio.run(scenario())
    assert info.cluster == 1 and velocity.shape == (2, *info.image_shape)


def test_a_member_the_pool_does_not_hold_is_named_to_the_router(pool):
    """A router.yaml naming a member the pool does not hold (a typo): the pool's 404 says which
    it holds, and the router refuses that report at once, with the reason, instead of waiting
    for a member that will never be ready."""
    held = "this pool holds no member 'expert-9'; it holds " + ", ".join(MEMBERS)
    for method, path in (("GET", "readyz"), ("GET", "info"), ("POST", "velocity")):
        reply = httpx.request(method, f"{pool}/v1/members/expert-9/{path}", content=b"")
        assert (reply.status_code, reply.json()) == (404, {"detail": held}), path
    # A member it holds: a route it lacks, or one of its routes with the other method.
    for method, path, status, detail in (
            ("GET", "bogus", 404, "member 'expert-0' has no route 'bogus'; it has velocity, "
                                  "info, readyz"),
            ("POST", "readyz", 405, "use GET"), ("GET", "velocity", 405, "use POST")):
        reply = httpx.request(method, f"{pool}/v1/members/expert-0/{path}", content=b"")
        assert (reply.status_code, reply.json()["detail"]) == (status, detail), path
    settings = PoolSettings(connect_s=2.0, attempt_s=30.0, deadline_s=READY_S,
                            health_interval_s=0.2)
    discovery = StaticDiscovery((pool.removeprefix("http://"),), "expert-9")

    async def refused() -> str:
        async with ExpertPool.discovered({"e": discovery}, settings) as experts:
            deadline = time.monotonic() + READY_S
            while experts.invalid_report("e") is None:
                assert time.monotonic() < deadline, "the router never refused the report"
                await asyncio.sleep(0.02)
            return experts.invalid_report("e")

    assert asyncio.run(refused()) == (f"{pool.removeprefix('http://')}: "
                                      f"/v1/members/expert-9/readyz answered 404: {held}")


def pooled_config(stages: Path, endpoint: str) -> RouterConfigFile:
    """router.yaml with every expert and stage a member of the pool at ``endpoint``."""
    raw = text_config(stages, {f"expert_{k}": endpoint for k in range(EXPERTS)},
                      {key: endpoint for key in ("text_encoder", "decoder",
                                                 "router_network")}).to_dict()
    for k, expert in enumerate(raw["experts"]):
        expert["discovery"]["member"] = f"expert-{k}"
    for role, name in PLAN_NAMES.items():
        raw[name.replace("-", "_")]["member"] = name
    return RouterConfigFile.from_dict(raw)


def counts(base: str) -> dict[tuple[str, ...], float]:
    """The pool's request counters: ``ddm_pool_requests`` by (route, kind, status) and each
    member's ``ddm_expert_requests`` by (member, kind, status)."""
    metrics = httpx.get(f"{base}/metrics").text
    found: dict[tuple[str, ...], float] = {}
    for name, labels, value in re.findall(r'^(ddm_pool_requests_total|ddm_expert_requests_total)'
                                          r'{([^}]*)} (\S+)$', metrics, re.M):
        label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        found[(name, label.get("route") or label["member"], label["kind"],
               label["status"])] = float(value)
    return found


def test_a_router_over_one_pool_gives_the_unpooled_image(stages, pool):
    """With one request per step: a top-2 step's calls to both experts go to the pool as one
    request (the router network's calls, a stage's, go to its own route, one per step)."""
    request = {"prompt": "a red car", "seed": 7, "response_format": "b64_json"}

    def image(config: RouterConfigFile) -> bytes:
        with running(create_router_app(config)) as router:
            wait_ready(router)
            reply = httpx.post(f"{router}/v1/images/generations", json=request,
                               timeout=READY_S)
            assert reply.status_code == 200, reply.text
            return base64.b64decode(reply.json()["data"][0]["b64_json"])

    before = counts(pool)
    pooled = image(pooled_config(stages, pool.removeprefix("http://")))
    after = counts(pool)
    added = {key: after[key] - before.get(key, 0.0) for key in after
             if after[key] != before.get(key, 0.0)}
    steps = 4  # text_config's sampling: 4 steps, top2, so both experts at every step
    assert added[("ddm_pool_requests_total", "/v1/pool/velocity", "pool_velocity",
                  "200")] == steps
    for k in range(EXPERTS):
        assert added[("ddm_expert_requests_total", f"expert-{k}", "pool_velocity",
                      "200")] == steps
        # A member's own route took only its context: no velocity call of its own.
        assert ("ddm_expert_requests_total", f"expert-{k}", "velocity",
                "200") not in added
    assert added[("ddm_expert_requests_total", "router-network", "route", "200")] == steps
    with running(create_model_app(stages / "expert_0", ServingOptions(max_batch=8))) as e0, \
            running(create_model_app(stages / "expert_1", ServingOptions(max_batch=8))) as e1:
        for base in (e0, e1):
            wait_ready(base)
        unpooled = image(text_config(stages, {"expert_0": e0.removeprefix("http://"),
                                              "expert_1": e1.removeprefix("http://")}))
    assert pooled == unpooled


def test_with_calls_ahead_a_steps_velocities_go_beside_its_routing(stages, pool, monkeypatch):
    """DDM_CALLS_AHEAD=on (what ``auto`` chooses where the router network runs on an
    accelerator; this pool runs on the CPU): from the second step on, each step's calls to
    both experts go to the pool beside its routing, still one pool request per step; the
    router counts them used, and the image is the one made without them."""
    request = {"prompt": "a red car", "seed": 7, "response_format": "b64_json"}
    steps = 4  # text_config's sampling: 4 steps, top2, so both experts at every step

    def image() -> tuple[bytes, str]:
        config = pooled_config(stages, pool.removeprefix("http://"))
        with running(create_router_app(config)) as router:
            wait_ready(router)
            reply = httpx.post(f"{router}/v1/images/generations", json=request,
                               timeout=READY_S)
            assert reply.status_code == 200, reply.text
            return (base64.b64decode(reply.json()["data"][0]["b64_json"]),
                    httpx.get(f"{router}/metrics").text)

    monkeypatch.setenv("DDM_CALLS_AHEAD", "off")
    without, _ = image()
    monkeypatch.setenv("DDM_CALLS_AHEAD", "on")
    before = counts(pool)
    with_ahead, metrics = image()
    added = {key: value - before.get(key, 0.0) for key, value in counts(pool).items()}
    assert with_ahead == without
    assert added[("ddm_pool_requests_total", "/v1/pool/velocity", "pool_velocity",
                  "200")] == steps
    assert 'ddm_router_calls_ahead_total{outcome="used"} 6.0' in metrics  # 2 experts, 3 steps
    assert 'outcome="unused"' not in metrics
    # The served stages' round trips are timed like the experts': the prompt and guidance's
    # empty prompt encoded, a routing per step, one decoding.
    stage_calls = {s.labels["stage"]: s.value for f in text_string_to_metric_families(metrics)
                   if f.name == "ddm_router_stage_call_seconds" for s in f.samples
                   if s.name.endswith("_count")}
    assert stage_calls == {"text_encoder": 2, "router": steps, "decoder": 1}
    stage_rows = {s.labels["stage"]: s.value for f in text_string_to_metric_families(metrics)
                  if f.name == "ddm_router_stage_request_rows" for s in f.samples
                  if s.name.endswith("_sum")}
    assert stage_rows == {"text_encoder": 2, "router": steps, "decoder": 1}  # a row each


def test_a_pool_over_its_memory_limit_exits_1_before_loading_naming_each_member(stages,
                                                                              tmp_path):
    log = tmp_path / "termination-log"
    members = [f"--member={name}={path}" for name, path in members_of(stages).items()]
    done = subprocess.run(
        [sys.executable, "-m", "ddm", "serve", "pool", *members, "--port", "0",
         "--memory-limit-bytes", "1000"],
        env={**os.environ, "DDM_TERMINATION_LOG": str(log)}, capture_output=True, text=True,
        timeout=READY_S)
    assert done.returncode == 1, done.stderr
    message = log.read_text()
    sizes = {name: int(re.search(rf"{name} ([\d,]+) bytes", message).group(1).replace(",", ""))
             for name in MEMBERS}
    total = int(re.search(r"sum ([\d,]+) bytes", message).group(1).replace(",", ""))
    assert total == sum(sizes.values()) > 1000
    assert ("limit 1,000 bytes (--memory-limit-bytes: the pool's resources.limits.memory)"
            in message)
    assert "ready" not in done.stderr  # no member was loaded


def test_a_generation_that_starts_later_steps_with_the_one_under_way(stages, pool):
    """A second generation starting while the first is stepping joins its waves: every step
    of the second goes in a pool request of the first (one request per step of the longer
    generation), rather than the two alternating as two groups of one."""
    app = create_router_app(pooled_config(stages, pool.removeprefix("http://")))
    # Patient: nothing here is held elsewhere, so no wave should go by the timer.
    app.state.router.lockstep = Lockstep(max_wait_s=READY_S,
                                         on_wave=app.state.router.metrics.observe_wave)
    with running(app) as router:
        wait_ready(router)
        _, requests = _a_second_generation_under_way(router, pool)
        metrics = httpx.get(f"{router}/metrics").text
    assert requests == FIRST_STEPS
    # The router's metrics say so: waves of two generations (the second's routing and expert
    # queries; its first routing may go alone, while the first generation is at its experts),
    # none let go by the timer.
    alone = float(re.search(r'^ddm_router_lockstep_wave_generations_bucket\{le="1.0"\} (\S+)$',
                            metrics, re.M)[1])
    waves = float(re.search(r"^ddm_router_lockstep_wave_generations_count (\S+)$", metrics,
                            re.M)[1])
    assert waves - alone >= 2 * SECOND_STEPS - 1, metrics
    assert 'ddm_router_lockstep_waves_total{released="timer"}' not in metrics


def test_in_two_lockstep_groups_a_later_generation_steps_apart_and_changes_no_pixel(
        stages, pool, monkeypatch):
    """DDM_LOCKSTEP_GROUPS=2: a second generation starting while the first is stepping joins
    the other group, whose waves are its own: no wave lets both go, where one group would
    merge them (the test above), and so would auto on a CPU; each image is the one a router
    of one group makes. (Two groups' calls that happen to be made in the same turn of the
    event loop still share a pool request: :mod:`ddm.serving.router.fleet.pool_calls`.)"""

    def generations(groups: str, kept: int) -> tuple[dict[str, bytes], float, float]:
        monkeypatch.setenv("DDM_LOCKSTEP_GROUPS", groups)
        app = create_router_app(pooled_config(stages, pool.removeprefix("http://")))
        assert app.state.router.lockstep.groups == (0,) * kept
        with running(app) as router:
            wait_ready(router)
            images, requests = _a_second_generation_under_way(router, pool)
            metrics = httpx.get(f"{router}/metrics").text
        waves = float(re.search(r"^ddm_router_lockstep_wave_generations_count (\S+)$",
                                metrics, re.M)[1])
        alone = float(re.search(r'^ddm_router_lockstep_wave_generations_bucket\{le="1.0"\} '
                                r'(\S+)$', metrics, re.M)[1])
        return images, requests, waves - alone

    two_groups, requests, shared_waves = generations("2", kept=2)
    assert shared_waves == 0
    assert FIRST_STEPS <= requests <= FIRST_STEPS + SECOND_STEPS
    one_group, _, _ = generations("1", kept=1)
    assert two_groups == one_group
    # auto, the default, keeps two groups but opens the second only where an expert reports
    # an accelerator: this pool's run on the CPU, so the second generation joins the first's
    # waves (not every one of them: its default wait lets a wave go without a generation
    # held up on a loaded machine, which the test above rules out with a patient lockstep).
    by_default, requests, shared_waves = generations("auto", kept=2)
    assert shared_waves > 0
    assert FIRST_STEPS <= requests < FIRST_STEPS + SECOND_STEPS
    assert by_default == one_group


#: Long enough (tiny models step in milliseconds) for the second to start well within it.
FIRST_STEPS, SECOND_STEPS = 200, 3


def _a_second_generation_under_way(router: str, pool: str) -> tuple[dict[str, bytes], float]:
    """"a red car" in :data:`FIRST_STEPS` steps and, once its first step reached ``pool``, "a
    blue boat" in :data:`SECOND_STEPS`, through ``router``: their images by prompt, and the
    pool velocity requests they made."""
    velocity = ("ddm_pool_requests_total", "/v1/pool/velocity", "pool_velocity", "200")
    images: dict[str, bytes] = {}

    def generate(prompt: str, steps: int) -> None:
        reply = httpx.post(f"{router}/v1/images/generations", timeout=READY_S,
                           json={"prompt": prompt, "seed": 3, "steps": steps,
                                 "response_format": "b64_json"})
        assert reply.status_code == 200, reply.text
        images[prompt] = base64.b64decode(reply.json()["data"][0]["b64_json"])

    before = counts(pool).get(velocity, 0.0)
    first = threading.Thread(target=generate, args=("a red car", FIRST_STEPS))
    first.start()
    until(lambda: counts(pool).get(velocity, 0.0) > before, "the first generation's first step")
    generate("a blue boat", SECOND_STEPS)
    first.join(READY_S)
    assert not first.is_alive()
    return images, counts(pool)[velocity] - before


def test_grouped_on_a_step_s_rows_each_get_their_own_expert_s_velocity(stages):
    """--grouped-forward on: a pool request with two rows for each expert (a step) goes
    through the group, whose /v1/info says so; each row's velocity is its own expert's (to
    float32's rounding), and each member's metrics count its own rows."""
    experts = {name: stages / MEMBERS[name] for name in ("expert-0", "expert-1")}
    with running(create_model_app(experts, ServingOptions(max_batch=4,
                                                          grouped_forward="on"))) as base:
        wait_ready(base)
        info = httpx.get(f"{base}/v1/info").json()
        (group,) = info["pool"]["groups"]
        assert (group["members"], group["mode"], group["grouped_up_to_rows"],
                group["failure"]) == (["expert-0", "expert-1"], "on", 4, None)
        member = info["members"]["expert-0"]
        width, latent = member["text_width"], tuple(member["latent_shape"])
        context = encode_request(Context(
            1, RNG.standard_normal((2, 5, width)).astype(np.float32),
            np.ones((2, 5), np.uint8), RNG.standard_normal((2, 5, width)).astype(np.float32)))
        for name in experts:
            assert post(base, f"/v1/members/{name}/velocity", context).status_code == 200
        calls = tuple((name, VelocityRequest(
            30, RNG.standard_normal((2, *latent)).astype(np.float32),
            np.array([0.3, 0.7], np.float32), context_id(context),
            np.array([1, 0], np.int32), np.ones(2, np.float32))) for name in experts)
        request = PoolVelocityRequest(30, calls)
        reply = post(base, POOL_VELOCITY_PATH, encode_pool_request(request))
        assert reply.status_code == 200, reply.content
        metrics = httpx.get(f"{base}/metrics").text
    together = decode_pool_response(reply.content, request)
    for name in experts:  # the group's batches, in each member's metrics with its own rows
        assert batches(metrics, name)[1] == 2.0
    with running(create_model_app(experts, ServingOptions(max_batch=4,
                                                          grouped_forward="off"))) as alone:
        wait_ready(alone)
        assert httpx.get(f"{alone}/v1/info").json()["pool"]["groups"] == []
        for (name, call), velocity in zip(calls, together):
            post(alone, f"/v1/members/{name}/velocity", context)
            own = post(alone, f"/v1/members/{name}/velocity", encode_request(call)).content
            np.testing.assert_allclose(velocity, decode_response(own, 30, (2, *latent)),
                                       atol=1e-4)
    assert np.abs(together[0] - together[1]).max() > 1e-3  # the experts differ


def test_a_router_over_a_grouped_pool_gives_the_ungrouped_image(stages, pool):
    """A top-2 step's rows of both experts, guided, go through one grouped forward: the
    image is the ungrouped pool's within float32's rounding (2/255 at most), one pool
    request per step as before."""
    request = {"prompt": "a red car", "seed": 7, "response_format": "b64_json"}

    def pixels(endpoint: str) -> np.ndarray:
        with running(create_router_app(pooled_config(stages, endpoint))) as router:
            wait_ready(router)
            reply = httpx.post(f"{router}/v1/images/generations", json=request,
                               timeout=READY_S)
            assert reply.status_code == 200, reply.text
        png = base64.b64decode(reply.json()["data"][0]["b64_json"])
        from PIL import Image
        import io
        return np.asarray(Image.open(io.BytesIO(png)), np.int16)

    options = ServingOptions(max_batch=8, grouped_forward="on")
    with running(create_model_app(members_of(stages), options)) as grouped:
        wait_ready(grouped)
        before = counts(grouped)
        image = pixels(grouped.removeprefix("http://"))
        velocity = ("ddm_pool_requests_total", "/v1/pool/velocity", "pool_velocity", "200")
        assert counts(grouped)[velocity] - before.get(velocity, 0.0) == 4  # text_config: 4
    assert np.abs(image - pixels(pool.removeprefix("http://"))).max() <= 2


def test_a_group_runs_a_batch_grouped_or_member_by_member_each_row_its_own_expert_s(stages):
    """One batch of a group holding both experts' rows, guided and not: within its grouped
    share it is one forward of the group's network (a hook counts it), over it one forward
    per member; either way each row gets its own expert's velocity, as the expert's own
    batcher answers it."""
    options = ServingOptions(max_batch=16, grouped_forward="on")
    members = {name: load_member(stages / MEMBERS[name], options, Hooks())
               for name in ("expert-0", "expert-1")}
    (group,) = asyncio.run(preload(members, options, Hooks()))
    for member in members.values():
        member.publish(member.load_and_warm())
        member.batcher.start()
    group.start()
    assert group.up_to_rows == 16
    width, latent = 32, members["expert-0"].limits.image_shape
    context = Context(1, RNG.standard_normal((3, 7, width)).astype(np.float32),
                      np.ones((3, 7), np.uint8),
                      RNG.standard_normal((3, 7, width)).astype(np.float32))
    identity = context_id(encode_request(context))
    for member in members.values():
        member.contexts.put(identity, context)
    calls = [VelocityRequest(20 + k, RNG.standard_normal((3, *latent)).astype(np.float32),
                             RNG.uniform(0.1, 0.9, 3).astype(np.float32), identity,
                             np.array([2, 0, 1], np.int32),
                             np.array([7.5, 1.0, 3.0], np.float32)) for k in range(2)]

    async def own() -> list[np.ndarray]:  # each expert's own batcher
        return await asyncio.gather(*(member.velocity(call)
                                      for member, call in zip(members.values(), calls)))

    alone = asyncio.run(own())
    held = np.empty(6, object)
    held[:] = [members["expert-0"].contexts.get(identity, "text")] * 6
    batch = (np.concatenate([c.x for c in calls]), np.concatenate([c.t for c in calls]), held,
             np.concatenate([c.rows for c in calls]),
             np.concatenate([c.guidance for c in calls]), np.repeat([0, 1], 3))
    forwards = []
    group.network.register_forward_hook(lambda *_: forwards.append(1))
    grouped = group.execute(VelocityKey(7), batch)
    assert len(forwards) == 1  # both experts' 10 forward rows in one
    group.up_to_rows = 4  # each member's share is 5 forward rows (two of its rows guided)
    member_by_member = group.execute(VelocityKey(7), batch)
    assert len(forwards) == 1  # the members' own networks ran
    for k, velocity in enumerate(alone):
        np.testing.assert_allclose(grouped[3 * k:3 * (k + 1)], velocity, atol=1e-4)
        np.testing.assert_array_equal(member_by_member[3 * k:3 * (k + 1)], velocity)
    assert np.abs(alone[0] - alone[1]).max() > 1e-3  # the experts differ
    for member in members.values():
        asyncio.run(member.close())
