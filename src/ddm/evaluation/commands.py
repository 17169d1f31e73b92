"""``ddm eval``: score a samples file against the shipped (or a given) held-out classifier."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ddm.checkpoints.format import read_meta
from ddm.convention import to_model_space, to_uint8
from ddm.data import load_dataset
from ddm.evaluation.classifier import Classifier, load_classifier
from ddm.evaluation.evaluate import evaluate_samples
from ddm.samples import load_samples_npz


def default_classifier() -> Path:
    from ddm.checkpoints.discovery import default_checkpoints

    return default_checkpoints() / "classifier"


def reference_images(classifier_dir: Path) -> np.ndarray:
    """The real held-out images the classifier was trained on, as uint8 ``(N, H, W)``.

    FD compares generated samples with these: real digits no expert has seen.
    """
    data = read_meta(classifier_dir).data
    source, size = data.get("source", "digits"), int(data.get("image_size", 16))
    heldout = load_dataset(source, size, "heldout")
    return to_uint8(to_model_space(heldout.images)[:, 0])


@lru_cache(maxsize=4)
def _judge(classifier_dir: Path) -> tuple[Classifier, np.ndarray]:
    return load_classifier(classifier_dir), reference_images(classifier_dir)


def evaluate_images(images: np.ndarray, labels: np.ndarray,
                    classifier_dir: Path | None = None) -> dict[str, Any]:
    """Accuracy and FD of uint8 images ``(N, H, W)`` generated for ``labels`` ``(N,)``."""
    classifier, reference = _judge(Path(classifier_dir or default_classifier()))
    if images.shape[1:] != reference.shape[1:]:
        raise ValueError(f"samples are {images.shape[1]}x{images.shape[2]} but the classifier "
                         f"judges {reference.shape[1]}x{reference.shape[2]} images")
    return evaluate_samples(images, labels, classifier, reference)


def eval_command(samples: Path, classifier_dir: Path | None = None) -> dict[str, Any]:
    """Metrics of a samples ``.npz``, plus the mean expert forward passes per image."""
    sample_set = load_samples_npz(samples)
    result = evaluate_images(sample_set.images, sample_set.labels, classifier_dir)
    if sample_set.expert_calls is not None:
        result["expert_calls_per_image"] = float(sample_set.expert_calls.mean())
    return result
