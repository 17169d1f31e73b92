"""``ddm train classifier`` and ``ddm eval``: train the judge, score a samples file with it."""

from __future__ import annotations

import platform
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ddm.checkpoints.format import read_meta
from ddm.convention import to_model_space, to_uint8
from ddm.data import load_dataset
from ddm.data.datasets import SPLITS
from ddm.evaluation.classifier import (BATCH_SIZE, LEARNING_RATE, Classifier, ClassifierConfig,
                                       load_classifier, save_classifier, train_classifier)
from ddm.evaluation.evaluate import evaluate_samples
from ddm.samples import load_samples_npz


def train_classifier_command(data: str, image_size: int, steps: int, seed: int, out: Path,
                             split: str = "train",
                             progress: Callable[[int, float], None] | None = None) -> Path:
    """Train the evaluation classifier on ``split`` and record its accuracy on the other one.

    MNIST: train on its 60k training images, so that its 10k test images, the reference of
    every Frechet distance, stay unseen by the judge (as Inception never saw FID's
    reference). The shipped digits classifier predates this and learned the held-out split.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    learned = load_dataset(data, image_size, split)
    other_split = SPLITS[1 - SPLITS.index(split)]
    other = load_dataset(data, image_size, other_split)
    started = time.perf_counter()
    weights = train_classifier(learned.images, learned.labels, image_size=image_size,
                               steps=steps, seed=seed, progress=progress)
    seconds = round(time.perf_counter() - started, 1)
    config = ClassifierConfig(image_size=image_size)
    judged = Classifier.from_weights(config, weights)
    accuracy = float((judged.predict(to_uint8(to_model_space(other.images))[:, 0])
                      == other.labels).mean())
    record = {"source": data, "split": split, "name": learned.name, "images": len(learned),
              "image_size": image_size, f"{other_split}_accuracy": round(accuracy, 5)}
    training = {"steps": steps, "seed": seed, "batch_size": BATCH_SIZE,
                "learning_rate": LEARNING_RATE, "device": "cpu", "seconds": seconds,
                "host": platform.machine()}
    return save_classifier(out, config, weights, name=out.name, data=record, training=training)


def default_classifier() -> Path:
    from ddm.sampling.pipeline import default_checkpoints

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
