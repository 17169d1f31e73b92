"""Fixtures shared by unit and integration tests: tiny real checkpoints.

There are no trained checkpoints in the repository's tests, so these are random-init ``smoke``
UNets written with the real checkpoint format; the format is framework-neutral, so the JAX one
differs only in the framework it records.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddm.checkpoint import CheckpointMeta, save_checkpoint
from ddm.models.config import UNET_CONFIGS

#: The classes the smoke experts serve (of the smoke config's 10).
SMOKE_CLASSES = (0, 1, 2, 3, 4)


def _smoke_expert(directory: Path, framework: str) -> Path:
    import torch

    from ddm.models.torch_io import canonical_weights
    from ddm.models.torch_unet import UNet

    config = UNET_CONFIGS["smoke"]
    torch.manual_seed(0)
    groups = [list(SMOKE_CLASSES), [5, 6, 7, 8, 9]]
    meta = CheckpointMeta(kind="expert", name=f"smoke-{framework}",
                          architecture=config.to_dict(), framework=framework,
                          classes=SMOKE_CLASSES,
                          partition={"scheme": {"method": "labels", "groups": groups},
                                     "index": 0})
    return save_checkpoint(directory, meta, canonical_weights(UNet(config)))


@pytest.fixture(scope="session")
def smoke_expert_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init ``smoke`` expert recorded as trained with PyTorch (classes 0-4)."""
    return _smoke_expert(tmp_path_factory.mktemp("ckpt") / "smoke-torch", "torch")


@pytest.fixture(scope="session")
def smoke_jax_expert_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same ``smoke`` expert recorded as trained with JAX (classes 0-4)."""
    return _smoke_expert(tmp_path_factory.mktemp("ckpt") / "smoke-jax", "jax")
