"""The text2img report's judges read a coloured digit's colour, grey digit and ink mass as the
data painted them; its prompts pair thick and thin twins on the same noise; its verdicts are
paired run by run, in the direction each metric improves; it names each routing (the router
network alone or with its text prior)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ddm.data.colored_mnist import COLOUR_NAMES, paint
from ddm.evaluation.report import paired_verdict
from ddm.evaluation.text2img_judges import grey, ink_colours, ink_mass
from ddm.evaluation.text2img_report import (SINGLE_MODEL, WITH_PRIOR, Prompts, Row, RunStore,
                                            render)


def _strokes(widths: list[int], level: float = 1.0) -> np.ndarray:
    """Grey (N, 1, 32, 32) vertical bars of the given widths, anti-aliased at their edge."""
    images = np.zeros((len(widths), 1, 32, 32), np.float32)
    for i, width in enumerate(widths):
        images[i, 0, 4:28, 10:10 + width] = level
        images[i, 0, 4:28, 10 + width] = 0.3 * level  # a soft edge keeps the hue
    return images


def test_the_ink_colour_is_the_painted_one_for_every_named_colour() -> None:
    colours = np.arange(len(COLOUR_NAMES))
    painted = paint(_strokes([3] * len(colours), level=0.8), colours).transpose(0, 2, 3, 1)
    assert ink_colours(painted).tolist() == colours.tolist()
    assert ink_colours(np.zeros((1, 32, 32, 3), np.uint8)).tolist() == [-1]  # no ink


def test_grey_and_ink_mass_undo_the_painting() -> None:
    bars = _strokes([2, 5])
    painted = paint(bars, np.array([0, 5])).transpose(0, 2, 3, 1)  # red, magenta
    np.testing.assert_array_equal(grey(painted), np.rint(bars[:, 0] * 255).astype(np.uint8))
    mass = ink_mass(painted)
    assert mass[1] > mass[0]
    assert mass[0] == pytest.approx(24 * 2 + 24 * 0.3, abs=0.1)


def test_the_judges_refuse_what_is_not_an_rgb_image() -> None:
    with pytest.raises(ValueError, match=r"uint8 RGB images \(N, H, W, 3\)"):
        grey(np.zeros((2, 3, 32, 32), np.uint8))
    with pytest.raises(ValueError, match="uint8 RGB"):
        ink_colours(np.zeros((2, 32, 32, 3), np.float32))


def test_prompts_pair_thick_and_thin_twins_on_one_noise() -> None:
    prompts = Prompts.make()
    assert len(prompts.text) == 10 * 7 * 2
    assert prompts.text[:2] == ("a thick red zero", "a thin red zero")
    assert prompts.text[-1] == "a thin white nine"
    noise = prompts.noise((4, 8, 8), seed=3)
    np.testing.assert_array_equal(noise[0::2], noise[1::2])
    assert not np.array_equal(noise[0], noise[2])
    np.testing.assert_array_equal(noise, prompts.noise((4, 8, 8), seed=3))


def test_verdicts_pair_runs_in_the_direction_a_metric_improves() -> None:
    assert paired_verdict([0.9, 0.8, 0.95], [0.7, 0.75, 0.9], "a", "b",
                          lower_is_better=False, digits=3).startswith(
        "a is better, higher in all 3 runs (per run +0.100")
    assert paired_verdict([0.9, 0.8, 0.95], [0.7, 0.75, 0.9], "a", "b").startswith(
        "b is better, lower in all 3 runs")
    assert paired_verdict([1.0, 2.0, 3.0], [2.0, 1.0, 3.0], "a", "b") == (
        "no consistent difference, a lower in 1 of 3 runs (per run +0.00 +/- 1.00)")


def test_reports_on_one_cache_share_runs_each_computed_once(tmp_path: Path) -> None:
    computed: list[str] = []

    def compute(name: str) -> dict[str, object]:
        computed.append(name)
        return {"fd": 1.5, "by": name}

    first, second = RunStore(tmp_path), RunStore(tmp_path)
    first.run("run-a", lambda: compute("first"))
    second.run("run-a", lambda: compute("second"))  # claimed: skipped
    second.run("run-b", lambda: compute("second"))
    assert computed == ["first", "second"]
    assert second.result("run-a") == {"fd": 1.5, "by": "first"}
    assert first.result("run-b")["by"] == "second"
    assert RunStore(tmp_path).result("run-a")["by"] == "first"  # a rerun resumes
    alone = RunStore(None)
    alone.run("run-a", lambda: compute("alone"))
    assert alone.result("run-a")["by"] == "alone"


def test_a_stopped_reports_claim_is_taken_over_and_a_live_ones_kept(tmp_path: Path) -> None:
    """Runs are cached by default, so a report stopped mid-run must not leave its run
    claimed for ever (the next report would wait an hour for it)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()
    (tmp_path / "stopped.claim").write_text(f"{host} {gone.pid}")
    (tmp_path / "running.claim").write_text(f"{host} {os.getppid()}")
    store = RunStore(tmp_path)
    assert store.run("stopped", lambda: {"by": "this report"})
    assert store.result("stopped") == {"by": "this report"}
    assert not store.run("running", lambda: {"by": "this report"})

    class Stopped(Exception):
        pass

    def interrupted() -> dict[str, object]:
        raise Stopped()

    with pytest.raises(Stopped):
        store.run("failed", interrupted)
    assert not (tmp_path / "failed.claim").exists()  # free for the next report


def _row(model: str, routing: str, guidance: float, digit: list[float]) -> Row:
    values = {m: [0.5, 0.5, 0.5] for m in ("colour", "stroke", "fd", "clip_match",
                                            "clip_score")}
    return Row(model, routing, guidance, values={**values, "digit": digit},
               usage=np.full((30, 4), 0.5))


def test_the_report_names_each_routing_and_judges_the_prior_against_the_network_alone():
    ddm = "DDM (4 experts)"
    rows = [_row(ddm, f"top1{suffix}", g, digit)  # the sweep: at the default, top-1
            for suffix, digits in (("", (0.3, 0.4)), (WITH_PRIOR, (0.5, 0.9)))
            for g, digit in zip((1.0, 4.0), ([d, d, d] for d in digits))]
    rows += [_row(ddm, f"{s}{suffix}", 4.0, [d, d + 0.01, d])
             for s in ("top2", "ensemble") for suffix, d in (("", 0.3), (WITH_PRIOR, 0.8))]
    rows.append(_row("monolith (12000 steps)", SINGLE_MODEL, 4.0, [1.0, 1.0, 1.0]))
    text = render(rows, {"checkpoints": "ckpt", "backends": "torch", "n": 140, "steps": 30,
                         "classifier": "clf", "machine": "cpu"})
    assert "| DDM (4 experts) | top1 + text prior | 4 | 0.900 +/- 0.000 |" in text
    assert "- Guidance (top1 + text prior): digit accuracy 0.500 at guidance 1 -> 0.900" in text
    assert ("- The text prior (top1 + text prior vs top1): digit accuracy 0.400 -> 0.900, with "
            "the prior is better, higher in all 3 runs") in text
    assert "- DDM top2 + text prior vs the monolith (12000 steps):" in text
    assert "- DDM top2 vs the monolith (12000 steps):" in text  # the network alone, too
