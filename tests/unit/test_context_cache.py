"""An expert's context cache: bounded by bytes, the least recently used context evicted first,
a context larger than the whole cache refused, a miss answered UNKNOWN_CONTEXT."""

from __future__ import annotations

import hashlib
import tracemalloc

import numpy as np
import pytest

from ddm.serving.model.contexts import ENTRY_BYTES, ContextCache
from ddm.serving.wire.protocol import UNKNOWN_CONTEXT, Context, LabelContext, ProtocolError

ROW = np.zeros((1, 4, 8), np.float32)  # 128 bytes
HELD = ROW.nbytes + ENTRY_BYTES  # what holding a context of it costs
NONE = np.zeros((0, 4, 8), np.float32)
MASK = np.ones((1, 4), np.uint8)


def text(embeddings: np.ndarray, negative: np.ndarray = NONE) -> Context:
    return Context(0, embeddings, MASK, negative)


def test_the_least_recently_used_context_goes_first_when_bytes_run_out():
    cache = ContextCache(max_bytes=3 * HELD)
    for name in (b"a", b"b", b"c"):
        cache.put(name, text(ROW))
    cache.get(b"a", "text")  # now the most recently used
    cache.put(b"d", text(ROW))
    assert cache.bytes == 3 * HELD and cache.evictions == 1
    with pytest.raises(ProtocolError) as missed:
        cache.get(b"b", "text")
    assert missed.value.status == UNKNOWN_CONTEXT == 412
    for name in (b"a", b"c", b"d"):
        cache.get(name, "text")


def test_storing_a_context_again_costs_nothing_and_copies_are_owned():
    cache = ContextCache(max_bytes=4 * HELD)
    body = bytearray(ROW.tobytes())
    view = np.frombuffer(body, np.float32).reshape(ROW.shape)
    cache.put(b"a", text(view))
    cache.put(b"a", text(view))
    body[:4] = np.float32(1.0).tobytes()  # the request body is reused: the cache kept a copy
    assert len(cache) == 1 and cache.bytes == HELD
    assert cache.get(b"a", "text").embeddings[0, 0, 0] == 0.0


def test_a_context_larger_than_the_cache_is_refused():
    cache = ContextCache(max_bytes=HELD)
    with pytest.raises(ProtocolError, match="a context of 768 bytes exceeds this expert's "
                                            "context cache of 640 bytes") as refused:
        cache.put(b"a", text(ROW, ROW))
    assert refused.value.status == 422 and len(cache) == 0


def test_label_contexts_share_the_cache_and_a_context_of_the_other_kind_is_refused():
    cache = ContextCache(max_bytes=HELD + ENTRY_BYTES + 16)
    labels = np.array([3, 7], np.int64)
    cache.put(b"l", LabelContext(0, labels))
    cache.put(b"t", text(ROW))
    assert cache.bytes == HELD + ENTRY_BYTES + labels.nbytes and len(cache) == 2
    np.testing.assert_array_equal(cache.get(b"l", "labels").labels, labels)
    with pytest.raises(ProtocolError, match="holds text; this model is conditioned on labels"
                       ) as refused:
        cache.get(b"t", "labels")
    assert refused.value.status == 422
    with pytest.raises(ProtocolError, match="holds labels; this model is conditioned on text"):
        cache.get(b"l", "text")


def test_rows_a_context_lacks_are_refused():
    cache = ContextCache(max_bytes=1024)
    cache.put(b"l", LabelContext(0, np.array([3, 7], np.int64)))
    stored = cache.get(b"l", "labels")
    stored.check_rows(np.array([1, 0], np.int32))
    with pytest.raises(ProtocolError, match="'rows' name row 2 of a context of 2") as refused:
        stored.check_rows(np.array([0, 2], np.int32))
    assert refused.value.status == 422


def test_many_tiny_contexts_hold_no_more_memory_than_the_cache_s_size():
    """A label context of one row is 8 bytes of rows; holding it costs some 400 more. Charged
    its rows alone, a cache filled with such contexts (one tenant's cheap requests) held about
    fifty times its size."""
    budget = 1 << 20
    cache = ContextCache(max_bytes=budget)
    messages = [LabelContext(0, np.array([k % 10], np.int64)) for k in range(20_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for k, message in enumerate(messages):  # each id a new object, as a request's is
            cache.put(hashlib.sha256(k.to_bytes(4, "little")).digest(), message)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert cache.bytes <= budget and 1_000 < len(cache) < 20_000
    assert held <= budget, f"{len(cache)} contexts hold {held} bytes"
