"""Train the learned router: cross-entropy of ``RouterNet(x_t, t, y)`` against partition ids."""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F

from ddm.models.config import RouterNetworkConfig
from ddm.models.router_net import RouterNet
from ddm.training.config import TrainConfig
from ddm.training.distributed import SINGLE, World
from ddm.training.resume import Resumable
from ddm.training.torch_loop import ProgressFn, noisy_batch, optimise, prepare


def train_router(network_config: RouterNetworkConfig, train: TrainConfig, images: np.ndarray,
                 labels: np.ndarray, partition_ids: np.ndarray,
                 device: torch.device | None = None,
                 progress: ProgressFn | None = None,
                 resumable: Resumable | None = None, world: World = SINGLE
                 ) -> dict[str, np.ndarray]:
    """Learn ``p(k | x_t, t, y)``; ``partition_ids`` ``(N,)`` names each image's expert.

    Noisy inputs are made exactly as for the experts (``ddm.convention``), so the router is
    trained on the same distribution of ``x_t`` it meets while sampling. Each of ``world``'s
    processes takes its slice of every batch (``ddm.training.distributed``).
    """
    ids = np.asarray(partition_ids, dtype=np.int64)
    if ids.shape != (len(images),):
        raise ValueError(f"partition_ids must have shape ({len(images)},), got {ids.shape}")
    if ids.min() < 0 or ids.max() >= network_config.num_experts:
        raise ValueError(f"partition ids must lie in [0, {network_config.num_experts})")
    torch.manual_seed(train.seed)
    model, ema, device = prepare(RouterNet(network_config), train, device, world)
    images = np.asarray(images, dtype=np.float32)
    labels = np.asarray(labels, dtype=np.int64)

    def loss_at(step: int) -> torch.Tensor:
        rows, path = noisy_batch(images, train, step, world)
        logits = model(torch.from_numpy(path.x_t).to(device), torch.from_numpy(path.t).to(device),
                       torch.from_numpy(labels[rows]).to(device))
        return F.cross_entropy(logits, torch.from_numpy(ids[rows]).to(device))

    optimise(model, train, loss_at, progress, ema, resumable)
    return ema.weights()
