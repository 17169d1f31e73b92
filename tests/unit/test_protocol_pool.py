"""Protocol version 3 (docs/protocol.md): a pool velocity request carries several calls to
members (a member once per context) in one body and round-trips byte for byte; its reply
carries each call's rows or error; every bad body or reply is refused with the status and a
message naming what is wrong."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ddm.serving.wire.protocol import (MemberError, Limits, PoolVelocityRequest, ProtocolError,
                                       RemoteExpertError, VelocityRequest, decode_pool_response,
                                       decode_request, encode_error, encode_pool_request,
                                       encode_pool_response, max_pool_reply_bytes)

RNG = np.random.default_rng(0)
SHAPE = (4, 2, 2)
LIMITS = Limits(image_shape=SHAPE, max_batch=8)


def call(rows: int, context: int = 1, guidance: float = 1.0) -> VelocityRequest:
    return VelocityRequest(5, RNG.standard_normal((rows, *SHAPE)).astype(np.float32),
                               np.linspace(0, 1, rows, dtype=np.float32), bytes([context]) * 32,
                               np.arange(rows, dtype=np.int32),
                               np.full(rows, guidance, np.float32))


def pool(*calls: tuple[str, VelocityRequest]) -> PoolVelocityRequest:
    return PoolVelocityRequest(5, tuple(calls))


REQUEST = pool(("expert-0", call(2, 1, 7.5)), ("expert-1", call(1, 2)))


def test_a_pool_request_round_trips_byte_for_byte_as_version_3():
    body = encode_pool_request(REQUEST)
    assert body[4] == 3 and body[5] == 14  # version 3, kind POOL_VELOCITY
    decoded = decode_request(body, LIMITS)
    assert isinstance(decoded, PoolVelocityRequest) and decoded.request_id == 5
    assert [name for name, _ in decoded.calls] == ["expert-0", "expert-1"]
    for (_, sent), (_, got) in zip(REQUEST.calls, decoded.calls):
        assert got.context == sent.context and got.request_id == 5
        for name in ("x", "t", "rows", "guidance"):
            np.testing.assert_array_equal(getattr(got, name), getattr(sent, name))
    assert encode_pool_request(decoded) == body


def test_a_member_may_be_called_once_per_context_in_one_request():
    twice = pool(("expert-0", call(2, 1)), ("expert-1", call(1, 2)), ("expert-0", call(1, 3)))
    body = encode_pool_request(twice)
    decoded = decode_request(body, LIMITS)
    assert isinstance(decoded, PoolVelocityRequest)
    assert [(name, c.context[0]) for name, c in decoded.calls] == [
        ("expert-0", 1), ("expert-1", 2), ("expert-0", 3)]
    for (_, sent), (_, got) in zip(twice.calls, decoded.calls):
        np.testing.assert_array_equal(got.x, sent.x)
    assert encode_pool_request(decoded) == body
    # Each call answers on its own: the first call to expert-0 its rows, the second its 412.
    outs = decode_pool_response(encode_pool_response(
        twice, [twice.calls[0][1].x, twice.calls[1][1].x, MemberError(412, "unknown")]), twice)
    np.testing.assert_array_equal(outs[0], twice.calls[0][1].x)
    assert isinstance(outs[2], RemoteExpertError) and outs[2].code == 412


def test_a_reply_carries_each_member_s_rows_or_error_in_their_dtype():
    half = [c.x.astype(ml_dtypes.bfloat16) for _, c in REQUEST.calls]
    body = encode_pool_response(REQUEST, half)
    assert len(body) <= max_pool_reply_bytes((3, *SHAPE), 2)
    outs = decode_pool_response(body, REQUEST)
    for out, sent in zip(outs, half):
        assert out.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(out, sent)
    # Members of other dtypes: float32 for all.
    outs = decode_pool_response(encode_pool_response(REQUEST, [half[0], REQUEST.calls[1][1].x]),
                                REQUEST)
    assert [out.dtype for out in outs] == [np.float32, np.float32]
    np.testing.assert_array_equal(outs[0], half[0].astype(np.float32))
    # One member's rows and the other's 412.
    outs = decode_pool_response(encode_pool_response(
        REQUEST, [half[0], MemberError(412, "unknown context ab12")]), REQUEST)
    np.testing.assert_array_equal(outs[0], half[0])
    assert isinstance(outs[1], RemoteExpertError) and outs[1].code == 412
    assert outs[1].message == "unknown context ab12" and outs[1].request_id == 5


def test_a_member_s_non_finite_output_is_that_member_s_422():
    out = REQUEST.calls[0][1].x.copy()
    out[0, 0, 0, 0] = np.inf
    first, second = decode_pool_response(
        encode_pool_response(REQUEST, [out, REQUEST.calls[1][1].x]), REQUEST)
    assert isinstance(first, RemoteExpertError) and first.code == 422
    assert "member expert-0" in first.message and "not finite" in first.message
    np.testing.assert_array_equal(second, REQUEST.calls[1][1].x)


def test_an_error_reply_to_the_whole_request_raises():
    with pytest.raises(RemoteExpertError, match="unknown member 'e9'") as info:
        decode_pool_response(encode_error(5, 404, "unknown member 'e9'"), REQUEST)
    assert info.value.code == 404


def patched(body: bytes, tail: np.ndarray) -> bytes:
    """``body`` with its last tensor's data (``counts``) replaced by ``tail``."""
    raw = tail.astype("<i4").tobytes()
    return body[:-len(raw)] + raw


@pytest.mark.parametrize("make_body, limits, status, message", [
    (lambda: encode_pool_request(pool(("e0", call(1)), ("e0", call(1)), ("e1", call(1)))),
     Limits(image_shape=SHAPE, max_batch=2), 422,
     r"carries 1 to 2 calls \(one row each at least, max_batch 2 rows in all\), got 3"),
    (lambda: encode_pool_request(REQUEST), Limits(image_shape=SHAPE, max_batch=2), 422,
     "batch of 3 exceeds the limit of 2"),
    (lambda: encode_pool_request(pool(("", call(1)), ("e1", call(1)))), LIMITS, 400,
     "'lengths' must be positive and sum to the 2 bytes of 'members'"),
    (lambda: encode_pool_request(pool(("e" * 64, call(1)))), LIMITS, 422,
     "is longer than 63 bytes"),
    (lambda: encode_pool_request(pool(("e0", call(1)), ("e1", call(0)))), LIMITS, 422,
     r"call 1 \(member 'e1'\) has no rows"),
    (lambda: patched(encode_pool_request(REQUEST), np.array([2, 2])), LIMITS, 400,
     "'counts' must be non-negative and sum to the 3 rows of 'x'"),
    (lambda: patched(encode_pool_request(REQUEST), np.array([4, -1])), LIMITS, 400,
     "'counts' must be non-negative"),
    (lambda: encode_pool_request(REQUEST).replace(b"expert-1", b"expert-\xff"), LIMITS, 422,
     "call 1's member name is not valid UTF-8"),
    (lambda: encode_pool_request(pool(("e0", call(2, guidance=51.0)))), LIMITS, 422,
     "'guidance' must be finite and in"),
    (lambda: encode_pool_request(pool(("e0", VelocityRequest(
        5, np.zeros((1, 4, 3, 3), np.float32), np.zeros(1, np.float32), bytes(32),
        np.zeros(1, np.int32), np.ones(1, np.float32))))), LIMITS, 422,
     r"'x' images are \(4, 3, 3\)"),
    (lambda: encode_pool_request(pool(("e0", VelocityRequest(
        5, np.zeros((1, *SHAPE), np.float32), np.full(1, 2.0, np.float32), bytes(32),
        np.zeros(1, np.int32), np.ones(1, np.float32))))), LIMITS, 422,
     r"'t' must be finite and in \[0, 1\]"),
    (lambda: encode_pool_request(pool(("e0", VelocityRequest(
        5, np.zeros((1, *SHAPE), np.float32), np.zeros(1, np.float32), bytes(32),
        np.full(1, -1, np.int32), np.ones(1, np.float32))))), LIMITS, 422,
     "'rows' must be non-negative"),
    (lambda: encode_pool_request(REQUEST)[:4] + bytes([2]) + encode_pool_request(REQUEST)[5:],
     LIMITS, 400, "a pool velocity request is a version 3 message, sent as version 2"),
    (lambda: encode_pool_request(REQUEST), Limits(image_shape=SHAPE, max_body_bytes=64), 413,
     "exceeds the limit of 64"),
])
def test_bad_pool_requests_are_refused_by_name(make_body, limits, status, message):
    with pytest.raises(ProtocolError, match=message) as info:
        decode_request(make_body(), limits)
    assert info.value.status == status


def test_replies_that_do_not_fit_the_request_are_refused():
    outs = [c.x for _, c in REQUEST.calls]
    other = pool(("expert-0", call(2)), ("expert-1", call(2)))
    with pytest.raises(ProtocolError, match=r"a pool response for 2 calls of \(4, 4, 2, 2\)"):
        decode_pool_response(encode_pool_response(REQUEST, outs), other)
    # An error code outside HTTP's error statuses, and a 200 that carries a message.
    for result in (MemberError(700, "?"), MemberError(200, "ok?")):
        with pytest.raises(ProtocolError, match="neither finite rows with 200 nor an error"):
            decode_pool_response(encode_pool_response(REQUEST, [outs[0], result]), REQUEST)
    body = encode_pool_response(REQUEST, [outs[0], MemberError(503, "loading")])
    with pytest.raises(ProtocolError, match="'lengths' must be non-negative and sum"):
        decode_pool_response(patched(body, np.array([0, 6])), REQUEST)
