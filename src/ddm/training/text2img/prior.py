"""Fitting the router's text prior ``p(k | c)`` (:mod:`ddm.models.text_prior`) on the training
captions: a softmax regression of each caption's cluster (its image's k-means cluster) on the
caption's CLIP joint-space text embedding.

Why fitted, not CLIP's zero-shot against the centroids: on the training captions the fitted
regression's likelihood of the clusters is far better than the zero-shot's at any logit scale,
near the captions' own conditional entropy; the zero-shot sends "a thin eight" and "a thin
five" to the cluster of ones (thin strokes), which the regression does not (the figures:
docs/text2img.md).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ddm.models.text_prior import TextPrior

#: L2 penalty of the regression's weights (per caption, mean over the training images); small:
#: it only keeps the optimum finite where a caption's clusters are pure.
L2 = 1e-4
#: L-BFGS iterations: full batch on the distinct captions, converged well before.
ITERATIONS = 500


def fit_text_prior(projection: np.ndarray, pooled: np.ndarray, caption_index: np.ndarray,
                   clusters: np.ndarray, k: int) -> tuple[TextPrior, float]:
    """The prior and its training negative log-likelihood (nats per image).

    ``projection`` (J, D): CLIP's text projection; ``pooled`` (U, D): the distinct captions'
    pooled vectors (:func:`~ddm.models.text_prior.pooled_text`; zero rows, the empty caption,
    are left out of the fit: they carry no evidence); ``caption_index`` and ``clusters`` (N,):
    each training image's caption and cluster. Deterministic: zero start, full-batch L-BFGS."""
    counts = np.zeros((len(pooled), k), np.float64)
    np.add.at(counts, (caption_index, clusters), 1.0)
    frequencies = counts.sum(axis=0) / counts.sum()
    if not (frequencies > 0).all():
        raise ValueError(f"every cluster needs training images; frequencies {frequencies}")
    worded = np.any(pooled != 0, axis=1)
    joint = torch.from_numpy(pooled[worded].astype(np.float64)) @ torch.from_numpy(
        projection.astype(np.float64)).T
    z = torch.nn.functional.normalize(joint, dim=-1)
    target = torch.from_numpy(counts[worded] / counts[worded].sum())
    weights = torch.zeros((k, z.shape[1]), dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(k, dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.LBFGS([weights, bias], max_iter=ITERATIONS,
                                  tolerance_grad=1e-10, tolerance_change=1e-12,
                                  line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        optimiser.zero_grad()
        log_p = torch.log_softmax(z @ weights.T + bias, dim=-1)
        value = -(target * log_p).sum() + L2 * (weights ** 2).sum()
        value.backward()
        return value

    optimiser.step(loss)
    with torch.no_grad():
        nll = float(-(target * torch.log_softmax(z @ weights.T + bias, dim=-1)).sum())
    return TextPrior(projection=projection.astype(np.float64),
                     weights=weights.detach().numpy(), bias=bias.detach().numpy(),
                     log_frequencies=np.log(frequencies)), nll


def distinct_captions(captions: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(distinct, index)``: the sorted distinct captions, the empty one always among them,
    and each caption's index into them: the latents stage's numbering."""
    distinct, index = np.unique(np.asarray(("", *captions)), return_inverse=True)
    return distinct, index[1:].astype(np.int64)
