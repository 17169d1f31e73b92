"""``ddm sample DDM.yaml`` with no sampling flag uses the DDM's own defaults (its
``spec.sampling``), so it writes the pixels ``ddm up DDM.yaml`` answers to a request naming only
what to draw and the seed: for each label and text DDM we ship, served from its example (the
YAML ``make demo`` and the docs run), sampled in this process from that YAML, or from the
``ddm.yaml`` an import wrote beside its checkpoints."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest
from PIL import Image

from ddm.cli import main
from ddm.deploy.spec import load_manifest
from ddm.runtime.local import LocalPlan
from tests.support.local_runtime import ddm_up

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
GENERATION_S = 300.0  # tens of steps of small models on two busy cores
#: Label DDMs: their example, the label and seed asked.
LABEL_DDMS = {"mnist": (EXAMPLES / "mnist.yaml", 3, 11),
              "digits": (EXAMPLES / "digits.yaml", 7, 5),
              "digits-heterogeneous": (EXAMPLES / "heterogeneous.yaml", 2, 8)}
PROMPT, SEED = "a thick red seven", 21

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _png(b64: str) -> np.ndarray:
    with Image.open(io.BytesIO(base64.b64decode(b64))) as image:
        return np.asarray(image)


def _sample(capsys: pytest.CaptureFixture[str], *argv: object) -> None:
    code = main(["sample", *map(str, argv), "--quiet"])
    assert code == 0, capsys.readouterr().err


@pytest.fixture(scope="module")
def text2img() -> Iterator[LocalPlan]:
    with ddm_up(EXAMPLES / "text2img.yaml") as (plan, _, _):
        yield plan


@pytest.mark.parametrize("manifest", [ROOT / "checkpoints" / "text2img" / "ddm.yaml",
                                      EXAMPLES / "text2img.yaml"], ids=["ddm.yaml", "example"])
def test_a_text_ddm_sampled_from_its_yaml_gives_the_served_pixels(text2img, manifest, tmp_path,
                                                                   capsys):
    reply = httpx.post(f"{text2img.url}/v1/images/generations", timeout=GENERATION_S,
                       json={"prompt": PROMPT, "seed": SEED})
    assert reply.status_code == 200, reply.text
    served = _png(reply.json()["data"][0]["b64_json"])
    sampling = load_manifest(manifest).spec.sampling
    assert (reply.json()["steps"], reply.json()["strategy"],
            reply.json()["guidance_scale"]) == (sampling.steps, sampling.strategy,
                                                sampling.guidance_scale)

    out = tmp_path / "x.png"
    _sample(capsys, manifest, "--prompt", PROMPT, "--seed", SEED, "--out", out)
    local = np.asarray(Image.open(out))
    assert local.shape == served.shape == (32, 32, 3)
    difference = np.abs(local.astype(int) - served).max()
    print(f"\n{manifest.name}: largest pixel difference {difference}")
    assert difference <= 1  # in-process and served floats may round apart


@pytest.mark.parametrize("name", list(LABEL_DDMS))
def test_a_label_ddm_sampled_from_its_yaml_gives_the_served_pixels(name, tmp_path, capsys):
    manifest, label, seed = LABEL_DDMS[name]
    out = tmp_path / "s.npz"
    _sample(capsys, manifest, "--labels", label, "--seed", seed, "--out", out)
    with np.load(out) as samples:
        local, steps, strategy = samples["images"][0], samples["steps"], samples["strategy"]
    with ddm_up(manifest) as (plan, log, _):
        reply = httpx.post(f"{plan.url}/v1/generate", timeout=GENERATION_S,
                           json={"labels": [label], "seed": seed})
        assert reply.status_code == 200, reply.text + log.getvalue()[-2000:]
    served = _png(reply.json()["images"][0])
    assert (int(steps), str(strategy)) == (reply.json()["steps"], reply.json()["strategy"])
    assert local.shape == served.shape
    difference = np.abs(local.astype(int) - served).max()
    print(f"\n{name}: largest pixel difference {difference}")
    assert difference <= 1  # in-process and served floats may round apart
