"""Score generated samples: class accuracy under the held-out classifier and Frechet distance.

Samples travel as ``.npz`` files (written by the sampling CLI, read by the quality report):
``images`` uint8 ``(N, H, W)`` with 0 background and 255 ink, ``labels`` int ``(N,)`` (the
class each sample was conditioned on), optionally ``expert_calls`` int ``(N,)`` (expert
evaluations spent per sample). :func:`load_samples_npz` checks all of that up front.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ddm.evaluation.classifier import Classifier
from ddm.evaluation.frechet import frechet_distance

_REQUIRED_KEYS = ("images", "labels")
_OPTIONAL_KEYS = ("expert_calls",)


class SamplesFileError(ValueError):
    """A samples file is missing, unreadable, or does not hold the arrays it should."""


@dataclass(frozen=True, eq=False)
class SampleSet:
    """``images`` uint8 ``(N, H, W)``, ``labels`` int64 ``(N,)``, ``expert_calls`` int64 or None."""

    images: np.ndarray
    labels: np.ndarray
    expert_calls: np.ndarray | None = None


def evaluate_samples(images_uint8: np.ndarray, labels: np.ndarray, classifier: Classifier,
                     reference_images_uint8: np.ndarray) -> dict[str, Any]:
    """Metrics of samples ``(N, H, W)`` conditioned on ``labels`` ``(N,)``, JSON-ready.

    ``accuracy``: fraction the classifier labels as conditioned; ``per_class_accuracy``:
    the same per conditioning class (keys are class strings); ``fd``: Frechet distance of
    the classifier's features between the samples and ``reference_images_uint8``; ``n``
    and ``n_reference``: the counts, since FD is only comparable at equal counts.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or len(labels) != len(images_uint8):
        raise ValueError(f"need one label per image: {len(images_uint8)} images, labels of "
                         f"shape {labels.shape}")
    correct = classifier.predict(images_uint8) == labels
    per_class = {str(int(c)): float(correct[labels == c].mean()) for c in np.unique(labels)}
    fd = frechet_distance(classifier.features(images_uint8),
                          classifier.features(reference_images_uint8))
    return {"n": int(len(labels)), "n_reference": int(len(reference_images_uint8)),
            "accuracy": float(correct.mean()), "per_class_accuracy": per_class, "fd": fd}


def load_samples_npz(path: str | os.PathLike) -> SampleSet:
    """Read and validate a samples file; every problem raises :class:`SamplesFileError`."""
    path = Path(path)
    if not path.is_file():
        raise SamplesFileError(f"samples file {path} does not exist")
    unreadable = (OSError, ValueError, EOFError, zipfile.BadZipFile)
    try:
        archive = np.load(path, allow_pickle=False)
    except unreadable as exc:
        raise SamplesFileError(f"samples file {path} is not a readable .npz ({exc})") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise SamplesFileError(f"samples file {path} is a single .npy array, not an .npz")
    with archive:
        keys = set(archive.files)
        try:
            arrays = {k: archive[k] for k in keys & {*_REQUIRED_KEYS, *_OPTIONAL_KEYS}}
        except unreadable as exc:
            raise SamplesFileError(f"samples file {path} has a corrupt array ({exc})") from None
    missing = [k for k in _REQUIRED_KEYS if k not in keys]
    unknown = sorted(keys - {*_REQUIRED_KEYS, *_OPTIONAL_KEYS})
    if missing or unknown:
        raise SamplesFileError(f"samples file {path}: missing keys {missing}, unknown keys "
                               f"{unknown}; expected images, labels and optionally expert_calls")
    images, labels = arrays["images"], arrays["labels"]
    if images.dtype != np.uint8 or images.ndim != 3:
        raise SamplesFileError(f"samples file {path}: images must be uint8 (N, H, W), got "
                               f"{images.dtype} {images.shape}")
    n = images.shape[0]
    _check_counts(path, "labels", labels, n)
    calls = arrays.get("expert_calls")
    if calls is not None:
        _check_counts(path, "expert_calls", calls, n)
    return SampleSet(images=images, labels=labels.astype(np.int64),
                     expert_calls=None if calls is None else calls.astype(np.int64))


def _check_counts(path: Path, key: str, values: np.ndarray, n: int) -> None:
    if values.dtype.kind not in "iu" or values.shape != (n,):
        raise SamplesFileError(f"samples file {path}: {key} must be integers of shape ({n},), "
                               f"got {values.dtype} {values.shape}")
    if n and values.min() < 0:
        raise SamplesFileError(f"samples file {path}: {key} must be non-negative")
