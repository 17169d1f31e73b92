"""The digit classifier that judges generated samples: class accuracy and Frechet features.

Train it only on data the diffusion models never saw (the ``heldout`` split of
``ddm.data``): a classifier fitted to the diffusion training set would reward memorised
images. The network is small (two conv stages, adaptive pooling to 4x4, so any image size
works) and its penultimate ReLU layer (``feature_dim`` wide) gives the features for
``ddm.evaluation.frechet``. Inputs are ``[0, 1]`` images with ink at 1; the public
:class:`Classifier` takes the uint8 images that samplers write (0 background, 255 ink).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ddm.checkpoints.format import CheckpointError, CheckpointMeta, load_checkpoint, save_checkpoint
from ddm.models.config import ConfigError, config_from_dict
from ddm.models.torch_io import canonical_weights, load_canonical

BATCH_SIZE = 64
LEARNING_RATE = 2e-3  # Adam, cosine-decayed to zero over the run
MAX_SHIFT = 1  # augmentation: random translations of up to this many pixels
_INFERENCE_BATCH = 512


@dataclass(frozen=True)
class ClassifierConfig:
    """Architecture of :class:`ClassifierNet`; recorded as the checkpoint's ``architecture``."""

    image_size: int = 16
    channels: tuple[int, int] = (32, 64)
    feature_dim: int = 64
    num_classes: int = 10

    def __post_init__(self) -> None:
        for name in ("image_size", "feature_dim", "num_classes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(
                    f"ClassifierConfig.{name} must be a positive integer, got {value!r}")
        channels = tuple(self.channels)
        if len(channels) != 2 or any(not isinstance(c, int) or c < 1 for c in channels):
            raise ConfigError(
                f"ClassifierConfig.channels must be two positive integers, got {channels!r}")
        object.__setattr__(self, "channels", channels)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "channels": list(self.channels)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ClassifierConfig":
        return config_from_dict(cls, d)


class ClassifierNet(nn.Module):
    """``(B, 1, H, W)`` in ``[0, 1]`` -> ``(logits (B, classes), features (B, feature_dim))``."""

    def __init__(self, config: ClassifierConfig) -> None:
        super().__init__()
        self.config = config
        c1, c2 = config.channels
        self.body = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
            nn.Flatten(), nn.Linear(16 * c2, config.feature_dim), nn.ReLU())
        self.head = nn.Linear(config.feature_dim, config.num_classes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.body(x)
        return self.head(features), features


def train_classifier(images01: np.ndarray, labels: np.ndarray, config: ClassifierConfig,
                     steps: int, seed: int,
                     progress: Callable[[int, float], None] | None = None
                     ) -> dict[str, np.ndarray]:
    """Train a :class:`ClassifierNet` of ``config``; canonical weights out.

    ``images01`` ``(N, 1, S, S)`` in ``[0, 1]``, ``labels`` ``(N,)``: the held-out split,
    never the diffusion training set. Batch ``i`` and its random shifts come from
    ``(seed, i)`` alone, so a run is reproducible. ``progress(step, loss)`` after each step.
    """
    image_size = config.image_size
    images = np.asarray(images01, dtype=np.float32)
    targets = torch.as_tensor(np.asarray(labels, dtype=np.int64))
    if images.shape[1:] != (1, image_size, image_size) or targets.shape != images.shape[:1]:
        raise ValueError(f"expected images (N, 1, {image_size}, {image_size}) and labels (N,), "
                         f"got {images.shape} and {tuple(targets.shape)}")
    if len(images) == 0 or targets.min() < 0 or targets.max() >= config.num_classes:
        raise ValueError(f"labels must be non-empty and lie in 0..{config.num_classes - 1}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        net = ClassifierNet(config)
    optimizer = torch.optim.Adam(net.parameters(), lr=LEARNING_RATE)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    net.train()
    for step in range(steps):
        rng = np.random.default_rng((seed, step))
        rows = rng.integers(0, len(images), size=BATCH_SIZE)
        logits, _ = net(torch.from_numpy(_random_shift(images[rows], rng)))
        loss = F.cross_entropy(logits, targets[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if progress is not None:
            progress(step + 1, loss.item())
    return canonical_weights(net)


class Classifier:
    """A trained classifier over uint8 images ``(N, H, W)`` or ``(N, 1, H, W)`` (255 = ink)."""

    def __init__(self, net: ClassifierNet) -> None:
        self.net = net.eval()
        self.config = net.config

    @classmethod
    def from_weights(cls, config: ClassifierConfig,
                     weights: Mapping[str, np.ndarray]) -> "Classifier":
        net = ClassifierNet(config)
        net.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in weights.items()})
        return cls(net)

    def predict(self, images_uint8: np.ndarray) -> np.ndarray:
        """The most likely class of each image, ``(N,)`` int64."""
        logits, _ = self._run(images_uint8)
        return logits.argmax(axis=1).astype(np.int64)

    def features(self, images_uint8: np.ndarray) -> np.ndarray:
        """Penultimate-layer features ``(N, feature_dim)`` float64, for Frechet distances."""
        return self._run(images_uint8)[1].astype(np.float64)

    def _run(self, images_uint8: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = _as_input(images_uint8, self.config.image_size)
        logits, features = [], []
        with torch.inference_mode():
            for start in range(0, len(x), _INFERENCE_BATCH):
                out, feat = self.net(torch.from_numpy(x[start:start + _INFERENCE_BATCH]))
                logits.append(out.numpy())
                features.append(feat.numpy())
        if not logits:
            return (np.zeros((0, self.config.num_classes), np.float32),
                    np.zeros((0, self.config.feature_dim), np.float32))
        return np.concatenate(logits), np.concatenate(features)


def save_classifier(directory: str | os.PathLike, config: ClassifierConfig,
                    weights: Mapping[str, np.ndarray], *, name: str = "digit-classifier",
                    data: dict[str, Any] | None = None,
                    training: dict[str, Any] | None = None) -> Path:
    """Write a ``kind="classifier"`` checkpoint; ``data`` should name the held-out split used."""
    meta = CheckpointMeta(kind="classifier", name=name, architecture=config.to_dict(),
                          framework="torch", classes=tuple(range(config.num_classes)),
                          data=dict(data or {}), training=dict(training or {}))
    return save_checkpoint(directory, meta, weights)


def load_classifier(directory: str | os.PathLike) -> Classifier:
    """Load and check a classifier checkpoint (kind, architecture, every weight's shape)."""
    ckpt = load_checkpoint(directory)
    if ckpt.meta.kind != "classifier":
        raise CheckpointError(f"checkpoint {ckpt.path} is a {ckpt.meta.kind}, not a classifier")
    try:
        config = ClassifierConfig.from_dict(ckpt.meta.architecture)
    except ConfigError as exc:
        raise CheckpointError(f"checkpoint {ckpt.path}: invalid architecture: {exc}") from None
    return Classifier(load_canonical(ClassifierNet(config), ckpt))


def _random_shift(batch: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Translate each image by up to ``MAX_SHIFT`` pixels per axis, filling with background."""
    size = batch.shape[-1]
    pad = MAX_SHIFT
    padded = np.pad(batch, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    offsets = rng.integers(0, 2 * pad + 1, size=(len(batch), 2))
    return np.stack([padded[i, :, dy:dy + size, dx:dx + size]
                     for i, (dy, dx) in enumerate(offsets)])


def _as_input(images_uint8: np.ndarray, image_size: int) -> np.ndarray:
    """uint8 ``(N, H, W)`` or ``(N, 1, H, W)`` -> float32 ``(N, 1, H, W)`` in ``[0, 1]``."""
    images = np.asarray(images_uint8)
    if images.dtype != np.uint8:
        raise TypeError(f"classifier inputs must be uint8 images (0 background, 255 ink), "
                        f"got {images.dtype}")
    if images.ndim == 3:
        images = images[:, None]
    if images.ndim != 4 or images.shape[1:] != (1, image_size, image_size):
        raise ValueError(f"classifier expects images (N, {image_size}, {image_size}) or "
                         f"(N, 1, {image_size}, {image_size}), "
                         f"got {np.asarray(images_uint8).shape}")
    return images.astype(np.float32) / 255.0
