"""A model server's text rows in a batch: each call's rows travel the batcher as references to
its stored context and are gathered once per batch (ddm.serving.model.stage)."""

from __future__ import annotations

import numpy as np

from ddm.conditioning import concat
from ddm.serving.model.contexts import StoredContext
from ddm.serving.model.stage import batch_conditioning

TOKENS, WIDTH = 3, 4


def _context(seed: int, rows: int, negative: bool, dtype: type = np.float32) -> StoredContext:
    rng = np.random.default_rng(seed)
    embeddings = rng.standard_normal((rows, TOKENS, WIDTH)).astype(dtype)
    negatives = (rng.standard_normal((rows, TOKENS, WIDTH)).astype(dtype) if negative
                 else np.zeros((0, TOKENS, WIDTH), dtype))
    return StoredContext(embeddings, negatives)


def test_a_batch_of_calls_on_several_contexts_gets_each_rows_own_embeddings() -> None:
    first = _context(0, rows=4, negative=True)
    second = _context(1, rows=2, negative=False)  # unguided rows only: no negative rows
    third = _context(2, rows=3, negative=True, dtype=np.float16)
    # Three calls as the batcher joins them: [first rows 2, 0], [second row 1], [third rows 1, 1].
    held = np.empty(5, object)
    held[:] = [first, first, second, third, third]
    index = np.array([2, 0, 1, 1, 1], np.int32)
    guidance = np.array([7.5, 7.5, 1.0, 2.0, 2.0], np.float32)

    cond = batch_conditioning(TOKENS, [held, index, guidance])

    expected = np.stack([first.embeddings[2], first.embeddings[0], second.embeddings[1],
                         third.embeddings[1], third.embeddings[1]]).astype(np.float32)
    assert cond.embeddings.dtype == np.float32
    np.testing.assert_array_equal(cond.embeddings, expected)
    np.testing.assert_array_equal(cond.guidance, guidance)
    assert cond.negative is not None
    np.testing.assert_array_equal(cond.negative.embeddings[[0, 1, 3, 4]], np.stack([
        first.negative[2], first.negative[0], third.negative[1],
        third.negative[1]]).astype(np.float32))
    # An unguided row's negative is a placeholder never run: its own embeddings.
    np.testing.assert_array_equal(cond.negative.embeddings[2], second.embeddings[1])
    # Guidance's forward of the rows and then their negative rows copies neither again.
    both = concat([cond.unguided(), cond.negative])
    assert np.shares_memory(both.embeddings, cond.embeddings)
    np.testing.assert_array_equal(both.embeddings[:5], expected)
    np.testing.assert_array_equal(both.embeddings[5:], cond.negative.embeddings)
    # The batch owns its rows: writing to them leaves the stored contexts as they were.
    cond.embeddings[:] = 0
    assert first.embeddings[2].any() and third.embeddings[1].any()
