"""A partition fitted once and shipped as its own file, which experts and router reference.

Refitting k-means inside every expert's run (``kmeans:K``) gives experts trained with
different seeds different clusters; a partition file (``file:PATH``) is fitted once by
``ddm partition fit`` and every trainer assigns with it, recording its sha256.

The file is JSON: ``{"format": "ddm-partition/1", "partition": {...}, "fit": {...}}``.
``partition`` is :meth:`KMeansPartition.to_dict` (features, image size, centroids and the
sha256 of those); ``fit`` says how it was made (data, seed, cluster sizes, the classes in
each cluster), for people: it is not hashed, so refitting the same clusters from another
copy of the data gives the same hash.

MNIST's partition clusters HOG features (:mod:`ddm.data.features`): stroke directions in
a 4x4 grid of 8x8-pixel cells, normalised per image, so shape and slant count and pen width
and darkness do not. What matters for a DDM is that clusters are coherent groups of
images, yet not unions of whole classes: a router that sees the label must still need the
image (with a label split it learns a lookup, the digits DDM's flaw). HOG with 4x4 cells
came nearest the classifier's own features by that measure, far ahead of raw pixels and of
coarser cells (H(cluster | label) per feature: docs/training.md, "Figures" under DDMTraining).
The DDM paper clusters DINOv2 features, which a CPU demo cannot ship; HOG is pure NumPy, so
the file alone assigns any image.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from ddm.data.datasets import Dataset, load_dataset, recorded_source
from ddm.data.partition import (KMEANS_RESTARTS, KMeansPartition, LabelPartition,
                                fit_kmeans, parse_label_groups, partition_from_dict)
from ddm.fileio import atomic_path, check_output
from ddm.models.config import ConfigError

FORMAT = "ddm-partition/1"


def fit_partition(dataset: Dataset, k: int, features: str | dict[str, Any], seed: int,
                  source: str) -> dict[str, Any]:
    """Fit k-means on ``dataset`` and return the partition file's content (not yet written)."""
    partition = fit_kmeans(dataset.images, k, seed, features)
    ids = partition.assign(dataset.images, dataset.labels)
    classes = int(dataset.labels.max()) + 1
    counts = np.zeros((k, classes), dtype=np.int64)
    np.add.at(counts, (ids, dataset.labels), 1)
    fit = {"source": recorded_source(source), "split": "train", "name": dataset.name,
           "images": len(dataset), "k": k, "seed": seed, "restarts": KMEANS_RESTARTS,
           "cluster_sizes": counts.sum(axis=1).tolist(),
           "classes_per_cluster": counts.tolist(),
           "label_to_cluster_entropy_bits": round(conditional_entropy_bits(counts), 4)}
    return {"format": FORMAT, "partition": partition.to_dict(), "fit": fit}


def conditional_entropy_bits(counts: np.ndarray) -> float:
    """``H(cluster | label)`` in bits from a ``(K, classes)`` count table.

    0 means every label sits in one cluster (routing given the label is a lookup); up to
    ``log2 K`` when every label spreads evenly over the clusters.
    """
    counts = np.asarray(counts, dtype=np.float64)
    per_label = counts.sum(axis=0)
    p_cluster = np.divide(counts, per_label, out=np.zeros_like(counts), where=per_label > 0)
    logs = np.log2(p_cluster, out=np.zeros_like(p_cluster), where=p_cluster > 0)
    return float(-(per_label / per_label.sum() * (p_cluster * logs).sum(axis=0)).sum())


def save_partition_file(path: str | os.PathLike, content: dict[str, Any]) -> Path:
    """Write ``fit_partition``'s content atomically as indented JSON."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(content, indent=1) + "\n")
    return Path(path)


def read_partition_file(path: str | os.PathLike) -> dict[str, Any]:
    """The file's whole content, after checking its format and its partition's sha256."""
    path = Path(path)
    try:
        content = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"partition file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"partition file {path} is not readable JSON ({exc})") from None
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        found = content.get("format") if isinstance(content, dict) else type(content).__name__
        raise ConfigError(f"partition file {path}: format {found!r}, expected {FORMAT!r}")
    if not isinstance(content.get("partition"), dict) or "sha256" not in content["partition"]:
        raise ConfigError(f"partition file {path} has no hashed 'partition' record")
    try:
        partition_from_dict(content["partition"])
    except (ConfigError, ValueError) as exc:
        raise ConfigError(f"partition file {path}: {exc}") from None
    return content


def load_partition(path: str | os.PathLike) -> LabelPartition | KMeansPartition:
    """The partition in a partition file, its sha256 verified."""
    return partition_from_dict(read_partition_file(path)["partition"])


def partition_from_spec(spec: str, dataset: Dataset,
                        seed: int) -> LabelPartition | KMeansPartition:
    """A trainer's ``--partition``: ``file:PATH`` (fitted once: use this),
    ``labels:0-4,5-9`` (label groups), or ``kmeans:K`` (legacy: refitted on ``dataset``
    with ``seed``, pixel features, so experts of different seeds disagree)."""
    method, _, arg = spec.partition(":")
    if method == "file" and arg:
        return load_partition(arg)
    if method == "labels" and arg:
        return LabelPartition(parse_label_groups(arg))
    if method == "kmeans" and arg.isdigit() and int(arg) >= 1:
        return fit_kmeans(dataset.images, int(arg), seed)
    raise ValueError(f"unknown partition {spec!r}; use 'file:PATH' (from `ddm partition fit`), "
                     "'labels:0-4,5-9' or 'kmeans:K'")


def fit_partition_command(data: str, k: int, features: str | dict[str, Any], image_size: int,
                          seed: int, out: Path) -> dict[str, Any]:
    """``ddm partition fit``: fit on ``data``'s train split, write ``out``, return a summary."""
    check_output(out, ".json", "--out")  # before minutes of loading and fitting, not after
    dataset = load_dataset(data, image_size, "train")
    content = fit_partition(dataset, k, features, seed, data)
    save_partition_file(out, content)
    fit = content["fit"]
    return {"out": str(out), "sha256": content["partition"]["sha256"],
            "cluster_sizes": fit["cluster_sizes"],
            "label_to_cluster_entropy_bits": fit["label_to_cluster_entropy_bits"]}
