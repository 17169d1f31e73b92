"""``python -m benchmarks serve``'s text2img latency (issue 23's "must show"): one prompt, 30
steps, top-2 with guidance, from the shipped DDM (checkpoints/text2img) served by ``ddm up
examples/text2img.yaml`` (its text encoder and decoder as servers of their own, two PyTorch
and two JAX experts, the router), timed from the client's POST to its answer; and the same
models run in this process (``load_ddm`` + ``generate_text``) for the same prompts and
seeds. Target: served under one second; the ratio says what serving adds.

Rounds alternate served and in-process, after one warm-up of each (JIT, first allocations), so
a load change on the machine hits both alike.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import httpx

from benchmarks.fleet import BenchError, say
from ddm.models.ddm import load_ddm
from ddm.sampling.pipeline import generate_text
from tests.support.local_runtime import ddm_up

REPOSITORY = Path(__file__).resolve().parents[1]
EXAMPLE = REPOSITORY / "examples" / "text2img.yaml"
CHECKPOINTS = REPOSITORY / "checkpoints" / "text2img"
#: What the issue asks of one prompt's answer.
TARGET_S = 1.0
STEPS, STRATEGY, GUIDANCE = 30, "top2", 4.0
PROMPTS = ("a thick red seven", "the number 3 in blue", "a thin green two",
           "a yellow five", "a thick white nine")


def text2img_latency(rounds: int, log: TextIO = sys.stderr) -> dict[str, Any]:
    """Served and in-process seconds per one-prompt generation, ``rounds`` of each."""
    ddm = load_ddm(CHECKPOINTS)

    def in_process(i: int) -> float:
        started = time.perf_counter()
        generate_text(ddm, [PROMPTS[i % len(PROMPTS)]], steps=STEPS, seed=i,
                      strategy=STRATEGY, guidance_scale=GUIDANCE)
        return time.perf_counter() - started

    served_s: list[float] = []
    local_s: list[float] = []
    with ddm_up(EXAMPLE) as (plan, log_lines, _), httpx.Client(timeout=300) as client:
        def served(i: int) -> float:
            started = time.perf_counter()
            answer = client.post(f"{plan.url}/v1/images/generations", json={
                "prompt": PROMPTS[i % len(PROMPTS)], "n": 1, "seed": i, "steps": STEPS,
                "strategy": STRATEGY, "guidance_scale": GUIDANCE})
            elapsed = time.perf_counter() - started
            if answer.status_code != 200:
                raise BenchError(f"the router answered {answer.status_code}: {answer.text}\n"
                                 f"{log_lines.getvalue()[-2000:]}")
            return elapsed

        say(log, "text2img: ddm up is ready; warming up")
        served(0)
        in_process(0)
        for i in range(1, rounds + 1):
            served_s.append(served(i))
            local_s.append(in_process(i))
        say(log, f"text2img: {rounds} rounds done")
    served_median, local_median = statistics.median(served_s), statistics.median(local_s)
    return {"text2img_latency": {
        "what": f"one prompt, {STEPS} steps, {STRATEGY}, guidance {GUIDANCE:g}: served by ddm up "
                "(separate text encoder and decoder) vs the same models in-process",
        "value": round(served_median, 3), "target": TARGET_S, "comparison": "<=",
        "met": served_median <= TARGET_S,
        "served_s": {"median": round(served_median, 3), "max": round(max(served_s), 3)},
        "in_process_s": {"median": round(local_median, 3), "max": round(max(local_s), 3)},
        "ratio_served_to_in_process": round(served_median / local_median, 2),
        "rounds": rounds}}


def text2img_summary_lines(result: dict[str, Any]) -> list[str]:
    figure = result["text2img_latency"]
    return [f"{'met ' if figure['met'] else 'MISS'}  text2img one prompt served: "
            f"{figure['served_s']['median']} s median (target <= {figure['target']} s); "
            f"in-process {figure['in_process_s']['median']} s, ratio "
            f"x{figure['ratio_served_to_in_process']}"]
