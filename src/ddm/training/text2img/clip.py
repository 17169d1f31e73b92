"""The small CLIP: both towers trained contrastively on (image, caption), then frozen.

The loss is CLIP's symmetric cross-entropy over the batch's similarity matrix, with one fix for
our data: captions repeat (many images are "a red 7"), so every row whose caption equals the
row's own is a positive too (targets spread evenly over them), instead of being pushed apart.
Empty captions describe nothing and are left out. Images enter in model space ``[-1, 1]``
(``ColoredDigits.float_images``): the model is ours, so there is no ImageNet normalisation.
The text tower alone, saved as a ``CLIPTextModel``, is the DDM's text encoder.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ddm.data.colored_mnist import ColoredDigits
from ddm.models.text2img import Text2ImgSizes, clip_config
from ddm.training.config import TrainConfig
from ddm.training.resume import Resumable
from ddm.training.text2img.tokenizer import special_ids, tokenize
from ddm.training.torch_loop import ProgressFn, optimise


def contrastive_loss(logits: torch.Tensor, caption_ids: torch.Tensor) -> torch.Tensor:
    """Symmetric cross-entropy of ``(B, B)`` image-to-text ``logits`` where rows sharing a
    caption id are all positives."""
    same = (caption_ids[:, None] == caption_ids[None, :]).float()
    targets = same / same.sum(dim=1, keepdim=True)
    return 0.5 * (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets))


def train_clip(data: ColoredDigits, tokenizer: Any, size: Text2ImgSizes, train: TrainConfig,
               resumable: Resumable | None = None, progress: ProgressFn | None = None) -> Any:
    """Train a ``CLIPModel`` on ``data``'s captioned rows; batches from ``(seed, step)``."""
    from transformers import CLIPModel

    torch.manual_seed(train.seed)
    model = CLIPModel(clip_config(size, len(tokenizer), tokenizer.model_max_length,
                                  special_ids(tokenizer)))
    captioned = np.flatnonzero(np.asarray(data.captions) != "")
    if captioned.size < 2:
        raise ValueError("CLIP needs at least two captioned images")
    unique, caption_ids = np.unique(np.asarray(data.captions), return_inverse=True)
    input_ids = torch.from_numpy(tokenize(tokenizer, list(unique)))

    def loss_at(step: int) -> torch.Tensor:
        rng = np.random.default_rng([train.seed, step])
        rows = captioned[rng.integers(0, captioned.size, train.batch_size)]
        ids = torch.from_numpy(caption_ids[rows])
        out = model(input_ids=input_ids[ids], pixel_values=torch.from_numpy(
            data.float_images(rows)))
        return contrastive_loss(out.logits_per_image, ids)

    optimise(model, train, loss_at, progress=progress, resumable=resumable)
    return model.eval().requires_grad_(False)


def text_encoder_of(clip: Any) -> Any:
    """The text tower of a trained ``CLIPModel`` as a ``CLIPTextModel`` (same weights, keys
    checked strictly)."""
    from transformers import CLIPTextModel

    encoder = CLIPTextModel(clip.config.text_config)
    encoder.load_state_dict(clip.text_model.state_dict(), strict=True)
    return encoder.eval().requires_grad_(False)


@torch.no_grad()
def image_embeddings(clip: Any, images: np.ndarray, batch: int = 500) -> np.ndarray:
    """Unit-norm projected image features ``(N, projection_dim)`` of uint8 ``(N, 3, 32, 32)``."""
    out = []
    for start in range(0, len(images), batch):
        pixels = torch.from_numpy(images[start:start + batch].astype(np.float32) / 127.5 - 1.0)
        features = clip.get_image_features(pixel_values=pixels)
        features = getattr(features, "pooler_output", features)
        out.append(F.normalize(features, dim=-1).numpy())
    return np.concatenate(out).astype(np.float32)


@torch.no_grad()
def text_embeddings(clip: Any, tokenizer: Any, prompts: list[str]) -> np.ndarray:
    """Unit-norm projected text features ``(B, projection_dim)``."""
    ids = torch.from_numpy(tokenize(tokenizer, prompts))
    features = clip.get_text_features(input_ids=ids)
    features = getattr(features, "pooler_output", features)
    return F.normalize(features, dim=-1).numpy().astype(np.float32)
