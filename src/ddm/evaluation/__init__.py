"""Judging generated digits: a held-out classifier, Frechet distance, and sample files."""

from ddm.evaluation.classifier import (
    Classifier,
    ClassifierConfig,
    ClassifierNet,
    load_classifier,
    save_classifier,
    train_classifier,
)
from ddm.evaluation.evaluate import SampleSet, SamplesFileError, evaluate_samples, load_samples_npz
from ddm.evaluation.frechet import feature_stats, frechet_distance, frechet_distance_from_stats

__all__ = [
    "Classifier", "ClassifierConfig", "ClassifierNet", "load_classifier", "save_classifier",
    "train_classifier", "SampleSet", "SamplesFileError", "evaluate_samples", "load_samples_npz",
    "feature_stats", "frechet_distance", "frechet_distance_from_stats",
]
