"""The experts' partition: k-means on the small CLIP's image embeddings, fitted once.

The DDM paper clusters DINOv2 features; ours are the unit-norm projected image features of the
CLIP trained here, so clusters group what CLIP tells apart (colour first, then shape). The file
follows ``ddm.data.partition_file``'s layout with its own format name (its features come from a
model, not from pixels): the partition record (features, the encoder weights' sha256, centroids)
is hashed with ``partition_sha256``, and ``fit`` records, for people, cluster sizes and how
digits and colours spread over the clusters.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from ddm.data.colored_mnist import COLOUR_NAMES, ColoredDigits
from ddm.data.partition import fit_kmeans, partition_sha256
from ddm.data.partition_file import conditional_entropy_bits

FORMAT = "ddm-text2img-partition/1"
FEATURES = "clip-image-embeddings"


def fit_embedding_partition(embeddings: np.ndarray, data: ColoredDigits, k: int, seed: int,
                            encoder_sha256: str) -> dict[str, Any]:
    """k-means (the project's, k-means++ and Lloyd) on ``(N, D)`` embeddings -> file content."""
    kmeans = fit_kmeans(embeddings[:, None, None, :], k, seed)  # pixels of a 1x1xD "image"
    ids = assign(kmeans.centroids, embeddings)
    record = {"method": "kmeans", "features": FEATURES, "encoder_sha256": encoder_sha256,
              "centroids": kmeans.centroids.tolist()}
    by_digit = _counts(ids, data.labels, k, 10)
    by_colour = _counts(ids, data.colours, k, len(COLOUR_NAMES))
    fit = {"images": len(data), "k": k, "seed": seed,
           "cluster_sizes": by_digit.sum(axis=1).tolist(),
           "digits_per_cluster": by_digit.tolist(), "colours_per_cluster": by_colour.tolist(),
           "colours": list(COLOUR_NAMES),
           "digit_to_cluster_entropy_bits": round(conditional_entropy_bits(by_digit), 4),
           "colour_to_cluster_entropy_bits": round(conditional_entropy_bits(by_colour), 4)}
    return {"format": FORMAT, "partition": {**record, "sha256": partition_sha256(record)},
            "fit": fit}


def assign(centroids: np.ndarray, embeddings: np.ndarray) -> np.ndarray:
    """The nearest centroid of each embedding, ``(N,)`` int64."""
    centroids = np.asarray(centroids, dtype=np.float32)
    scores = (centroids * centroids).sum(1)[None, :] - 2.0 * embeddings @ centroids.T
    return np.argmin(scores, axis=1).astype(np.int64)


def read_embedding_partition(path: Path) -> dict[str, Any]:
    """The partition record of a file :func:`fit_embedding_partition` wrote, hash checked."""
    content = json.loads(Path(path).read_text())
    if content.get("format") != FORMAT:
        raise ValueError(f"{path}: format {content.get('format')!r}, expected {FORMAT!r}")
    record = content["partition"]
    if record.get("sha256") != partition_sha256(record):
        raise ValueError(f"{path}: the partition's sha256 does not match its content")
    return record


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _counts(ids: np.ndarray, values: np.ndarray, k: int, n: int) -> np.ndarray:
    counts = np.zeros((k, n), dtype=np.int64)
    np.add.at(counts, (ids, values), 1)
    return counts

