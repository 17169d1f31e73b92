"""Tiny stage checkpoints with random weights, in the layout DESIGN-22 section 1 declares:
one directory per stage (the library's config.json with our ``_ddm`` block, one safetensors
file), written by each library's own ``save_pretrained``.

``write_text_ddm`` makes a text2img-style DDM (diffusers PixArt experts in our convention, our
LatentRouter, a CLIP text encoder with a word-level ``PreTrainedTokenizerFast``, an
AutoencoderKL decoder) at the text2img training's ``smoke`` sizes: 4x8x8 latents, 32x32 RGB
images, 16-wide text. ``write_paris_stages`` declares a tiny Paris release's components as
stages (what ``ddm import paris`` does).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from ddm.models.text2img import (LATENT_CHANNELS, LATENT_SIZE, SIZES, expert_kwargs,
                                 vae_kwargs)

CAPTIONS = ("a red car", "a blue cat on the beach", "a green bird at sunset", "a photo")
SMOKE = SIZES["smoke"]
LATENT_SHAPE = [LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE]


def write_text_ddm(root: Path, experts: int = 2, seed: int = 0,
                   dtype: torch.dtype = torch.float32) -> Path:
    """expert_0..N-1/ (pixart), router/ (latent-router), text_encoder/ (clip-text),
    decoder/ (autoencoder-kl) under ``root``, weights random in ``seed`` and saved in
    ``dtype``."""
    from diffusers import AutoencoderKL, PixArtTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from ddm.models.latent_router import LatentRouter
    from ddm.training.text2img.tokenizer import build_tokenizer, special_ids

    width = SMOKE.text_width
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for k in range(experts):
            model = PixArtTransformer2DModel(**expert_kwargs(SMOKE, width))
            _randomise(model)
            save_stage(model.to(dtype), root / f"expert_{k}", role="expert", family="pixart",
                       convention="ours", latent_shape=LATENT_SHAPE, text_width=width,
                       cluster=k)
        router = LatentRouter(input_size=LATENT_SIZE, in_channels=LATENT_CHANNELS,
                              hidden_size=16, depth=1, num_heads=2, num_clusters=experts)
        save_stage(router.to(dtype), root / "router", role="router", family="latent-router",
                   convention="ours", latent_shape=LATENT_SHAPE)
        tokenizer = build_tokenizer(CAPTIONS, max_length=12)
        ids = special_ids(tokenizer)
        encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
            num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=12,
            bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"]))
        save_stage(encoder.to(dtype), root / "text_encoder", role="text_encoder",
                   family="clip-text", text_width=width)
        tokenizer.save_pretrained(root / "text_encoder")
        save_stage(AutoencoderKL(**vae_kwargs(SMOKE)).to(dtype), root / "decoder",
                   role="decoder", family="autoencoder-kl", latent_shape=LATENT_SHAPE)
    return root


def write_paris_stages(release: Path, out: Path) -> Path:
    """A tiny Paris release's components as stage checkpoints under ``out``: experts and
    router with their flow-match convention declared, the tokenizer beside the text encoder."""
    config = json.loads((release / "config.json").read_text())
    shape = [config["latent_channels"], config["latent_size"], config["latent_size"]]
    experts = sorted(p.name for p in release.glob("expert_*"))
    for k, name in enumerate(experts):
        shutil.copytree(release / name, out / name)
        declare(out / name, role="expert", family="paris-dit", convention="flow-match-1000",
                latent_shape=shape, cluster=k)
    shutil.copytree(release / "router", out / "router")
    declare(out / "router", role="router", family="paris-router",
            convention="flow-match-1000", latent_shape=shape)
    shutil.copytree(release / "text_encoder", out / "text_encoder")
    shutil.copytree(release / "tokenizer", out / "text_encoder", dirs_exist_ok=True)
    declare(out / "text_encoder", role="text_encoder", family="clip-text")
    shutil.copytree(release / "vae", out / "decoder")
    declare(out / "decoder", role="decoder", family="autoencoder-kl", latent_shape=shape)
    return out


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
