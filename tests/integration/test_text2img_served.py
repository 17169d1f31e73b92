"""The shipped text-to-image DDM as `make demo` serves it (``ddm up examples/text2img.yaml``:
its text encoder and decoder as servers of their own, two PyTorch and two JAX experts, the
router), asked over HTTP what issue 23 promises at the shipped defaults: prompts naming each
digit and a colour give that digit in that colour at least 95% of the time, and a thick prompt
gives more ink than a thin one of the same digit and seed."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np

from tests.support.local_runtime import ddm_up
from tests.support.text2img_served import Ask, judge, png_rgb

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "text2img.yaml"


def test_prompts_get_their_digit_colour_and_stroke_from_ddm_up() -> None:
    with ddm_up(EXAMPLE) as (plan, log, _):
        def draw(ask: Ask) -> np.ndarray:
            answer = httpx.post(f"{plan.url}/v1/images/generations", timeout=300, json={
                "prompt": ask.prompt, "n": 1, "seed": ask.seed})
            assert answer.status_code == 200, answer.text + log.getvalue()[-2000:]
            return png_rgb(answer.json()["data"][0]["b64_json"])

        verdict = judge(draw)
    verdict.assert_meets_the_bar("ddm up")


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
