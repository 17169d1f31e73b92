"""Encode uint8 images (grayscale digits, 0 background and 255 ink, or RGB) as PNG tiles and
grids."""

from __future__ import annotations

import io

import numpy as np


def png_bytes(image: np.ndarray, scale: int = 1) -> bytes:
    """One ``(H, W)`` grayscale or ``(H, W, 3)`` RGB uint8 image -> PNG bytes, upscaled
    ``scale`` times (nearest)."""
    from PIL import Image

    rgb = image.ndim == 3 and image.shape[2] == 3
    if not (image.ndim == 2 or rgb) or image.dtype != np.uint8:
        raise ValueError(f"expected a (H, W) or (H, W, 3) uint8 image, got {image.shape} "
                         f"{image.dtype}")
    pixels = image.repeat(scale, axis=0).repeat(scale, axis=1) if scale > 1 else image
    buffer = io.BytesIO()
    Image.fromarray(pixels, mode="RGB" if rgb else "L").save(buffer, format="PNG")
    return buffer.getvalue()


def grid(images: np.ndarray, columns: int, pad: int = 1) -> np.ndarray:
    """Tile ``(N, H, W)`` or RGB ``(N, H, W, 3)`` uint8 images row by row into one image with
    ``pad`` pixel gutters."""
    n, h, w = images.shape[:3]
    columns = max(1, min(columns, n))
    rows = -(-n // columns)
    out = np.zeros((rows * (h + pad) + pad, columns * (w + pad) + pad, *images.shape[3:]),
                   np.uint8)
    for i, image in enumerate(images):
        r, c = divmod(i, columns)
        top, left = pad + r * (h + pad), pad + c * (w + pad)
        out[top:top + h, left:left + w] = image
    return out
