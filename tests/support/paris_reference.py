"""Paris's published sampler, written independently of ddm's sampling and serving code.

It does what the public Neuron port's ``ParisPipeline.generate`` does (GitHub
jimburtoft/neuronx-distributed-inference, branch contrib/paris-diffusion-model), with the
field's own components: CLIP-encode the prompt and the empty prompt (77 tokens, padded); start
from ``randn(1, C, S, S)`` of the seed; at each timestep of diffusers'
``FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)`` grid, softmax the router
network's logits, run each chosen expert on the conditional and unconditional rows as one
batch, guide ``uncond + scale * (cond - uncond)``, mix the chosen experts' outputs by their
renormalised probabilities and take the scheduler's Euler step; decode
``latents / scaling_factor`` with diffusers' ``AutoencoderKL`` and map ``[-1, 1]`` to uint8
as the port does (truncating). Served images are compared with this within 2/255.
Only the networks (ddm.models.paris, checked against the port's) are shared with ddm.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
from transformers import CLIPTextModel, CLIPTokenizer

from ddm.models.paris_loading import load_paris_expert, load_paris_router

#: The routings the port offers: the best expert, the best two renormalised, all experts.
ROUTINGS = ("top1", "top2", "full")


@dataclass(frozen=True)
class ReferenceImage:
    """One generation: ``image`` (H, W, 3) uint8, the final ``latents`` (1, C, S, S) float32
    and, per step, the experts that ran it (``experts``) with their weights (``weights``)."""

    image: np.ndarray
    latents: np.ndarray
    experts: list[tuple[int, ...]]
    weights: list[tuple[float, ...]]


class ParisReference:
    """A Paris release directory, loaded on the CPU in float32."""

    def __init__(self, release: Path) -> None:
        self.tokenizer = CLIPTokenizer.from_pretrained(release / "tokenizer")
        self.text_encoder = CLIPTextModel.from_pretrained(release / "text_encoder").eval()
        self.vae = AutoencoderKL.from_pretrained(release / "vae").eval()
        self.router = load_paris_router(release / "router")
        count = len(list(release.glob("expert_*")))
        self.experts = [load_paris_expert(release / f"expert_{k}") for k in range(count)]

    @torch.no_grad()
    def encode(self, prompt: str) -> torch.Tensor:
        """``prompt`` -> CLIP's last hidden state (1, 77, width), padded to 77 tokens."""
        tokens = self.tokenizer(prompt, max_length=77, padding="max_length", truncation=True,
                                return_tensors="pt")
        return self.text_encoder(tokens.input_ids).last_hidden_state

    def initial_latents(self, seed: int) -> torch.Tensor:
        """The port's starting noise: ``torch.randn(1, C, S, S)`` right after seeding."""
        size = self.experts[0].config.input_size
        shape = (1, self.experts[0].config.in_channels, size, size)
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    @torch.no_grad()
    def generate(self, prompt: str, routing: str = "top2", cfg_scale: float = 7.5,
                 num_steps: int = 50, seed: int = 42,
                 latents: torch.Tensor | None = None) -> ReferenceImage:
        """One image; ``latents`` (1, C, S, S) replaces the seed's noise when given."""
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)
        scheduler.set_timesteps(num_steps)
        text = torch.cat([self.encode(prompt), self.encode("")])
        x = self.initial_latents(seed) if latents is None else latents.clone()
        experts, weights = [], []
        for timestep in scheduler.timesteps:
            t = timestep.unsqueeze(0)
            probabilities = torch.softmax(self.router(x, t), dim=-1)[0]
            chosen, chosen_weights = _route(probabilities, routing)
            output = torch.zeros_like(x)
            for k, w in zip(chosen, chosen_weights):
                both = self.experts[k](torch.cat([x, x]), torch.cat([t, t]), text)
                output = output + w * (both[1:] + cfg_scale * (both[:1] - both[1:]))
            experts.append(chosen)
            weights.append(chosen_weights)
            x = scheduler.step(output, timestep, x).prev_sample
        decoded = self.vae.decode(x / self.vae.config.scaling_factor).sample
        pixels = (decoded / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()[0]
        return ReferenceImage(image=(pixels * 255).astype(np.uint8), latents=x.numpy(),
                              experts=experts, weights=weights)


def _route(probabilities: torch.Tensor, routing: str) -> tuple[tuple[int, ...],
                                                               tuple[float, ...]]:
    """The port's choice of experts and their weights from one row of router probabilities."""
    if routing == "top1":
        return (int(probabilities.argmax()),), (1.0,)
    if routing == "top2":
        values, indices = probabilities.topk(2)
        values = values / values.sum()
        return tuple(int(k) for k in indices), tuple(float(v) for v in values)
    kept = [k for k in range(len(probabilities)) if probabilities[k] >= 1e-6]
    return tuple(kept), tuple(float(probabilities[k]) for k in kept)
