"""A tiny Paris DDM served as a router serves one: each expert on an expert server of its own
(guidance inside), the text encoder, decoder and router network loaded in the router, all on
loopback in this process."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from ddm.deploy.router_config import RouterConfigFile
from ddm.serving.expert.server import create_expert_app
from ddm.serving.router.server import create_router_app
from tests.integration.servers import running, wait_ready
from tests.support.paris_release import write_paris_release
from tests.support.text_stages import write_paris_stages

#: The tiny release's experts.
EXPERTS = 2


def text_config(stages: Path, experts: Mapping[str, str]) -> RouterConfigFile:
    """router.yaml for the tiny Paris DDM at ``stages``: its experts at ``experts`` (name:
    host:port), the other stages in the router."""
    return RouterConfigFile.from_dict({
        "experts": [{"name": name, "discovery": {"endpoints": [endpoint]}}
                    for name, endpoint in experts.items()],
        "conditioning": "text", "sampling": {"steps": 4, "strategy": "top2",
                                             "guidance_scale": 7.5},
        "text_encoder": {"checkpoint": str(stages / "text_encoder")},
        "decoder": {"checkpoint": str(stages / "decoder")},
        "router_network": {"checkpoint": str(stages / "router")}})


def paris_stages(root: Path) -> Path:
    """A tiny Paris release under ``root``, and its components as stage checkpoints."""
    return write_paris_stages(write_paris_release(root / "release"), root / "stages")


@contextmanager
def served_text_ddm(root: Path) -> Iterator[tuple[str, Path]]:
    """Serve a tiny Paris DDM made under ``root``; yields the router's base URL (ready) and
    the stage checkpoints' root."""
    stages = paris_stages(root)
    with ExitStack() as stack:
        experts = {}
        for k in range(EXPERTS):
            base = stack.enter_context(running(create_expert_app(stages / f"expert_{k}",
                                                                 "torch", max_batch=8)))
            wait_ready(base)
            experts[f"expert_{k}"] = base.removeprefix("http://")
        router = stack.enter_context(running(create_router_app(text_config(stages, experts))))
        wait_ready(router)
        yield router, stages
