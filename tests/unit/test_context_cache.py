"""An expert's context cache: bounded by bytes, the least recently used context evicted first,
a context larger than the whole cache refused, a miss answered UNKNOWN_CONTEXT."""

from __future__ import annotations

import numpy as np
import pytest

from ddm.serving.model.contexts import ContextCache
from ddm.serving.wire.protocol import UNKNOWN_CONTEXT, ProtocolError

ROW = np.zeros((1, 4, 8), np.float32)  # 128 bytes
NONE = np.zeros((0, 4, 8), np.float32)


def test_the_least_recently_used_context_goes_first_when_bytes_run_out():
    cache = ContextCache(max_bytes=3 * ROW.nbytes)
    for name in (b"a", b"b", b"c"):
        cache.put(name, ROW, NONE)
    cache.get(b"a")  # now the most recently used
    cache.put(b"d", ROW, NONE)
    assert cache.bytes == 3 * ROW.nbytes and cache.evictions == 1
    with pytest.raises(ProtocolError) as missed:
        cache.get(b"b")
    assert missed.value.status == UNKNOWN_CONTEXT == 412
    for name in (b"a", b"c", b"d"):
        cache.get(name)


def test_storing_a_context_again_costs_nothing_and_copies_are_owned():
    cache = ContextCache(max_bytes=4 * ROW.nbytes)
    body = bytearray(ROW.tobytes())
    view = np.frombuffer(body, np.float32).reshape(ROW.shape)
    cache.put(b"a", view, NONE)
    cache.put(b"a", view, NONE)
    body[:4] = np.float32(1.0).tobytes()  # the request body is reused: the cache kept a copy
    assert len(cache) == 1 and cache.bytes == ROW.nbytes
    assert cache.get(b"a").embeddings[0, 0, 0] == 0.0


def test_a_context_larger_than_the_cache_is_refused():
    cache = ContextCache(max_bytes=ROW.nbytes)
    with pytest.raises(ProtocolError, match="a context of 256 bytes exceeds this expert's "
                                            "context cache of 128 bytes") as refused:
        cache.put(b"a", ROW, ROW)
    assert refused.value.status == 422 and len(cache) == 0
