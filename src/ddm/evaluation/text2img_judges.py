"""What a generated coloured digit is judged by: its digit (our MNIST classifier on the grey
image), its colour (the hue of its ink), its stroke (its ink mass), its features (FD in the
MNIST classifier's feature space, which no text2img model trained in), and its agreement with
the prompt (the small CLIP the text encoder came from).

Images are uint8 ``(N, 32, 32, 3)`` (what the pipeline returns); ink is any pixel whose
brightest channel is at least :data:`INK_LEVEL`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch.nn import functional as F

from ddm.data.colored_mnist import COLOUR_NAMES, COLOURS, DIGIT_WORDS

#: The grey level (0..255) from which a pixel counts as ink for its colour.
INK_LEVEL = 128
_COLOUR_TABLE = np.array([COLOURS[name] for name in COLOUR_NAMES], np.float64)


def grey(images: np.ndarray) -> np.ndarray:
    """uint8 ``(N, H, W, 3)`` -> uint8 ``(N, H, W)``: each pixel's brightest channel, the grey
    digit the colour was painted from (every named colour has a channel at full)."""
    images = _rgb(images)
    return images.max(axis=-1)


def ink_mass(images: np.ndarray) -> np.ndarray:
    """``(N,)`` the total grey level of each image, in full-ink pixels."""
    return grey(images).reshape(len(images), -1).sum(axis=1) / 255.0


def ink_colours(images: np.ndarray) -> np.ndarray:
    """``(N,)`` index into :data:`COLOUR_NAMES` of each image's ink: the named colour nearest
    the mean chromaticity (RGB over the brightest channel) of its ink pixels; -1 without ink."""
    images = _rgb(images).astype(np.float64)
    brightest = images.max(axis=-1)
    out = np.full(len(images), -1, np.int64)
    for i, (pixels, level) in enumerate(zip(images, brightest)):
        ink = level >= INK_LEVEL
        if ink.any():
            chroma = (pixels[ink] / level[ink, None]).mean(axis=0)
            out[i] = int(np.argmin(((_COLOUR_TABLE - chroma) ** 2).sum(axis=1)))
    return out


def attribute_prompts() -> tuple[list[str], np.ndarray, np.ndarray]:
    """Every "a {colour} {digit}" prompt with its digit and colour: the candidates CLIP picks
    an image's attributes from."""
    digits, colours = np.meshgrid(np.arange(len(DIGIT_WORDS)), np.arange(len(COLOUR_NAMES)),
                                  indexing="ij")
    prompts = [f"a {COLOUR_NAMES[c]} {DIGIT_WORDS[d]}" for d, c in
               zip(digits.ravel(), colours.ravel())]
    return prompts, digits.ravel(), colours.ravel()


@dataclass(frozen=True)
class ClipJudge:
    """The small CLIP (both towers): how well an image agrees with its prompt."""

    model: Any
    tokenizer: Any

    @classmethod
    def load(cls, clip: Path, tokenizer: Path) -> ClipJudge:
        from transformers import AutoTokenizer, CLIPModel

        model = CLIPModel.from_pretrained(clip, use_safetensors=True,
                                          trust_remote_code=False).eval()
        return cls(model.requires_grad_(False), AutoTokenizer.from_pretrained(
            tokenizer, trust_remote_code=False))

    @torch.no_grad()
    def image_features(self, images: np.ndarray) -> np.ndarray:
        """Unit-norm projected features ``(N, P)`` of uint8 ``(N, 32, 32, 3)`` images."""
        pixels = torch.from_numpy(_rgb(images).transpose(0, 3, 1, 2).astype(np.float32)
                                  / 127.5 - 1.0)
        features = self.model.get_image_features(pixel_values=pixels)
        return F.normalize(getattr(features, "pooler_output", features), dim=-1).numpy()

    @torch.no_grad()
    def text_features(self, prompts: Sequence[str]) -> np.ndarray:
        """Unit-norm projected features ``(B, P)`` of prompts, tokenized as the encoder's."""
        ids = self.tokenizer(list(prompts), padding="max_length", truncation=True,
                             max_length=self.tokenizer.model_max_length,
                             return_tensors="pt").input_ids
        features = self.model.get_text_features(input_ids=ids)
        return F.normalize(getattr(features, "pooler_output", features), dim=-1).numpy()

    def agreement(self, images: np.ndarray, prompts: Sequence[str], digits: np.ndarray,
                  colours: np.ndarray) -> tuple[float, float]:
        """``(score, match)``: the mean cosine of each image with its prompt, and the
        fraction whose nearest "a {colour} {digit}" prompt names its asked digit and colour."""
        image = self.image_features(images)
        score = float((image * self.text_features(prompts)).sum(axis=1).mean())
        candidates, cand_digits, cand_colours = attribute_prompts()
        best = (image @ self.text_features(candidates).T).argmax(axis=1)
        match = (cand_digits[best] == digits) & (cand_colours[best] == colours)
        return score, float(match.mean())


def _rgb(images: np.ndarray) -> np.ndarray:
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"expected uint8 RGB images (N, H, W, 3), got {images.dtype} "
                         f"{images.shape}")
    return images
