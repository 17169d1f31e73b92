"""Judging generated digits: a held-out classifier, Frechet distance, and sample files."""

from ddm.evaluation.classifier import (
    Classifier,
    ClassifierConfig,
    ClassifierNet,
    load_classifier,
    save_classifier,
    train_classifier,
)
from ddm.evaluation.evaluate import evaluate_samples
from ddm.evaluation.frechet import feature_stats, frechet_distance, frechet_distance_from_stats

__all__ = [
    "Classifier", "ClassifierConfig", "ClassifierNet", "load_classifier", "save_classifier",
    "train_classifier", "evaluate_samples",
    "feature_stats", "frechet_distance", "frechet_distance_from_stats",
]
