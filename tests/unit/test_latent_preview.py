"""The latent -> RGB preview projection: fitted by least squares, it recovers a decoder that
is linear per pixel exactly, whatever its up-sampling."""

from __future__ import annotations

import numpy as np
import pytest

from ddm.serving.router.previews import LatentPreview, fit_preview


def test_the_fit_recovers_a_per_pixel_linear_decoder():
    rng = np.random.default_rng(0)
    mixing = rng.standard_normal((4, 3)).astype(np.float32) * 0.3
    offset = np.array([0.1, -0.2, 0.05], np.float32)
    latents = rng.standard_normal((3, 4, 8, 8)).astype(np.float32)
    colours = np.einsum("ncij,cd->ndij", latents, mixing) + offset[None, :, None, None]
    images = colours.repeat(2, axis=2).repeat(2, axis=3)  # a 2x nearest up-sampling decoder
    preview = fit_preview(latents, images)
    np.testing.assert_allclose(preview.weights[:4], mixing, atol=1e-5)
    np.testing.assert_allclose(preview.weights[4], offset, atol=1e-5)
    expected = np.rint((np.clip(colours[0], -1, 1) + 1) * 127.5).astype(np.uint8)
    np.testing.assert_array_equal(preview.rgb(latents[0]), expected.transpose(1, 2, 0))


def test_a_preview_refuses_latents_of_another_width():
    with pytest.raises(ValueError, match="4-channel latents was given 3 channels"):
        LatentPreview(np.zeros((5, 3), np.float32)).rgb(np.zeros((3, 8, 8), np.float32))


def test_decoded_images_must_be_rgb_at_a_multiple_of_the_latent_size():
    with pytest.raises(ValueError, match="not \\(N, 3\\) RGB"):
        fit_preview(np.zeros((2, 4, 8, 8), np.float32), np.zeros((2, 1, 16, 16), np.float32))
