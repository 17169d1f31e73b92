"""The expert wire format: round trips, the documented bytes, every rejection, and fuzzing."""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddm.deploy.limits import MAX_STATE_MAGNITUDE
from ddm.serving.wire.protocol import (MAX_ERROR_MESSAGE_BYTES, LabelContext, Limits,
                                       ProtocolError, RemoteExpertError, Solver,
                                       IntegrateRequest, VelocityRequest, context_id,
                                       decode_request, decode_response, encode_error,
                                       encode_response, encode_request)

# The codes of docs/protocol.md, restated so that a change to the module shows up here.
NAME = {"x": 1, "t": 2, "grid": 4, "out": 5, "message": 6, "context": 10, "rows": 11,
        "guidance": 12}
DTYPE = {np.dtype(np.float32): 1, np.dtype(np.float16): 2, np.dtype(np.int32): 3,
         np.dtype(np.int64): 4, np.dtype(np.uint8): 5}
RESPONSE, ERROR, VELOCITY, INTEGRATE = 3, 4, 7, 8
#: The version velocity and integrate requests are sent with; replies keep version 1.
CALLS_VERSION = 2
LIMITS = Limits()


def fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


Tensor = tuple[int, int, tuple[int, ...], bytes]


def tensor(name: str, array: np.ndarray) -> Tensor:
    array = np.ascontiguousarray(array)
    return NAME[name], DTYPE[array.dtype], array.shape, array.tobytes()


def raw_body(kind: int, tensors: list[Tensor], *, request_id: int = 1, param: int = 0,
             magic: bytes = b"DDMT", version: int | None = None, flags: int = 0,
             count: int | None = None) -> bytes:
    """An independent writer of the documented layout, for bodies the encoders will not make
    (``version`` left out: the kind's own)."""
    if version is None:
        version = CALLS_VERSION if kind in (VELOCITY, INTEGRATE) else 1
    body = struct.pack("<4sBBBBQH", magic, version, kind, flags,
                       len(tensors) if count is None else count, request_id, param)
    for name, dtype, shape, _ in tensors:
        body += struct.pack(f"<BBB{len(shape)}I", name, dtype, len(shape), *shape)
    for *_, data in tensors:
        body += bytes(-len(body) % 8) + data
    return body


X = np.linspace(-1, 1, 32, dtype=np.float32).reshape(2, 1, 4, 4)
T = np.array([0.1, 0.9], np.float32)
#: A context id (a SHA-256: any 32 bytes), rows of it and their guidance scales.
ID = bytes(range(32))
ROWS = np.array([1, 0], np.int32)
GUIDANCE = np.array([1.0, 4.5], np.float32)
GRID = np.array([0.0, 0.25, 0.5], np.float32)
#: Where ``velocity()``'s padding before ``x`` lies: its five descriptors end at byte 65.
PADDING_BEFORE_X = 66
#: ``velocity()``'s tensors after ``x``, for bodies whose ``x`` is written by hand.
AFTER_X = [tensor("t", T), tensor("context", np.frombuffer(ID, np.uint8)), tensor("rows", ROWS),
           tensor("guidance", GUIDANCE)]


def velocity(x: np.ndarray = X, t: np.ndarray = T, rows: np.ndarray = ROWS,
             guidance: np.ndarray = GUIDANCE, **fields) -> bytes:
    return raw_body(VELOCITY, [tensor("x", x), tensor("t", t),
                               tensor("context", np.frombuffer(ID, np.uint8)),
                               tensor("rows", rows), tensor("guidance", guidance)], **fields)


def integrate(x: np.ndarray = X, rows: np.ndarray = ROWS, grid: np.ndarray = GRID,
              solver: int = 1, **fields) -> bytes:
    return raw_body(INTEGRATE, [tensor("x", x), tensor("context", np.frombuffer(ID, np.uint8)),
                                tensor("rows", rows), tensor("guidance", GUIDANCE[:len(rows)]),
                                tensor("grid", grid)], param=solver, **fields)


def with_byte(body: bytes, offset: int, value: int) -> bytes:
    return body[:offset] + bytes([value]) + body[offset + 1:]


# ------------------------------------------------------------------------------- round trips


def test_velocity_request_round_trips() -> None:
    got = decode_request(encode_request(
        VelocityRequest(2**64 - 1, X, T, ID, ROWS, GUIDANCE)), LIMITS)
    assert isinstance(got, VelocityRequest) and got.request_id == 2**64 - 1
    assert got.context == ID
    for sent, received in [(X, got.x), (T, got.t), (ROWS, got.rows), (GUIDANCE, got.guidance)]:
        assert received.dtype == sent.dtype and received.shape == sent.shape
        np.testing.assert_array_equal(received, sent)


@pytest.mark.parametrize("solver", list(Solver))
def test_integrate_request_round_trips(solver: Solver) -> None:
    got = decode_request(encode_request(
        IntegrateRequest(5, X, ID, ROWS, GUIDANCE, GRID, solver)), LIMITS)
    assert isinstance(got, IntegrateRequest) and got.request_id == 5
    assert got.solver is solver and got.context == ID
    np.testing.assert_array_equal(got.x, X)
    np.testing.assert_array_equal(got.rows, ROWS)
    np.testing.assert_array_equal(got.grid, GRID)


@pytest.mark.parametrize("name, code", [("euler", 1), ("heun", 2)])
def test_a_solver_travels_as_its_documented_code(name: str, code: int) -> None:
    body = encode_request(IntegrateRequest(5, X, ID, ROWS, GUIDANCE, GRID,
                                                    Solver[name.upper()]))
    assert struct.unpack_from("<H", body, 16) == (code,)  # the header's param field


def test_encoders_cast_to_the_wire_dtypes_and_layout() -> None:
    x64 = X.astype(np.float64)[:, :, :, ::-1]  # float64 and not contiguous
    got = decode_request(encode_request(
        VelocityRequest(1, x64, T.tolist(), ID, [1, 0], [1.0, 2.0])), LIMITS)
    assert (got.x.dtype, got.t.dtype, got.rows.dtype, got.guidance.dtype) == (
        np.float32, np.float32, np.int32, np.float32)
    np.testing.assert_array_equal(got.x, x64.astype(np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_response_round_trips(dtype: type) -> None:
    out = decode_response(encode_response(9, X.astype(dtype)), 9, expected_shape=X.shape)
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, X.astype(dtype))


def test_error_reply_raises_remote_expert_error() -> None:
    with pytest.raises(RemoteExpertError, match="expert error 503: überlastet") as info:
        decode_response(encode_error(4, 503, "überlastet"), 4)
    assert (info.value.code, info.value.message, info.value.request_id) == (503, "überlastet", 4)
    with pytest.raises(RemoteExpertError):  # id 0: the expert could not read the request's id
        decode_response(encode_error(0, 400, "bad magic"), 4)


def test_error_text_is_cut_on_a_character_boundary() -> None:
    with pytest.raises(RemoteExpertError) as info:
        decode_response(encode_error(1, 500, "a" + "é" * MAX_ERROR_MESSAGE_BYTES), 1)
    message = info.value.message
    assert message == "a" + "é" * ((MAX_ERROR_MESSAGE_BYTES - 1) // 2)
    assert len(message.encode()) <= MAX_ERROR_MESSAGE_BYTES


def test_request_bytes_match_the_documented_example() -> None:
    """docs/protocol.md's example: the label context of labels 3 and 7 (its own bytes are
    ``test_protocol_labels.py``'s), then a velocity request naming its row 0 (label 3)."""
    context = encode_request(LabelContext(1, np.array([3, 7], np.int64)))
    identity = context_id(context)
    assert identity.hex() == ("831e7a6e944f2299c3f78e2c179fdbcf"
                              "f98377a4870421610cbc954b33bfea17")
    x, t = np.array([[[[0.0, 0.5], [-1.0, 1.0]]]], np.float32), np.array([0.25], np.float32)
    rows, unguided = np.array([0], np.int32), np.array([1.0], np.float32)
    body = encode_request(VelocityRequest(1, x, t, identity, rows, unguided))
    documented = bytes.fromhex(
        "44444d54020700050100000000000000" "00000101040100000001000000020000"
        "0002000000020101010000000a050120" "0000000b0301010000000c0101010000"
        "0000000000000000000000000000003f" "000080bf0000803f0000803e00000000"
        + identity.hex() + "00000000000000000000803f")
    assert body == documented == raw_body(VELOCITY, [
        tensor("x", x), tensor("t", t), tensor("context", np.frombuffer(identity, np.uint8)),
        tensor("rows", rows), tensor("guidance", unguided)])
    assert len(body) == 140


def test_encoders_lay_out_each_shape_alike_whatever_came_before() -> None:
    """Headers are reused per shape: interleaved shapes, dtypes and ids still give the
    documented bytes (the independent writer's)."""
    shapes = [X, X[:1], X.astype(np.float16), X, np.zeros((3, 2, 1, 5), np.float32), X[:1]]
    for request_id, out in enumerate(shapes * 2, start=5):
        assert encode_response(request_id, out) == raw_body(
            RESPONSE, [tensor("out", out)], request_id=request_id)
    for request_id, x in enumerate([X, X[:1], X]):
        rows, guidance = ROWS[:len(x)], GUIDANCE[:len(x)]
        assert encode_request(VelocityRequest(
            request_id, x, T[:len(x)], ID, rows, guidance)) == velocity(
            x, T[:len(x)], rows, guidance, request_id=request_id)


def test_a_body_laid_out_like_one_decoded_before_is_still_checked_whole() -> None:
    decode_request(velocity(), LIMITS)  # its layout is now known
    with pytest.raises(ProtocolError, match="padding before 'x' is not zero"):
        decode_request(with_byte(velocity(), PADDING_BEFORE_X, 1), LIMITS)
    with pytest.raises(ProtocolError, match="'x' has non-finite"):
        decode_request(velocity(x=np.where(X > 0.9, np.inf, X)), LIMITS)
    sent = decode_request(velocity(x=-X, request_id=9), LIMITS)
    assert sent.request_id == 9 and np.array_equal(sent.x, -X)


def test_bodies_of_many_shapes_keep_a_bounded_memo_and_decode_right() -> None:
    """A client may send any dims: the known layouts stay bounded, and every body decodes to
    its own arrays, the first shapes again after many others."""
    from ddm.serving.wire import protocol

    shapes = [(1, 1, side, side + 1) for side in range(1, 150)]
    for shape in shapes + shapes[:3]:
        x = np.full(shape, 0.5, np.float32)
        sent = decode_request(velocity(x, T[:1], ROWS[:1], GUIDANCE[:1]), LIMITS)
        assert sent.x.shape == shape and np.array_equal(sent.x, x)
    assert len(protocol._KNOWN_LAYOUTS) <= 64


def wire_sizes(batch: int, shape: tuple[int, int, int]) -> tuple[int, int, int, int]:
    """(request bytes, raw x + t + context + rows + guidance bytes, response bytes, raw out
    bytes)."""
    x = np.zeros((batch, *shape), np.float32)
    t, rows, guidance = (np.zeros(batch, np.float32), np.zeros(batch, np.int32),
                         np.ones(batch, np.float32))
    request = encode_request(VelocityRequest(1, x, t, ID, rows, guidance))
    raw = x.nbytes + t.nbytes + len(ID) + rows.nbytes + guidance.nbytes
    return len(request), raw, len(encode_response(1, x)), x.nbytes


@pytest.mark.parametrize("batch, shape, request_bytes, response_bytes", [
    (1, (1, 16, 16), 1148, 1064), (1, (1, 32, 32), 4220, 4136), (64, (1, 16, 16), 66408, 65576)])
def test_bytes_on_wire_match_the_documented_table(batch: int, shape: tuple[int, int, int],
                                                  request_bytes: int,
                                                  response_bytes: int) -> None:
    assert wire_sizes(batch, shape)[::2] == (request_bytes, response_bytes)


def test_bytes_on_wire_ratio() -> None:
    request, raw, response, raw_out = wire_sizes(1, (1, 32, 32))
    assert request / raw <= 1.02 and response / raw_out <= 1.02
    # 16x16 misses 1.02 (docs/protocol.md says why): 80 bytes of header and padding.
    request, raw, response, raw_out = wire_sizes(1, (1, 16, 16))
    assert (request - raw, response - raw_out) == (80, 40)


# ------------------------------------------------------------------------------- zero copy


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_decoded_arrays_are_read_only_aligned_views_of_the_body(wrap: Callable) -> None:
    body = wrap(encode_request(VelocityRequest(1, X, T, ID, ROWS, GUIDANCE)))
    request = decode_request(body, LIMITS)
    whole = np.frombuffer(body, np.uint8)
    for array in (request.x, request.t, request.rows, request.guidance):
        assert np.shares_memory(array, whole)
        assert not array.flags.writeable and array.flags.aligned
    with pytest.raises(ValueError, match="read-only"):
        request.x[0, 0, 0, 0] = 1.0


def test_decoded_response_is_a_view_of_the_body() -> None:
    body = encode_response(1, X)
    out = decode_response(body, 1)
    assert np.shares_memory(out, np.frombuffer(body, np.uint8)) and not out.flags.writeable


# ------------------------------------------------------------------------------- rejections

REQUEST_ERRORS: list[tuple[str, Callable[[], bytes], Limits, int, str]] = [
    ("short", lambda: velocity()[:10], LIMITS, 400, "truncated header: 10 bytes"),
    ("magic", lambda: velocity(magic=b"DDMX"), LIMITS, 400, "bad magic b'DDMX'"),
    ("version", lambda: velocity(version=5), LIMITS, 400, "unsupported protocol version 5"),
    ("v2 kind as v1", lambda: velocity(version=1), LIMITS, 400,
     "a velocity request is a version 2 message, sent as version 1"),
    ("kind", lambda: with_byte(velocity(), 5, 99), LIMITS, 400, "unknown message kind 99"),
    # Version 1's label-only requests are gone; their codes are unknown, never reused.
    ("label velocity", lambda: raw_body(1, [tensor("x", X), tensor("t", T), (3, 4, (2,),
                                                                            bytes(16))]),
     LIMITS, 400, "unknown message kind 1"),
    ("label integrate", lambda: with_byte(integrate(), 5, 2), LIMITS, 400,
     "unknown message kind 2"),
    ("label tensor", lambda: with_byte(velocity(), 44, 3), LIMITS, 400,
     "unknown tensor name code 3"),
    ("reply", lambda: encode_response(1, X), LIMITS, 400, "a response is not expected here"),
    ("flags", lambda: velocity(flags=1), LIMITS, 400, "reserved flags must be 0"),
    ("count", lambda: velocity(count=2), LIMITS, 400, "carries 5 tensors, got 2"),
    ("descriptor cut", lambda: velocity()[:20], LIMITS, 400, "truncated header: descriptor"),
    ("dims cut", lambda: velocity()[:30], LIMITS, 400, "truncated header: dims of 'x'"),
    ("name code", lambda: with_byte(velocity(), 18, 99), LIMITS, 400,
     "unknown tensor name code 99"),
    ("order", lambda: raw_body(VELOCITY, [tensor("x", X), tensor("rows", ROWS), tensor("t", T),
                                          tensor("context", np.frombuffer(ID, np.uint8)),
                                          tensor("guidance", GUIDANCE)]),
     LIMITS, 400, "tensor 1 of a velocity request must be 't', got 'rows'"),
    ("dtype code", lambda: with_byte(velocity(), 19, 77), LIMITS, 400, "unknown dtype code 77"),
    ("dtype", lambda: velocity(x=X.astype(np.float16)), LIMITS, 422,
     r"dtype float16 is not allowed for 'x' \(allowed: float32\)"),
    ("rows dtype", lambda: velocity(rows=ROWS.astype(np.uint8)), LIMITS, 422,
     "dtype uint8 is not allowed for 'rows'"),
    ("ndim", lambda: velocity(x=X[0]), LIMITS, 422, "'x' must have 4 dimensions, got 3"),
    ("dtype, then cut", lambda: velocity(x=X.astype(np.float16))[:-1], LIMITS, 400,
     "truncated tensor data: 'guidance'"),
    ("padding", lambda: with_byte(velocity(), PADDING_BEFORE_X, 1), LIMITS, 400,
     "padding before 'x'"),
    ("data cut", lambda: velocity()[:-1], LIMITS, 400, "truncated tensor data: 'guidance'"),
    ("trailing", lambda: velocity() + b"\0", LIMITS, 400, "1 trailing bytes"),
    ("param", lambda: velocity(param=1), LIMITS, 400,
     "parameter field of a velocity request"),
    ("huge dims", lambda: raw_body(VELOCITY, [(1, 1, (2**32 - 1,) * 4, b""), *AFTER_X]),
     LIMITS, 400, "truncated tensor data: 'x'"),
    ("empty but huge", lambda: raw_body(VELOCITY, [(1, 1, (2**32 - 1, 2**32 - 1, 0, 0), b""),
                                                   *AFTER_X]),
     LIMITS, 400, r"dims \(4294967295, 4294967295, 0, 0\) describe no array"),
    ("batch mismatch", lambda: velocity(t=np.zeros(3, np.float32)), LIMITS, 400,
     "batch mismatch: 'x' has 2 rows, 't' 3, 'rows' 2, 'guidance' 2"),
    ("empty batch", lambda: velocity(X[:0], T[:0], ROWS[:0], GUIDANCE[:0]), LIMITS, 422,
     "empty batch"),
    ("big batch", velocity, Limits(max_batch=1), 422, "batch of 2 exceeds the limit of 1"),
    ("big body", velocity, Limits(max_body_bytes=100), 413, "exceeds the limit of 100"),
    ("image shape", velocity, Limits(image_shape=(1, 8, 8)), 422,
     r"images are \(1, 4, 4\), this expert serves \(1, 8, 8\)"),
    ("empty image", lambda: velocity(x=np.zeros((2, 0, 4, 4), np.float32)), LIMITS, 422,
     "are empty"),
    ("t above 1", lambda: velocity(t=np.array([0.5, 1.5], np.float32)), LIMITS, 422,
     r"'t' must be finite and in \[0, 1\]"),
    ("t below 0", lambda: velocity(t=np.array([-0.1, 0.5], np.float32)), LIMITS, 422, "'t' must"),
    ("t nan", lambda: velocity(t=np.array([np.nan, 0.5], np.float32)), LIMITS, 422, "'t' must"),
    ("x inf", lambda: velocity(x=np.where(X > 0.9, np.inf, X)), LIMITS, 422, "'x' has non-finite"),
    ("x nan", lambda: velocity(x=np.where(X > 0.9, np.nan, X)), LIMITS, 422, "'x' has non-finite"),
    ("x huge", lambda: velocity(x=np.full_like(X, 3e38)), LIMITS, 422,
     r"'x' has values beyond \+-10000 \(MAX_STATE_MAGNITUDE\): magnitude 3e\+38"),
    ("x past the bound", lambda: velocity(x=np.where(X > 0.9, -10001.0, X).astype(np.float32)),
     LIMITS, 422, "'x' has values beyond"),
    ("solver", lambda: integrate(solver=7), LIMITS, 422, "unknown solver code 7"),
    ("integrate batch", lambda: raw_body(INTEGRATE, [
        tensor("x", X), tensor("context", np.frombuffer(ID, np.uint8)), tensor("rows", ROWS[:1]),
        tensor("guidance", GUIDANCE), tensor("grid", GRID)], param=1), LIMITS, 400,
     "batch mismatch"),
    ("short grid", lambda: integrate(grid=GRID[:1]), LIMITS, 422, "at least 2 times, got 1"),
    ("flat grid", lambda: integrate(grid=np.array([0.0, 0.5, 0.5], np.float32)), LIMITS, 422,
     "'grid' must be strictly increasing"),
    ("backward grid", lambda: integrate(grid=GRID[::-1]), LIMITS, 422, "strictly increasing"),
    ("grid range", lambda: integrate(grid=np.array([0.5, 1.5], np.float32)), LIMITS, 422,
     r"'grid' must be finite and in \[0, 1\]"),
    ("steps", integrate, Limits(max_steps=1), 422, "'grid' has 2 steps, the limit is 1"),
]


@pytest.mark.parametrize("make_body, limits, status, message",
                         [case[1:] for case in REQUEST_ERRORS],
                         ids=[case[0] for case in REQUEST_ERRORS])
def test_decode_request_rejects(make_body: Callable[[], bytes], limits: Limits, status: int,
                                message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as info:
        decode_request(make_body(), limits)
    assert info.value.status == status


def test_errors_carry_the_request_id_once_the_header_is_read() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_request(velocity(t=np.array([2.0, 0.5], np.float32), request_id=42), LIMITS)
    assert info.value.request_id == 42
    with pytest.raises(ProtocolError) as info:
        decode_request(velocity(magic=b"HTTP", request_id=42), LIMITS)
    assert info.value.request_id is None


def test_huge_declared_dims_allocate_nothing() -> None:
    body = raw_body(VELOCITY, [(1, 1, (2**32 - 1,) * 4, b""), (2, 1, (2**32 - 1,), b""),
                               (10, 5, (32,), b""), (11, 3, (2**32 - 1,), b""),
                               (12, 1, (2**32 - 1,), b"")])
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="truncated tensor data"):
            decode_request(body, LIMITS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


RESPONSE_ERRORS: list[tuple[str, Callable[[], bytes], str]] = [
    ("other id", lambda: encode_response(2, X), "reply is for request 2, expected 1"),
    ("other error id", lambda: encode_error(2, 500, "boom"), "error reply is for request 2"),
    ("request", lambda: velocity(), "a velocity request is not expected here"),
    ("shape", lambda: encode_response(1, X[:1]), r"'out' has shape \(1, 1, 4, 4\)"),
    ("non-finite", lambda: raw_body(RESPONSE, [tensor("out", X / 0.0)]),
     "'out' has non-finite values"),
    ("param", lambda: raw_body(RESPONSE, [tensor("out", X)], param=3), "parameter field"),
    ("trailing", lambda: encode_response(1, X) + b"x", "1 trailing bytes"),
]


@pytest.mark.parametrize("make_body, message", [case[1:] for case in RESPONSE_ERRORS],
                         ids=[case[0] for case in RESPONSE_ERRORS])
def test_decode_response_rejects(make_body: Callable[[], bytes], message: str) -> None:
    with np.errstate(divide="ignore", invalid="ignore"), pytest.raises(ProtocolError,
                                                                       match=message):
        decode_response(make_body(), 1, expected_shape=X.shape)


def test_states_up_to_the_bound_are_accepted() -> None:
    x = np.where(X > 0.9, -MAX_STATE_MAGNITUDE, X).astype(np.float32)
    assert np.array_equal(decode_request(velocity(x=x), LIMITS).x, x)


@pytest.mark.parametrize("out", [lambda: X / 0.0, lambda: (X * 1e5).astype(np.float16)],
                         ids=["inf", "float16 overflow"])
def test_a_non_finite_output_is_refused_as_the_requests_422(out: Callable[[], np.ndarray]
                                                            ) -> None:
    """A server never sends what a caller would take for a broken replica: a request whose
    values overflow the model (or the wire dtype) is that request's own 422."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"), \
            pytest.raises(ProtocolError, match="the model's 'out' for this request is not "
                                               "finite") as refused:
        encode_response(1, out())
    assert refused.value.status == 422


@pytest.mark.parametrize("encode, message", [
    (lambda: encode_request(VelocityRequest(1, X, T, ID, ROWS.astype(np.float64),
                                                     GUIDANCE)),
     "cannot send float64 as 'rows'"),
    (lambda: encode_request(VelocityRequest(1, X[0], T, ID, ROWS, GUIDANCE)),
     "'x' must have 4 dimensions"),
    (lambda: encode_request(VelocityRequest(-1, X, T, ID, ROWS, GUIDANCE)),
     "request id -1"),
    (lambda: encode_response(2**64, X), "does not fit in u64"),
    (lambda: encode_request(IntegrateRequest(1, X, ID, ROWS, GUIDANCE, GRID, 7)),
     "unknown solver 7"),
    (lambda: encode_error(1, 70000, "x"), "error code 70000"),
])
def test_encoders_refuse_what_the_layout_cannot_carry(encode: Callable[[], bytes],
                                                      message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        encode()


@pytest.mark.parametrize("fields", [{"max_batch": 0}, {"max_steps": True},
                                    {"image_shape": (1, 16)}, {"image_shape": (0, 4, 4)}])
def test_limits_reject_nonsense(fields: dict) -> None:
    with pytest.raises(ValueError, match="Limits"):
        Limits(**fields)


# ------------------------------------------------------------------------------- properties


@st.composite
def requests(draw: st.DrawFn) -> VelocityRequest | IntegrateRequest:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    batch, channels, height, width = (draw(st.integers(1, n)) for n in (3, 2, 5, 5))
    x = rng.standard_normal((batch, channels, height, width), dtype=np.float32)
    rows = rng.integers(0, 10, batch).astype(np.int32)
    guidance = rng.uniform(0.0, 10.0, batch).astype(np.float32)
    context, request_id = rng.bytes(32), draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        return VelocityRequest(request_id, x, rng.random(batch, dtype=np.float32), context,
                                   rows, guidance)
    start, stop = sorted(draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=2,
                                       max_size=2, unique=True)))
    grid = np.linspace(start, stop, draw(st.integers(2, 6)), dtype=np.float32)
    return IntegrateRequest(request_id, x, context, rows, guidance, grid,
                                draw(st.sampled_from(list(Solver))))


@fuzz(150)
@given(requests())
def test_every_valid_request_round_trips(sent: VelocityRequest | IntegrateRequest
                                         ) -> None:
    got = decode_request(encode_request(sent), LIMITS)
    assert type(got) is type(sent) and got.request_id == sent.request_id
    assert got.context == sent.context
    for name in ("x", "t", "rows", "guidance", "grid", "solver"):
        if hasattr(sent, name):
            np.testing.assert_array_equal(getattr(got, name), getattr(sent, name))


def decode_only_raises_protocol_errors(body: bytes, limits: Limits) -> None:
    """Whatever the bytes, decoding returns a request or raises ProtocolError, and never
    allocates much more than the body (declared sizes must not be trusted)."""
    tracemalloc.start()
    try:
        try:
            decode_request(body, limits)
        except ProtocolError as err:
            assert err.status in (400, 413, 422)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024 + 4 * len(body)


STRICT = Limits(max_batch=2, max_steps=4, max_body_bytes=512, image_shape=(1, 4, 4),
                allowed_labels=range(5))
any_limits = st.sampled_from([LIMITS, STRICT])


@fuzz(400)
@given(st.one_of(st.binary(max_size=128),
                 st.binary(max_size=128).map(lambda tail: velocity()[:18] + tail)), any_limits)
def test_fuzz_random_bytes(body: bytes, limits: Limits) -> None:
    decode_only_raises_protocol_errors(body, limits)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid request after 1 to 4 bit flips, byte writes, truncations, insertions or cuts,
    half of them aimed at the header (random bytes already hit the magic)."""
    body = bytearray(encode_request(draw(requests())))
    for _ in range(draw(st.integers(1, 4))):
        if not body:
            break
        header = st.integers(min(4, len(body) - 1), min(len(body), 64) - 1)  # past the magic
        at = draw(st.one_of(st.integers(0, len(body) - 1), header))
        op = draw(st.sampled_from(["flip", "write", "truncate", "insert", "cut"]))
        if op == "flip":
            body[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "write":
            body[at] = draw(st.sampled_from([0, 1, 2, 3, 4, 0x7F, 0x80, 0xFF]))
        elif op == "truncate":
            del body[at:]
        elif op == "insert":
            body[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del body[at]
    return bytes(body)


@fuzz(700)
@given(mutated(), any_limits)
def test_fuzz_mutated_requests(body: bytes, limits: Limits) -> None:
    decode_only_raises_protocol_errors(body, limits)
