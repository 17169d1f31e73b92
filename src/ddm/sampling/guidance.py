"""Classifier-free guidance inside an expert, as a wrapper the solver sees as a plain velocity.

``guided(forward, null)(x, t, cond)`` runs the conditional rows and, for the rows whose
``cond.guidance`` is not 1, their unconditional twins (the negative prompt's embeddings where
``cond.negative`` has them, else the ``null`` conditioning made once at load) as one batch,
and returns ``u + s (c - u)`` on the guided rows, ``c`` on the others (after diffusers'
``cat([latents] * 2)`` / ``chunk(2)`` and flow_matching's CFG wrapper). Further per-row arrays
(``velocity(x, t, cond, *per_row)``: which expert of a grouped forward takes each row) go to
``forward`` with each twin's rows repeated as ``x``'s are. Guidance is linear in
the network's output, so guiding our velocity equals guiding a FlowMatchEulerDiscrete output
and converting. Guidance at the expert keeps a guided step one call, and the mixture of
experts linear.
"""

from __future__ import annotations

import numpy as np

from ddm.conditioning import TEXT, Conditioning, concat, guided_rows
from ddm.models.stages import ConditionedVelocity


def guided(forward: ConditionedVelocity, null: Conditioning | None) -> ConditionedVelocity:
    """``forward`` (an unguided velocity) guided per row against ``null`` (one row of text
    conditioning, e.g. CLIP of the empty prompt), or, with None, against the negative rows
    every guided call must then carry (an expert server: the context brings them)."""
    if null is not None and (null.kind != TEXT or len(null) != 1 or null.guidance is not None):
        raise ValueError("the null conditioning must be one unguided row of text embeddings")

    def velocity(x: np.ndarray, t: np.ndarray, cond: Conditioning,
                 *per_row: np.ndarray) -> np.ndarray:
        plain = cond.unguided()
        if cond.guidance is None:
            return forward(x, t, plain, *per_row)
        rows = np.flatnonzero(guided_rows(cond.guidance, len(cond),
                                          cond.negative is not None or null is not None,
                                          "the conditioning"))
        if not rows.size:
            return forward(x, t, plain, *per_row)
        if cond.negative is None:
            unconditional = null.take(np.zeros(rows.size, np.int64))
        else:  # every row guided (the usual step): concat copies them, so no take first
            unconditional = (cond.negative if rows.size == len(cond)
                             else cond.negative.take(rows))
        both = forward(np.concatenate([x, x[rows]]), np.concatenate([t, t[rows]]),
                       concat([plain, unconditional]),
                       *(np.concatenate([array, array[rows]]) for array in per_row))
        v = np.array(both[:len(x)], dtype=np.float32)
        c, u = v[rows], both[len(x):]
        scale = cond.guidance[rows].reshape(-1, *(1,) * (x.ndim - 1))
        v[rows] = u + scale * (c - u)
        return v

    return velocity
