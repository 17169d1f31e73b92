"""The router checks what it is given: real expert servers on loopback against the router network's
checkpoint and router.yaml. A mismatch keeps the router unready and generating nothing, with a
message naming the expert and what disagrees: ``/readyz`` and 503 bodies in the router's own words
(anyone may read them), the log quoting what the expert said."""

from __future__ import annotations

import dataclasses
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from ddm.checkpoints.format import load_checkpoint, save_checkpoint
from ddm.convention import CONVENTION_NAME
from ddm.data import partition_sha256
from ddm.deploy.router_config import RouterConfigFile
from ddm.serving.model.server import create_model_app
from ddm.serving.model.options import ServingOptions
from ddm.serving.router.fleet.replicas import ExpertInfo, ExpertProblem
from ddm.serving.router.api.server import create_router_app
from ddm.serving.router.api.state import expert_mismatches
from tests.integration.servers import running, wait_ready

# the models run on two cores shared with everything else
pytestmark = pytest.mark.usefixtures("one_torch_thread")

DIGITS = Path(__file__).resolve().parents[2] / "checkpoints" / "digits"
LOW, HIGH = list(range(5)), list(range(5, 10))
WAIT_S = 60.0
KMEANS = {"scheme": {"method": "kmeans", "features": "pixels",
                     "centroids": [[0.0] * 4, [1.0] * 4]}, "index": 0}




@pytest.fixture(scope="module")
def experts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """``host:port`` of the shipped experts (parts 0 and 1 of a label partition), and of a copy
    of expert 0-4 recorded as part 0 of a k-means partition."""
    shipped = load_checkpoint(DIGITS / "expert-0-4")
    other = save_checkpoint(tmp_path_factory.mktemp("kmeans") / "expert",
                            dataclasses.replace(shipped.meta, partition=KMEANS), shipped.weights)
    paths = {"low": DIGITS / "expert-0-4", "high": DIGITS / "expert-5-9", "kmeans": other}
    with ExitStack() as stack:
        bases = {}
        for name, path in paths.items():
            bases[name] = stack.enter_context(running(create_model_app(
                path, ServingOptions(max_batch=8))))
            wait_ready(bases[name])
        yield {name: base.removeprefix("http://") for name, base in bases.items()}


def _router(experts: dict[str, str], listed: list[tuple[str, str, list[int]]]):
    """A router app over ``(name, expert, classes)`` in that order, with the shipped network."""
    return create_router_app(RouterConfigFile.from_dict({
        "experts": [{"name": name, "classes": classes,
                     "discovery": {"endpoints": [experts[expert]]}}
                    for name, expert, classes in listed],
        "router_checkpoint": str(DIGITS / "router")}))


def _details(app) -> list[str]:
    """What the router logs of its experts' mismatches."""
    return [f"expert {p.expert}: {p.detail}" for p in app.state.router.mismatches()]


def _problems_once_known(base: str) -> tuple[int, list[str]]:
    """/readyz once every expert has been heard from (its status and problems)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        reply = httpx.get(f"{base}/readyz")
        problems = reply.json().get("problems", [])
        if not any("loading" in p or "reported" in p or "no expert" in p for p in problems):
            return reply.status_code, problems
        time.sleep(0.05)
    raise AssertionError(f"{base}: experts not heard from after {WAIT_S} s")


def test_experts_listed_in_partition_order_make_the_router_ready(experts):
    app = _router(experts, [("first", "low", LOW), ("second", "high", HIGH)])
    with running(app) as base:
        assert _problems_once_known(base) == (200, [])


def test_the_router_works_out_its_mixture_once_per_change_of_its_experts_reports(experts):
    """Generations, streams and probes read what the router made of the reports (the checks
    hash every partition) and make it again only when a report changes."""
    app = _router(experts, [("first", "low", LOW), ("second", "high", HIGH)])
    with running(app) as base:
        assert _problems_once_known(base) == (200, [])
        router = app.state.router
        made = router.mixture()
        for _ in range(2):
            assert httpx.post(f"{base}/v1/generate", json={"labels": [3], "steps": 1}
                              ).status_code == 200
            assert httpx.get(f"{base}/readyz").status_code == 200
        assert router.mixture() is made
        replica = router.pool.replicas("first")[0]
        # what the prober stores when a restarted replica reports something new
        replica.info = dataclasses.replace(replica.info, image_shape=(1, 8, 8))
        reply = httpx.get(f"{base}/readyz")
        assert reply.status_code == 503
        assert reply.json()["problems"][0].startswith("image shapes disagree")


def test_experts_listed_out_of_order_keep_the_router_unready_and_idle(experts):
    """Classes listed to match, so only the partition says the order is wrong: the network's
    output 0 is the expert of labels 0-4, and top-1 would silently send 0s to the 5-9 expert."""
    app = _router(experts, [("first", "high", HIGH), ("second", "low", LOW)])
    with running(app) as base:
        status, problems = _problems_once_known(base)
        assert status == 503
        assert problems == [
            "expert first is not part 0 of the router network's partition, but the router "
            "config lists it at position 0: list the experts in partition order (details in the "
            "router's log)",
            "expert second is not part 1 of the router network's partition, but the router "
            "config lists it at position 1: list the experts in partition order (details in the "
            "router's log)"]
        assert _details(app) == [
            "expert first: is part 1 of the router network's partition, but the router config "
            "lists it at position 0: list the experts in partition order",
            "expert second: is part 0 of the router network's partition, but the router config "
            "lists it at position 1: list the experts in partition order"]
        reply = httpx.post(f"{base}/v1/generate", json={"labels": [0], "steps": 2})
        assert reply.status_code == 503
        assert "expert first is not part 0" in reply.json()["detail"]


def test_an_expert_of_another_partition_keeps_the_router_unready(experts):
    app = _router(experts, [("first", "kmeans", LOW), ("second", "high", HIGH)])
    with running(app) as base:
        status, problems = _problems_once_known(base)
        assert status == 503
        assert problems == [
            "expert first was made for another partition than the router network's: experts "
            "and router must share one fitted partition (details in the router's log)"]
        labels = load_checkpoint(DIGITS / "router").meta.partition["scheme"]
        assert _details(app) == [
            f"expert first: its partition (kmeans partition into 2) was made for partition sha256 "
            f"{partition_sha256(KMEANS['scheme'])}, but partition sha256 "
            f"{partition_sha256(labels)} is expected: experts and router must share one fitted "
            "partition (the router network's: labels partition into 2)"]


def test_classes_listed_beyond_what_an_expert_serves_keep_the_router_unready(experts):
    app = _router(experts, [("first", "low", [0, 1, 2, 3, 4, 5]), ("second", "high", HIGH)])
    with running(app) as base:
        status, problems = _problems_once_known(base)
        assert status == 503
        assert problems == ["expert first does not serve every class the router config lists "
                            "[0, 1, 2, 3, 4, 5] (details in the router's log)"]
        assert _details(app) == ["expert first: serves classes [0, 1, 2, 3, 4], but the router "
                                 "config lists [0, 1, 2, 3, 4, 5]"]


def test_an_expert_of_another_convention_is_named():
    """A pure check (no server of this code can load another convention's checkpoint)."""
    config = RouterConfigFile.from_dict({"experts": [
        {"name": "old", "discovery": {"endpoints": ["127.0.0.1:1"]}}],
        "sampling": {"strategy": "oracle"}})
    info = ExpertInfo((1, 16, 16), tuple(LOW), 8, convention="ddpm/eps", partition=None)
    assert expert_mismatches(config, {"old": info}, None) == [ExpertProblem(
        "old", f"follows another convention than the router's {CONVENTION_NAME!r}",
        f"follows the convention 'ddpm/eps', the router {CONVENTION_NAME!r}")]


def test_an_expert_that_serves_its_raw_prediction_is_named():
    """A pure check: this code's servers always convert (``"serves": "velocity"``, checked
    next), so only a foreign server would answer its network's own epsilon."""
    config = RouterConfigFile.from_dict({"experts": [
        {"name": "raw", "discovery": {"endpoints": ["127.0.0.1:1"]}}],
        "sampling": {"strategy": "oracle"}})
    info = ExpertInfo((1, 16, 16), tuple(LOW), 8, convention=CONVENTION_NAME, serves="epsilon")
    assert [p.detail for p in expert_mismatches(config, {"raw": info}, None)] == [
        "answers 'epsilon', not our velocity: its server does not convert its objective"]
    converted = ExpertInfo((1, 16, 16), tuple(LOW), 8, convention=CONVENTION_NAME,
                           serves="velocity")
    assert expert_mismatches(config, {"raw": converted}, None) == []


def test_this_codes_expert_says_it_serves_velocity(experts):
    """What the check above relies on, read from a real expert's /v1/info."""
    assert httpx.get(f"http://{experts['low']}/v1/info").json()["serves"] == "velocity"
