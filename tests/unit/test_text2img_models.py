"""The text2img partition file and router network, on known inputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ddm.data.colored_mnist import colorize
from ddm.data.partition_file import save_partition_file
from ddm.models.latent_router import LatentRouter, timestep_features
from ddm.training.text2img.partition import (assign, fit_embedding_partition,
                                             read_embedding_partition)


def _two_blobs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    centres = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], np.float32)
    truth = np.repeat([0, 1], 50)
    return (centres[truth] + 0.01 * rng.standard_normal((100, 3))).astype(np.float32), truth


def test_partition_finds_the_blobs_and_records_how_digits_spread(tmp_path: Path) -> None:
    embeddings, truth = _two_blobs()
    data = colorize(np.ones((100, 1, 2, 2), np.float32), np.arange(100) % 10, seed=0)
    content = fit_embedding_partition(embeddings, data, 2, seed=0, encoder_sha256="ab" * 32)
    ids = assign(np.asarray(content["partition"]["centroids"]), embeddings)
    assert len(set(ids[truth == 0])) == 1 and len(set(ids[truth == 1])) == 1
    assert ids[0] != ids[-1]
    assert sorted(content["fit"]["cluster_sizes"]) == [50, 50]
    assert content["fit"]["digit_to_cluster_entropy_bits"] == pytest.approx(1.0, abs=0.1)
    path = save_partition_file(tmp_path / "partition.json", content)
    assert read_embedding_partition(path)["sha256"] == content["partition"]["sha256"]


def test_an_edited_partition_is_refused(tmp_path: Path) -> None:
    embeddings, _ = _two_blobs()
    data = colorize(np.ones((100, 1, 2, 2), np.float32), np.arange(100) % 10, seed=0)
    content = fit_embedding_partition(embeddings, data, 2, seed=0, encoder_sha256="ab" * 32)
    content["partition"]["centroids"][0][0] += 0.5
    path = save_partition_file(tmp_path / "partition.json", content)
    with pytest.raises(ValueError, match="sha256"):
        read_embedding_partition(path)
    (tmp_path / "other.json").write_text(json.dumps({"format": "ddm-partition/1"}))
    with pytest.raises(ValueError, match="format"):
        read_embedding_partition(tmp_path / "other.json")


def test_time_features_are_cos_then_sin_of_scaled_time() -> None:
    features = timestep_features(torch.tensor([0.0, 0.5]), 8)
    assert features[0].tolist() == [1.0] * 4 + [0.0] * 4
    torch.testing.assert_close(features[1, 0], torch.cos(torch.tensor(500.0)))
    torch.testing.assert_close(features[1, 4], torch.sin(torch.tensor(500.0)))


def test_router_round_trips_through_save_pretrained(tmp_path: Path) -> None:
    torch.manual_seed(0)
    router = LatentRouter(hidden_size=16, depth=1, num_heads=2, num_clusters=3).eval()
    router.save_pretrained(tmp_path)
    loaded = LatentRouter.from_pretrained(tmp_path).eval()
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([0.1, 0.9])
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, t), router(x, t))
    assert loaded(x, t).shape == (2, 3)
    with pytest.raises(ValueError, match="multiple"):
        LatentRouter(input_size=8, patch_size=3)
