"""The router <-> expert wire format: raw little-endian tensors behind a small versioned header.

A router calls its experts at every sampler step, and with small models the encoding, not the
model, dominates latency. Bodies therefore carry the tensors' own bytes, decoded as read-only
NumPy views without copies, and are checked strictly so that a server can answer every bad body
with a precise 4xx before touching a model. This module is the one place that knows the layout;
``docs/protocol.md`` describes it byte by byte, with its codes and HTTP statuses.

Version 1 is the replies (RESPONSE, ERROR); its label-only requests (kinds 1 and 2) are gone:
their codes are unknown kinds now. Version 2 carries a generation's CONTEXT (its text
embeddings, sent once per expert replica and named by the SHA-256 of its bytes), VELOCITY /
INTEGRATE (rows of a context, a guidance scale per row), and the stages' ENCODE, DECODE and
ROUTE. Replies may carry bfloat16 (``ml_dtypes``' NumPy dtype: its raw 16 bits on the wire).
Version 3 adds a pool's POOL_VELOCITY: the velocity calls of a step to the members of one pool
server in one body (a member once per context it is called with), answered by one POOL_RESPONSE
holding each call's output or error.
Version 4 adds LABEL_CONTEXT: a generation's class labels as a context, named by id like a
text one, so that every expert, label or text, answers the same VELOCITY / INTEGRATE /
POOL_VELOCITY calls.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
import threading
from dataclasses import dataclass
from enum import IntEnum
from typing import Sequence

import ml_dtypes
import numpy as np

from ddm.conditioning import Conditioning, EncodedPrompts
from ddm.deploy.limits import (MAX_BATCH, MAX_CLASS, MAX_CONTEXT_BODY_BYTES, MAX_CONTEXT_ROWS,
                               MAX_GUIDANCE_SCALE, MAX_PROMPT_BYTES, MAX_PROMPTS,
                               MAX_STATE_MAGNITUDE, MAX_STEPS, MAX_TEXT_TOKENS, MAX_TEXT_WIDTH,
                               SOLVERS)

#: HTTP ``Content-Type`` of every body in this format.
CONTENT_TYPE = "application/x-ddm-tensor"
MAGIC = b"DDMT"
#: Replies are version 1; contexts, calls and the stages' kinds version 2, a pool's version 3, a
#: label context version 4.
VERSION, VERSION_TEXT, VERSION_POOL, VERSION_LABELS = 1, 2, 3, 4
#: The error code (and HTTP status) of a text call naming a context the expert does not hold
#: (never sent, or evicted, or the replica restarted): the caller sends the context, retries.
UNKNOWN_CONTEXT = 412
#: Bytes of a context id: a SHA-256.
CONTEXT_ID_BYTES = 32
#: Every tensor's data starts at a multiple of this many bytes from the start of the body.
ALIGNMENT = 8
#: Error texts are cut to this many UTF-8 bytes so that an error reply stays small.
MAX_ERROR_MESSAGE_BYTES = 4096
#: The longest member name a pool request carries: a DNS label's 63 (the names are the plan's).
MAX_MEMBER_NAME_BYTES = 63

# magic, version, kind, flags, tensor count, request id, kind-specific parameter.
_FIXED = struct.Struct("<4sBBBBQH")
# name code, dtype code, ndim; then ndim u32 dims.
_DESCRIPTOR = struct.Struct("<BBB")
_MAX_U64 = 2**64 - 1
#: Shapes whose layouts are kept, for decoding and for encoding alike: a caller sends the same
#: shapes at every step; bounded, since a client may send any dims.
_SHAPES_REMEMBERED = 64
_MAX_U16 = 2**16 - 1


class ProtocolError(ValueError):
    """A body that is not an acceptable message, with the HTTP status a server answers.

    ``status`` is 400 for a body that cannot be decoded (layout, codes, tensor names), 413 for
    one longer than ``Limits.max_body_bytes``, and 422 for a decodable body the expert refuses
    (a dtype, rank or shape it does not take, a batch or grid over its limits, bad values).
    ``request_id`` is filled in once the header has been read, so that the error reply can
    echo it.
    """

    def __init__(self, message: str, status: int = 400, request_id: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.request_id = request_id


class RemoteExpertError(RuntimeError):
    """The expert answered with an error message instead of a result."""

    def __init__(self, code: int, message: str, request_id: int) -> None:
        super().__init__(f"expert error {code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


#: ODE solvers an expert runs for multi-step delegation, named as ``ddm.deploy.limits.SOLVERS``
#: names them (upper-case); the values are the wire codes, each name's place in that tuple from 1.
Solver = IntEnum("Solver", [name.upper() for name in SOLVERS])


class _Kind(IntEnum):
    # 1 and 2 were version 1's label-only velocity and integrate requests: never reuse them.
    RESPONSE = 3
    ERROR = 4
    CONTEXT = 5
    CONTEXT_ACK = 6
    VELOCITY = 7
    INTEGRATE = 8
    ENCODE = 9
    ENCODED = 10
    DECODE = 11
    ROUTE = 12
    PROBABILITIES = 13
    POOL_VELOCITY = 14
    POOL_RESPONSE = 15
    LABEL_CONTEXT = 16


# For error messages.
_KIND_NAMES = {_Kind.VELOCITY: "a velocity request", _Kind.INTEGRATE: "an integrate request",
               _Kind.RESPONSE: "a response", _Kind.ERROR: "an error reply",
               _Kind.CONTEXT: "a context", _Kind.CONTEXT_ACK: "a context acknowledgement",
               _Kind.ENCODE: "an encode request", _Kind.ENCODED: "an encode reply",
               _Kind.DECODE: "a decode request", _Kind.ROUTE: "a route request",
               _Kind.PROBABILITIES: "a route reply",
               _Kind.POOL_VELOCITY: "a pool velocity request",
               _Kind.POOL_RESPONSE: "a pool response",
               _Kind.LABEL_CONTEXT: "a label context"}
_REQUESTS = (_Kind.CONTEXT, _Kind.VELOCITY, _Kind.INTEGRATE, _Kind.ENCODE, _Kind.DECODE,
             _Kind.ROUTE, _Kind.POOL_VELOCITY, _Kind.LABEL_CONTEXT)
_REPLIES = (_Kind.RESPONSE, _Kind.ERROR)
_KIND_CODES = {kind.value: kind for kind in _Kind}
#: The version each kind is sent with: the replies keep version 1.
_VERSIONS = {kind: VERSION if kind <= _Kind.ERROR else
             VERSION_TEXT if kind <= _Kind.PROBABILITIES else
             VERSION_POOL if kind <= _Kind.POOL_RESPONSE else VERSION_LABELS for kind in _Kind}

_F32, _F16, _BF16 = np.dtype("<f4"), np.dtype("<f2"), np.dtype(ml_dtypes.bfloat16)
_I32, _I64, _U8 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("u1")
_DTYPES = {1: _F32, 2: _F16, 3: _I32, 4: _I64, 5: _U8, 6: _BF16}
_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}
#: Wire dtypes of floating tensors a model produces, by precision name.
WIRE_DTYPES = {"float32": _F32, "float16": _F16, "bfloat16": _BF16}
# 3 was version 1's label tensor "y": never reuse it.
_NAMES = {1: "x", 2: "t", 4: "grid", 5: "out", 6: "message", 7: "embeddings",
          8: "mask", 9: "negative", 10: "context", 11: "rows", 12: "guidance", 13: "text",
          14: "lengths", 15: "cut", 16: "probs", 17: "pooled", 18: "unknown", 19: "members",
          20: "counts", 21: "codes", 22: "labels"}
_NAME_CODES = {name: code for code, name in _NAMES.items()}


@dataclass(frozen=True)
class _Spec:
    """One tensor slot of a message kind; encoders cast other dtypes to ``dtypes[0]``."""

    name: str
    ndim: int
    dtypes: tuple[np.dtype, ...]


_FLOATS = (_F32, _F16, _BF16)
_X, _T, _GRID = _Spec("x", 4, (_F32,)), _Spec("t", 1, (_F32,)), _Spec("grid", 1, (_F32,))
_TEXT_ROWS = (_Spec("context", 1, (_U8,)), _Spec("rows", 1, (_I32,)),
              _Spec("guidance", 1, (_F32,)))
_EMBEDDINGS, _MASK = _Spec("embeddings", 3, _FLOATS), _Spec("mask", 2, (_U8,))
# Each kind carries exactly these tensors, in this order.
_SCHEMAS: dict[_Kind, tuple[_Spec, ...]] = {
    _Kind.RESPONSE: (_Spec("out", 4, _FLOATS),),
    _Kind.ERROR: (_Spec("message", 1, (_U8,)),),
    _Kind.CONTEXT: (_EMBEDDINGS, _MASK, _Spec("negative", 3, _FLOATS)),
    _Kind.CONTEXT_ACK: (_Spec("context", 1, (_U8,)),),
    _Kind.VELOCITY: (_X, _T, *_TEXT_ROWS),
    _Kind.INTEGRATE: (_X, *_TEXT_ROWS, _GRID),
    _Kind.ENCODE: (_Spec("text", 1, (_U8,)), _Spec("lengths", 1, (_I32,))),
    _Kind.ENCODED: (_EMBEDDINGS, _MASK, _Spec("cut", 1, (_I32,)),
                    _Spec("unknown", 2, (_I32,))),
    _Kind.DECODE: (_X,),
    _Kind.ROUTE: (_X, _T, _Spec("pooled", 2, (_F32,))),
    _Kind.PROBABILITIES: (_Spec("probs", 2, (_F32,)),),
    _Kind.POOL_VELOCITY: (_X, _T, _Spec("rows", 1, (_I32,)), _Spec("guidance", 1, (_F32,)),
                          _Spec("context", 2, (_U8,)), _Spec("members", 1, (_U8,)),
                          _Spec("lengths", 1, (_I32,)), _Spec("counts", 1, (_I32,))),
    _Kind.POOL_RESPONSE: (_Spec("out", 4, _FLOATS), _Spec("codes", 1, (_I32,)),
                          _Spec("message", 1, (_U8,)), _Spec("lengths", 1, (_I32,))),
    _Kind.LABEL_CONTEXT: (_Spec("labels", 1, (_I64,)),),
}


@dataclass(frozen=True, eq=False)
class Context:
    """A generation's text conditioning, sent once to each expert replica (version 2):
    ``embeddings`` (N, L, D) and ``negative`` (N, L, D), the unconditional rows guidance uses
    (a negative prompt's embeddings, or the empty prompt's), or (0, L, D) when no row is guided;
    ``mask`` (N, L) uint8, 1 for a token. Floats as float32, float16 or bfloat16. ``id`` is
    the SHA-256 of the message's bytes after its fixed header (:func:`context_id`): the same
    conditioning has the same id whoever sends it, and an expert recomputes it, never trusting
    the sender's."""

    request_id: int
    embeddings: np.ndarray
    mask: np.ndarray
    negative: np.ndarray
    id: bytes = b""


@dataclass(frozen=True, eq=False)
class LabelContext:
    """A generation's label conditioning, sent once to each expert replica (version 4):
    ``labels`` (N,) int64 class labels, each in ``0..MAX_CLASS``. ``id`` is the SHA-256 of the
    message's bytes after its fixed header, as a :class:`Context`'s (its descriptor names
    ``labels``, so no label context has a text context's id); velocity and integrate calls
    name its rows as they name a text context's."""

    request_id: int
    labels: np.ndarray
    id: bytes = b""


@dataclass(frozen=True, eq=False)
class VelocityRequest:
    """Ask for the guided ``v(x, t, c)`` (version 2): ``x`` (B, C, H, W) float32, ``t`` (B,)
    float32 in [0, 1], the conditioning of row ``i`` being row ``rows[i]`` (int32) of the
    context (text or labels) named ``context`` (32 bytes), guided with scale ``guidance[i]``
    (float32; 1: unguided). Decoded arrays are read-only views of the body."""

    request_id: int
    x: np.ndarray
    t: np.ndarray
    context: bytes
    rows: np.ndarray
    guidance: np.ndarray


@dataclass(frozen=True, eq=False)
class IntegrateRequest:
    """Ask the expert to integrate ``dx/dt = v(x, t, c)`` from ``grid[0]`` to ``grid[-1]``
    visiting every time of ``grid`` (S + 1,) float32 with ``solver``; ``x`` is the state at
    ``grid[0]``, its rows conditioned and guided as a :class:`VelocityRequest`'s. Sending the
    grid, not a step count, keeps the expert on the router's times."""

    request_id: int
    x: np.ndarray
    context: bytes
    rows: np.ndarray
    guidance: np.ndarray
    grid: np.ndarray
    solver: Solver


@dataclass(frozen=True, eq=False)
class EncodeRequest:
    """Ask a text encoder for the embeddings of ``prompts`` (version 2)."""

    request_id: int
    prompts: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class DecodeRequest:
    """Ask a decoder for the images of latents ``x`` (B, C, S, S) float32 (version 2)."""

    request_id: int
    x: np.ndarray


@dataclass(frozen=True, eq=False)
class RouteRequest:
    """Ask a router for ``p(k | x, t, c)``: ``x`` (B, C, S, S), ``t`` (B,) float32 and the
    prompts' ``pooled`` text vectors (B, D) float32 for a router's text prior
    (:mod:`ddm.models.text_prior`; a zero row: no prompt); (B, 0): none sent."""

    request_id: int
    x: np.ndarray
    t: np.ndarray
    pooled: np.ndarray


@dataclass(frozen=True, eq=False)
class PoolVelocityRequest:
    """The velocity calls of one step to members of one pool server, in one body (version
    3): ``calls`` pairs a member's name with its rows of one context, a
    :class:`VelocityRequest` carrying this request's id; a member may be named by several
    calls (concurrent generations, each with its own context). Decoded, each call's arrays are
    read-only views of the body's; the calls' rows follow one another in ``calls``' order."""

    request_id: int
    calls: tuple[tuple[str, VelocityRequest], ...]


@dataclass(frozen=True)
class MemberError:
    """One call of a pool request failed: ``code`` the HTTP status its member's own route
    would have answered (412 for an unknown context, 422, 503...), ``message`` why."""

    code: int
    message: str


Request = (Context | LabelContext | VelocityRequest | IntegrateRequest | EncodeRequest
           | DecodeRequest | RouteRequest | PoolVelocityRequest)

#: The request each query name stands for (a role's ``queries`` in ddm.checkpoints.roles).
QUERIES: dict[str, type] = {
    "velocity": VelocityRequest, "integrate": IntegrateRequest, "context": Context,
    "encode": EncodeRequest, "decode": DecodeRequest, "route": RouteRequest}
#: A request's name in a model server's metrics (``kind``): the query it asks.
_REQUEST_KINDS: dict[type, str] = {**{t: q for q, t in QUERIES.items()},
                                   LabelContext: "context",
                                   PoolVelocityRequest: "pool_velocity"}


def request_kind(message: object) -> str:
    """What ``message`` asks, as metrics name it (``velocity``, ``context``, ...)."""
    return _REQUEST_KINDS[type(message)]


@dataclass(frozen=True)
class Limits:
    """What a server accepts, checked while decoding a request.

    ``max_body_bytes`` is checked before parsing, ``max_batch`` and ``max_steps`` before any
    tensor value is read. ``image_shape`` is the expected ``(C, H, W)`` (a latent's for a
    latent DDM's stages) and ``allowed_labels`` the classes this expert serves (any iterable of
    ints); ``None`` accepts any. ``text_width`` is the width ``D`` a context's embeddings must
    have; contexts have at most ``max_context_rows`` rows of ``max_text_tokens`` tokens, an
    encode request ``max_prompts`` prompts of ``max_prompt_bytes`` UTF-8 bytes each, a pool
    velocity request ``max_batch`` rows in all (so at most that many calls). Left out,
    each is the most any of our servers may be set to take (a client decoding a reply accepts
    whatever a valid server sends); a server passes its own.
    """

    max_batch: int = MAX_BATCH
    max_body_bytes: int = MAX_CONTEXT_BODY_BYTES
    max_steps: int = MAX_STEPS
    image_shape: tuple[int, int, int] | None = None
    allowed_labels: frozenset[int] | None = None
    text_width: int | None = None
    max_context_rows: int = MAX_CONTEXT_ROWS
    max_text_tokens: int = MAX_TEXT_TOKENS
    max_prompts: int = MAX_PROMPTS
    max_prompt_bytes: int = MAX_PROMPT_BYTES

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_body_bytes", "max_steps", "max_context_rows",
                     "max_text_tokens", "max_prompts", "max_prompt_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive integer, got {value!r}")
        if self.image_shape is not None:
            shape = tuple(int(d) for d in self.image_shape)
            if len(shape) != 3 or min(shape) < 1:
                raise ValueError(f"Limits.image_shape must be a positive (C, H, W), got {shape}")
            object.__setattr__(self, "image_shape", shape)
        if self.allowed_labels is not None:
            object.__setattr__(self, "allowed_labels",
                               frozenset(int(c) for c in self.allowed_labels))


# ---------------------------------------------------------------------------------- encoding


def _solver(solver: int) -> Solver:
    try:
        return Solver(solver)
    except ValueError:
        raise ProtocolError(f"unknown solver {solver!r}") from None


def _id_tensor(context: bytes) -> np.ndarray:
    if len(context) != CONTEXT_ID_BYTES:
        raise ProtocolError(f"a context id is {CONTEXT_ID_BYTES} bytes, got {len(context)}")
    return np.frombuffer(context, _U8)


def encode_request(request: Context | LabelContext | VelocityRequest | IntegrateRequest
                   | EncodeRequest | DecodeRequest | RouteRequest) -> bytes:
    """The body of a request other than a pool's (a context's ``id`` is not sent: the receiver
    computes it, :func:`context_id`). Other dtypes are cast to the wire dtype (float32 images
    and times, int32 rows) where NumPy's ``same_kind`` rule allows; values are the server's to
    check."""
    if isinstance(request, Context):
        return _encode(_Kind.CONTEXT, request.request_id, 0,
                       (request.embeddings, request.mask, request.negative))
    if isinstance(request, LabelContext):
        return _encode(_Kind.LABEL_CONTEXT, request.request_id, 0, (request.labels,))
    if isinstance(request, VelocityRequest):
        return _encode(_Kind.VELOCITY, request.request_id, 0,
                       (request.x, request.t, _id_tensor(request.context), request.rows,
                        request.guidance))
    if isinstance(request, IntegrateRequest):
        return _encode(_Kind.INTEGRATE, request.request_id, _solver(request.solver),
                       (request.x, _id_tensor(request.context), request.rows, request.guidance,
                        request.grid))
    if isinstance(request, EncodeRequest):
        texts = [p.encode("utf-8") for p in request.prompts]
        return _encode(_Kind.ENCODE, request.request_id, 0,
                       (np.frombuffer(b"".join(texts), _U8),
                        np.array([len(t) for t in texts], _I32)))
    if isinstance(request, DecodeRequest):
        return _encode(_Kind.DECODE, request.request_id, 0, (request.x,))
    if isinstance(request, RouteRequest):
        return _encode(_Kind.ROUTE, request.request_id, 0,
                       (request.x, request.t, request.pooled))
    raise TypeError(f"not a request: {type(request).__name__}")


def encode_pool_request(request: PoolVelocityRequest) -> bytes:
    """The body of a pool velocity request (version 3): the calls' rows one after the
    other, with each call's member name, row count and context id."""
    if not request.calls:
        raise ProtocolError("a pool velocity request carries at least one call")
    names = [name.encode("utf-8") for name, _ in request.calls]
    calls = [call for _, call in request.calls]
    return _encode(_Kind.POOL_VELOCITY, request.request_id, 0, (
        np.concatenate([np.asarray(c.x, _F32) for c in calls]),
        np.concatenate([np.asarray(c.t, _F32) for c in calls]),
        np.concatenate([np.asarray(c.rows, _I32) for c in calls]),
        np.concatenate([np.asarray(c.guidance, _F32) for c in calls]),
        np.stack([_id_tensor(c.context) for c in calls]),
        np.frombuffer(b"".join(names), _U8), np.array([len(n) for n in names], _I32),
        np.array([c.x.shape[0] for c in calls], _I32)))


def context_id(body: bytes | bytearray | memoryview) -> bytes:
    """The id of an encoded :class:`Context` or :class:`LabelContext`: SHA-256 of its bytes
    after the fixed header (descriptors and tensors; the request id is left out)."""
    return hashlib.sha256(_byte_view(body)[_FIXED.size:]).digest()


def encode_context_ack(request_id: int, context: bytes) -> bytes:
    """The reply to a context: its id, as the expert computed it."""
    return _encode(_Kind.CONTEXT_ACK, request_id, 0, (_id_tensor(context),))


def encode_encoded(request_id: int, encoded: EncodedPrompts) -> bytes:
    """The reply to an encode request: the embeddings in their own float dtype, the mask as
    uint8 (every token counts where there is none) and the cuts as int32."""
    cond = encoded.cond
    assert cond.embeddings is not None, "EncodedPrompts holds text conditioning"
    mask = np.ones(cond.embeddings.shape[:2], _U8) if cond.mask is None else cond.mask
    _check_output("embeddings", cond.embeddings)
    return _encode(_Kind.ENCODED, request_id, 0, (cond.embeddings, np.asarray(mask, _U8),
                                                  np.asarray(encoded.tokens_cut, _I32),
                                                  np.asarray(encoded.unknown, _I32)))


def encode_probabilities(request_id: int, probs: np.ndarray) -> bytes:
    """The reply to a route request: ``probs`` (B, K) float32."""
    _check_output("probs", probs)
    return _encode(_Kind.PROBABILITIES, request_id, 0, (probs,))


def encode_pool_response(request: PoolVelocityRequest,
                         results: Sequence[np.ndarray | MemberError]) -> bytes:
    """The reply to a pool velocity request: each call's output rows, in ``request.calls``'
    order, or its error. An output that is not finite becomes that call's 422, as
    :func:`encode_response` refuses it; outputs travel in their own dtype where every call's
    is the same, else as float32; a failed call's rows are zeros."""
    assert len(results) == len(request.calls), "one result per call"
    checked: list[np.ndarray | MemberError] = []
    for (name, call), result in zip(request.calls, results):
        if not isinstance(result, MemberError):
            assert result.shape == call.x.shape, f"member {name}'s output is {result.shape}"
            try:
                _check_output("out", result)
            except ProtocolError as error:
                result = MemberError(error.status, f"member {name}: {error}")
        checked.append(result)
    dtypes = {r.dtype for r in checked if not isinstance(r, MemberError)}
    dtype = dtypes.pop() if len(dtypes) == 1 else _F32
    messages = [_message_bytes(r.message) if isinstance(r, MemberError) else b""
                for r in checked]
    return _encode(_Kind.POOL_RESPONSE, request.request_id, 0, (
        np.concatenate([np.zeros(call.x.shape, dtype) if isinstance(r, MemberError)
                        else np.asarray(r, dtype) for (_, call), r in zip(request.calls,
                                                                          checked)]),
        np.array([r.code if isinstance(r, MemberError) else 200 for r in checked], _I32),
        np.frombuffer(b"".join(messages), _U8), np.array([len(m) for m in messages], _I32)))


def encode_response(request_id: int, out: np.ndarray) -> bytes:
    """The reply to a request: ``out`` (B, C, H, W) is the velocity for a velocity request,
    the state at ``grid[-1]`` for an integrate request, the images for a decode request;
    float16 and bfloat16 are sent as they are, to halve it."""
    _check_output("out", out)
    return _encode(_Kind.RESPONSE, request_id, 0, (out,))


def _check_output(name: str, values: np.ndarray) -> None:
    """A model's output is sent only if finite (a caller refuses anything else as a malformed
    reply, the replica's fault): a request whose own values make it overflow, in the model
    or in the wire dtype, is refused instead, that request's 422, so that no request can make
    a sound replica look broken."""
    if not np.isfinite(values).all():
        raise ProtocolError(f"the model's '{name}' for this request is not finite (in "
                            f"{np.asarray(values).dtype}): its inputs are beyond what the "
                            "model computes", 422)


def max_reply_bytes(shape: tuple[int, ...]) -> int:
    """The size of a float32 response whose ``out`` has ``shape`` (B, C, H, W): the largest
    valid answer to a request whose ``x`` has that shape (float16 is half the data)."""
    return _aligned(_FIXED.size + _DESCRIPTOR.size + 4 * len(shape)) + 4 * math.prod(shape)


def max_pool_reply_bytes(shape: tuple[int, ...], calls: int) -> int:
    """The size of the largest valid reply to a pool request of ``calls`` calls whose
    ``x`` has ``shape`` (B, C, H, W): float32 rows, and an error message per call."""
    header = _FIXED.size + len(_SCHEMAS[_Kind.POOL_RESPONSE]) * _DESCRIPTOR.size + 4 * (4 + 3)
    return (_aligned(header) + _aligned(4 * math.prod(shape)) + 2 * _aligned(4 * calls)
            + _aligned(calls * MAX_ERROR_MESSAGE_BYTES))


def max_error_reply_bytes() -> int:
    """The size of the largest error reply: its header and a message cut to
    :data:`MAX_ERROR_MESSAGE_BYTES`."""
    return _aligned(_FIXED.size + _DESCRIPTOR.size + 4) + MAX_ERROR_MESSAGE_BYTES


def encode_error(request_id: int, code: int, message: str) -> bytes:
    """An error reply; ``code`` is an HTTP status (e.g. ``ProtocolError.status``, 500, 503)."""
    if not 0 <= code <= _MAX_U16:
        raise ProtocolError(f"error code {code} does not fit in u16")
    return _encode(_Kind.ERROR, request_id, code, (np.frombuffer(_message_bytes(message), _U8),))


def _message_bytes(message: str) -> bytes:
    """An error text's UTF-8, cut to :data:`MAX_ERROR_MESSAGE_BYTES` (cutting may split the
    last character; "ignore" drops the piece)."""
    text = message.encode("utf-8")[:MAX_ERROR_MESSAGE_BYTES].decode("utf-8", "ignore")
    return text.encode("utf-8")


def _encode(kind: _Kind, request_id: int, param: int, values: tuple[np.ndarray, ...]) -> bytes:
    if not 0 <= request_id <= _MAX_U64:
        raise ProtocolError(f"request id {request_id} does not fit in u64")
    arrays = [_to_wire(value, spec) for value, spec in zip(values, _SCHEMAS[kind])]
    gaps = _header_gaps(kind, tuple((array.dtype, array.shape) for array in arrays))
    parts: list[bytes | np.ndarray] = [
        _FIXED.pack(MAGIC, _VERSIONS[kind], kind, 0, len(arrays), request_id, param)]
    for gap, array in zip(gaps, arrays):
        parts += [gap, array]
    return b"".join(parts)


@functools.lru_cache(maxsize=_SHAPES_REMEMBERED)
def _header_gaps(kind: _Kind, tensors: tuple[tuple[np.dtype, tuple[int, ...]], ...]
                 ) -> tuple[bytes, ...]:
    """What goes before each tensor's data: the descriptors and their padding before the
    first, padding before the others. Cached, since a caller sends the same shapes at every
    step."""
    header = b"".join(_DESCRIPTOR.pack(_NAME_CODES[spec.name], _DTYPE_CODES[dtype], len(shape))
                      + struct.pack(f"<{len(shape)}I", *shape)
                      for spec, (dtype, shape) in zip(_SCHEMAS[kind], tensors))
    offset = _FIXED.size + len(header)
    gaps = []
    for dtype, shape in tensors:
        start = _aligned(offset)
        gaps.append(bytes(start - offset))
        offset = start + math.prod(shape) * dtype.itemsize
    return (header + gaps[0], *gaps[1:])


def _to_wire(value: np.ndarray, spec: _Spec) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype not in spec.dtypes:
        try:
            array = array.astype(spec.dtypes[0], casting="same_kind")
        except TypeError:
            raise ProtocolError(f"cannot send {array.dtype} as '{spec.name}' "
                                f"(wire dtypes: {_dtype_names(spec)})") from None
    if array.ndim != spec.ndim:
        raise ProtocolError(f"'{spec.name}' must have {spec.ndim} dimensions, "
                            f"got shape {array.shape}")
    return np.ascontiguousarray(array)


# ---------------------------------------------------------------------------------- decoding


def decode_request(body: bytes | bytearray | memoryview, limits: Limits) -> Request:
    """Parse and validate a request body; raises :class:`ProtocolError` on anything wrong.

    The arrays are read-only views into ``body`` (no copy): keep ``body`` alive as long as
    they are used, and copy them before writing.
    """
    view = _byte_view(body)
    if view.nbytes > limits.max_body_bytes:
        raise ProtocolError(f"body of {view.nbytes} bytes exceeds the limit of "
                            f"{limits.max_body_bytes}", 413)
    kind, flags, count, request_id, param = _read_fixed(view)
    try:
        kind = _check_kind(kind, flags, count, _REQUESTS, _version(view))
        tensors = _read_tensors(view, kind)
        if kind is _Kind.CONTEXT:
            return _check_context(request_id, param, tensors, limits, context_id(view))
        if kind is _Kind.LABEL_CONTEXT:
            return _check_label_context(request_id, param, tensors, limits, context_id(view))
        if kind is _Kind.ENCODE:
            return _check_encode(request_id, param, tensors, limits)
        return _CHECKS[kind](request_id, param, tensors, limits)
    except ProtocolError as err:
        err.request_id = request_id
        raise


def decode_response(body: bytes | bytearray | memoryview, expected_request_id: int,
                    expected_shape: tuple[int, ...] | None = None) -> np.ndarray:
    """The ``out`` tensor of a reply (B, C, H, W), float32, float16 or bfloat16 as sent,
    read-only.

    Raises :class:`RemoteExpertError` for an error reply, and :class:`ProtocolError` for a
    malformed one, another request's reply, a shape other than ``expected_shape`` or
    non-finite values, so that a caller can retry elsewhere.
    """
    (tensor,) = _read_reply(body, expected_request_id, _Kind.RESPONSE)
    if expected_shape is not None and tensor.shape != tuple(expected_shape):
        raise ProtocolError(f"'out' has shape {tensor.shape}, expected {tuple(expected_shape)}",
                            422)
    if not np.isfinite(tensor).all():
        raise ProtocolError("'out' has non-finite values", 422)
    return tensor


def decode_pool_response(body: bytes | bytearray | memoryview, request: PoolVelocityRequest
                         ) -> list[np.ndarray | RemoteExpertError]:
    """A pool server's reply to ``request``: per call, in ``request.calls``' order, its
    output rows (read-only views, float32, float16 or bfloat16 as sent) or the
    :class:`RemoteExpertError` its member's own route would have raised. An error reply for
    the whole request raises :class:`RemoteExpertError`; a malformed reply (shapes other than
    the request's, a non-finite output, codes that are not 200 or an HTTP error status)
    :class:`ProtocolError`, as :func:`decode_response`."""
    out, codes, message, lengths = _read_reply(body, request.request_id, _Kind.POOL_RESPONSE)
    calls = [call for _, call in request.calls]
    shape = (sum(c.x.shape[0] for c in calls), *calls[0].x.shape[1:])
    if out.shape != shape or codes.shape != (len(calls),) or lengths.shape != (len(calls),):
        raise ProtocolError(f"a pool response for {len(calls)} calls of {shape} has 'out' "
                            f"{out.shape}, 'codes' {codes.shape}, 'lengths' {lengths.shape}",
                            422)
    if (lengths < 0).any() or int(lengths.astype(np.int64).sum()) != message.shape[0]:
        raise ProtocolError(f"'lengths' must be non-negative and sum to the "
                            f"{message.shape[0]} bytes of 'message'", 422)
    results: list[np.ndarray | RemoteExpertError] = []
    start = at = 0
    for (name, call), code, length in zip(request.calls, codes.tolist(), lengths.tolist()):
        rows, text = out[start:start + call.x.shape[0]], message[at:at + length]
        start, at = start + call.x.shape[0], at + length
        if code == 200 and not length and np.isfinite(rows).all():
            results.append(rows)
        elif 400 <= code <= 599:
            results.append(RemoteExpertError(code, text.tobytes().decode("utf-8", "replace"),
                                             request.request_id))
        else:
            raise ProtocolError(f"member {name}'s answer is code {code} with a {length}-byte "
                                "message: neither finite rows with 200 nor an error status",
                                422)
    return results


def decode_context_ack(body: bytes | bytearray | memoryview, expected_request_id: int) -> bytes:
    """The context id an expert acknowledged; errors as :func:`decode_response`."""
    (context,) = _read_reply(body, expected_request_id, _Kind.CONTEXT_ACK)
    if context.shape != (CONTEXT_ID_BYTES,):
        raise ProtocolError(f"a context id is {CONTEXT_ID_BYTES} bytes, got {context.shape[0]}",
                            422)
    return context.tobytes()


def decode_encoded(body: bytes | bytearray | memoryview, expected_request_id: int,
                   prompts: int, limits: Limits) -> EncodedPrompts:
    """A text encoder's reply for ``prompts`` prompts: (P, L, D) embeddings with L and D
    within ``limits`` (``text_width`` when set), a 0/1 mask, cuts >= 0, finite values; read
    into float32 embeddings and int64 mask and cuts (copies, not views of ``body``)."""
    embeddings, mask, cut, unknown = _read_reply(body, expected_request_id, _Kind.ENCODED)
    rows, tokens, width = embeddings.shape
    if rows != prompts or mask.shape != (rows, tokens) or cut.shape != (rows,) or (
            unknown.shape[1:] != (3,)):
        raise ProtocolError(f"an encode reply for {prompts} prompts has embeddings "
                            f"{embeddings.shape}, mask {mask.shape}, cut {cut.shape}, "
                            f"unknown {unknown.shape}", 422)
    _check_text_shape("embeddings", tokens, width, limits)
    if not ((mask <= 1).all() and (cut >= 0).all() and np.isfinite(embeddings).all()):
        raise ProtocolError("an encode reply's mask must be 0/1, its cut >= 0, its "
                            "embeddings finite", 422)
    if not ((unknown[:, 0] >= 0).all() and (unknown[:, 0] < rows).all()
            and (unknown[:, 1] >= 0).all() and (unknown[:, 1] < unknown[:, 2]).all()
            and (unknown[:, 2] <= MAX_PROMPT_BYTES).all()):
        raise ProtocolError(f"an encode reply's unknown words must be (prompt < {rows}, "
                            f"start, end) with 0 <= start < end <= {MAX_PROMPT_BYTES}", 422)
    return EncodedPrompts(Conditioning(embeddings=embeddings.astype(np.float32),
                                       mask=mask.astype(np.int64)), cut.astype(np.int64),
                          unknown.astype(np.int64))


def decode_probabilities(body: bytes | bytearray | memoryview, expected_request_id: int,
                         rows: int, clusters: int | None) -> np.ndarray:
    """A router network's reply: (rows, K) probabilities (K = ``clusters`` when given), each
    row non-negative and summing to 1 within float32 rounding."""
    (probs,) = _read_reply(body, expected_request_id, _Kind.PROBABILITIES)
    if probs.shape[0] != rows or (clusters is not None and probs.shape[1] != clusters):
        raise ProtocolError(f"'probs' has shape {probs.shape}, expected ({rows}, "
                            f"{clusters if clusters is not None else 'K'})", 422)
    if not (np.isfinite(probs).all() and (probs >= 0).all()
            and np.allclose(probs.sum(axis=1), 1.0, atol=1e-3)):
        raise ProtocolError("'probs' rows must be finite, non-negative and sum to 1", 422)
    return probs


def _read_reply(body: bytes | bytearray | memoryview, expected_request_id: int,
                kind: _Kind) -> list[np.ndarray]:
    """The tensors of a reply of ``kind``; an error reply raises :class:`RemoteExpertError`."""
    view = _byte_view(body)
    code, flags, count, request_id, param = _read_fixed(view)
    found = _check_kind(code, flags, count, (kind, _Kind.ERROR), _version(view))
    tensors = _read_tensors(view, found)
    if found is _Kind.ERROR:
        # 0 means the expert could not read the request's id.
        if request_id not in (expected_request_id, 0):
            raise ProtocolError(f"error reply is for request {request_id}, "
                                f"expected {expected_request_id}")
        raise RemoteExpertError(param, tensors[0].tobytes().decode("utf-8", "replace"),
                                request_id)
    if request_id != expected_request_id:
        raise ProtocolError(f"reply is for request {request_id}, expected {expected_request_id}")
    _check_param_zero(param, found)
    return tensors


def _byte_view(body: bytes | bytearray | memoryview) -> memoryview:
    """Read-only, so that views of a ``bytearray`` body are read-only too."""
    return memoryview(body).toreadonly().cast("B")


def _read_fixed(view: memoryview) -> tuple[int, int, int, int, int]:
    """(kind, flags, count, request id, param) once magic and version say the rest is ours."""
    if view.nbytes < _FIXED.size:
        raise ProtocolError(f"truncated header: {view.nbytes} bytes, "
                            f"the fixed part alone is {_FIXED.size}")
    magic, version, kind, flags, count, request_id, param = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version not in (VERSION, VERSION_TEXT, VERSION_POOL, VERSION_LABELS):
        raise ProtocolError(f"unsupported protocol version {version}; this build speaks "
                            f"{VERSION}, {VERSION_TEXT}, {VERSION_POOL} and {VERSION_LABELS}")
    return kind, flags, count, request_id, param


def _version(view: memoryview) -> int:
    return view[4]


def _check_kind(code: int, flags: int, count: int, kinds: tuple[_Kind, ...],
                version: int) -> _Kind:
    kind = _KIND_CODES.get(code)
    if kind is None:
        raise ProtocolError(f"unknown message kind {code}")
    if _VERSIONS[kind] != version:
        raise ProtocolError(f"{_KIND_NAMES[kind]} is a version {_VERSIONS[kind]} message, "
                            f"sent as version {version}")
    if kind not in kinds:
        raise ProtocolError(f"{_KIND_NAMES[kind]} is not expected here "
                            f"(want {' or '.join(_KIND_NAMES[k] for k in kinds)})")
    if flags:
        raise ProtocolError(f"reserved flags must be 0, got {flags:#04x}")
    expected = len(_SCHEMAS[kind])
    if count != expected:
        raise ProtocolError(f"{_KIND_NAMES[kind]} carries {expected} tensors, got {count}")
    return kind


@dataclass(frozen=True)
class _Placed:
    """Where one tensor of a well-formed body lies."""

    dtype: np.dtype
    dims: tuple[int, ...]
    start: int


@dataclass(frozen=True)
class _Layout:
    """A well-formed body's tensors and the padding before each (which must be zero)."""

    tensors: tuple[_Placed, ...]
    padding: tuple[tuple[int, int], ...]


#: Bytes from a kind's first descriptor to its last dims, when every rank is the schema's.
_DESCRIPTORS_END = {kind: _FIXED.size + sum(_DESCRIPTOR.size + 4 * spec.ndim for spec in specs)
                    for kind, specs in _SCHEMAS.items()}
#: Layouts of bodies decoded before, by (kind, descriptor bytes, body size): a sampling loop
#: sends the same shapes at every step, so a request is laid out once and then only its
#: padding is checked.
_KNOWN_LAYOUTS: dict[tuple[_Kind, bytes, int], _Layout] = {}
#: Held to change :data:`_KNOWN_LAYOUTS` (reads need no lock: a dict lookup is atomic).
_LAYOUTS_WRITE = threading.Lock()


def _read_tensors(view: memoryview, kind: _Kind) -> list[np.ndarray]:
    """The tensors as views of the body: its layout as read before, when its header and size
    are a known body's and its padding is zero; else read and checked by :func:`_read_layout`.
    """
    key = (kind, bytes(view[_FIXED.size:_DESCRIPTORS_END[kind]]), view.nbytes)
    layout = _KNOWN_LAYOUTS.get(key)
    if layout is None or any(any(view[start:end]) for start, end in layout.padding):
        layout = _read_layout(view, kind)
        with _LAYOUTS_WRITE:  # servers may decode on several threads
            if len(_KNOWN_LAYOUTS) >= _SHAPES_REMEMBERED:
                del _KNOWN_LAYOUTS[next(iter(_KNOWN_LAYOUTS))]  # the oldest
            _KNOWN_LAYOUTS[key] = layout
    return [np.ndarray(placed.dims, placed.dtype, view, placed.start)
            for placed in layout.tensors]


def _read_layout(view: memoryview, kind: _Kind) -> _Layout:
    """Descriptors, then data: every size is checked against the body before any view; a
    body that is not well formed raises :class:`ProtocolError` (400, or 422 for a dtype or
    rank we decode but do not accept)."""
    size = view.nbytes
    offset = _FIXED.size
    layouts: list[tuple[_Spec, np.dtype, tuple[int, ...]]] = []
    refused: str | None = None  # a dtype or rank we decode but do not accept: 422, after 400s
    for index, spec in enumerate(_SCHEMAS[kind]):
        if offset + _DESCRIPTOR.size > size:
            raise ProtocolError(f"truncated header: descriptor of '{spec.name}' is cut off")
        name_code, dtype_code, ndim = _DESCRIPTOR.unpack_from(view, offset)
        name = _NAMES.get(name_code)
        if name is None:
            raise ProtocolError(f"unknown tensor name code {name_code}")
        if name != spec.name:
            raise ProtocolError(f"tensor {index} of {_KIND_NAMES[kind]} must be "
                                f"'{spec.name}', got '{name}'")
        dtype = _DTYPES.get(dtype_code)
        if dtype is None:
            raise ProtocolError(f"unknown dtype code {dtype_code} for '{name}'")
        if dtype not in spec.dtypes:
            refused = refused or (f"dtype {dtype.name} is not allowed for '{name}' "
                                  f"(allowed: {_dtype_names(spec)})")
        if ndim != spec.ndim:
            refused = refused or f"'{name}' must have {spec.ndim} dimensions, got {ndim}"
        offset += _DESCRIPTOR.size
        if offset + 4 * ndim > size:
            raise ProtocolError(f"truncated header: dims of '{name}' are cut off")
        layouts.append((spec, dtype, struct.unpack_from(f"<{ndim}I", view, offset)))
        offset += 4 * ndim

    placed, padding = [], []
    for spec, dtype, dims in layouts:
        start = _aligned(offset)
        if start > size:
            raise ProtocolError(f"truncated tensor data: '{spec.name}' would start at byte "
                                f"{start}, the body has {size}")
        if any(view[offset:start]):
            raise ProtocolError(f"padding before '{spec.name}' is not zero")
        nbytes = math.prod(dims) * dtype.itemsize  # exact: Python ints do not overflow
        if nbytes > size - start:
            raise ProtocolError(f"truncated tensor data: '{spec.name}' {dims} needs {nbytes} "
                                f"bytes at offset {start}, the body has {size - start} left")
        try:
            np.ndarray(dims, dtype, view, start)
        except ValueError:  # e.g. (2**32 - 1, 2**32 - 1, 0, 0): no bytes, yet too big for NumPy
            raise ProtocolError(f"'{spec.name}' dims {dims} describe no array NumPy can hold "
                                "(more than 64 dimensions, or sizes overflowing its index)"
                                ) from None
        placed.append(_Placed(dtype, dims, start))
        if start > offset:
            padding.append((offset, start))
        offset = start + nbytes
    if offset != size:
        raise ProtocolError(f"{size - offset} trailing bytes after the last tensor")
    if refused is not None:
        raise ProtocolError(refused, 422)
    return _Layout(tuple(placed), tuple(padding))


def _check_grid(param: int, grid: np.ndarray, limits: Limits) -> Solver:
    """The solver ``param`` names; the grid's size and times checked."""
    try:
        solver = Solver(param)
    except ValueError:
        raise ProtocolError(f"unknown solver code {param} (known: "
                            f"{', '.join(f'{s.value} {s.name.lower()}' for s in Solver)})",
                            422) from None
    steps = grid.shape[0] - 1
    if steps < 1:
        raise ProtocolError(f"'grid' needs at least 2 times, got {grid.shape[0]}", 422)
    if steps > limits.max_steps:
        raise ProtocolError(f"'grid' has {steps} steps, the limit is {limits.max_steps}", 422)
    times = _check_times("grid", grid)
    if not all(a < b for a, b in zip(times, times[1:])):
        raise ProtocolError("'grid' must be strictly increasing", 422)
    return solver


def _check_context(request_id: int, param: int, tensors: list[np.ndarray], limits: Limits,
                   identity: bytes) -> Context:
    embeddings, mask, negative = tensors
    _check_param_zero(param, _Kind.CONTEXT)
    rows, tokens, width = embeddings.shape
    if not 1 <= rows <= limits.max_context_rows:
        raise ProtocolError(f"a context holds 1 to {limits.max_context_rows} rows, got {rows}",
                            422)
    _check_text_shape("embeddings", tokens, width, limits)
    if mask.shape != (rows, tokens):
        raise ProtocolError(f"'mask' has shape {mask.shape}, the embeddings' (N, L) is "
                            f"{(rows, tokens)}", 422)
    if negative.shape not in ((rows, tokens, width), (0, tokens, width)):
        raise ProtocolError(f"'negative' has shape {negative.shape}; expected {embeddings.shape}"
                            f" or (0, {tokens}, {width}) (no guided rows)", 422)
    if not (mask <= 1).all():
        raise ProtocolError("'mask' holds values other than 0 and 1", 422)
    if not (np.isfinite(embeddings).all() and np.isfinite(negative).all()):
        raise ProtocolError("a context's embeddings have non-finite values", 422)
    return Context(request_id, embeddings, mask, negative, identity)


def _check_label_context(request_id: int, param: int, tensors: list[np.ndarray],
                         limits: Limits, identity: bytes) -> LabelContext:
    (labels,) = tensors
    _check_param_zero(param, _Kind.LABEL_CONTEXT)
    rows = labels.shape[0]
    if not 1 <= rows <= limits.max_context_rows:
        raise ProtocolError(f"a context holds 1 to {limits.max_context_rows} rows, got {rows}",
                            422)
    if not ((labels >= 0).all() and (labels <= MAX_CLASS).all()):
        raise ProtocolError(f"'labels' must be class labels in 0..{MAX_CLASS}", 422)
    return LabelContext(request_id, labels, identity)


def _check_text_shape(name: str, tokens: int, width: int, limits: Limits) -> None:
    if not 1 <= tokens <= limits.max_text_tokens:
        raise ProtocolError(f"'{name}' has {tokens} tokens per row; the limit is "
                            f"{limits.max_text_tokens}", 422)
    expected = limits.text_width
    if (expected is not None and width != expected) or not 1 <= width <= MAX_TEXT_WIDTH:
        raise ProtocolError(f"'{name}' are {width} wide; this stage takes "
                            f"{expected if expected is not None else f'at most {MAX_TEXT_WIDTH}'}",
                            422)


def _check_text_rows(context: np.ndarray, rows: np.ndarray, guidance: np.ndarray) -> bytes:
    """The context id; rows >= 0 (the expert checks them against the context), guidance
    finite in [0, MAX_GUIDANCE_SCALE]."""
    if context.shape != (CONTEXT_ID_BYTES,):
        raise ProtocolError(f"'context' must be a {CONTEXT_ID_BYTES}-byte id, got "
                            f"{context.shape[0]} bytes", 422)
    _check_rows_guidance(rows, guidance)
    return context.tobytes()


def _check_rows_guidance(rows: np.ndarray, guidance: np.ndarray) -> None:
    if rows.size and rows.min() < 0:
        raise ProtocolError("'rows' must be non-negative", 422)
    if not all(0.0 <= g <= MAX_GUIDANCE_SCALE for g in guidance.tolist()):
        raise ProtocolError(f"'guidance' must be finite and in [0, {MAX_GUIDANCE_SCALE}]", 422)


def _check_velocity(request_id: int, param: int, tensors: list[np.ndarray],
                    limits: Limits) -> VelocityRequest:
    x, t, context, rows, guidance = tensors
    _check_param_zero(param, _Kind.VELOCITY)
    _check_batch(x, {"t": t, "rows": rows, "guidance": guidance}, limits)
    _check_times("t", t)
    identity = _check_text_rows(context, rows, guidance)
    _check_image(x, limits)
    return VelocityRequest(request_id, x, t, identity, rows, guidance)


def _check_integrate(request_id: int, param: int, tensors: list[np.ndarray],
                     limits: Limits) -> IntegrateRequest:
    x, context, rows, guidance, grid = tensors
    _check_batch(x, {"rows": rows, "guidance": guidance}, limits)
    solver = _check_grid(param, grid, limits)
    identity = _check_text_rows(context, rows, guidance)
    _check_image(x, limits)
    return IntegrateRequest(request_id, x, identity, rows, guidance, grid, solver)


def _check_encode(request_id: int, param: int, tensors: list[np.ndarray],
                  limits: Limits) -> EncodeRequest:
    text, lengths = tensors
    _check_param_zero(param, _Kind.ENCODE)
    if int(lengths.astype(np.int64).sum()) != text.shape[0] or (lengths < 0).any():
        raise ProtocolError(f"'lengths' must be non-negative and sum to the {text.shape[0]} "
                            "bytes of 'text'")
    if not 1 <= lengths.shape[0] <= limits.max_prompts:
        raise ProtocolError(f"an encode request holds 1 to {limits.max_prompts} prompts, got "
                            f"{lengths.shape[0]}", 422)
    ends = np.cumsum(lengths.astype(np.int64)).tolist()
    prompts = []
    for index, (start, end) in enumerate(zip([0, *ends], ends)):
        if end - start > limits.max_prompt_bytes:
            raise ProtocolError(f"prompt {index} is {end - start} bytes; the limit is "
                                f"{limits.max_prompt_bytes}", 422)
        try:
            prompts.append(text[start:end].tobytes().decode("utf-8"))
        except UnicodeDecodeError:
            raise ProtocolError(f"prompt {index} is not valid UTF-8", 422) from None
    return EncodeRequest(request_id, tuple(prompts))


def _check_decode(request_id: int, param: int, tensors: list[np.ndarray],
                  limits: Limits) -> DecodeRequest:
    (x,) = tensors
    _check_param_zero(param, _Kind.DECODE)
    _check_batch(x, {}, limits)
    _check_image(x, limits)
    return DecodeRequest(request_id, x)


def _check_route(request_id: int, param: int, tensors: list[np.ndarray],
                 limits: Limits) -> RouteRequest:
    x, t, pooled = tensors
    _check_param_zero(param, _Kind.ROUTE)
    _check_batch(x, {"t": t, "pooled": pooled}, limits)
    _check_times("t", t)
    _check_image(x, limits)
    if pooled.shape[1] > MAX_TEXT_WIDTH or not np.isfinite(pooled).all():
        raise ProtocolError(f"'pooled' must be finite and at most {MAX_TEXT_WIDTH} wide, got "
                            f"width {pooled.shape[1]}", 422)
    return RouteRequest(request_id, x, t, pooled)


def _check_pool_velocity(request_id: int, param: int, tensors: list[np.ndarray],
                         limits: Limits) -> PoolVelocityRequest:
    x, t, rows, guidance, contexts, members, lengths, counts = tensors
    _check_param_zero(param, _Kind.POOL_VELOCITY)
    count = lengths.shape[0]
    if not 1 <= count <= limits.max_batch:  # each call has a row at least
        raise ProtocolError(f"a pool velocity request carries 1 to {limits.max_batch} calls "
                            f"(one row each at least, max_batch {limits.max_batch} rows in "
                            f"all), got {count}", 422)
    if counts.shape != (count,) or contexts.shape != (count, CONTEXT_ID_BYTES):
        raise ProtocolError(f"{count} calls need {count} 'counts' and ({count}, "
                            f"{CONTEXT_ID_BYTES}) 'context', got {counts.shape[0]} and "
                            f"{contexts.shape}")
    if int(lengths.astype(np.int64).sum()) != members.shape[0] or (lengths < 1).any():
        raise ProtocolError(f"'lengths' must be positive and sum to the {members.shape[0]} "
                            "bytes of 'members'")
    if int(counts.astype(np.int64).sum()) != x.shape[0] or (counts < 0).any():
        raise ProtocolError(f"'counts' must be non-negative and sum to the {x.shape[0]} rows "
                            "of 'x'")
    _check_batch(x, {"t": t, "rows": rows, "guidance": guidance}, limits)
    _check_times("t", t)
    _check_rows_guidance(rows, guidance)
    _check_image(x, limits)
    names: list[str] = []
    ends = np.cumsum(lengths.astype(np.int64)).tolist()
    for start, end in zip([0, *ends], ends):
        try:
            name = members[start:end].tobytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"call {len(names)}'s member name is not valid UTF-8",
                                422) from None
        if end - start > MAX_MEMBER_NAME_BYTES:
            raise ProtocolError(f"member {name[:MAX_MEMBER_NAME_BYTES]!r} is longer than "
                                f"{MAX_MEMBER_NAME_BYTES} bytes", 422)
        names.append(name)
    calls, start = [], 0
    for index, (name, size) in enumerate(zip(names, counts.tolist())):
        if size == 0:
            raise ProtocolError(f"call {index} (member {name!r}) has no rows", 422)
        part = slice(start, start + size)
        start += size
        calls.append((name, VelocityRequest(request_id, x[part], t[part],
                                            contexts[index].tobytes(), rows[part],
                                            guidance[part])))
    return PoolVelocityRequest(request_id, tuple(calls))


def _check_param_zero(param: int, kind: _Kind) -> None:
    if param:
        raise ProtocolError(f"the parameter field of {_KIND_NAMES[kind]} must be 0, got {param}")


def _check_batch(x: np.ndarray, others: dict[str, np.ndarray], limits: Limits) -> None:
    batch = x.shape[0]
    if any(other.shape[0] != batch for other in others.values()):
        sizes = ", ".join(f"'{name}' {other.shape[0]}" for name, other in others.items())
        raise ProtocolError(f"batch mismatch: 'x' has {batch} rows, {sizes}")
    if batch == 0:
        raise ProtocolError("empty batch", 422)
    check_batch_size(batch, limits.max_batch)


def check_batch_size(batch: int, max_batch: int) -> None:
    """Refuse (422) a batch of more rows than ``max_batch``: a message's own, or a member's
    share of a pool request, whose limit is the pool's sum."""
    if batch > max_batch:
        raise ProtocolError(f"batch of {batch} exceeds the limit of {max_batch}", 422)


def _check_image(x: np.ndarray, limits: Limits) -> None:
    image = x.shape[1:]
    if limits.image_shape is not None and image != limits.image_shape:
        raise ProtocolError(f"'x' images are {image}, this expert serves {limits.image_shape}",
                            422)
    if min(image) == 0:
        raise ProtocolError(f"'x' images {image} are empty", 422)
    largest = float(np.abs(x).max())  # NaN if any is NaN, and NaN fails the comparison
    if not largest <= MAX_STATE_MAGNITUDE:
        raise ProtocolError("'x' has non-finite values" if not math.isfinite(largest) else
                            f"'x' has values beyond +-{MAX_STATE_MAGNITUDE:g} "
                            f"(MAX_STATE_MAGNITUDE): magnitude {largest:.3g}", 422)


def _check_times(name: str, times: np.ndarray) -> list[float]:
    """The times as Python floats: at these sizes a list beats NumPy's per-call overhead."""
    values = times.tolist()
    if not all(0.0 <= v <= 1.0 for v in values):  # NaN fails both comparisons
        raise ProtocolError(f"'{name}' must be finite and in [0, 1]", 422)
    return values


def check_labels(y: np.ndarray, limits: Limits) -> None:
    """Refuse (422) labels outside ``limits.allowed_labels`` (``None``: any)."""
    if limits.allowed_labels is None:
        return
    unknown = set(y.tolist()) - limits.allowed_labels
    if unknown:
        raise ProtocolError(f"labels {sorted(unknown)[:8]} are not served by this expert "
                            f"(serves {sorted(limits.allowed_labels)})", 422)


_CHECKS = {_Kind.VELOCITY: _check_velocity, _Kind.INTEGRATE: _check_integrate,
           _Kind.DECODE: _check_decode,
           _Kind.ROUTE: _check_route, _Kind.POOL_VELOCITY: _check_pool_velocity}


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def _dtype_names(spec: _Spec) -> str:
    return ", ".join(dtype.name for dtype in spec.dtypes)
