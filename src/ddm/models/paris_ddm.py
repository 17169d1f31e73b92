"""A Paris release directory -> a :class:`~ddm.models.stages.TextDDM`, in this process.

Each component is loaded by role: ``expert_K/`` (K = 0..N-1, the router network's output
order) and ``router/`` strictly (:mod:`ddm.models.paris_loading`), ``tokenizer/`` +
``text_encoder/`` as CLIP, ``vae/`` as AutoencoderKL. Paris's networks follow
FlowMatchEulerDiscrete (time input ``sigma * 1000``, output ``noise - data``); they declare it
(:class:`~ddm.convention.FlowMatchNetwork`) and are converted exactly at their edge, so the
sampler works in our time and velocity on FlowMatchEulerDiscrete's own grid. The state shape
(latent channels and size) and the text width are checked across every stage.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ddm.checkpoints.format import CheckpointError
from ddm.conditioning import Conditioning
from ddm.convention import FlowMatchNetwork, TimeGrid
from ddm.models.paris import ParisExpert, ParisExpertConfig, ParisRouter, ParisRouterConfig
from ddm.models.paris_loading import load_paris_expert, load_paris_router, read_component_config
from ddm.models.stages import (ClipTextEncoder, ConditionedRouter, ConditionedVelocity,
                               TextDDM, VaeDecoder)

#: Paris's networks' convention (diffusers' ``FlowMatchEulerDiscreteScheduler(1000)``).
PARIS_CONVENTION = FlowMatchNetwork(num_train_timesteps=1000)
#: The release's sampler settings where its top-level config.json says nothing (the port's).
DEFAULT_GUIDANCE, DEFAULT_STEPS, DEFAULT_ROUTING = 7.5, 50, "top2"

_EXPERT_DIR = re.compile(r"expert_(\d+)")
#: A release's components beside its experts.
RELEASE_COMPONENTS = ("router", "vae", "text_encoder", "tokenizer")


def load_paris_ddm(release: str | Path, device: str = "cpu") -> TextDDM:
    """Load every stage of the Paris release at ``release`` on ``device``; weights keep
    their dtype. Raises a ``CheckpointError`` naming a missing component or a stage whose
    shapes disagree with the experts'."""
    root = Path(release)
    indices = release_experts(root)
    experts = [load_paris_expert(root / f"expert_{k}").to(device) for k in indices]
    router = load_paris_router(root / "router").to(device)
    encoder = ClipTextEncoder(root / "tokenizer", root / "text_encoder", device)
    decoder = VaeDecoder(root / "vae", device)
    latent_shape = check_paris_shapes(root, [e.config for e in experts], router.config,
                                      decoder.latent_channels, encoder.width)
    settings = read_component_config(root)
    return TextDDM(
        expert_names=tuple(f"expert_{k}" for k in indices),
        experts=tuple(_expert_velocity(e) for e in experts),
        router=_router_probabilities(router) if len(experts) > 1 else None,
        encode=encoder, decode=decoder, null=encoder([""]),
        latent_shape=latent_shape, grid=TimeGrid("flow-match"),
        guidance_scale=float(settings.get("cfg_scale", DEFAULT_GUIDANCE)),
        steps=int(settings.get("num_inference_steps", DEFAULT_STEPS)),
        strategy=str(settings.get("routing", DEFAULT_ROUTING)))


def release_experts(root: Path) -> list[int]:
    """The expert indices 0..N-1 of the release at ``root``, after checking that it holds
    every component directory."""
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory (a Paris release)")
    indices = sorted(int(m.group(1)) for p in root.iterdir()
                     if p.is_dir() and (m := _EXPERT_DIR.fullmatch(p.name)))
    if indices != list(range(len(indices))) or not indices:
        raise CheckpointError(f"{root} must hold expert_0 .. expert_N-1, found experts "
                              f"{indices}")
    for role in RELEASE_COMPONENTS:
        if not (root / role).is_dir():
            raise CheckpointError(f"{root} has no {role}/ component")
    return indices


def check_paris_shapes(root: Path, experts: Sequence[ParisExpertConfig],
                       router: ParisRouterConfig, latent_channels: int,
                       text_width: int) -> tuple[int, int, int]:
    """The state's (C, S, S), the same for every expert, the router and the decoder (which
    takes ``latent_channels``); the experts take the text encoder's ``text_width``."""
    shapes = {f"expert_{k}": (e.in_channels, e.input_size) for k, e in enumerate(experts)}
    shapes["router"] = (router.in_channels, router.input_size)
    if len(set(shapes.values())) != 1:
        raise CheckpointError(f"{root}: the stages disagree on the latent (channels, size): "
                              f"{shapes}")
    channels, size = shapes["router"]
    outputs = {e.out_channels for e in experts}
    if outputs != {channels}:
        raise CheckpointError(f"{root}: experts predict {sorted(outputs)} channels for "
                              f"{channels}-channel latents")
    if latent_channels != channels:
        raise CheckpointError(f"{root}: the decoder takes {latent_channels}-channel "
                              f"latents, the experts make {channels}")
    widths = {e.text_embed_dim for e in experts}
    if widths != {text_width}:
        raise CheckpointError(f"{root}: the text encoder's width is {text_width}, the "
                              f"experts take {sorted(widths)}")
    if router.num_clusters != len(experts):
        raise CheckpointError(f"{root}: the router network has {router.num_clusters} "
                              f"clusters for {len(experts)} experts")
    return channels, size, size


def _expert_velocity(network: ParisExpert) -> ConditionedVelocity:
    """The expert as our unguided velocity: ``t`` -> ``sigma * 1000``, output negated."""
    parameter = next(network.parameters())

    @torch.no_grad()
    def velocity(x: np.ndarray, t: np.ndarray, cond: Conditioning) -> np.ndarray:
        if cond.embeddings is None:
            raise ValueError("a Paris expert is conditioned on text embeddings, not labels")
        output = network(_tensor(x, parameter), _tensor(PARIS_CONVENTION.timestep(t), parameter,
                                                         torch.float32),
                         _tensor(cond.embeddings, parameter))
        return PARIS_CONVENTION.velocity(output.float().cpu().numpy())

    return velocity


def _router_probabilities(network: ParisRouter) -> ConditionedRouter:
    """The router network's softmax over clusters; it sees only ``(x_t, t)``."""
    parameter = next(network.parameters())

    @torch.no_grad()
    def probabilities(x: np.ndarray, t: np.ndarray, _cond: Conditioning) -> np.ndarray:
        logits = network(_tensor(x, parameter),
                         _tensor(PARIS_CONVENTION.timestep(t), parameter, torch.float32))
        return torch.softmax(logits.float(), dim=-1).cpu().numpy()

    return probabilities


def _tensor(array: np.ndarray, like: torch.Tensor,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(like.device, dtype or like.dtype)
