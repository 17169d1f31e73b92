"""Protocol version 2 (docs/protocol.md): a text DDM's messages round-trip, a context's id is
the SHA-256 of its bytes after the fixed header (the same whoever sends it), bfloat16 replies
carry the raw 16 bits, and every bad body is refused with the status and a message naming it."""

from __future__ import annotations

import hashlib
import struct

import ml_dtypes
import numpy as np
import pytest

from ddm.conditioning import Conditioning, EncodedPrompts
from ddm.serving.wire.protocol import (UNKNOWN_CONTEXT, Context, DecodeRequest, EncodeRequest,
                                       Limits, ProtocolError, RemoteExpertError, RouteRequest,
                                       Solver, IntegrateRequest, VelocityRequest,
                                       context_id, decode_context_ack, decode_encoded,
                                       decode_probabilities, decode_request, decode_response,
                                       encode_context_ack, encode_encoded, encode_error,
                                       encode_probabilities, encode_response, encode_request)

RNG = np.random.default_rng(0)
EMBEDDINGS = RNG.standard_normal((2, 3, 4)).astype(np.float32)
MASK = np.array([[1, 1, 0], [1, 1, 1]], np.uint8)
X = RNG.standard_normal((2, 4, 2, 2)).astype(np.float32)
LIMITS = Limits(image_shape=(4, 2, 2), text_width=4)


def context(request_id: int = 1, negative: np.ndarray | None = None) -> bytes:
    return encode_request(Context(request_id, EMBEDDINGS, MASK,
                                       np.zeros_like(EMBEDDINGS) if negative is None
                                       else negative))


def test_a_context_round_trips_and_its_id_is_the_sha256_after_the_fixed_header():
    body = context(request_id=7)
    assert body[4] == 2 and body[5] == 5  # version 2, kind CONTEXT
    decoded = decode_request(body, LIMITS)
    assert isinstance(decoded, Context) and decoded.request_id == 7
    np.testing.assert_array_equal(decoded.embeddings, EMBEDDINGS)
    np.testing.assert_array_equal(decoded.mask, MASK)
    assert decoded.id == hashlib.sha256(body[18:]).digest() == context_id(body)
    # The request id is not part of the id: a retry or another router names the same context.
    assert context_id(context(request_id=8)) == decoded.id
    assert context_id(context(negative=np.ones_like(EMBEDDINGS))) != decoded.id


def test_the_context_example_of_the_docs_byte_for_byte():
    """docs/protocol.md's CONTEXT example: one row of two tokens of width 2, no negative."""
    body = encode_request(Context(1, np.array([[[1.0, -1.0], [0.5, 2.0]]], np.float32),
                                       np.array([[1, 0]], np.uint8),
                                       np.zeros((0, 2, 2), np.float32)))
    assert body.hex() == (
        "44444d54020500030100000000000000" "0000"  # DDMT v2 kind 5 count 3 id 1 param 0
        "0701030100000002000000" "02000000"    # embeddings f32 (1, 2, 2)
        "080502" "01000000" "02000000"         # mask u8 (1, 2)
        "090103" "00000000" "02000000" "02000000"  # negative f32 (0, 2, 2)
        "0000000000"                           # pad to 64
        "0000803f000080bf0000003f00000040"     # embeddings
        "0100"                                 # mask
        "000000000000")                        # pad to 88, where negative's 0 bytes start
    assert len(body) == 88


def test_text_velocity_integrate_encode_decode_and_route_round_trip():
    t = np.array([0.25, 0.5], np.float32)
    ident = bytes(range(32))
    rows, guidance = np.array([1, 0], np.int32), np.array([7.5, 1.0], np.float32)
    velocity = decode_request(encode_request(
        VelocityRequest(3, X, t, ident, rows, guidance)), LIMITS)
    assert isinstance(velocity, VelocityRequest) and velocity.context == ident
    np.testing.assert_array_equal(velocity.guidance, guidance)
    grid = np.linspace(0, 1, 5, dtype=np.float32)
    integrate = decode_request(encode_request(
        IntegrateRequest(4, X, ident, rows, guidance, grid, Solver.HEUN)), LIMITS)
    assert isinstance(integrate, IntegrateRequest) and integrate.solver is Solver.HEUN
    encode = decode_request(encode_request(EncodeRequest(5, ("a cat", "", "café"))),
                            LIMITS)
    assert isinstance(encode, EncodeRequest) and encode.prompts == ("a cat", "", "café")
    decode = decode_request(encode_request(DecodeRequest(6, X)), LIMITS)
    assert isinstance(decode, DecodeRequest) and decode.x.shape == X.shape
    pooled = np.array([[0.5, -1.0, 2.0], [0.0, 0.0, 0.0]], np.float32)
    route = decode_request(encode_request(RouteRequest(7, X, t, pooled)), LIMITS)
    assert isinstance(route, RouteRequest) and route.t.tolist() == [0.25, 0.5]
    np.testing.assert_array_equal(route.pooled, pooled)
    unpooled = decode_request(encode_request(
        RouteRequest(8, X, t, np.zeros((2, 0), np.float32))), LIMITS)
    assert isinstance(unpooled, RouteRequest) and unpooled.pooled.shape == (2, 0)


def test_replies_round_trip_and_bfloat16_travels_as_its_raw_bits():
    ident = bytes(range(32))
    assert decode_context_ack(encode_context_ack(9, ident), 9) == ident
    # The encoder's answer crosses as the one type the in-process encoder answers too.
    sent = EncodedPrompts(Conditioning(embeddings=EMBEDDINGS.astype(ml_dtypes.bfloat16),
                                       mask=MASK.astype(np.int64)), np.array([0, 4], np.int64),
                          np.array([[1, 2, 8]], np.int64))
    encoded = decode_encoded(encode_encoded(9, sent), 9, prompts=2, limits=LIMITS)
    assert isinstance(encoded, EncodedPrompts) and encoded.tokens_cut.tolist() == [0, 4]
    assert encoded.unknown.tolist() == [[1, 2, 8]] and encoded.unknown.dtype == np.int64
    assert (encoded.cond.embeddings.dtype, encoded.cond.mask.dtype) == (np.float32, np.int64)
    np.testing.assert_array_equal(encoded.cond.embeddings,
                                  EMBEDDINGS.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(encoded.cond.mask, MASK)
    probs = np.array([[0.25, 0.75], [1.0, 0.0]], np.float32)
    np.testing.assert_array_equal(decode_probabilities(encode_probabilities(9, probs), 9, 2, 2),
                                  probs)
    half = X.astype(ml_dtypes.bfloat16)
    body = encode_response(9, half)
    assert body[-X.size * 2:] == half.view(np.uint16).tobytes()
    out = decode_response(body, 9, X.shape)
    np.testing.assert_array_equal(out.astype(np.float32), half.astype(np.float32))


def test_an_unknown_context_is_an_error_reply_of_its_own_code():
    with pytest.raises(RemoteExpertError) as info:
        decode_response(encode_error(3, UNKNOWN_CONTEXT, "unknown context ab12"), 3)
    assert info.value.code == UNKNOWN_CONTEXT == 412


def with_u32(body: bytes, offset: int, value: int) -> bytes:
    return body[:offset] + struct.pack("<I", value) + body[offset + 4:]


@pytest.mark.parametrize("make_body, limits, status, message", [
    (lambda: context(), Limits(text_width=8), 422, "'embeddings' are 4 wide; this stage takes 8"),
    (lambda: context(), Limits(max_context_rows=1), 422, "a context holds 1 to 1 rows, got 2"),
    (lambda: context(), Limits(max_text_tokens=2), 422, "has 3 tokens per row; the limit is 2"),
    (lambda: context(negative=np.zeros((1, 3, 4), np.float32)), LIMITS, 422,
     r"'negative' has shape \(1, 3, 4\)"),
    (lambda: encode_request(Context(1, EMBEDDINGS, MASK * 2, EMBEDDINGS)), LIMITS, 422,
     "'mask' holds values other than 0 and 1"),
    (lambda: encode_request(Context(1, EMBEDDINGS * np.inf, MASK, EMBEDDINGS)), LIMITS,
     422, "non-finite"),
    (lambda: encode_request(VelocityRequest(
        1, X, np.zeros(2, np.float32), bytes(32), np.array([0, -1], np.int32),
        np.ones(2, np.float32))), LIMITS, 422, "'rows' must be non-negative"),
    (lambda: encode_request(VelocityRequest(
        1, X, np.zeros(2, np.float32), bytes(32), np.zeros(2, np.int32),
        np.array([1.0, 51.0], np.float32))), LIMITS, 422, r"'guidance' must be finite and in"),
    (lambda: encode_request(VelocityRequest(
        1, X, np.zeros(2, np.float32), bytes(32), np.zeros(3, np.int32),
        np.ones(2, np.float32))), LIMITS, 400, "batch mismatch: 'x' has 2 rows"),
    (lambda: encode_request(EncodeRequest(1, ("x" * 10,))), Limits(max_prompt_bytes=4),
     422, "prompt 0 is 10 bytes; the limit is 4"),
    (lambda: encode_request(EncodeRequest(1, ("a",) * 3)), Limits(max_prompts=2), 422,
     "1 to 2 prompts, got 3"),
    # 'lengths' (the second tensor's one dim at offset 26) claims more bytes than 'text' has.
    (lambda: with_u32(encode_request(EncodeRequest(1, ("ab",))), 21, 3), LIMITS, 400,
     "truncated|'lengths' must be non-negative and sum"),
    (lambda: encode_request(DecodeRequest(1, np.zeros((1, 4, 3, 3), np.float32))), LIMITS,
     422, r"'x' images are \(4, 3, 3\), this expert serves \(4, 2, 2\)"),
    (lambda: context()[:4] + bytes([1]) + context()[5:], LIMITS, 400,
     "a context is a version 2 message, sent as version 1"),
])
def test_bad_version_2_bodies_are_refused_by_name(make_body, limits, status, message):
    with pytest.raises(ProtocolError, match=message) as info:
        decode_request(make_body(), limits)
    assert info.value.status == status


def test_invalid_utf8_prompts_are_refused():
    body = encode_request(EncodeRequest(1, ("ab",)))
    bad = body.replace(b"ab", b"\xff\xfe")
    with pytest.raises(ProtocolError, match="prompt 0 is not valid UTF-8"):
        decode_request(bad, LIMITS)


def test_replies_that_do_not_fit_the_request_are_refused():
    with pytest.raises(ProtocolError, match="'probs' rows must be finite, non-negative"):
        decode_probabilities(encode_probabilities(1, np.array([[0.5, 0.6]], np.float32)), 1,
                             1, 2)
    with pytest.raises(ProtocolError, match=r"'probs' has shape \(1, 2\), expected \(1, 3\)"):
        decode_probabilities(encode_probabilities(1, np.array([[0.5, 0.5]], np.float32)), 1,
                             1, 3)
    for spans in ([[2, 0, 1]], [[0, 3, 3]], [[0, -1, 2]], [[0, 0, 4097]]):
        with pytest.raises(ProtocolError, match="unknown words must be"):
            decode_encoded(encode_encoded(1, EncodedPrompts(
                Conditioning(embeddings=EMBEDDINGS, mask=MASK), np.zeros(2, np.int64),
                np.array(spans, np.int64))), 1, prompts=2, limits=LIMITS)
    with pytest.raises(ProtocolError, match="an encode reply for 3 prompts"):
        decode_encoded(encode_encoded(1, EncodedPrompts(
            Conditioning(embeddings=EMBEDDINGS, mask=MASK), np.zeros(2, np.int64))), 1,
            prompts=3, limits=LIMITS)
