"""Partitions of a dataset into the K disjoint parts that K experts each learn alone.

Two methods, one interface (:class:`Partition`): :class:`LabelPartition` groups digit
classes (``0-4`` and ``5-9``); :class:`KMeansPartition` clusters images by features of
:mod:`ddm.data.features` (why MNIST uses HOG: :mod:`ddm.data.partition_file`). A partition
serialises to a small JSON-able dict (``to_dict`` / :func:`partition_from_dict`) with the
sha256 of its content, which every expert and router checkpoint records in its
``partition`` field; :func:`check_partition_hash` is the one check that they agree.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import numpy as np

from ddm.data.features import PIXELS, check_spec, extract
from ddm.models.config import ConfigError

#: k-means restarts (k-means++ each); the lowest-inertia run wins.
KMEANS_RESTARTS = 4
KMEANS_MAX_ITERATIONS = 100
#: Stop once the centres' total squared shift is below this times the mean pixel variance.
KMEANS_TOLERANCE = 1e-4


class Partition(Protocol):
    @property
    def num_partitions(self) -> int: ...

    def assign(self, images: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Images ``(N, 1, H, W)`` in ``[0, 1]`` and labels ``(N,)`` -> part ids ``(N,)`` int64."""
        ...

    @property
    def sha256(self) -> str: ...

    def to_dict(self) -> dict[str, Any]:
        """JSON-able content plus its ``sha256`` (see :func:`partition_sha256`)."""
        ...


@dataclass(frozen=True)
class LabelPartition:
    """Part ``i`` holds the classes ``groups[i]``; groups must be disjoint."""

    groups: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        groups = tuple(tuple(_label(v) for v in _sequence(g, "a label group"))
                       for g in _sequence(self.groups, "groups"))
        if not groups or any(not g for g in groups):
            raise ConfigError(f"label groups must be non-empty, got {groups}")
        owner: dict[int, int] = {}
        for index, group in enumerate(groups):
            for label in group:
                if label in owner:
                    where = (f"twice in group {index}" if owner[label] == index
                             else f"in groups {owner[label]} and {index}")
                    raise ConfigError(f"label groups must be disjoint: label {label} is {where}")
                owner[label] = index
        object.__setattr__(self, "groups", groups)

    @property
    def num_partitions(self) -> int:
        return len(self.groups)

    def assign(self, images: np.ndarray, labels: np.ndarray) -> np.ndarray:
        owner = {label: index for index, group in enumerate(self.groups) for label in group}
        labels = np.asarray(labels)
        stray = sorted(set(np.unique(labels).tolist()) - set(owner))
        if stray:
            raise ValueError(f"label(s) {', '.join(map(str, stray))} belong to no group "
                             f"of {self.groups}")
        return np.array([owner[int(y)] for y in labels], dtype=np.int64)

    @property
    def sha256(self) -> str:
        return partition_sha256(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return _hashed({"method": "labels", "groups": [list(g) for g in self.groups]})


@dataclass(frozen=True, eq=False)
class KMeansPartition:
    """Part ``i`` holds the images whose ``features`` are nearest (Euclidean) ``centroids[i]``.

    ``features`` is a spec of :mod:`ddm.data.features`; ``image_size`` the side of the
    images it was fitted on (``None`` in partitions recorded before it was).
    """

    centroids: np.ndarray  # (K, D) float32
    features: str | Mapping[str, Any] = PIXELS
    image_size: int | None = None

    def __post_init__(self) -> None:
        try:
            centroids = np.array(self.centroids, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"k-means centroids must be a (K, D) array of numbers ({exc})") from None
        if centroids.ndim != 2 or 0 in centroids.shape or not np.all(np.isfinite(centroids)):
            raise ConfigError(f"k-means centroids must be a finite, non-empty (K, D) array, "
                              f"got shape {centroids.shape}")
        size = self.image_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ConfigError(f"k-means image_size must be a positive integer, got {size!r}")
        object.__setattr__(self, "centroids", centroids)
        object.__setattr__(self, "features", check_spec(self.features))

    @property
    def num_partitions(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def sha256(self) -> str:
        return partition_sha256(self.to_dict())

    def assign(self, images: np.ndarray, labels: np.ndarray) -> np.ndarray:
        images = np.asarray(images)
        if self.image_size is not None and (images.ndim != 4 or images.shape[2:] != (
                self.image_size, self.image_size)):
            raise ValueError(f"this k-means partition was fitted on {self.image_size}x"
                             f"{self.image_size} images; got images of shape {images.shape}")
        x = extract(self.features, images)
        if x.shape[1] != self.centroids.shape[1]:
            raise ValueError(f"images of shape {images.shape[1:]} give {x.shape[1]} features; "
                             f"the k-means centroids were fitted on {self.centroids.shape[1]}")
        return _nearest(x, self.centroids)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"method": "kmeans", "features": self.features}
        if self.image_size is not None:
            d["image_size"] = self.image_size
        return _hashed({**d, "centroids": self.centroids.tolist()})


def fit_kmeans(images: np.ndarray, k: int, seed: int,
               features: str | Mapping[str, Any] = PIXELS) -> KMeansPartition:
    """k-means (k-means++ seeding, Lloyd iterations) on ``features`` of ``images``
    ``(N, 1, S, S)``; deterministic in ``seed``. Pixel partitions keep the legacy record
    (no ``image_size``), so refitting one gives the same dict as before."""
    spec = check_spec(features)
    x = extract(spec, images)
    if not isinstance(k, (int, np.integer)) or not 1 <= k <= len(x):
        raise ValueError(f"k must be an integer between 1 and the {len(x)} images, got {k!r}")
    rng = np.random.default_rng(seed)
    runs = [_lloyd(x, _kmeans_plus_plus(x, int(k), rng)) for _ in range(KMEANS_RESTARTS)]
    centroids, _ = min(runs, key=lambda run: run[1])
    size = None if spec == PIXELS else int(np.asarray(images).shape[-1])
    return KMeansPartition(centroids, spec, size)


def partition_from_dict(d: Mapping[str, Any]) -> LabelPartition | KMeansPartition:
    """Rebuild a partition from ``to_dict`` output, rejecting unknown methods and keys.

    A ``sha256`` key, when present, must match the content: a partition edited after it
    was hashed is refused.
    """
    if not isinstance(d, Mapping):
        raise ConfigError(f"a partition must be a mapping, got {type(d).__name__}")
    fields = {"labels": {"method", "groups"}, "kmeans": {"method", "features", "centroids"}}
    optional = {"labels": {"sha256"}, "kmeans": {"image_size", "sha256"}}
    method = d.get("method")
    if method not in fields:
        raise ConfigError(f"unknown partition method {method!r}; "
                          f"known: {', '.join(sorted(fields))}")
    unknown = sorted(set(d) - fields[method] - optional[method])
    missing = sorted(fields[method] - set(d))
    if unknown or missing:
        raise ConfigError(f"{method} partition: unknown keys {unknown}, missing keys {missing}")
    partition: LabelPartition | KMeansPartition
    if method == "labels":
        partition = LabelPartition(d["groups"])
    else:
        partition = KMeansPartition(d["centroids"], d["features"], d.get("image_size"))
    if "sha256" in d and d["sha256"] != partition.sha256:
        raise ConfigError(f"{method} partition: recorded sha256 {d['sha256']} does not match "
                          f"its content's sha256 {partition.sha256}: edited or damaged")
    return partition


def partition_sha256(d: Mapping[str, Any]) -> str:
    """sha256 of a partition's ``to_dict`` (its ``sha256`` key left out) as canonical JSON.

    It covers exactly what decides ``assign`` (method, features, image size, centroids or
    groups), so two partitions with one hash put every image in the same part.
    """
    content = {key: value for key, value in d.items() if key != "sha256"}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _hashed(content: dict[str, Any]) -> dict[str, Any]:
    return {**content, "sha256": partition_sha256(content)}


class PartitionMismatchError(ValueError):
    """A model was trained against a different partition than the one it is used with."""


def check_partition_hash(expected: str, found: str, who: str) -> None:
    """Raise :class:`PartitionMismatchError` naming both hashes unless they are equal.

    ``who`` names the holder of ``found``, e.g. ``"expert checkpoints/mnist/expert-2"``.
    """
    if expected != found:
        raise PartitionMismatchError(f"{who} was made for partition sha256 {found}, but "
                                     f"partition sha256 {expected} is expected: experts and "
                                     "router must share one fitted partition")


def classes_of(part_ids: np.ndarray, labels: np.ndarray, index: int) -> tuple[int, ...]:
    """The sorted classes present in part ``index``, given ``assign``'s output for ``labels``."""
    return tuple(int(c) for c in np.unique(np.asarray(labels)[np.asarray(part_ids) == index]))


def parse_label_groups(spec: str) -> tuple[tuple[int, ...], ...]:
    """``"0-4,5-9"`` -> ``((0..4), (5..9))``; ``"0,1,2;3,4"`` -> ``((0, 1, 2), (3, 4))``.

    With a ``;`` anywhere, ``;`` separates groups and ``,`` the items of one group;
    without, every ``,``-item is a group. An item is a label or an inclusive range ``a-b``.
    """
    if ";" in spec:
        items = [group.split(",") for group in spec.split(";")]
    else:
        items = [[group] for group in spec.split(",")]
    groups = tuple(tuple(label for item in group for label in _parse_item(item, spec))
                   for group in items)
    return LabelPartition(groups).groups


def _parse_item(item: str, spec: str) -> range:
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", item)
    if not match:
        raise ConfigError(f"cannot parse label groups {spec!r}: {item.strip()!r} is not a "
                          "label or a range like 0-4")
    low = int(match.group(1))
    high = int(match.group(2)) if match.group(2) is not None else low
    if high < low:
        raise ConfigError(f"cannot parse label groups {spec!r}: range {low}-{high} is empty")
    return range(low, high + 1)


def _sequence(value: Any, what: str) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"{what} must be a sequence, got {value!r}")
    return tuple(value)


def _label(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ConfigError(f"a label must be a non-negative integer, got {value!r}")
    return int(value)


def _squared_distances(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    d = (x * x).sum(1)[:, None] - 2.0 * (x @ centroids.T) + (centroids * centroids).sum(1)[None, :]
    return np.maximum(d, 0.0)


def _nearest(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Index of the closest centroid; ``|x|^2`` is left out since it does not change the argmin."""
    return np.argmin((centroids * centroids).sum(1)[None, :] - 2.0 * (x @ centroids.T),
                     axis=1).astype(np.int64)


def _kmeans_plus_plus(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """Arthur & Vassilvitskii's seeding: each next centre drawn with probability ~ D(x)^2."""
    centroids = [x[rng.integers(len(x))]]
    closest = _squared_distances(x, centroids[0][None])[:, 0]
    for _ in range(1, k):
        total = closest.sum()
        pick = rng.choice(len(x), p=closest / total) if total > 0 else rng.integers(len(x))
        centroids.append(x[pick])
        closest = np.minimum(closest, _squared_distances(x, x[pick][None])[:, 0])
    return np.stack(centroids)


def _lloyd(x: np.ndarray, centroids: np.ndarray) -> tuple[np.ndarray, float]:
    """Lloyd iterations until the centres move less than scikit-learn's default tolerance.

    An emptied cluster keeps its centre. Returns the centres and their inertia.
    """
    k = len(centroids)
    tolerance = KMEANS_TOLERANCE * float(x.var(axis=0).mean())
    for _ in range(KMEANS_MAX_ITERATIONS):
        ids = _nearest(x, centroids)
        counts = np.bincount(ids, minlength=k).astype(x.dtype)
        sums = (x.T @ np.eye(k, dtype=x.dtype)[ids]).T  # this order is BLAS's fast path
        moved = np.where(counts[:, None] > 0, sums / np.maximum(counts, 1.0)[:, None], centroids)
        shift = float(((moved - centroids) ** 2).sum())
        centroids = moved
        if shift <= tolerance:
            break
    return centroids, float(_squared_distances(x, centroids).min(axis=1).sum())
