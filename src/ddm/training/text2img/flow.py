"""Experts, monolith and router of the text-to-image DDM, trained on precomputed latents.

The text encoder and the VAE are frozen, so the ``latents`` stage encodes every training image
once (posterior means times the VAE's scaling factor) and every distinct caption once (the text
encoder's ``last_hidden_state``); :class:`LatentSet` holds them with each image's cluster.
Experts and the monolith learn our velocity by flow matching (``ddm.convention``: ``t ~ U(0, 1)``,
``x_t = (1 - t) x0 + t x1``, target ``x1 - x0``); the 10% empty captions are the unconditional
rows guidance needs. The router learns the cluster of ``x1`` from ``(x_t, t)`` alone. Batches,
times and noise come from ``(seed, step)``, so a resumed run makes the same updates.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ddm.convention import TIME_EMBEDDING_SCALE, PathSample, sample_path
from ddm.models.text2img import Text2ImgSizes, expert_kwargs
from ddm.training.config import TrainConfig
from ddm.training.distributed import SINGLE, World
from ddm.training.resume import Resumable
from ddm.training.torch_loop import ProgressFn, data_parallel, optimise, prepare, unwrapped


@dataclass(frozen=True)
class LatentSet:
    """``latents`` ``(N, 4, 8, 8)`` scaled, ``clusters`` and ``caption_index`` ``(N,)``,
    ``text_embeddings`` ``(U, L, D)`` of the distinct captions; float32 / int64."""

    latents: np.ndarray
    clusters: np.ndarray
    caption_index: np.ndarray
    text_embeddings: np.ndarray

    def save(self, path: Path, metadata: dict[str, str]) -> None:
        from safetensors.numpy import save_file

        from ddm.fileio import atomic_path

        arrays = {"latents": self.latents, "clusters": self.clusters,
                  "caption_index": self.caption_index, "text_embeddings": self.text_embeddings}
        with atomic_path(path) as tmp:  # safetensors writes the buffer: C order, not strides
            save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(tmp),
                      metadata=metadata)

    @classmethod
    def load(cls, path: Path) -> "LatentSet":
        from safetensors.numpy import load_file

        return cls(**load_file(str(path)))


def _batch(data: LatentSet, rows: np.ndarray, train: TrainConfig, step: int,
           world: World) -> tuple[np.ndarray, PathSample]:
    """Step ``step``'s global batch from ``(seed, step)``; ``world``'s rank keeps its slice."""
    rng = np.random.default_rng([train.seed, step])
    picked = rows[rng.integers(0, len(rows), train.batch_size)]
    t = rng.random(train.batch_size, dtype=np.float32)
    x0 = rng.standard_normal((train.batch_size, *data.latents.shape[1:]), dtype=np.float32)
    part = world.shard(train.batch_size)
    return picked[part], sample_path(x0[part], data.latents[picked[part]], t[part])


def train_flow(data: LatentSet, rows: np.ndarray, size: Text2ImgSizes, train: TrainConfig,
               resumable: Resumable | None = None, progress: ProgressFn | None = None,
               world: World = SINGLE) -> Any:
    """A ``PixArtTransformer2DModel`` trained on ``rows`` of ``data``; returns its EMA. Each
    of ``world``'s processes takes its slice of every batch (``ddm.training.distributed``)."""
    from diffusers import PixArtTransformer2DModel

    if rows.size == 0:
        raise ValueError("no training rows: the cluster is empty")
    torch.manual_seed(train.seed)
    model, ema, _ = prepare(PixArtTransformer2DModel(
        **expert_kwargs(size, data.text_embeddings.shape[-1])), train, None, world)
    embeddings = torch.from_numpy(data.text_embeddings)

    def loss_at(step: int) -> torch.Tensor:
        picked, path = _batch(data, rows, train, step, world)
        velocity = model(torch.from_numpy(path.x_t),
                         encoder_hidden_states=embeddings[data.caption_index[picked]],
                         timestep=torch.from_numpy(path.t) * TIME_EMBEDDING_SCALE).sample
        return F.mse_loss(velocity, torch.from_numpy(path.velocity))

    optimise(model, train, loss_at, progress=progress, ema=ema, resumable=resumable)
    model = unwrapped(model)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in ema.weights().items()})
    return model.eval().requires_grad_(False)


def train_latent_router(data: LatentSet, k: int, size: Text2ImgSizes, train: TrainConfig,
                        resumable: Resumable | None = None,
                        progress: ProgressFn | None = None, world: World = SINGLE) -> Any:
    """A :class:`LatentRouter` trained by cross-entropy to each latent's cluster; data-parallel
    over ``world`` as :func:`train_flow` is."""
    from ddm.models.latent_router import LatentRouter

    torch.manual_seed(train.seed)
    router = LatentRouter(input_size=data.latents.shape[-1], in_channels=data.latents.shape[1],
                          patch_size=size.router_patch, hidden_size=size.router_width,
                          depth=size.router_depth, num_heads=size.router_heads, num_clusters=k)
    rows = np.arange(len(data.latents))
    clusters = torch.from_numpy(data.clusters)
    network = data_parallel(router, torch.device("cpu"), world)

    def loss_at(step: int) -> torch.Tensor:
        picked, path = _batch(data, rows, train, step, world)
        logits = network(torch.from_numpy(path.x_t), torch.from_numpy(path.t))
        return F.cross_entropy(logits, clusters[picked])

    optimise(network, train, loss_at, progress=progress, resumable=resumable)
    return router.eval().requires_grad_(False)


@torch.no_grad()
def router_accuracy(router: Any, data: LatentSet, times: tuple[float, ...], rows: int,
                    seed: int) -> dict[str, float]:
    """Top-1 accuracy of the router's cluster at each time, on ``rows`` random training rows."""
    rng = np.random.default_rng(seed)
    picked = rng.choice(len(data.latents), min(rows, len(data.latents)), replace=False)
    x1 = data.latents[picked]
    out = {}
    for t in times:
        x0 = rng.standard_normal(x1.shape, dtype=np.float32)
        tt = np.full(len(x1), t, np.float32)
        logits = router(torch.from_numpy(sample_path(x0, x1, tt).x_t), torch.from_numpy(tt))
        out[f"t={t:g}"] = round(float((logits.argmax(1).numpy() == data.clusters[picked]).mean()),
                                4)
    return out
