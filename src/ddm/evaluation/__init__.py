"""Judging generated digits: a classifier's features, Frechet distance, precision/recall and
density/coverage against matched real subsets, and the real-vs-real floor."""

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
from ddm.evaluation.manifold import ManifoldScores, manifold_metrics
from ddm.evaluation.scoring import (SEEDS, Judge, Scores, cluster_agreement, matched_subsets,
                                   score_features, summarise)

__all__ = [
    "Classifier", "ClassifierConfig", "ClassifierNet", "load_classifier", "save_classifier",
    "train_classifier", "evaluate_samples",
    "feature_stats", "frechet_distance", "frechet_distance_from_stats", "ManifoldScores",
    "manifold_metrics", "SEEDS", "Judge", "Scores", "cluster_agreement", "matched_subsets",
    "score_features", "summarise",
]
