"""``ddm train classifier`` and ``ddm eval``: train the judge, score a samples file with it."""

from __future__ import annotations

import platform
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ddm.checkpoints.discovery import default_checkpoints, shipped_ddms
from ddm.checkpoints.format import check_checkpoint_output, read_meta
from ddm.convention import to_model_space, to_uint8
from ddm.data import load_dataset
from ddm.data.datasets import SPLITS, recorded_source
from ddm.data.mnist import IDXError
from ddm.evaluation.classifier import (BATCH_SIZE, LEARNING_RATE, Classifier, ClassifierConfig,
                                       load_classifier, save_classifier, train_classifier)
from ddm.evaluation.evaluate import evaluate_samples
from ddm.evaluation.scoring import SEEDS, Judge, small_sample_warnings, summarise
from ddm.progress import progress_bar
from ddm.samples import load_samples_npz


def train_classifier_command(data: str, image_size: int, steps: int, seed: int, out: Path,
                             split: str = "train", channels: Sequence[int] = (32, 64),
                             progress: Callable[[int, float], None] | None = None) -> Path:
    """Train the evaluation classifier on ``split`` and record its accuracy on the other one.

    MNIST: train on its 60k training images, so that its 10k test images, the reference of
    every Frechet distance, stay unseen by the judge (as Inception never saw FID's
    reference). The shipped digits classifier predates this and learned the held-out split.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    check_checkpoint_output(out)
    learned = load_dataset(data, image_size, split)
    other_split = SPLITS[1 - SPLITS.index(split)]
    other = load_dataset(data, image_size, other_split)
    started = time.perf_counter()
    config = ClassifierConfig(image_size=image_size, channels=tuple(channels))
    weights = train_classifier(learned.images, learned.labels, config, steps=steps, seed=seed,
                               progress=progress)
    seconds = round(time.perf_counter() - started, 1)
    judged = Classifier.from_weights(config, weights)
    accuracy = float((judged.predict(to_uint8(to_model_space(other.images))[:, 0])
                      == other.labels).mean())
    record = {"source": recorded_source(data), "split": split, "name": learned.name,
              "images": len(learned),
              "image_size": image_size, f"{other_split}_accuracy": round(accuracy, 5)}
    training = {"steps": steps, "seed": seed, "batch_size": BATCH_SIZE,
                "learning_rate": LEARNING_RATE, "device": "cpu", "seconds": seconds,
                "host": platform.machine()}
    return save_classifier(out, config, weights, name=out.name, data=record, training=training)


def classifier_size(classifier_dir: Path) -> int:
    """The side of the images a classifier checkpoint judges (its config.json, no weights)."""
    return int(read_meta(classifier_dir).architecture["image_size"])


def shipped_classifier(image_size: int | None = None) -> Path | None:
    """The shipped classifier that judges ``image_size`` images (None: any): the default
    DDM's first, then the other shipped DDMs' (``checkpoints/*/classifier``)."""
    for ddm in (default_checkpoints(), *shipped_ddms()):
        path = ddm / "classifier"
        if path.is_dir() and image_size in (None, classifier_size(path)):
            return path
    return None


def choose_classifier(image_size: int) -> Path:
    """The classifier for samples of side ``image_size`` when none is given, or an error that
    says how to get one."""
    found = shipped_classifier(image_size)
    if found is None:
        raise ValueError(f"no shipped classifier judges {image_size}x{image_size} images: train "
                         f"one (ddm train classifier --image-size {image_size} --data SOURCE "
                         "--out DIR) and pass --classifier DIR")
    return found


def size_mismatch(images: np.ndarray, judged: int, classifier: str) -> str:
    """Why ``images`` ``(N, H, W)`` cannot be judged at ``judged`` pixels, and the fix."""
    side = images.shape[1]
    fix = shipped_classifier(side) if images.shape[1] == images.shape[2] else None
    hint = (f"pass --classifier {fix}, which judges {side}x{side}" if fix is not None
            else "pass --classifier with one trained at that size")
    return (f"samples are {images.shape[1]}x{images.shape[2]} but {classifier} judges "
            f"{judged}x{judged} images: {hint}")


def reference_set(classifier_dir: Path, data: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The real reference digits as uint8 ``(N, H, W)`` and their labels: the ``heldout``
    split (MNIST: the test set) of ``data``, by default the source the classifier learned.

    The classifier records which data it learned (``digits``, or ``mnist`` without a path:
    :func:`~ddm.data.datasets.recorded_source`); ``data`` says where MNIST's files are here.
    """
    recorded = read_meta(classifier_dir).data
    source, size = data or recorded.get("source", "digits"), int(recorded.get("image_size", 16))
    try:
        heldout = load_dataset(source, size, "heldout")
    except (IDXError, FileNotFoundError, ValueError) as exc:
        if data is not None:
            raise
        raise ValueError(f"{classifier_dir} compares samples with the held-out images of "
                         f"{source}, which cannot be read here ({exc}): pass --data mnist:DIR, "
                         "a directory with the four MNIST IDX files") from None
    return to_uint8(to_model_space(heldout.images)[:, 0]), heldout.labels


def reference_images(classifier_dir: Path) -> np.ndarray:
    """The classifier's reference digits, uint8 ``(N, H, W)`` (see :func:`reference_set`)."""
    return reference_set(classifier_dir)[0]


@lru_cache(maxsize=4)
def _judge(classifier_dir: Path) -> tuple[Classifier, np.ndarray]:
    return load_classifier(classifier_dir), reference_images(classifier_dir)


def evaluate_images(images: np.ndarray, labels: np.ndarray,
                    classifier_dir: Path | None = None) -> dict[str, Any]:
    """Accuracy and FD of uint8 images ``(N, H, W)`` generated for ``labels`` ``(N,)``, judged
    by ``classifier_dir`` (default: the shipped classifier for their size)."""
    directory = Path(classifier_dir or choose_classifier(images.shape[1]))
    classifier, reference = _judge(directory)
    if images.shape[1:] != reference.shape[1:]:
        raise ValueError(size_mismatch(images, reference.shape[1], str(directory)))
    return evaluate_samples(images, labels, classifier, reference)


def load_judge(classifier_dir: Path | None = None, data: str | None = None) -> Judge:
    """The classifier (default: the default DDM's) with its reference set's features."""
    directory = Path(classifier_dir or default_checkpoints() / "classifier")
    return Judge(load_classifier(directory), *reference_set(directory, data))


def score_runs(judge: Judge, runs: Sequence[tuple[np.ndarray, np.ndarray]],
               with_floor: bool = True,
               progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run ``i`` (uint8 images, labels) is scored as seed ``i``; the floor over ``SEEDS``
    uses run 0's labels. Returns per-metric ``{"mean", "std", "values"}``, ``accuracy``
    likewise, ``floor`` (``with_floor``), ``n``, ``warnings`` (too few images or runs to
    trust the figures), and ``cpu_seconds``: this process's CPU
    time (all threads) for the whole evaluation. ``progress(n)``: ``n`` more scorings done
    (one per run, ``len(SEEDS)`` for the floor)."""
    if not runs:
        raise ValueError("no samples to evaluate")
    started = time.process_time()
    size = judge.reference_images.shape[1:]
    accuracies, scores = [], []
    for seed, (images, labels) in enumerate(runs):
        if images.shape[1:] != size:
            raise ValueError(size_mismatch(images, size[0], "the classifier"))
        accuracies.append(float((judge.classifier.predict(images) == labels).mean()))
        scores.append(judge.score(images, labels, seed))
        if progress is not None:
            progress(1)
    summary = summarise(scores)
    spread = np.array(accuracies)
    return {"n": int(len(runs[0][1])), "runs": len(runs),
            "accuracy": {"mean": float(spread.mean()),
                         "std": float(spread.std(ddof=1)) if len(runs) > 1 else 0.0,
                         "values": accuracies},
            **summary,
            **({"floor": _floor(judge, runs[0][1], progress)} if with_floor else {}),
            "warnings": small_sample_warnings(len(runs[0][1]),
                                              judge.classifier.config.feature_dim, len(runs)),
            "cpu_seconds": round(time.process_time() - started, 2)}


def _floor(judge: Judge, labels: np.ndarray,
           progress: Callable[[int], None] | None) -> dict[str, Any]:
    floor = summarise(judge.floor(labels))
    if progress is not None:
        progress(len(SEEDS))
    return floor


def eval_command(samples: Sequence[Path], classifier_dir: Path | None = None,
                 data: str | None = None, quiet: bool = False) -> dict[str, Any]:
    """Scores of samples files (one per seed, see :func:`score_runs`) by ``classifier_dir``
    (default: the shipped classifier for their size), plus the classifier used and the mean
    expert forward passes per image when the files record them. A progress bar on a
    terminal's stderr unless ``quiet``."""
    sets = [load_samples_npz(path) for path in samples]
    if classifier_dir is None:
        classifier_dir = choose_classifier(sets[0].images.shape[1])
    judged = classifier_size(classifier_dir)
    for found in sets:  # before the reference set loads: a wrong judge fails at once
        if found.images.shape[1:] != (judged, judged):
            raise ValueError(size_mismatch(found.images, judged, str(classifier_dir)))
    with progress_bar(len(sets) + len(SEEDS), f"scoring {len(sets)} run(s)", "score",
                      quiet) as bar:
        bar.set_postfix_str("reference features")
        judge = load_judge(classifier_dir, data)
        bar.set_postfix_str("")
        result = score_runs(judge, [(s.images, s.labels) for s in sets], progress=bar.update)
    result["classifier"] = str(classifier_dir)
    calls = [s.expert_calls for s in sets if s.expert_calls is not None]
    if calls:
        result["expert_calls_per_image"] = float(np.concatenate(calls).mean())
    return result
