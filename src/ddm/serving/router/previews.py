"""Live previews of latents: a linear latent -> RGB projection per decoder.

A latent DDM's state is not an image, and decoding every step would cost a decoder call per
frame. A VAE's decoder is close to linear per pixel at low frequency (the reason Stable
Diffusion's community previews multiply latents by a 4x3 matrix), so each latent pixel's
colour is approximated as ``rgb = W^T [z; 1]``. The projection is fitted once per decoder, by
least squares of decoded images (average-pooled to the latent grid) on a few random latents,
rather than taken from the decoder's config: diffusers' ``AutoencoderKL`` config records no
such matrix, and the published ones hold for Stable Diffusion's own VAE only, not for any other
decoder (our tiny test decoders included). The fit works for every decoder, in the router or
on its own server, through the same :class:`~ddm.serving.router.stage_clients.StageCaller`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ddm.convention import to_uint8

if TYPE_CHECKING:
    from ddm.serving.router.stage_clients import StageCaller

#: Random latents decoded to fit a projection: 4 x S x S pixels each, far more equations than
#: the (C + 1) x 3 unknowns.
FIT_LATENTS = 4
#: The fit's latents are drawn from this seed: the same decoder gets the same projection.
FIT_SEED = 0


@dataclass(frozen=True)
class LatentPreview:
    """``weights`` (C + 1, 3): a latent pixel ``[z_1 .. z_C, 1]`` -> RGB in ``[-1, 1]``;
    ``image_size`` (H, W): the decoder's images' size for the latents it was fitted on."""

    weights: np.ndarray
    image_size: tuple[int, int] | None = None

    def rgb(self, latents: np.ndarray) -> np.ndarray:
        """Latents (C, S, S) -> a preview (S, S, 3) uint8 RGB."""
        channels = latents.shape[0]
        if self.weights.shape != (channels + 1, 3):
            raise ValueError(f"a preview for {self.weights.shape[0] - 1}-channel latents was "
                             f"given {channels} channels")
        pixels = np.moveaxis(latents, 0, -1) @ self.weights[:-1] + self.weights[-1]
        return to_uint8(pixels)


def fit_preview(latents: np.ndarray, images: np.ndarray) -> LatentPreview:
    """The least-squares projection from latents (N, C, S, S) to their decoded images
    (N, 3, H, W), H and W multiples of S (the decoder's up-sampling)."""
    n, channels, size, _ = latents.shape
    factor = images.shape[-1] // size
    if images.shape[:2] != (n, 3) or images.shape[-2:] != (size * factor, size * factor):
        raise ValueError(f"decoded images {images.shape} are not (N, 3) RGB at a multiple of "
                         f"the latents' {size}x{size}")
    pooled = images.reshape(n, 3, size, factor, size, factor).mean(axis=(3, 5))
    inputs = np.moveaxis(latents, 1, -1).reshape(-1, channels)
    design = np.concatenate([inputs, np.ones((len(inputs), 1), inputs.dtype)], axis=1)
    targets = np.moveaxis(pooled, 1, -1).reshape(-1, 3)
    weights, *_ = np.linalg.lstsq(design.astype(np.float64), targets.astype(np.float64),
                                  rcond=None)
    return LatentPreview(weights.astype(np.float32), (int(images.shape[2]), int(images.shape[3])))


async def decoder_preview(decoder: StageCaller, latent_shape: tuple[int, int, int]
                          ) -> LatentPreview:
    """Fit ``decoder``'s projection on :data:`FIT_LATENTS` random latents of ``latent_shape``
    (one decoder call)."""
    latents = np.random.default_rng(FIT_SEED).standard_normal(
        (FIT_LATENTS, *latent_shape)).astype(np.float32)
    return fit_preview(latents, await decoder.decode(latents))
