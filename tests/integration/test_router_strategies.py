"""Routing strategies a client may choose, over real HTTP on loopback: the shipped digits DDM's
two experts and its router, in-process (issue 35: ``ensemble`` calls every expert at every
step, and one such request per scale-down delay kept every expert awake).

* A DDM that allows only some (``router.yaml`` ``sampling.strategies``, the operator's
  ``DDM_ALLOWED_STRATEGIES``): another is a 422 naming the allowed ones; ``/v1/info`` offers
  only those.
* Only the DDM's own strategy wakes a missing expert: with another, rows that no expert up can
  take are a 503 naming the rule, at once (under ``wait``), leaving no demand on it.
"""

from __future__ import annotations

import socket
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from ddm.deploy.router_config import RouterConfigFile
from ddm.serving.model.server import create_model_app
from ddm.serving.model.options import ServingOptions
from ddm.serving.router.api.server import create_router_app
from ddm.serving.router.fleet.lockstep import Lockstep
from tests.integration.servers import running, wait_ready

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "checkpoints" / "digits"
WAIT_S = 60.0  # a bound on a hang, not a speed target

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _config(endpoints: dict[str, str], **sampling: object) -> RouterConfigFile:
    return RouterConfigFile.from_dict({
        "experts": [{"name": name, "classes": classes,
                     "discovery": {"endpoints": [endpoints[name]]}}
                    for name, classes in (("expert-0-4", [0, 1, 2, 3, 4]),
                                          ("expert-5-9", [5, 6, 7, 8, 9]))],
        "router_checkpoint": str(DIGITS / "router"),
        "missing_expert": {"policy": "wait", "wait_s": 600},
        "sampling": {"steps": 2, "strategy": "top1", **sampling}})


def _replicas(base: str, expert: str) -> dict[str, str]:
    """``expert``'s replicas (endpoint: state) as the router at ``base`` lists them."""
    info = httpx.get(f"{base}/v1/info", timeout=30).json()
    return next(e for e in info["experts"] if e["name"] == expert)["replicas"]


def _states(base: str, expert: str) -> set[str]:
    return set(_replicas(base, expert).values())


def _endpoint(base: str, expert: str) -> str:
    """The address of ``expert``'s one replica."""
    (endpoint,) = _replicas(base, expert)
    return endpoint


def _until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition()`` (the router's state, seen over HTTP) until true."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen in {WAIT_S} s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def routers() -> Iterator[dict[str, str]]:
    """Base URLs of two routers of the digits DDM (its own strategy top1): ``allowing`` top1
    and topk:2 only, ``missing`` with expert-5-9 down (its address has no listener: as an
    expert scaled to zero)."""
    with ExitStack() as stack:
        experts = {}
        for name in ("expert-0-4", "expert-5-9"):
            base = stack.enter_context(running(create_model_app(
                DIGITS / name, ServingOptions(backend="torch"))))
            wait_ready(base)
            experts[name] = base.removeprefix("http://")
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{closed.getsockname()[1]}"
        closed.close()
        bases = {
            "allowing": stack.enter_context(running(create_router_app(_config(
                experts, strategies=["top1", "topk:2"])))),
            "missing": stack.enter_context(running(create_router_app(_config(
                {**experts, "expert-5-9": nobody}))))}
        for base in bases.values():
            wait_ready(base)
        yield bases


@pytest.fixture()
def router(routers: dict[str, str]) -> str:
    return routers["allowing"]


@pytest.mark.parametrize("strategy", ["ensemble", "threshold:0.2", "top3"])
def test_a_strategy_the_ddm_does_not_allow_is_a_422_naming_those_it_does(
        router: str, strategy: str) -> None:
    for path, body in (("/v1/generate", {"labels": [3], "strategy": strategy}),
                       ("/v1/images/generations", {"prompt": "3", "strategy": strategy})):
        answer = httpx.post(f"{router}{path}", json=body, timeout=60)
        assert answer.status_code == 422, answer.text
        assert f"strategy {strategy} is not allowed on this DDM; use top1, topk:2" in answer.text
    stream = httpx.get(f"{router}/v1/generate/stream",
                       params={"labels": "3", "strategy": strategy}, timeout=60)
    assert stream.status_code == 422 and "use top1, topk:2" in stream.text


@pytest.mark.parametrize("strategy", ["top1", "top2", "topk:2"])
def test_the_allowed_strategies_are_served_and_offered(router: str, strategy: str) -> None:
    answer = httpx.post(f"{router}/v1/generate", json={"labels": [3, 8], "strategy": strategy},
                        timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["experts"] == [["expert-0-4"], ["expert-5-9"]]
    assert httpx.get(f"{router}/v1/info", timeout=30).json()["strategies"] == ["top1", "topk:2"]


def test_another_strategy_does_not_wait_for_a_missing_expert_nor_count_demand_on_it(
        routers: dict[str, str]) -> None:
    """Under ``wait`` a top1 request for a 7 would wait (600 s) for expert-5-9 to be
    started; a topk:2 request, which only the experts up may serve, is told why at once."""
    base = routers["missing"]
    _until(lambda: _states(base, "expert-5-9") == {"down"}, "expert-5-9 seen down")
    answer = httpx.post(f"{base}/v1/generate", json={"labels": [7], "strategy": "topk:2"},
                        timeout=120)
    assert answer.status_code == 503, answer.text
    assert ("expert expert-5-9: unavailable: no ready replica; only strategy top1 starts one"
            in answer.text)
    served = httpx.post(f"{base}/v1/generate", json={"labels": [3], "strategy": "topk:2"},
                        timeout=120)
    assert served.status_code == 200 and served.json()["waited_s"] == 0.0, served.text
    demand = httpx.get(f"{base}/v1/demand", timeout=30).json()["experts"]
    assert (demand["expert-5-9"]["rows_per_s"], demand["expert-5-9"]["waiting"],
            demand["expert-5-9"]["idle_s"]) == (0, 0, None), demand
    assert demand["expert-0-4"]["rows_per_s"] > 0, demand


def test_a_generation_waiting_for_a_missing_expert_does_not_hold_the_others_steps(
        routers: dict[str, str]) -> None:
    """Generations step in lockstep (``ddm.serving.router.fleet.lockstep``); one that waits
    for a missing expert steps out meanwhile. The router here waits for a generation's wave
    as long as it takes, so a generation held in the wave would hold the other one too."""
    missing = routers["missing"]
    _until(lambda: _states(missing, "expert-5-9") == {"down"}, "expert-5-9 seen down")
    endpoints = {name: _endpoint(missing, name) for name in ("expert-0-4", "expert-5-9")}
    app = create_router_app(_config(endpoints))
    app.state.router.lockstep = Lockstep(max_wait_s=600.0)
    held: list[BaseException | httpx.Response] = []
    with running(app) as base:
        wait_ready(base)
        _until(lambda: _states(base, "expert-5-9") == {"down"}, "expert-5-9 seen down")

        def seven() -> None:
            try:
                held.append(httpx.post(f"{base}/v1/generate", json={"labels": [7]},
                                       timeout=600))
            except httpx.HTTPError as error:  # the router stopped under it
                held.append(error)

        waiting = threading.Thread(target=seven)
        waiting.start()
        _until(lambda: httpx.get(f"{base}/v1/demand", timeout=30).json()["experts"]
               ["expert-5-9"]["waiting"] == 1, "the 7 waiting for expert-5-9")
        served = httpx.post(f"{base}/v1/generate", json={"labels": [3]}, timeout=WAIT_S)
        assert served.status_code == 200 and served.json()["waited_s"] == 0.0, served.text
        assert not held  # the 7 still waits
    waiting.join(WAIT_S)
    assert not waiting.is_alive()
