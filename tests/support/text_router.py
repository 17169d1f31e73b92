"""A tiny Paris DDM served as a router serves one: each expert on an expert server of its own
(guidance inside), the text encoder, decoder and router network loaded in the router or each
on a stage server of its own, all on loopback in this process."""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from ddm.checkpoints.declared import CONFIG_KEYS, DECODER, ROUTER, TEXT_ENCODER
from ddm.deploy.imported import DECODER_DIR, ROUTER_DIR, TEXT_ENCODER_DIR
from ddm.deploy.router_config import RouterConfigFile
from ddm.serving.model.server import create_model_app
from ddm.serving.model.options import ServingOptions
from ddm.serving.router.api.server import create_router_app
from tests.integration.servers import running, wait_ready
from tests.support.paris_release import TinyParis, write_paris_release
from tests.support.text_stages import hand_prior, with_prior, write_paris_stages

#: The tiny release's experts.
EXPERTS = 2


#: The stages besides the experts -> their directories in the imported DDM.
STAGES = {TEXT_ENCODER: TEXT_ENCODER_DIR, DECODER: DECODER_DIR, ROUTER: ROUTER_DIR}


def text_config(stages: Path, experts: Mapping[str, str],
                apart: Mapping[str, str] | None = None) -> RouterConfigFile:
    """router.yaml for the tiny Paris DDM at ``stages``: its experts at ``experts`` (name:
    host:port), the other stages at ``apart`` (name: host:port) or in the router."""
    apart = apart or {}
    return RouterConfigFile.from_dict({
        "experts": [{"name": name, "discovery": {"endpoints": [endpoint]}}
                    for name, endpoint in experts.items()],
        "conditioning": "text", "sampling": {"steps": 4, "strategy": "top2",
                                             "guidance_scale": 7.5},
        **{CONFIG_KEYS[role]: {"endpoints": [apart[CONFIG_KEYS[role]]]}
           if CONFIG_KEYS[role] in apart else {"checkpoint": str(stages / directory)}
           for role, directory in STAGES.items()}})


def paris_stages(root: Path, sizes: TinyParis = TinyParis()) -> Path:
    """A tiny Paris release of ``sizes`` under ``root``, and its components as stage
    checkpoints."""
    return write_paris_stages(write_paris_release(root / "release", sizes), root / "stages")


@contextmanager
def served_text_ddm(root: Path, stages_apart: bool = False, sizes: TinyParis = TinyParis(),
                    max_batch: int = 8, text_prior: bool = False
                    ) -> Iterator[tuple[str, Path]]:
    """Serve a tiny Paris DDM of ``sizes`` made under ``root`` (``stages_apart``: its text
    encoder, decoder and router network each on a stage server; each expert server takes
    ``max_batch`` forward rows; ``text_prior``: its router declares
    :func:`~tests.support.text_stages.hand_prior`); yields the router's base URL (ready) and
    the stage checkpoints' root."""
    stages = paris_stages(root, sizes)
    if text_prior:
        width = json.loads((stages / "text_encoder" / "config.json").read_text())["hidden_size"]
        with_prior(stages, hand_prior(width))
    with ExitStack() as stack:
        def serve(app) -> str:
            base = stack.enter_context(running(app))
            wait_ready(base)
            return base.removeprefix("http://")

        options = ServingOptions(backend="torch", max_batch=max_batch)
        experts = {f"expert_{k}": serve(create_model_app(stages / f"expert_{k}", options))
                   for k in range(EXPERTS)}
        apart = {CONFIG_KEYS[role]: serve(create_model_app(stages / directory))
                 for role, directory in STAGES.items()} if stages_apart else {}
        router = stack.enter_context(running(create_router_app(
            text_config(stages, experts, apart))))
        wait_ready(router)
        yield router, stages
