"""Coloured MNIST with captions: the text-to-image DDM's data, built from the IDX files given.

Each 28x28 digit is padded to 32x32 and painted in one of seven named colours on black (the
grey level scales the colour, so anti-aliased edges stay soft). Its stroke is named from its
ink mass relative to the other digits *of its class* in the same split: the lightest third is
"thin", the heaviest third "thick", the middle third unnamed (so "thick" and "thin" prompts
differ clearly). Captions come from several templates that name the digit (as a word or a
numeral), the colour and the stroke; some templates omit attributes, and a fixed fraction of
captions are empty, the unconditional rows classifier-free guidance needs.

Everything is a function of the IDX pixels and ``seed``: the same files and seed give the same
colours, strokes and captions on every machine.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from ddm.data.mnist import load_mnist

#: The ink colours, in the order of their ids, as RGB in [0, 1].
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0), "cyan": (0.0, 1.0, 1.0), "magenta": (1.0, 0.0, 1.0),
    "white": (1.0, 1.0, 1.0),
}
COLOUR_NAMES = tuple(COLOURS)
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
#: Stroke ids: named thin / thick, or unnamed (the middle third of its class's ink masses).
THIN, THICK, UNNAMED_STROKE = 0, 1, 2
STROKE_NAMES = ("thin", "thick")
IMAGE_SIZE = 32
EMPTY_FRACTION = 0.1

#: Caption templates: ``{digit}`` is a word or a numeral (drawn per caption), ``{colour}`` and
#: ``{stroke}`` the attributes; a template naming the stroke is used only for named strokes.
TEMPLATES = (
    "a {stroke} {colour} {digit}",
    "the number {digit} in {colour}",
    "a {colour} {digit}",
    "a {digit} drawn in {colour}",
    "a {stroke} {digit} in {colour}",
    "a handwritten {digit} in {colour} ink with a {stroke} stroke",
    "the digit {digit}",
    "a {stroke} {digit}",
    "{colour} {digit}",
    "{digit}",
)


@dataclass(frozen=True)
class ColoredDigits:
    """A captioned split: ``images`` ``(N, 3, 32, 32)`` uint8 (0 black .. 255 full colour),
    ``labels`` the digit, ``colours`` an index into :data:`COLOUR_NAMES`, ``strokes`` one of
    :data:`THIN`, :data:`THICK`, :data:`UNNAMED_STROKE`, and one caption per image."""

    images: np.ndarray
    labels: np.ndarray
    colours: np.ndarray
    strokes: np.ndarray
    captions: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.labels)

    def float_images(self, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
        """Rows of ``images`` in model space ``[-1, 1]``, float32 (ink at its colour's +1)."""
        return self.images[rows].astype(np.float32) / 127.5 - 1.0


def stroke_classes(grey: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per image: :data:`THIN` below its class's 1/3 ink-mass quantile, :data:`THICK` above the
    2/3 quantile, else :data:`UNNAMED_STROKE`. ``grey`` is ``(N, H, W)`` or ``(N, 1, H, W)``."""
    mass = np.asarray(grey, dtype=np.float64).reshape(len(labels), -1).sum(axis=1)
    strokes = np.full(len(labels), UNNAMED_STROKE, dtype=np.int64)
    for label in np.unique(labels):
        rows = np.flatnonzero(labels == label)
        low, high = np.quantile(mass[rows], [1 / 3, 2 / 3])
        strokes[rows[mass[rows] < low]] = THIN
        strokes[rows[mass[rows] > high]] = THICK
    return strokes


def paint(grey: np.ndarray, colours: np.ndarray) -> np.ndarray:
    """Grey digits ``(N, 1, H, W)`` in [0, 1] and colour ids ``(N,)`` -> uint8 ``(N, 3, H, W)``."""
    rgb = np.asarray([COLOURS[name] for name in COLOUR_NAMES], dtype=np.float32)[colours]
    painted = np.asarray(grey, dtype=np.float32) * rgb[:, :, None, None]
    return np.rint(painted * 255.0).astype(np.uint8)


def caption(template: str, label: int, colour: int, stroke: int, numeral: bool) -> str:
    """Fill one template; "a" becomes "an" before a vowel sound ("an eight", "an 8")."""
    if "{stroke}" in template and stroke == UNNAMED_STROKE:
        raise ValueError(f"template {template!r} names a stroke, but this digit's is unnamed")
    text = template.format(digit=str(label) if numeral else DIGIT_WORDS[label],
                           colour=COLOUR_NAMES[colour],
                           stroke=STROKE_NAMES[stroke] if stroke != UNNAMED_STROKE else "")
    return re.sub(r"\ba (?=[aeiou8])", "an ", text)


def captions_for(labels: np.ndarray, colours: np.ndarray, strokes: np.ndarray,
                 rng: np.random.Generator, empty_fraction: float = EMPTY_FRACTION
                 ) -> tuple[str, ...]:
    """One caption per row: a template drawn uniformly among those its stroke allows, a word or
    a numeral for the digit (even odds), and ``empty_fraction`` of rows left empty."""
    without = [t for t in TEMPLATES if "{stroke}" not in t]
    picks = rng.random(len(labels))
    numerals = rng.random(len(labels)) < 0.5
    empty = rng.random(len(labels)) < empty_fraction
    out = []
    for i, (label, colour, stroke) in enumerate(zip(labels, colours, strokes)):
        choices = without if stroke == UNNAMED_STROKE else TEMPLATES
        template = choices[int(picks[i] * len(choices))]
        out.append("" if empty[i] else caption(template, int(label), int(colour),
                                                int(stroke), bool(numerals[i])))
    return tuple(out)


#: The prompt a text2img DDM trained on these captions declares as its example (its text
#: encoder's ``_ddm.example_prompt``, which the page starts with): a caption of the first
#: template, in words every such DDM knows.
EXAMPLE_PROMPT = caption(TEMPLATES[0], 8, COLOUR_NAMES.index("red"), THICK, numeral=False)


def colorize(grey: np.ndarray, labels: np.ndarray, seed: int) -> ColoredDigits:
    """Colour and caption grey digits ``(N, 1, S, S)`` in [0, 1]; deterministic in ``seed``."""
    labels = np.asarray(labels, dtype=np.int64)
    rng = np.random.default_rng([seed, len(labels)])
    colours = rng.integers(0, len(COLOUR_NAMES), len(labels))
    strokes = stroke_classes(grey, labels)
    return ColoredDigits(images=paint(grey, colours), labels=labels, colours=colours,
                         strokes=strokes, captions=captions_for(labels, colours, strokes, rng))


def load_colored_mnist(directory: str | os.PathLike, part: str = "train",
                       seed: int = 0) -> ColoredDigits:
    """MNIST's ``part`` (``train`` or ``t10k``) from ``directory``'s IDX files, coloured and
    captioned at 32x32 (the 28x28 digits padded, every pixel kept)."""
    grey, labels = load_mnist(directory, IMAGE_SIZE, part)
    return colorize(grey, labels, seed)
