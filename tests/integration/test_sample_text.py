"""``ddm sample`` on a text DDM (a tiny Paris release imported by ``ddm import paris``): the
README promises that ``ddm sample`` in-process and the router give the same images, so for the
same request (prompts, seed, steps, strategy, guidance) its RGB PNG and samples file hold the
router's pixels (its PNGs, within 1/255 as in-process and served floats may round apart), and
``ddm sample --router`` writes them in the same file, one request per --batch-size. Bad
input is refused by name before any model runs: a prompt to a label DDM, a label to a text
DDM, guidance outside deploy/limits.py's range."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np
import pytest
from PIL import Image

from ddm.cli import main
from ddm.deploy.limits import MAX_GUIDANCE_SCALE
from ddm.samples import SamplesFileError, load_samples_npz
from tests.support.text_router import served_text_ddm

GENERATION_S = 120.0  # a few steps of tiny models on two busy cores
REQUEST = {"seed": 3, "steps": 4, "strategy": "top2", "guidance_scale": 7.5}
FLAGS = ("--seed", "3", "--steps", "4", "--strategy", "top2", "--guidance-scale", "7.5")
LABEL_DDM = Path(__file__).parents[2] / "checkpoints" / "digits"
TEXT2IMG = Path(__file__).parents[2] / "examples" / "text2img.yaml"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    with served_text_ddm(tmp_path_factory.mktemp("served")) as fleet:
        yield fleet


def _png(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)))


def _sample(capsys, *argv: object) -> tuple[int, str]:
    code = main(["sample", *map(str, argv), "--quiet"])
    return code, capsys.readouterr().err


def test_one_prompt_to_a_png_is_the_routers_image(served, tmp_path, capsys):
    router, stages = served
    reply = httpx.post(f"{router}/v1/images/generations", timeout=GENERATION_S,
                       json={"prompt": "a red seven", "n": 1, **REQUEST})
    assert reply.status_code == 200, reply.text
    served_image = _png(base64.b64decode(reply.json()["data"][0]["b64_json"]))

    out = tmp_path / "one.png"
    code, err = _sample(capsys, stages / "ddm.yaml", "--prompt", "a red seven", *FLAGS,
                        "--out", out)
    assert code == 0, err
    image = _png(out.read_bytes())
    assert image.shape == served_image.shape == (16, 16, 3)  # RGB, the decoder's size
    assert np.abs(image.astype(int) - served_image).max() <= 1


@pytest.mark.parametrize("via_router", [False, True], ids=["in-process", "--router"])
def test_prompts_to_a_samples_file_are_the_routers_images_in_any_batch(served, tmp_path,
                                                                        capsys, via_router):
    router, stages = served
    prompts = ["a red seven", "a blue cat on the beach"]
    guidance = {"negative_prompt": "a photo", "guidance_cutoff": 0.5}
    reply = httpx.post(f"{router}/v1/generate", timeout=GENERATION_S,
                       json={"prompts": prompts, **REQUEST, **guidance})
    assert reply.status_code == 200, reply.text
    served_images = np.stack([_png(base64.b64decode(image))
                              for image in reply.json()["images"]])

    out, grid = tmp_path / "s.npz", tmp_path / "grid.png"
    source = ("--router", router) if via_router else (stages,)
    code, err = _sample(capsys, *source, "--prompt", prompts[0], "--prompt", prompts[1], *FLAGS,
                        "--negative-prompt", "a photo", "--guidance-cutoff", "0.5",
                        "--batch-size", "1", "--out", out, "--png", grid)
    assert code == 0, err
    with np.load(out) as samples:
        fields = {key: samples[key] for key in samples.files}
    assert set(fields) == {"images", "prompts", "expert_calls", "strategy", "steps", "solver",
                           "seed", "source", "guidance_scale", "guidance_cutoff",
                           "negative_prompt"}
    assert fields["images"].shape == (2, 16, 16, 3) and fields["images"].dtype == np.uint8
    assert np.abs(fields["images"].astype(int) - served_images).max() <= 1
    assert fields["prompts"].tolist() == prompts
    assert (fields["steps"], fields["seed"], str(fields["strategy"])) == (4, 3, "top2")
    assert str(fields["source"]) == (router if via_router else str(stages))
    assert (fields["guidance_scale"], fields["guidance_cutoff"]) == (7.5, 0.5)
    assert str(fields["negative_prompt"]) == "a photo"
    assert fields["expert_calls"].tolist() == [8, 8]  # top2 at each of 4 steps
    row = _png(grid.read_bytes())
    assert row.shape == (18, 35, 3)  # two 16x16 images and their 1-pixel black gutters
    np.testing.assert_array_equal(row[1:17, 1:17], fields["images"][0])
    with pytest.raises(SamplesFileError, match="holds a text DDM's images"):
        load_samples_npz(out)  # ddm eval scores digits against labels only


@pytest.mark.parametrize("ddm,extra,problem", [
    ("label", ("--prompt", "a red seven"),
     "is a label DDM (conditioned on class labels): it takes --labels, not --prompt"),
    ("label", ("--guidance-cutoff", "0.5"), "it takes --labels, not --guidance-cutoff"),
    ("router", ("--labels", "7"), "is a text DDM (conditioned on prompts): it takes --prompt, "
                                  "not --labels"),
    ("router", ("--prompt", "a", "--guidance-scale", "0.5", "--steps", "999"),
     "steps: Input should be less than or equal to 200"),  # declared 1..1000; its limit 200
    ("text", ("--labels", "7"), "is a text DDM (conditioned on prompts): it takes --prompt, "
                                "not --labels"),
    ("text", (), "is a text DDM: give --prompt"),
    ("text", ("--prompt", "a", "--strategy", "oracle"), "the oracle strategy routes by label"),
    ("text", ("--prompt", "a", "--out-as", "x"), "unrecognized arguments: --out-as"),
])
def test_bad_input_is_refused_by_name_before_anything_is_written(served, tmp_path, capsys,
                                                                 ddm, extra, problem):
    source = {"label": (LABEL_DDM,), "text": (served[1],), "router": ("--router", served[0])}[ddm]
    out = tmp_path / "s.npz"
    try:
        code, err = _sample(capsys, *source, *extra, "--out", out)
    except SystemExit as exit_:  # argparse's own refusals
        code, err = exit_.code, capsys.readouterr().err
    assert code != 0 and problem in err, err  # 2: ours; 1: the router refused it
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag,value", [("--guidance-scale", str(MAX_GUIDANCE_SCALE + 1)),
                                        ("--guidance-scale", "-1"),
                                        ("--guidance-scale", "nan"),
                                        ("--guidance-cutoff", "1.5"),
                                        ("--guidance-cutoff", "0")])
def test_guidance_out_of_range_is_refused_naming_the_flag_and_its_range(served, tmp_path,
                                                                        capsys, flag, value):
    bounds = f"[0, {MAX_GUIDANCE_SCALE:g}]" if flag == "--guidance-scale" else "(0, 1]"
    with pytest.raises(SystemExit) as exit_:
        _sample(capsys, served[1], "--prompt", "a", flag, value, "--out", tmp_path / "s.png")
    assert exit_.value.code == 2
    assert f"{flag} must be a number in {bounds}, got '{value}'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_text_ddm_writes_only_npz_or_png(served, tmp_path, capsys):
    code, err = _sample(capsys, served[1], "--prompt", "a", "--out", tmp_path / "s.jpg")
    assert code == 2 and "--out must end with .npz (samples) or .png (images)" in err


def test_into_a_pipe_it_draws_no_bar_not_even_the_model_libraries(tmp_path):
    """The README's promise: bars on a terminal's stderr only. transformers draws its own as
    it loads a text encoder, into a pipe too, unless told not to."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    done = subprocess.run(
        [sys.executable, "-m", "ddm", "sample", str(TEXT2IMG), "--prompt", "a red seven",
         "--steps", "2", "--out", str(tmp_path / "seven.png")],
        capture_output=True, text=True, env=env, timeout=GENERATION_S)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "seven.png").is_file()
    assert done.stderr == ""  # stdout has the result; nothing else was said
