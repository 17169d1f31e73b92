"""Tiny MNIST IDX files with known ink masses, for the coloured-MNIST and text2img tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_bars_mnist(root: Path, part: str = "train", per_class: int = 3) -> np.ndarray:
    """Raw IDX files of ``10 * per_class`` 28x28 digits: image ``i`` of class ``c`` is a
    vertical bar ``i + 1`` pixels wide (ink 255), so its ink mass rises with ``i``."""
    labels = np.repeat(np.arange(10, dtype=np.uint8), per_class)
    widths = np.tile(np.arange(1, per_class + 1), 10)
    pixels = np.zeros((len(labels), 28, 28), np.uint8)
    for row, width in enumerate(widths):
        pixels[row, 4:24, 10:10 + width] = 255
    root.mkdir(parents=True, exist_ok=True)
    for kind, magic, data in (("images", 0x803, pixels), ("labels", 0x801, labels)):
        header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in data.shape)
        (root / f"{part}-{kind}-idx{magic & 0xFF}-ubyte").write_bytes(header + data.tobytes())
    return pixels
