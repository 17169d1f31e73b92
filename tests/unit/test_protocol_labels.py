"""Protocol version 4 (docs/protocol.md): a label context round-trips, its id is the SHA-256
of its bytes after the fixed header (never a text context's), and every bad one is refused
with the status and a message naming it."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from ddm.serving.wire.protocol import (Context, LabelContext, Limits, ProtocolError, context_id,
                                       decode_request, encode_request)

LABELS = np.array([3, 7, 3], np.int64)


def label_context(request_id: int = 1, labels: np.ndarray = LABELS) -> bytes:
    return encode_request(LabelContext(request_id, labels))


def test_a_label_context_round_trips_and_is_named_by_its_content():
    body = label_context(request_id=7)
    assert body[4] == 4 and body[5] == 16  # version 4, kind LABEL_CONTEXT
    decoded = decode_request(body, Limits())
    assert isinstance(decoded, LabelContext) and decoded.request_id == 7
    np.testing.assert_array_equal(decoded.labels, LABELS)
    assert decoded.id == hashlib.sha256(body[18:]).digest() == context_id(body)
    assert context_id(label_context(request_id=8)) == decoded.id  # the request id is not in it
    assert context_id(label_context(labels=LABELS + 1)) != decoded.id


def test_the_label_context_example_of_the_docs_byte_for_byte():
    """docs/protocol.md's LABEL_CONTEXT example: labels 3 and 7."""
    body = label_context(labels=np.array([3, 7], np.int64))
    assert body.hex() == (
        "44444d54041000010100000000000000" "0000"  # DDMT v4 kind 16 count 1 id 1 param 0
        "160401" "02000000"                    # labels i64 (2,)
        "00000000000000"                       # pad to 32
        "0300000000000000" "0700000000000000")  # labels
    assert len(body) == 48


def test_a_label_context_never_has_a_text_contexts_id():
    """Both are named by their bytes after the fixed header; the descriptors differ."""
    text = encode_request(Context(1, np.zeros((1, 1, 1), np.float32),
                                       np.ones((1, 1), np.uint8), np.zeros((0, 1, 1),
                                                                           np.float32)))
    assert context_id(text) != context_id(label_context(labels=np.zeros(1, np.int64)))


@pytest.mark.parametrize("make_body, limits, status, message", [
    (lambda: label_context(), Limits(max_context_rows=2), 422,
     "a context holds 1 to 2 rows, got 3"),
    (lambda: label_context(labels=np.zeros(0, np.int64)), Limits(), 422,
     "a context holds 1 to 256 rows, got 0"),
    (lambda: label_context(labels=np.array([0, -1], np.int64)), Limits(), 422,
     r"'labels' must be class labels in 0..999"),
    (lambda: label_context(labels=np.array([1000], np.int64)), Limits(), 422,
     r"'labels' must be class labels in 0..999"),
    (lambda: label_context(labels=np.arange(300, dtype=np.int64) % 10),
     Limits(max_body_bytes=1024), 413, "body of 2432 bytes exceeds the limit of 1024"),
    # int32 labels: a label context's labels are int64 (with the int64 bytes: trailing bytes).
    (lambda: label_context()[:19] + bytes([3]) + label_context()[20:], Limits(), 400,
     "12 trailing bytes after the last tensor"),
    (lambda: label_context()[:19] + bytes([3]) + label_context()[20:44], Limits(), 422,
     "dtype int32 is not allowed for 'labels' \\(allowed: int64\\)"),
    (lambda: label_context()[:4] + bytes([2]) + label_context()[5:], Limits(), 400,
     "a label context is a version 4 message, sent as version 2"),
    (lambda: label_context()[:16] + bytes([1]) + label_context()[17:], Limits(), 400,
     "the parameter field of a label context must be 0, got 1"),
])
def test_bad_label_contexts_are_refused_by_name(make_body, limits, status, message):
    with pytest.raises(ProtocolError, match=message) as info:
        decode_request(make_body(), limits)
    assert info.value.status == status
