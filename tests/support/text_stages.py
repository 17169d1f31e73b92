"""Tiny stage checkpoints with random weights, in the layout DESIGN-22 section 1 declares:
one directory per stage (the library's config.json with our ``_ddm`` block, one safetensors
file), written by each library's own ``save_pretrained``.

``write_text_ddm`` makes a text2img-style DDM (diffusers PixArt experts in our convention, our
LatentRouter, a CLIP text encoder with a word-level ``PreTrainedTokenizerFast``, an
AutoencoderKL decoder) at the text2img training's ``smoke`` sizes: 4x8x8 latents, 32x32 RGB
images, 16-wide text. ``write_paris_stages`` imports a tiny Paris release (``ddm import paris``).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddm.models.text2img import LATENT_CHANNELS, LATENT_SIZE, SIZES, expert_kwargs

CAPTIONS = ("a red car", "a blue cat on the beach", "a green bird at sunset", "a photo")
SMOKE = SIZES["smoke"]
LATENT_SHAPE = [LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE]


@dataclass(frozen=True)
class TinyText:
    """Shapes of a tiny text DDM: ``latent_side`` (4 channels), ``text_width`` x ``tokens``
    embeddings, a VAE of ``vae_blocks`` blocks (image side = latent side x 2^(blocks-1)).
    The default is the text2img training's smoke size; :data:`PARIS_SHAPES` has Paris's
    state and text shapes (4x32x32 latents, CLIP's 77 x 768, 256x256 images) at tiny widths."""

    latent_side: int = LATENT_SIZE
    text_width: int = SMOKE.text_width
    tokens: int = 12
    vae_blocks: int = 3


PARIS_SHAPES = TinyText(latent_side=32, text_width=768, tokens=77, vae_blocks=4)


def write_text_ddm(root: Path, experts: int = 2, seed: int = 0,
                   dtype: torch.dtype = torch.float32, shapes: TinyText = TinyText()) -> Path:
    """expert_0..N-1/ (pixart), router/ (latent-router), text_encoder/ (clip-text),
    decoder/ (autoencoder-kl) under ``root``, weights random in ``seed`` and saved in
    ``dtype``."""
    from diffusers import PixArtTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from ddm.models.latent_router import LatentRouter
    from ddm.training.text2img.tokenizer import build_tokenizer, special_ids

    width, side = shapes.text_width, shapes.latent_side
    latent_shape = [LATENT_CHANNELS, side, side]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for k in range(experts):
            model = PixArtTransformer2DModel(**{**expert_kwargs(SMOKE, width),
                                                "sample_size": side})
            _randomise(model)
            save_stage(model.to(dtype), root / f"expert_{k}", role="expert", family="pixart",
                       convention="ours", latent_shape=latent_shape, text_width=width,
                       cluster=k)
        router = LatentRouter(input_size=side, in_channels=LATENT_CHANNELS,
                              hidden_size=16, depth=1, num_heads=2, num_clusters=experts)
        save_stage(router.to(dtype), root / "router", role="router", family="latent-router",
                   convention="ours", latent_shape=latent_shape)
        tokenizer = build_tokenizer(CAPTIONS, max_length=shapes.tokens)
        ids = special_ids(tokenizer)
        encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
            num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=shapes.tokens,
            bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]))
        save_stage(encoder.to(dtype), root / "text_encoder", role="text_encoder",
                   family="clip-text", text_width=width)
        tokenizer.save_pretrained(root / "text_encoder")
        save_stage(_vae(shapes).to(dtype), root / "decoder", role="decoder",
                   family="autoencoder-kl", latent_shape=latent_shape)
    return root


def hand_prior(width: int = SMOKE.text_width) -> dict[str, Any]:
    """A text prior (``_ddm.text_prior``) for a two-expert DDM of text ``width``. Two
    clusters, a 2-d joint space reading text dimensions 0 and 1: a pooled vector along
    dimension 0 has p(k | c) = (3/4, 1/4) (logits ln 3, 0); p(k) = (1/4, 3/4)."""
    projection = np.zeros((2, width))
    projection[0, 0] = projection[1, 1] = 1.0
    return {"projection": projection.tolist(), "weights": [[math.log(3.0), 0.0], [0.0, 0.0]],
            "bias": [0.0, 0.0], "log_frequencies": [math.log(0.25), math.log(0.75)]}


def with_prior(root: Path, prior: object) -> Path:
    """``root`` with its router declaring ``prior`` as its text prior."""
    path = root / "router" / "config.json"
    config = json.loads(path.read_text())
    config["_ddm"]["text_prior"] = prior
    path.write_text(json.dumps(config))
    return root


def _vae(shapes: TinyText) -> Any:
    from diffusers import AutoencoderKL

    channels = (8,) + (16,) * (shapes.vae_blocks - 1)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS,
        down_block_types=("DownEncoderBlock2D",) * shapes.vae_blocks,
        up_block_types=("UpDecoderBlock2D",) * shapes.vae_blocks, block_out_channels=channels,
        layers_per_block=1, norm_num_groups=4,
        sample_size=shapes.latent_side * 2 ** (shapes.vae_blocks - 1))


def write_paris_stages(release: Path, out: Path) -> Path:
    """A tiny Paris release's components as stage checkpoints under ``out`` (a new
    directory): what ``ddm import paris`` writes, by it."""
    from ddm.models.paris_import import import_paris

    return import_paris(release, out)


def save_stage(model: Any, directory: Path, **declared: Any) -> Path:
    """``model.save_pretrained(directory)`` (safetensors) with ``_ddm`` = ``declared`` and
    the weights' SHA-256."""
    model.save_pretrained(directory, safe_serialization=True)
    return declare(directory, **declared)


def declare(directory: Path, **declared: Any) -> Path:
    """Add ``_ddm`` (``declared`` + the one safetensors file's SHA-256) to config.json."""
    (weights,) = directory.glob("*.safetensors")
    path = directory / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config["_ddm"] = {**declared,
                      "weights_sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}
    path.write_text(json.dumps(config, indent=2) + "\n")
    return directory


def _randomise(model: torch.nn.Module) -> None:
    """Parameters diffusers initialises to zero (AdaLN tables, the output projection) get
    random values, as training leaves them, so that text and time change the output."""
    with torch.no_grad():
        for parameter in model.parameters():
            if not parameter.any():
                parameter.normal_(0.0, 0.1)
