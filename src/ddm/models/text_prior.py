"""A router's text prior: what the prompt says about the cluster, combined with what the noisy
latent says, by Bayes' rule.

A text DDM's router network sees only ``(x_t, t)`` (as Paris's), so it estimates
``p(k | x_t, t)``; a conditional generation wants ``p(k | x_t, t, c)``. Assuming ``x_t`` and
the prompt ``c`` independent given the cluster ``k``::

    p(k | x_t, t, c)  ∝  p(k | x_t, t) * p(k | c) / p(k)

so the network's logits get ``log p(k | c) - log p(k)`` added before the softmax. At high noise
the network is near the prior ``p(k)`` and the prompt decides the experts; at low noise the
latent does. ``p(k | c)`` is a softmax regression on the prompt's joint-space text embedding
(CLIP's text projection of its pooled vector, unit-normalised): ``softmax(z W^T + b)``; CLIP's
zero-shot against the clusters' centroids is the case ``W = logit_scale * centroids``,
``b = 0`` (docs/text2img.md says which the shipped router uses and why). ``p(k)``: the
clusters' training frequencies.

The pooled vector is CLIP's: the last hidden state at the end-of-text token, the last token
the attention mask keeps (CLIP pads after it). A prompt with no token between the start and
end tokens (the empty prompt) carries no evidence: its pooled row is zeros and its factor 1.
Pure NumPy: the router stage in-process, the stage server and both drivers share it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ddm.checkpoints.format import CheckpointError
from ddm.conditioning import Conditioning
from ddm.deploy.limits import MAX_TEXT_WIDTH

#: The ``_ddm`` key under which a router declares its text prior, and the training's file of
#: it (``ddm train text2img text-prior``), which ``ddm import text2img`` declares.
TEXT_PRIOR_KEY, TEXT_PRIOR_FILE = "text_prior", "text_prior.json"
#: Tokens a prompt with no words still has: CLIP's start and end of text.
_FRAME_TOKENS = 2


@dataclass(frozen=True, eq=False)
class TextPrior:
    """``p(k | c)`` and ``p(k)`` of a router's ``K`` clusters, for text of width ``D``:

    * ``projection`` (J, D): CLIP's text projection into its joint space;
    * ``weights`` (K, J), ``bias`` (K,): ``p(k | c) = softmax(unit(projection @ pooled) @
      weights^T + bias)``;
    * ``log_frequencies`` (K,): ``log p(k)``, the clusters' training frequencies.
    """

    projection: np.ndarray
    weights: np.ndarray
    bias: np.ndarray
    log_frequencies: np.ndarray

    @property
    def clusters(self) -> int:
        return int(self.weights.shape[0])

    @property
    def text_width(self) -> int:
        return int(self.projection.shape[1])

    def log_odds(self, pooled: np.ndarray) -> np.ndarray:
        """``log p(k | c) - log p(k)``, (B, K) float64, of pooled rows (B, D); a zero row
        (no prompt) gets zeros."""
        pooled = np.asarray(pooled, np.float64)
        if pooled.ndim != 2 or pooled.shape[1] != self.text_width:
            raise ValueError(f"the router's text prior takes pooled text vectors (B, "
                             f"{self.text_width}), got shape {pooled.shape}")
        if not np.isfinite(pooled).all():
            raise ValueError("pooled text vectors must be finite")
        joint = pooled @ self.projection.T.astype(np.float64)
        norms = np.linalg.norm(joint, axis=1, keepdims=True)
        logits = (joint / np.where(norms > 0, norms, 1.0)) @ self.weights.T + self.bias
        log_posterior = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
        odds = log_posterior - self.log_frequencies
        return np.where(np.any(pooled != 0, axis=1, keepdims=True), odds, 0.0)

    def declaration(self) -> dict[str, Any]:
        """The JSON ``_ddm.text_prior`` block (float64 lists: the arrays round-trip)."""
        return {"projection": self.projection.tolist(), "weights": self.weights.tolist(),
                "bias": self.bias.tolist(), "log_frequencies": self.log_frequencies.tolist()}

    @classmethod
    def from_declaration(cls, where: str, block: Any) -> TextPrior:
        """Parse ``_ddm.text_prior``; ``CheckpointError`` naming the malformed field."""
        field = f"_ddm.{TEXT_PRIOR_KEY}"
        if not isinstance(block, Mapping) or set(block) != {"projection", "weights", "bias",
                                                           "log_frequencies"}:
            raise CheckpointError(f"{where}: {field} must be an object with exactly "
                                  "projection, weights, bias and log_frequencies")
        arrays = {name: _finite_array(where, f"{field}.{name}", block[name], ndim)
                  for name, ndim in (("projection", 2), ("weights", 2), ("bias", 1),
                                     ("log_frequencies", 1))}
        joint, width = arrays["projection"].shape
        clusters = arrays["weights"].shape[0]
        expected = {"projection": (joint, width), "weights": (clusters, joint),
                    "bias": (clusters,), "log_frequencies": (clusters,)}
        for name, shape in expected.items():
            if arrays[name].shape != shape or not all(shape):
                raise CheckpointError(f"{where}: {field}.{name} has shape "
                                      f"{arrays[name].shape}; expected {shape} (K clusters, "
                                      "J joint, D text dimensions, none zero)")
        if width > MAX_TEXT_WIDTH:
            raise CheckpointError(f"{where}: {field}.projection takes text of width {width}, "
                                  f"over {MAX_TEXT_WIDTH}")
        if not math.isclose(float(np.exp(arrays["log_frequencies"]).sum()), 1.0,
                            abs_tol=1e-6):
            raise CheckpointError(f"{where}: {field}.log_frequencies are not the logs of "
                                  "frequencies summing to 1")
        return cls(**arrays)


def pooled_text(cond: Conditioning) -> np.ndarray | None:
    """CLIP's pooled vector of each text row, (B, D) float32: the last hidden state at the
    end-of-text token (the last token the mask keeps); zeros for a prompt without words.
    None where the rows carry no mask (precomputed embeddings): they then carry no evidence."""
    if cond.embeddings is None or cond.mask is None:
        return None
    kept = cond.mask.sum(axis=1)
    rows = np.arange(len(cond))
    pooled = cond.embeddings[rows, np.maximum(kept - 1, 0)].astype(np.float32)
    pooled[kept <= _FRAME_TOKENS] = 0.0
    return pooled


def _finite_array(where: str, field: str, value: Any, ndim: int) -> np.ndarray:
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        raise CheckpointError(f"{where}: {field} is not an array of numbers") from None
    if array.ndim != ndim:
        raise CheckpointError(f"{where}: {field} must have {ndim} dimensions, got shape "
                              f"{array.shape}")
    if not np.isfinite(array).all():
        raise CheckpointError(f"{where}: {field} holds non-finite values")
    return array
