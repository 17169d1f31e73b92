"""Live previews of latents: the decoder's image of the clean latent each step predicts.

A latent DDM's state is not an image. Mid-way, ``x_t`` is half noise, off the latents the
decoder was trained on, so neither it nor a linear latent -> RGB map shows the digit: on the
shipped text2img DDM a least-squares map (Stable Diffusion's community previews) did not
reproduce even the final latent's image (correlation -0.25 to 0.6 with the decoded one, 8x8
pooled). The preview is the decoder's image of ``x1_hat = x_t + (1 - t) v``, what the step
predicts the end to be: the digit appears within the first steps and sharpens into the final
image, at the price of one decoder call per streamed step. The router sees states only (with
delegation, several steps go in one call), so ``v`` is the chord between two streamed states,
the Euler step's own velocity and, for any solver, the chunk's mean velocity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ddm.convention import data_from_velocity, to_uint8

if TYPE_CHECKING:
    from ddm.serving.router.fleet.stage_clients import StageCaller


@dataclass(frozen=True)
class StatePoint:
    """A streamed state ``x`` (N, C, S, S) at time ``t``."""

    t: float
    x: np.ndarray


def predicted_latents(before: StatePoint | None, now: StatePoint) -> np.ndarray:
    """The clean latents (N, C, S, S) ``now``'s state heads for: ``x1_hat = x_t + (1 - t) v``
    with ``v`` the chord from ``before`` (the previous streamed state); ``now.x`` itself when
    there is none (the first step, whose start the router never streams)."""
    if before is None or now.t <= before.t:
        return now.x
    velocity = (now.x - before.x) / np.float32(now.t - before.t)
    return data_from_velocity(now.x, np.full(len(now.x), now.t, np.float32), velocity)


async def latent_preview(decoder: StageCaller, before: StatePoint | None, now: StatePoint
                         ) -> np.ndarray:
    """The preview of ``now``'s first latent: (H, W, 3) uint8 RGB, the decoder's image of
    :func:`predicted_latents` (one decoder call)."""
    pixels = await decoder.decode(predicted_latents(before, now)[:1])
    return np.ascontiguousarray(to_uint8(pixels[0]).transpose(1, 2, 0))


async def decoded_size(decoder: StageCaller, latent_shape: tuple[int, int, int]
                       ) -> tuple[int, int]:
    """The (H, W) of ``decoder``'s images for latents of ``latent_shape`` (one decoder call
    on a zero latent)."""
    images = await decoder.decode(np.zeros((1, *latent_shape), np.float32))
    return int(images.shape[2]), int(images.shape[3])
