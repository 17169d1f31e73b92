"""The evaluation protocol: per-seed scores against matched real subsets, and their floor.

Every score compares ``n`` generated images with ``n`` real reference images drawn from the
judge's reference split (MNIST: its test set) with the same count of every class as the
generated labels. Seed ``s`` draws two disjoint such subsets, ``A_s`` and ``B_s``; generated
images of seed ``s`` are scored against ``B_s``, and ``A_s`` against ``B_s`` is the
real-vs-real floor: what a perfect generator would score at that size (FD is biased
upward at small ``n``, so only FDs at one ``n`` compare). Means and spreads (sample standard
deviation) are over seeds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

from ddm.data.partition import Partition
from ddm.evaluation.classifier import Classifier
from ddm.evaluation.frechet import frechet_distance
from ddm.evaluation.manifold import manifold_metrics

#: Seeds per configuration: each draws its own reference subset (and, for models, noise).
SEEDS = (0, 1, 2)
METRICS = ("fd", "precision", "recall", "density", "coverage")
#: Samples per feature dimension below which FD is unreliable: its covariance has D x D
#: entries, and with few samples its small-sample bias swamps the differences between models
#: (FID asks for 10k-50k images for Inception's 2048 features).
FD_SAMPLES_PER_FEATURE = 10


def small_sample_warnings(n: int, feature_dim: int, runs: int) -> list[str]:
    """What a reader of scores of ``runs`` runs of ``n`` images each must be told."""
    warnings = []
    reliable = FD_SAMPLES_PER_FEATURE * feature_dim
    if n < reliable:
        warnings.append(f"{n} images per run: FD is unreliable below {reliable} "
                        f"({FD_SAMPLES_PER_FEATURE} per feature of the classifier's "
                        f"{feature_dim}); compare it only with FDs of {n} images, such as "
                        "the real-vs-real floor")
    if runs == 1:
        warnings.append("one run: no spread; give one samples file per seed for one")
    return warnings


@dataclass(frozen=True)
class Scores:
    fd: float
    precision: float
    recall: float
    density: float
    coverage: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def score_features(fake: np.ndarray, real: np.ndarray) -> Scores:
    """FD and the manifold metrics of features ``fake`` ``(M, D)`` against ``real`` ``(N, D)``."""
    manifold = manifold_metrics(real, fake)
    return Scores(fd=frechet_distance(fake, real), **asdict(manifold))


def summarise(scores: Sequence[Scores]) -> dict[str, dict[str, object]]:
    """``{metric: {"mean", "std", "values"}}`` over seeds; ``std`` is 0 for a single seed."""
    if not scores:
        raise ValueError("nothing to summarise: no scores")
    summary: dict[str, dict[str, object]] = {}
    for metric in METRICS:
        values = np.array([getattr(s, metric) for s in scores], dtype=np.float64)
        spread = float(values.std(ddof=1)) if len(values) > 1 else 0.0
        summary[metric] = {"mean": float(values.mean()), "std": spread,
                           "values": [float(v) for v in values]}
    return summary


def matched_subsets(pool_labels: np.ndarray, labels: np.ndarray,
                    seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two disjoint index arrays into ``pool_labels``, each with ``labels``' class counts."""
    pool_labels, labels = np.asarray(pool_labels), np.asarray(labels)
    rng = np.random.default_rng(seed)
    first, second = [], []
    for label in np.unique(labels):
        want = int(np.sum(labels == label))
        rows = np.flatnonzero(pool_labels == label)
        if rows.size < 2 * want:
            raise ValueError(f"the reference holds {rows.size} images of class {label}; two "
                             f"disjoint subsets of {want} need {2 * want}: ask for fewer "
                             "images per class")
        picked = rng.permutation(rows)[:2 * want]
        first.append(picked[:want])
        second.append(picked[want:])
    return np.concatenate(first), np.concatenate(second)


class Judge:
    """A classifier and its real reference set, with the reference's features computed once."""

    def __init__(self, classifier: Classifier, reference_uint8: np.ndarray,
                 reference_labels: np.ndarray) -> None:
        self.classifier = classifier
        self.reference_labels = np.asarray(reference_labels)
        if len(self.reference_labels) != len(reference_uint8):
            raise ValueError(f"{len(reference_uint8)} reference images but "
                             f"{len(self.reference_labels)} labels")
        self.reference_features = classifier.features(reference_uint8)
        self.reference_images = np.asarray(reference_uint8)

    def score(self, images_uint8: np.ndarray, labels: np.ndarray, seed: int) -> Scores:
        """Generated ``(N, H, W)`` images for ``labels`` against this seed's ``B`` subset."""
        _, reference = matched_subsets(self.reference_labels, labels, seed)
        return score_features(self.classifier.features(images_uint8),
                              self.reference_features[reference])

    def floor(self, labels: np.ndarray, seeds: Sequence[int] = SEEDS) -> list[Scores]:
        """Real ``A_s`` against real ``B_s`` for each seed: the best any model can score."""
        scores = []
        for seed in seeds:
            real, reference = matched_subsets(self.reference_labels, labels, seed)
            scores.append(score_features(self.reference_features[real],
                                         self.reference_features[reference]))
        return scores

    def real_images(self, wanted: np.ndarray, labels: np.ndarray, seed: int) -> np.ndarray:
        """Real images with ``wanted``'s class counts, none from the ``B`` subset that
        :meth:`score` uses for ``labels`` and ``seed``: stand-ins for generated images in
        the checks that the metrics react as they should."""
        _, reference = matched_subsets(self.reference_labels, labels, seed)
        free = np.ones(len(self.reference_labels), dtype=bool)
        free[reference] = False
        rng = np.random.default_rng((seed, 1))
        rows = []
        for label in np.unique(wanted):
            want = int(np.sum(np.asarray(wanted) == label))
            pool = np.flatnonzero(free & (self.reference_labels == label))
            if pool.size < want:
                raise ValueError(f"only {pool.size} reference images of class {label} are "
                                 f"left outside the scoring subset; {want} asked for")
            rows.append(rng.permutation(pool)[:want])
        return self.reference_images[np.concatenate(rows)]


def cluster_agreement(partition: Partition, images_uint8: np.ndarray, labels: np.ndarray,
                      chosen: np.ndarray) -> float:
    """Fraction of images whose chosen expert (e.g. the router's top-1 at some step) is the
    partition cluster the finished image ``(N, H, W)`` uint8 falls in."""
    images = np.asarray(images_uint8)
    chosen = np.asarray(chosen)
    if images.ndim != 3 or chosen.shape != images.shape[:1]:
        raise ValueError(f"need uint8 images (N, H, W) and one choice per image, got "
                         f"{images.shape} and {chosen.shape}")
    clusters = partition.assign(images[:, None].astype(np.float32) / 255.0, labels)
    return float((clusters == chosen).mean())
