"""The shipped text-to-image DDM as `make demo` serves it (``ddm up examples/text2img.yaml``:
its text encoder and decoder as servers of their own, two PyTorch and two JAX experts, the
router), asked over HTTP what issue 23 promises at the shipped defaults: prompts naming each
digit and a colour give that digit in that colour at least 95% of the time, and a thick prompt
gives more ink than a thin one of the same digit and seed. The README's calls run against the
same deployment, as a newcomer would run them after `make demo`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.support.local_runtime import ddm_up
from tests.support.text2img_served import Ask, judge, png_rgb

REPOSITORY = Path(__file__).resolve().parents[2]
EXAMPLE = REPOSITORY / "examples" / "text2img.yaml"
#: Where the README says `make demo` serves.
README_URL = "http://127.0.0.1:8080"
#: The README's blocks that need more than `make demo`'s deployment, by their first command,
#: and where they are tested instead. Every other block runs against the deployment.
ELSEWHERE = {
    "git clone": "the clone this test runs in",
    "make demo": "the deployment these blocks run against (ddm up examples/text2img.yaml)",
    "make test": "the suite itself",
    "helm install": "a cluster: tests/e2e/test_helm_install.py",
}


@pytest.fixture(scope="module")
def demo() -> Iterator[tuple[str, object]]:
    """`make demo`'s deployment: its URL and its log."""
    with ddm_up(EXAMPLE) as (plan, log, _):
        yield plan.url, log


def test_prompts_get_their_digit_colour_and_stroke_from_ddm_up(demo) -> None:
    url, log = demo

    def draw(ask: Ask) -> np.ndarray:
        answer = httpx.post(f"{url}/v1/images/generations", timeout=300, json={
            "prompt": ask.prompt, "n": 1, "seed": ask.seed})
        assert answer.status_code == 200, answer.text + log.getvalue()[-2000:]
        return png_rgb(answer.json()["data"][0]["b64_json"])

    verdict = judge(draw)
    verdict.assert_meets_the_bar("ddm up")


def readme_blocks() -> list[tuple[str, str]]:
    """The README's fenced code blocks: (language, text)."""
    readme = (REPOSITORY / "README.md").read_text()
    return [(m.group(1), m.group(2))
            for m in re.finditer(r"^```(\w*)\n(.*?)^```", readme, re.M | re.S)]


def _runs_here(text: str) -> bool:
    first = text.strip().splitlines()[0]
    return not any(first.startswith(command) for command in ELSEWHERE)


def test_every_readme_block_is_run_here_or_named_with_where_it_is_tested() -> None:
    blocks = readme_blocks()
    assert any(_runs_here(text) for _, text in blocks)
    for language, text in blocks:
        assert _runs_here(text) == (language in ("bash", "python") and "curl" in text
                                    or "from openai" in text), (
            f"README block {text.splitlines()[0]!r}: run it here or name it in ELSEWHERE")


@pytest.mark.parametrize("index", [i for i, (_, text) in enumerate(readme_blocks())
                                   if _runs_here(text)])
def test_the_readme_calls_work_against_make_demos_deployment(demo, index, tmp_path) -> None:
    """Each call block as written, the port aside: curl answers PNGs, the OpenAI SDK writes
    one."""
    url, log = demo
    language, text = readme_blocks()[index]
    text = text.replace(README_URL, url)
    command = ["bash", "-euo", "pipefail", "-c", text] if language == "bash" else [
        sys.executable, "-c", text]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr + log.getvalue()[-2000:]
    if language == "bash":
        import json

        images = json.loads(result.stdout)["data"]
        assert images and all(png_rgb(image["b64_json"]).ndim == 3 for image in images)
    else:
        written = list(tmp_path.glob("*.png"))
        assert len(written) == 1 and written[0].read_bytes().startswith(b"\x89PNG")


def test_the_latency_benchmark_times_the_served_and_the_in_process_generation() -> None:
    """``python -m benchmarks serve``'s text2img figure, one round: both sides timed and
    compared, the verdict following the figure."""
    import io

    from benchmarks.text2img_latency import TARGET_S, text2img_latency, text2img_summary_lines

    figure = text2img_latency(1, io.StringIO())["text2img_latency"]
    served, local = figure["served_s"]["median"], figure["in_process_s"]["median"]
    assert served > 0 and local > 0
    assert abs(figure["ratio_served_to_in_process"] - served / local) < 0.02  # rounded figures
    assert figure["target"] == TARGET_S and figure["met"] == (figure["value"] <= TARGET_S)
    assert "text2img one prompt served" in text2img_summary_lines(
        {"text2img_latency": figure})[0]
