"""End to end on loopback: a tiny Paris release (random weights, the release's layout and key
names) imported with ``ddm import paris`` and served by ``ddm up DST/ddm.yaml`` (the experts
and, as the operator would, the text encoder and decoder as ``ddm serve stage`` processes of
their own; the router network in the router) answers ``POST /v1/images/generations`` with the
image Paris's published sampler makes (tests/support/paris_reference.py, written apart from
ddm's sampling code) within 2/255; guidance 1 and 7.5 give different images, the same seed
the same image."""

from __future__ import annotations

import base64
import io
import threading
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest
import yaml
from PIL import Image

from ddm.cli import main
from ddm.deploy.spec import load_manifest
from ddm.runtime.local import LocalPlan, free_port, run_local
from tests.support.paris_reference import ParisReference
from tests.support.paris_release import write_paris_release

IMAGES = "/v1/images/generations"
PROMPT = "a photo of a red car on the beach"
STEPS = 4
GENERATION_S = 180.0  # a few steps of tiny models through five processes on two busy cores

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    return write_paris_release(tmp_path_factory.mktemp("paris") / "release", seed=7)


@pytest.fixture(scope="module")
def imported(release: Path, tmp_path_factory) -> Path:
    """``ddm import paris``, then the text encoder and decoder moved to servers of their own
    (what ``--accelerator nvidia`` writes, on this machine's CPU)."""
    out = tmp_path_factory.mktemp("imported") / "paris"
    assert main(["import", "paris", str(release), "--out", str(out)]) == 0
    manifest = out / "ddm.yaml"
    document = yaml.safe_load(manifest.read_text())
    for stage in ("textEncoder", "decoder"):
        document["spec"][stage]["placement"] = "separate"
    manifest.write_text(yaml.safe_dump(document))
    return out


class _Log(io.StringIO):
    """``ddm up``'s output, written from its thread and read from the test's."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            return super().write(text)


@pytest.fixture(scope="module")
def served(imported: Path) -> Iterator[LocalPlan]:
    ready, stop, log, plans = threading.Event(), threading.Event(), _Log(), []
    outcome: list[int] = []

    def on_ready(plan: LocalPlan) -> None:
        plans.append(plan)
        ready.set()

    thread = threading.Thread(target=lambda: outcome.append(run_local(
        load_manifest(imported / "ddm.yaml"), router_port=free_port(), out=log,
        on_ready=on_ready, stop=stop)))
    thread.start()
    try:
        while not ready.wait(0.5):
            assert thread.is_alive(), f"ddm up stopped before it was ready:\n{log.getvalue()}"
        yield plans[0]
    finally:
        stop.set()
        thread.join(timeout=60)
    assert outcome == [0], log.getvalue()


def _npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def _generate(plan: LocalPlan, **fields) -> np.ndarray:
    assert plan.token_file is not None  # the import asks for a token: ddm up wrote one
    token = Path(plan.token_file).read_text().strip()
    reply = httpx.post(f"{plan.url}{IMAGES}", timeout=GENERATION_S,
                       headers={"Authorization": f"Bearer {token}"}, json={
        "prompt": PROMPT, "steps": STEPS, "strategy": "top2", "response_format": "b64_json",
        **fields})
    assert reply.status_code == 200, reply.text
    (item,) = reply.json()["data"]
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))).astype(int)


def test_ddm_up_runs_the_separate_stages_as_servers_of_their_own(served: LocalPlan) -> None:
    assert [p.name for p in served.stages] == ["text-encoder/0", "decoder/0"]
    assert [p.name for p in served.experts] == ["expert-0/0", "expert-1/0"]
    assert served.router_config.router_network.checkpoint.endswith("/router")


def test_the_served_image_equals_the_reference_samplers_within_2_of_255(
        served: LocalPlan, release: Path) -> None:
    reference = ParisReference(release)
    seed = 2
    expected = reference.generate(PROMPT, routing="top2", cfg_scale=7.5, num_steps=STEPS,
                                  seed=seed)
    image = _generate(served, guidance_scale=7.5,
                      latents=_npy(reference.initial_latents(seed).numpy()))
    assert image.shape == expected.image.shape == (16, 16, 3)
    difference = np.abs(image - expected.image.astype(int))
    assert difference.max() <= 2, f"max pixel difference {difference.max()}"


def test_guidance_changes_the_image_and_the_seed_decides_it(served: LocalPlan) -> None:
    guided = _generate(served, seed=5)  # the imported default, 7.5
    assert np.abs(guided - _generate(served, seed=5, guidance_scale=1.0)).max() > 0
    np.testing.assert_array_equal(guided, _generate(served, seed=5, guidance_scale=7.5))
    assert np.abs(guided - _generate(served, seed=6)).max() > 0
