"""Encode uint8 digit images (0 background, 255 ink) as PNG tiles and grids."""

from __future__ import annotations

import io

import numpy as np


def png_bytes(image: np.ndarray, scale: int = 1) -> bytes:
    """One ``(H, W)`` uint8 image -> PNG bytes, upscaled ``scale`` times (nearest)."""
    from PIL import Image

    if image.ndim != 2 or image.dtype != np.uint8:
        raise ValueError(f"expected a (H, W) uint8 image, got {image.shape} {image.dtype}")
    pixels = np.kron(image, np.ones((scale, scale), np.uint8)) if scale > 1 else image
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buffer, format="PNG")
    return buffer.getvalue()


def grid(images: np.ndarray, columns: int, pad: int = 1) -> np.ndarray:
    """Tile ``(N, H, W)`` uint8 images row by row into one image with ``pad`` pixel gutters."""
    n, h, w = images.shape
    columns = max(1, min(columns, n))
    rows = -(-n // columns)
    out = np.zeros((rows * (h + pad) + pad, columns * (w + pad) + pad), np.uint8)
    for i, image in enumerate(images):
        r, c = divmod(i, columns)
        top, left = pad + r * (h + pad), pad + c * (w + pad)
        out[top:top + h, left:left + w] = image
    return out
