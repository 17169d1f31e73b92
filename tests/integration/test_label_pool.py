"""Label experts in one pool (issues 36 and 37), over real HTTP on loopback: the shipped
digits DDM's two experts as members of one model server (what ``ddm serve pool --member
expert-0-4=checkpoints/digits/expert-0-4 --member expert-5-9=...`` runs), each answering under
``/v1/members/NAME`` with a label expert's ``/v1/info``; a router whose router.yaml finds both
in the pool (``discovery.member``) draws the same pixels as over the experts served alone."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from ddm.deploy.router_config import RouterConfigFile
from ddm.serving.model.options import ServingOptions
from ddm.serving.model.server import create_model_app
from ddm.serving.router.api.server import create_router_app
from tests.integration.servers import running, wait_ready

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "checkpoints" / "digits"
EXPERTS = {"expert-0-4": [0, 1, 2, 3, 4], "expert-5-9": [5, 6, 7, 8, 9]}
OPTIONS = ServingOptions(max_batch=8)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pool() -> Iterator[str]:
    with running(create_model_app({name: DIGITS / name for name in EXPERTS}, OPTIONS)) as base:
        wait_ready(base)
        yield base.removeprefix("http://")


def _config(endpoints: dict[str, str], member: bool) -> RouterConfigFile:
    """The digits DDM's router.yaml over ``endpoints`` (expert name -> host:port), each
    expert the pool member of its name where ``member``."""
    return RouterConfigFile.from_dict({
        "experts": [{"name": name, "classes": classes,
                     "discovery": {"endpoints": [endpoints[name]],
                                   **({"member": name} if member else {})}}
                    for name, classes in EXPERTS.items()],
        "router_checkpoint": str(DIGITS / "router"),
        "sampling": {"steps": 4, "strategy": "top2"}})


def _images(config: RouterConfigFile) -> list[str]:
    """PNGs (base64) of one seeded request whose rows go to both experts."""
    with running(create_router_app(config)) as router:
        wait_ready(router)
        reply = httpx.post(f"{router}/v1/generate", timeout=120, json={
            "labels": [0, 3, 5, 8], "seed": 5})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert {name for row in body["experts"] for name in row} == set(EXPERTS)
        return body["images"]


def test_each_label_member_answers_its_info_under_its_name(pool: str) -> None:
    info = httpx.get(f"http://{pool}/v1/info", timeout=30).json()
    assert sorted(info["members"]) == sorted(EXPERTS) and info["pool"]["ready"]
    for name, classes in EXPERTS.items():
        member = httpx.get(f"http://{pool}/v1/members/{name}/info", timeout=30).json()
        assert member == info["members"][name]
        assert (member["name"], member["classes"], member["conditioning"],
                member["serves"]) == (name, classes, "labels", "velocity")
        assert info["pool"]["members"][name]["weights_bytes"] == \
            (DIGITS / name / "weights.safetensors").stat().st_size - _header_bytes(DIGITS / name)


def test_a_router_over_the_pool_draws_the_unpooled_pixels(pool: str) -> None:
    pooled = _images(_config({name: pool for name in EXPERTS}, member=True))
    with ExitStack() as stack:
        alone = {}
        for name in EXPERTS:
            base = stack.enter_context(running(create_model_app(DIGITS / name, OPTIONS)))
            wait_ready(base)
            alone[name] = base.removeprefix("http://")
        unpooled = _images(_config(alone, member=False))
    assert pooled == unpooled


def _header_bytes(directory: Path) -> int:
    """The bytes of a safetensors file's length prefix and JSON header (not weights)."""
    with (directory / "weights.safetensors").open("rb") as file:
        return 8 + int.from_bytes(file.read(8), "little")
