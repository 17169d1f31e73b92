"""Score generated samples: class accuracy under the held-out classifier and Frechet distance.

Samples usually arrive as files in the format of ``ddm.samples``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ddm.evaluation.classifier import Classifier
from ddm.evaluation.frechet import frechet_distance


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
