"""The VAE: diffusers' AutoencoderKL, 32x32x3 <-> 4x8x8, trained here, and its latents.

Loss: L1 + MSE reconstruction of a latent *sampled* from the posterior, plus a KL term of weight
:data:`KL_WEIGHT` per latent element (per pixel the reconstruction weighs 1). SD's weight is
far smaller; with 256 latent dimensions per image ours keeps the latents near Gaussian, which
the experts denoise more easily, at a small cost in sharpness. The scaling factor is measured as
Stable Diffusion's was: ``1 / std`` of the posterior means over training images, written into
the VAE's config, so that ``scaling_factor * latent`` has unit variance.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ddm.data.colored_mnist import ColoredDigits
from ddm.models.text2img import Text2ImgSizes, vae_kwargs
from ddm.training.config import TrainConfig
from ddm.training.resume import Resumable
from ddm.training.torch_loop import ProgressFn, optimise

KL_WEIGHT = 1e-4
#: Images the scaling factor is measured on (SD measured it on one batch).
SCALE_IMAGES = 10_000


def train_vae(data: ColoredDigits, size: Text2ImgSizes, train: TrainConfig,
              resumable: Resumable | None = None, progress: ProgressFn | None = None) -> Any:
    """Train an ``AutoencoderKL`` on ``data``'s images; batches and posterior noise from
    ``(seed, step)``. Its ``scaling_factor`` is set by :func:`measure_scaling_factor`."""
    from diffusers import AutoencoderKL

    torch.manual_seed(train.seed)
    vae = AutoencoderKL(**vae_kwargs(size))

    def loss_at(step: int) -> torch.Tensor:
        rng = np.random.default_rng([train.seed, step])
        x = torch.from_numpy(data.float_images(rng.integers(0, len(data), train.batch_size)))
        posterior = vae.encode(x).latent_dist
        noise = torch.from_numpy(rng.standard_normal(posterior.mean.shape, dtype=np.float32))
        z = posterior.mean + posterior.std * noise
        reconstruction = vae.decode(z).sample
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        return F.l1_loss(reconstruction, x) + F.mse_loss(reconstruction, x) + KL_WEIGHT * kl

    optimise(vae, train, loss_at, progress=progress, resumable=resumable)
    vae.eval().requires_grad_(False)
    vae.register_to_config(scaling_factor=measure_scaling_factor(vae, data))
    return vae


@torch.no_grad()
def encode_means(vae: Any, images: np.ndarray, batch: int = 500) -> np.ndarray:
    """Posterior means ``(N, 4, 8, 8)`` float32 of uint8 images ``(N, 3, 32, 32)``, unscaled."""
    out = [vae.encode(torch.from_numpy(images[i:i + batch].astype(np.float32) / 127.5 - 1.0)
                      ).latent_dist.mean.numpy() for i in range(0, len(images), batch)]
    return np.concatenate(out).astype(np.float32)


def measure_scaling_factor(vae: Any, data: ColoredDigits) -> float:
    """``1 / std`` of the latents of the first :data:`SCALE_IMAGES` training images."""
    std = float(encode_means(vae, data.images[:SCALE_IMAGES]).std())
    if not np.isfinite(std) or std <= 0:
        raise ValueError(f"the VAE's latents have standard deviation {std}: training diverged")
    return round(1.0 / std, 5)
