"""A text2img DDM directory -> a :class:`~ddm.models.stages.TextDDM`, in this process, each
expert on PyTorch or JAX.

Reads the training's root (``tokenizer/``, ``text_encoder/``, ``vae/``) and the imported
layout (``text_encoder/`` holding its tokenizer files, ``decoder/``) alike: ``expert_K/``
(diffusers' PixArtTransformer2DModel, K = the router's output order), ``router/`` (our
LatentRouter), the text encoder (transformers' CLIPTextModel) and the VAE. Every network
declares our convention (``ddm.models.text2img``), so no conversion happens at the edge
beyond ``timestep = t * timestep_scale``. The state shape and text width are checked across
the stages.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ddm.checkpoints.format import CheckpointError, check_weight_shapes
from ddm.conditioning import Conditioning
from ddm.convention import TimeGrid
from ddm.models.stages import (ClipTextEncoder, ConditionedRouter, ConditionedVelocity, TextDDM,
                               VaeDecoder, weight_file)
from ddm.models.text2img import (DEFAULT_GUIDANCE, DEFAULT_STEPS, DEFAULT_STRATEGY,
                                 timestep_scale, velocity_network_config)

#: Where an expert runs.
BACKENDS = ("torch", "jax")
_EXPERT_DIR = re.compile(r"expert_(\d+)")


def load_torch_expert(directory: str | Path, device: str = "cpu") -> ConditionedVelocity:
    """A text2img expert (or the monolith) on PyTorch: our unguided velocity, float32 NumPy
    out; the network computes in its weights' dtype, and they must be exactly its tensors."""
    from diffusers import PixArtTransformer2DModel
    from safetensors.torch import load_file

    root = Path(directory)
    config = velocity_network_config(root)
    network = PixArtTransformer2DModel.from_config(config)
    weights = load_file(str(weight_file(root)))
    check_weight_shapes(root, {k: tuple(v.shape) for k, v in network.state_dict().items()},
                        weights)
    network.load_state_dict(weights, strict=True, assign=True)  # keeps the stored dtype
    network = network.to(device).eval()
    scale = timestep_scale(config)
    parameter = next(network.parameters())

    @torch.no_grad()
    def velocity(x: np.ndarray, t: np.ndarray, cond: Conditioning) -> np.ndarray:
        if cond.embeddings is None:
            raise ValueError(f"{root.name} is conditioned on text embeddings, not labels")
        timestep = torch.from_numpy(np.asarray(t, np.float32) * np.float32(scale))
        out = network(_tensor(x, parameter), encoder_hidden_states=_tensor(cond.embeddings,
                                                                           parameter),
                      timestep=timestep.to(parameter.device)).sample
        return out.float().cpu().numpy()

    return velocity


def load_expert(directory: str | Path, backend: str = "torch") -> ConditionedVelocity:
    """The expert at ``directory`` on ``backend`` (one of :data:`BACKENDS`)."""
    if backend == "torch":
        return load_torch_expert(directory)
    if backend == "jax":
        from ddm.models.flax_pixart import load_flax_expert

        return load_flax_expert(directory)
    raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")


def load_latent_router(directory: str | Path) -> ConditionedRouter:
    """The router network's softmax over clusters ``(B, K)``; it sees only ``(x_t, t)``."""
    from ddm.models.latent_router import LatentRouter

    network = LatentRouter.from_pretrained(Path(directory), use_safetensors=True).eval()

    @torch.no_grad()
    def probabilities(x: np.ndarray, t: np.ndarray, _cond: Conditioning) -> np.ndarray:
        logits = network(torch.from_numpy(np.asarray(x, np.float32)),
                         torch.from_numpy(np.asarray(t, np.float32)))
        return torch.softmax(logits.float(), dim=-1).numpy()

    return probabilities


def expert_directories(root: Path) -> list[Path]:
    """``root/expert_0 .. expert_N-1``, in order; a ``CheckpointError`` on a gap or none."""
    indices = sorted(int(m.group(1)) for p in root.iterdir()
                     if p.is_dir() and (m := _EXPERT_DIR.fullmatch(p.name)))
    if not indices or indices != list(range(len(indices))):
        raise CheckpointError(f"{root} must hold expert_0 .. expert_N-1, found experts "
                              f"{indices}")
    return [root / f"expert_{k}" for k in indices]


def load_text2img_ddm(root: str | Path, backends: Sequence[str] = ("torch",),
                      experts: Sequence[str] | None = None) -> TextDDM:
    """Every stage of the text2img DDM at ``root``. Expert ``k`` runs on
    ``backends[k % len(backends)]`` (``("torch", "jax")``: alternating). ``experts``: the
    subdirectories to load as the experts instead (``("monolith",)``: the baseline, unrouted).
    """
    base = Path(root)
    unknown = set(backends) - set(BACKENDS) or not backends
    if unknown:
        raise ValueError(f"backends must be some of {', '.join(BACKENDS)}, got {backends!r}")
    paths = expert_directories(base) if experts is None else [base / e for e in experts]
    velocities = tuple(load_expert(p, backends[k % len(backends)]) for k, p in enumerate(paths))
    configs = [velocity_network_config(p) for p in paths]
    tokenizer = base / "tokenizer" if (base / "tokenizer").is_dir() else base / "text_encoder"
    decoder_dir = base / "decoder" if (base / "decoder").is_dir() else base / "vae"
    encoder = ClipTextEncoder(tokenizer, base / "text_encoder")
    decoder = VaeDecoder(decoder_dir)
    router = load_latent_router(base / "router") if len(paths) > 1 else None
    latent_shape = _check_stages(base, configs, encoder, decoder)
    return TextDDM(expert_names=tuple(p.name for p in paths), experts=velocities,
                   router=router, encode=encoder, decode=decoder, null=encoder([""]),
                   latent_shape=latent_shape, grid=TimeGrid("uniform"),
                   guidance_scale=DEFAULT_GUIDANCE, steps=DEFAULT_STEPS,
                   strategy=DEFAULT_STRATEGY if router is not None else "top1")


def _check_stages(root: Path, configs: list[dict], encoder: ClipTextEncoder,
                  decoder: VaeDecoder) -> tuple[int, int, int]:
    """The state's (C, S, S), the same for every expert and the decoder; the experts take
    the text encoder's width."""
    shapes = {(c["in_channels"], c["out_channels"] or c["in_channels"], c["sample_size"])
              for c in configs}
    if len(shapes) != 1:
        raise CheckpointError(f"{root}: the experts disagree on the latent (channels in, "
                              f"out, size): {sorted(shapes)}")
    channels, out, size = shapes.pop()
    if out != channels or decoder.latent_channels != channels:
        raise CheckpointError(f"{root}: the experts map {channels} to {out} channels and the "
                              f"decoder takes {decoder.latent_channels}")
    widths = {c["caption_channels"] for c in configs}
    if widths != {encoder.width}:
        raise CheckpointError(f"{root}: the text encoder's width is {encoder.width}, the "
                              f"experts take {sorted(widths)}")
    return channels, size, size


def _tensor(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(like.device, like.dtype)
