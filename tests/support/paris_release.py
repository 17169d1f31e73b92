"""A tiny Paris release with random weights, in the release's layout and key names.

The layout is Bagel Labs' (its model card and the Neuron port)::

    model_index.json  config.json
    expert_0/ .. expert_{N-1}/   config.json + diffusion_pytorch_model.safetensors
    router/                      config.json + pytorch_model.safetensors
    vae/                         diffusers AutoencoderKL
    text_encoder/  tokenizer/    transformers CLIPTextModel, CLIPTokenizer

Experts and router carry the port's parameter names (ddm.models.paris); their config.json
uses the port's constructor names (the official field names are not published, nor are the
contents of the two index files, which are written here as a diffusers pipeline would).
Everything is built offline: the CLIP tokenizer's vocabulary is the byte alphabet plus a few
merged words, made with ``tokenizers``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import diffusers
import torch
from diffusers import AutoencoderKL
from safetensors.torch import save_file
from tokenizers import pre_tokenizers
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from ddm.models.paris import ParisExpert, ParisExpertConfig, ParisRouter, ParisRouterConfig

#: CLIP's context length, which Paris pads every prompt to.
CLIP_TOKENS = 77
#: The words the tiny tokenizer knows whole; any other text falls back to bytes.
WORDS = ("a", "photo", "of", "red", "car", "cat", "on", "the", "beach", "sunset")


@dataclass(frozen=True)
class TinyParis:
    """Sizes of a release; the defaults are tiny: 8x8x4 latents, 16x16 RGB images, 32-wide
    text. :data:`FULL_PARIS` has the published release's sizes."""

    experts: int = 2
    text_width: int = 32
    expert: ParisExpertConfig = field(default_factory=lambda: ParisExpertConfig(
        input_size=8, hidden_size=32, depth=2, num_heads=4, text_embed_dim=32))
    router: ParisRouterConfig = field(default_factory=lambda: ParisRouterConfig(
        input_size=8, hidden_size=32, depth=2, num_heads=4, num_clusters=2))
    text_layers: int = 2
    text_heads: int = 4
    #: The CLIP MLP's width; None: twice ``text_width``.
    text_intermediate: int | None = None
    #: The VAE's block widths: one 2x up-sampling per block after the first.
    vae_channels: tuple[int, ...] = (8, 16)
    vae_layers: int = 1
    vae_groups: int = 4


#: The published release's sizes (docs/paris.md): eight DiT-XL/2 experts, a DiT-B router
#: network, CLIP ViT-L/14's text encoder and Stable Diffusion's VAE (32x32x4 latents, 256 px).
FULL_PARIS = TinyParis(
    experts=8, text_width=768, expert=ParisExpertConfig(), router=ParisRouterConfig(),
    text_layers=12, text_heads=12, text_intermediate=3072, vae_channels=(128, 256, 512, 512),
    vae_layers=2, vae_groups=32)


def write_paris_release(root: Path, sizes: TinyParis = TinyParis(), seed: int = 0,
                        dtype: torch.dtype = torch.float32) -> Path:
    """Write a release with random weights (deterministic in ``seed``), stored in ``dtype``,
    under ``root``."""
    if sizes.router.num_clusters != sizes.experts:
        raise ValueError(f"router has {sizes.router.num_clusters} clusters for "
                         f"{sizes.experts} experts")
    root.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for k in range(sizes.experts):
            _write_network(root / f"expert_{k}", ParisExpert(**sizes.expert.to_dict()),
                           "diffusion_pytorch_model.safetensors", dtype)
        _write_network(root / "router", ParisRouter(**sizes.router.to_dict()),
                       "pytorch_model.safetensors", dtype)
        sized_vae(sizes).to(dtype).save_pretrained(root / "vae")
        tokenizer = tiny_tokenizer()
        tokenizer.save_pretrained(root / "tokenizer")
        CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=sizes.text_width,
            intermediate_size=sizes.text_intermediate or 2 * sizes.text_width,
            num_hidden_layers=sizes.text_layers, num_attention_heads=sizes.text_heads,
            max_position_embeddings=CLIP_TOKENS, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )).to(dtype).save_pretrained(root / "text_encoder")
    experts = {f"expert_{k}": ["paris", "DiTExpert"] for k in range(sizes.experts)}
    _write_json(root / "model_index.json", {
        "_class_name": "ParisPipeline", "_diffusers_version": diffusers.__version__,
        **experts, "router": ["paris", "Router"], "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"]})
    _write_json(root / "config.json", {
        "num_experts": sizes.experts, "routing": "top2", "cfg_scale": 7.5,
        "num_inference_steps": 50, "latent_channels": sizes.expert.in_channels,
        "latent_size": sizes.expert.input_size, "vae_scaling_factor": 0.18215})
    return root


def tiny_vae(latent_channels: int) -> AutoencoderKL:
    """An SD-style VAE with one 2x up-sampling: (B, C, S, S) latents -> (B, 3, 2S, 2S)."""
    return sized_vae(TinyParis(expert=ParisExpertConfig(
        input_size=8, hidden_size=32, depth=2, num_heads=4, text_embed_dim=32,
        in_channels=latent_channels, out_channels=latent_channels)))


def sized_vae(sizes: TinyParis) -> AutoencoderKL:
    """An SD-style VAE of ``sizes``: one 2x up-sampling per block after the first."""
    blocks = len(sizes.vae_channels)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=sizes.expert.in_channels,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=sizes.vae_channels, layers_per_block=sizes.vae_layers,
        norm_num_groups=sizes.vae_groups, scaling_factor=0.18215)


def tiny_tokenizer() -> CLIPTokenizer:
    """CLIP's byte-level BPE with the byte alphabet and :data:`WORDS` merged whole."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + [c + "</w>" for c in alphabet]
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        merged = symbols[0]
        for symbol in symbols[1:]:
            if (merged, symbol) not in merges:
                merges.append((merged, symbol))
                tokens.append(merged + symbol)
            merged += symbol
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(dict.fromkeys(tokens))}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_TOKENS)


def _write_network(directory: Path, network: torch.nn.Module, weights_name: str,
                   dtype: torch.dtype) -> None:
    """Save ``network`` in ``dtype`` with its port-style config; parameters the port
    initialises to zero (position table, modulation tables, CLS token) get random values, as
    training leaves them."""
    with torch.no_grad():
        for parameter in network.parameters():
            if not parameter.any():
                parameter.normal_(0.0, 0.1)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in network.state_dict().items()},
              str(directory / weights_name))
    _write_json(directory / "config.json", network.config.to_dict())


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
