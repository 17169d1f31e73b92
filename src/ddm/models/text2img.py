"""The text-to-image DDM's networks, from the field's libraries at toy sizes.

A small CLIP (transformers' ``CLIPModel``: a text and a vision tower trained contrastively),
whose text tower alone is the frozen text encoder; diffusers' ``AutoencoderKL`` mapping
32x32x3 images to 4x8x8 latents; diffusers' ``PixArtTransformer2DModel`` experts (text by
cross-attention, AdaLN-single time conditioning). Each has a tiny ``smoke`` size that tests
train for one step on CPU, and the ``small`` size the shipped model uses.

Conditioning is SD's: the text encoder's ``last_hidden_state`` of the prompt padded to the
tokenizer's ``model_max_length``, no attention mask; the empty prompt is the unconditional row.
The experts see time as ``t * TIME_EMBEDDING_SCALE`` in our convention (``ddm.convention``:
t = 0 noise, t = 1 data) and predict our velocity ``x1 - x0``; each expert's config.json
declares that under :data:`DDM_CONFIG_KEY` (diffusers ignores keys starting with ``_``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddm.convention import CONVENTION_NAME, TIME_EMBEDDING_SCALE
from ddm.models.config import ConfigError

#: Image side, latent channels and latent side of the whole pipeline.
IMAGE_SIZE, LATENT_CHANNELS, LATENT_SIZE = 32, 4, 8
#: The key in a diffusers config.json under which we declare conventions and provenance.
DDM_CONFIG_KEY = "_ddm"
#: The experts' (and the monolith's) diffusers class.
EXPERT_CLASS_NAME = "PixArtTransformer2DModel"
#: The sampler settings the model ships with: guidance 4 (colour and stroke follow the prompt
#: from there; digit accuracy still rises with it: docs/quality-text2img.md's sweep), 30
#: Euler steps, top-1 routing: with the router's text prior, top-1 drew the asked digit more
#: often than top-2 (0.955 vs 0.938 over 3 x 140 prompts) at half the expert calls.
DEFAULT_GUIDANCE, DEFAULT_STEPS, DEFAULT_STRATEGY = 4.0, 30, "top1"


@dataclass(frozen=True)
class Text2ImgSizes:
    """Widths and depths of every network of one named size."""

    text_width: int
    text_layers: int
    vision_width: int
    vision_layers: int
    projection_dim: int
    vae_channels: tuple[int, ...]
    expert_heads: int
    expert_head_dim: int
    expert_layers: int
    expert_patch: int
    router_width: int
    router_depth: int
    router_heads: int
    router_patch: int


SIZES: dict[str, Text2ImgSizes] = {
    "smoke": Text2ImgSizes(text_width=16, text_layers=1, vision_width=16, vision_layers=1,
                           projection_dim=8, vae_channels=(8, 16, 16), expert_heads=2,
                           expert_head_dim=8, expert_layers=1, expert_patch=2,
                           router_width=16, router_depth=1, router_heads=2, router_patch=2),
    "small": Text2ImgSizes(text_width=128, text_layers=3, vision_width=128, vision_layers=3,
                           projection_dim=64, vae_channels=(16, 32, 64), expert_heads=4,
                           expert_head_dim=32, expert_layers=4, expert_patch=2,
                           router_width=128, router_depth=3, router_heads=4, router_patch=2),
}


def sizes(name: str) -> Text2ImgSizes:
    """The named size, or a ConfigError listing the known ones."""
    if name not in SIZES:
        raise ConfigError(f"unknown text2img size {name!r}; known: {', '.join(SIZES)}")
    return SIZES[name]


def clip_config(size: Text2ImgSizes, vocab_size: int, max_length: int,
                special_ids: dict[str, int]) -> Any:
    """A ``CLIPConfig`` for 32x32 RGB images (4x4 patches) and ``max_length``-token prompts;
    ``special_ids`` maps ``bos``, ``eos`` and ``pad`` to the tokenizer's ids."""
    from transformers import CLIPConfig

    text = dict(vocab_size=vocab_size, hidden_size=size.text_width,
                intermediate_size=4 * size.text_width, num_hidden_layers=size.text_layers,
                num_attention_heads=max(1, size.text_width // 32),
                max_position_embeddings=max_length, bos_token_id=special_ids["bos"],
                eos_token_id=special_ids["eos"], pad_token_id=special_ids["pad"],
                projection_dim=size.projection_dim)
    vision = dict(image_size=IMAGE_SIZE, patch_size=4, num_channels=3,
                  hidden_size=size.vision_width, intermediate_size=4 * size.vision_width,
                  num_hidden_layers=size.vision_layers,
                  num_attention_heads=max(1, size.vision_width // 32),
                  projection_dim=size.projection_dim)
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=size.projection_dim)


def vae_kwargs(size: Text2ImgSizes) -> dict[str, Any]:
    """``AutoencoderKL`` arguments: 32x32x3 -> 4x8x8 (two downsamplings)."""
    blocks = len(size.vae_channels)
    if 2 ** (blocks - 1) != IMAGE_SIZE // LATENT_SIZE:
        raise ConfigError(f"{blocks} VAE blocks do not map {IMAGE_SIZE} to {LATENT_SIZE}")
    return dict(in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
                down_block_types=("DownEncoderBlock2D",) * blocks,
                up_block_types=("UpDecoderBlock2D",) * blocks,
                block_out_channels=size.vae_channels, layers_per_block=1,
                norm_num_groups=min(size.vae_channels) // 2, sample_size=IMAGE_SIZE)


def expert_kwargs(size: Text2ImgSizes, text_width: int) -> dict[str, Any]:
    """``PixArtTransformer2DModel`` arguments: 4x8x8 latents in, our velocity out (no learned
    sigma), cross-attention to ``text_width``-wide token embeddings, AdaLN-single."""
    return dict(num_attention_heads=size.expert_heads, attention_head_dim=size.expert_head_dim,
                in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
                num_layers=size.expert_layers, cross_attention_dim=size.expert_heads
                * size.expert_head_dim, caption_channels=text_width, sample_size=LATENT_SIZE,
                patch_size=size.expert_patch, norm_type="ada_norm_single",
                use_additional_conditions=False, interpolation_scale=1)


def router_convention() -> dict[str, Any]:
    """What the router's time input means: ours, scaled (it sees no prompt)."""
    return {"convention": CONVENTION_NAME, "timestep": "t * timestep_scale",
            "timestep_scale": TIME_EMBEDDING_SCALE}


def expert_convention() -> dict[str, Any]:
    """What an expert's inputs and output mean, as its config.json declares them."""
    return {**router_convention(), "prediction": "velocity x1 - x0",
            "conditioning": "text_encoder last_hidden_state of the padded prompt, no mask",
            "unconditional_prompt": ""}

