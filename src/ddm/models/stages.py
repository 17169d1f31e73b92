"""The stages of a text-conditioned latent DDM, each a model loaded by role from its own
component directory (after diffusers' ``model_index.json``): the text encoder (transformers'
CLIPTokenizer + CLIPTextModel), the experts and router network, the decoder (diffusers'
AutoencoderKL). :class:`TextDDM` bundles them for the in-process driver
(:mod:`ddm.sampling.pipeline`); each stage is a NumPy callable, so it can move to a server.

Weights keep the dtype they were saved in; every stage answers float32 NumPy arrays.
Only safetensors files are read (``use_safetensors=True``): loading runs no code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from safetensors import safe_open

from ddm.checkpoints.format import CheckpointError
from ddm.conditioning import Conditioning
from ddm.convention import TimeGrid

#: ``forward(x (B, C, H, W) f32, t (B,) f32 ours, cond) -> v (B, C, H, W) f32``: an expert's
#: unguided velocity in our convention (guidance wraps it: :mod:`ddm.sampling.guidance`).
ConditionedVelocity = Callable[[np.ndarray, np.ndarray, Conditioning], np.ndarray]
#: ``router(x (B, C, H, W), t (B,) ours, cond) -> probabilities (B, K)``.
ConditionedRouter = Callable[[np.ndarray, np.ndarray, Conditioning], np.ndarray]


class ClipTextEncoder:
    """``prompts`` -> text :class:`Conditioning`: CLIP's last hidden state (B, L, D) and the
    tokens' attention mask, each prompt padded and truncated to the tokenizer's length (77).
    The model sees no mask (as Stable Diffusion and Paris run CLIP); no pooled vector is kept
    (Paris's experts take none)."""

    def __init__(self, tokenizer: Path, text_encoder: Path, device: str = "cpu") -> None:
        from transformers import AutoTokenizer, CLIPTextModel

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.model = CLIPTextModel.from_pretrained(text_encoder, use_safetensors=True,
                                                   dtype="auto").to(device).eval()
        self.device = device

    @property
    def width(self) -> int:
        """``D``, the embedding width."""
        return int(self.model.config.hidden_size)

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str]) -> Conditioning:
        tokens = self.tokenizer(list(prompts), max_length=self.tokenizer.model_max_length,
                                padding="max_length", truncation=True, return_tensors="pt")
        hidden = self.model(tokens.input_ids.to(self.device)).last_hidden_state
        return Conditioning(embeddings=hidden.float().cpu().numpy(),
                            mask=tokens.attention_mask.numpy().astype(np.int64))


class VaeDecoder:
    """Latents (B, C, S, S) -> images (B, 3, H, W) float32 in ``[-1, 1]``: diffusers'
    ``AutoencoderKL.decode(latents / scaling_factor)``, in the weights' own dtype."""

    def __init__(self, directory: Path, device: str = "cpu") -> None:
        from diffusers import AutoencoderKL

        self.model = AutoencoderKL.from_pretrained(
            directory, use_safetensors=True, torch_dtype=stored_dtype(directory)
        ).to(device).eval()
        self.device = device

    @property
    def latent_channels(self) -> int:
        return int(self.model.config.latent_channels)

    @torch.no_grad()
    def __call__(self, latents: np.ndarray) -> np.ndarray:
        z = torch.from_numpy(np.asarray(latents, np.float32)).to(self.device, self.model.dtype)
        images = self.model.decode(z / self.model.config.scaling_factor).sample
        return images.float().cpu().numpy()


@dataclass(frozen=True)
class TextDDM:
    """A text-conditioned latent DDM's stages: experts (unguided velocities, the router
    network's output order), the router network (None: one expert), text encoder (None:
    embeddings come precomputed), decoder (None: latents out), the null conditioning the
    unguided half of classifier-free guidance uses (one row, made once at load), the state's
    ``latent_shape`` (C, S, S), the time grid and the release's defaults."""

    expert_names: tuple[str, ...]
    experts: tuple[ConditionedVelocity, ...]
    router: ConditionedRouter | None
    encode: Callable[[Sequence[str]], Conditioning] | None
    decode: Callable[[np.ndarray], np.ndarray] | None
    null: Conditioning
    latent_shape: tuple[int, int, int]
    grid: TimeGrid
    guidance_scale: float
    steps: int
    strategy: str


def weight_file(directory: Path) -> Path:
    """The one ``.safetensors`` file of a diffusers/transformers component directory."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if len(files) != 1:
        raise CheckpointError(f"{directory} must hold exactly one .safetensors file, found "
                              f"{[f.name for f in files]}")
    return files[0]


def stored_dtype(directory: Path) -> torch.dtype:
    """The one floating dtype of a diffusers component's safetensors weights."""
    path = weight_file(directory)
    with safe_open(str(path), framework="pt") as weights:
        dtypes = {weights.get_slice(name).get_dtype() for name in weights.keys()}
    floating = {_SAFETENSORS_DTYPES[d] for d in dtypes if d in _SAFETENSORS_DTYPES}
    if len(floating) != 1:
        raise CheckpointError(f"{path} holds weights of dtypes {sorted(dtypes)}; "
                              "expected one of F32, BF16, F16")
    return floating.pop()


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
