"""Coloured MNIST with captions: known colours, strokes and captions, deterministic per seed."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ddm.data.colored_mnist import (COLOUR_NAMES, DIGIT_WORDS, THICK, THIN, UNNAMED_STROKE,
                                    caption, colorize, load_colored_mnist, paint, stroke_classes)
from tests.support.bars_mnist import write_bars_mnist


def test_paint_scales_each_colour_by_the_grey_level() -> None:
    grey = np.zeros((2, 1, 2, 2), np.float32)
    grey[:, 0, 0, 0] = [1.0, 0.5]
    painted = paint(grey, np.array([COLOUR_NAMES.index("yellow"), COLOUR_NAMES.index("cyan")]))
    assert painted.dtype == np.uint8 and painted.shape == (2, 3, 2, 2)
    assert painted[0, :, 0, 0].tolist() == [255, 255, 0]
    assert painted[1, :, 0, 0].tolist() == [0, 128, 128]
    assert painted[:, :, 1, 1].max() == 0  # background stays black


def test_strokes_are_thirds_of_ink_mass_within_each_class() -> None:
    masses = np.array([1, 2, 3, 4, 5, 6, 60, 10, 35], np.float32)  # class 3 x6, class 8 x3
    grey = masses[:, None, None] * np.ones((9, 2, 2), np.float32) / 4
    labels = np.array([3] * 6 + [8] * 3)
    strokes = stroke_classes(grey, labels)
    assert strokes.tolist() == [THIN, THIN, UNNAMED_STROKE, UNNAMED_STROKE, THICK, THICK,
                                THICK, THIN, UNNAMED_STROKE]


@pytest.mark.parametrize("template, label, colour, stroke, numeral, expected", [
    ("a {stroke} {colour} {digit}", 7, "red", THICK, False, "a thick red seven"),
    ("the number {digit} in {colour}", 7, "red", UNNAMED_STROKE, True, "the number 7 in red"),
    ("a {digit} drawn in {colour}", 8, "white", THIN, False, "an eight drawn in white"),
    ("a {digit} drawn in {colour}", 8, "blue", THIN, True, "an 8 drawn in blue"),
    ("a {stroke} {digit}", 1, "green", THIN, True, "a thin 1"),
])
def test_captions_fill_templates(template: str, label: int, colour: str, stroke: int,
                                 numeral: bool, expected: str) -> None:
    assert caption(template, label, COLOUR_NAMES.index(colour), stroke, numeral) == expected


def test_a_stroke_template_refuses_an_unnamed_stroke() -> None:
    with pytest.raises(ValueError, match="stroke"):
        caption("a {stroke} {digit}", 1, 0, UNNAMED_STROKE, True)


def _synthetic(n: int = 3000) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(123)
    return rng.random((n, 1, 4, 4)).astype(np.float32), rng.integers(0, 10, n)


def test_captions_tell_the_truth_about_each_image() -> None:
    grey, labels = _synthetic()
    data = colorize(grey, labels, seed=5)
    empty = [c == "" for c in data.captions]
    assert 0.08 < np.mean(empty) < 0.12  # the unconditional rows guidance needs
    words = {w for i in range(10) for w in (str(i), DIGIT_WORDS[i])}
    for text, label, colour, stroke in zip(data.captions, data.labels, data.colours,
                                           data.strokes):
        tokens = set(re.findall(r"\w+", text))
        assert tokens & words <= {str(label), DIGIT_WORDS[label]}
        assert tokens & set(COLOUR_NAMES) <= {COLOUR_NAMES[colour]}
        named = tokens & {"thin", "thick"}
        assert named <= ({"thin"} if stroke == THIN else {"thick"} if stroke == THICK else set())
    captioned = [c for c in data.captions if c]
    assert any(not set(c.split()) & set(COLOUR_NAMES) for c in captioned)  # some omit colour
    assert any(set(c.split()) & {"thin", "thick"} for c in captioned)
    assert len({c for c in captioned}) > 200


def test_colouring_is_deterministic_per_seed() -> None:
    grey, labels = _synthetic(500)
    first, again, other = (colorize(grey, labels, seed) for seed in (1, 1, 2))
    assert first.captions == again.captions
    np.testing.assert_array_equal(first.images, again.images)
    assert first.captions != other.captions
    assert not np.array_equal(first.colours, other.colours)


def test_load_pads_idx_digits_to_32_and_names_strokes_per_class(tmp_path: Path) -> None:
    pixels = write_bars_mnist(tmp_path)
    data = load_colored_mnist(tmp_path, "train", seed=0)
    assert data.images.shape == (30, 3, 32, 32) and len(data.captions) == 30
    ink = data.images.max(axis=1)
    np.testing.assert_array_equal(ink[:, 2:30, 2:30], pixels)  # padded, every pixel kept
    assert ink[:, :2].max() == 0 and ink[:, :, 30:].max() == 0
    assert data.strokes.tolist() == [THIN, UNNAMED_STROKE, THICK] * 10
    assert data.float_images().min() == -1.0 and data.float_images().max() == 1.0
