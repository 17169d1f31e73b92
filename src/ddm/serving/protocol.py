"""The router <-> expert wire format: raw little-endian tensors behind a small versioned header.

A router calls its experts at every sampler step, and with small models the encoding, not the
model, dominates latency. Bodies therefore carry the tensors' own bytes, decoded as read-only
NumPy views without copies, and are checked strictly so that a server can answer every bad body
with a precise 4xx before touching a model. This module is the one place that knows the layout;
``docs/protocol.md`` describes it byte by byte, with its codes and HTTP statuses.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from ddm.deploy.limits import MAX_STEPS

#: HTTP ``Content-Type`` of every body in this format.
CONTENT_TYPE = "application/x-ddm-tensor"
MAGIC = b"DDMT"
VERSION = 1
#: Every tensor's data starts at a multiple of this many bytes from the start of the body.
ALIGNMENT = 8
#: Error texts are cut to this many UTF-8 bytes so that an error reply stays small.
MAX_ERROR_MESSAGE_BYTES = 4096

# magic, version, kind, flags, tensor count, request id, kind-specific parameter.
_FIXED = struct.Struct("<4sBBBBQH")
# name code, dtype code, ndim; then ndim u32 dims.
_DESCRIPTOR = struct.Struct("<BBB")
_MAX_U64 = 2**64 - 1
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


class Solver(IntEnum):
    """ODE solvers an expert runs for multi-step delegation; the values are the wire codes."""

    EULER = 1
    HEUN = 2


class _Kind(IntEnum):
    VELOCITY = 1
    INTEGRATE = 2
    RESPONSE = 3
    ERROR = 4


# For error messages.
_KIND_NAMES = {_Kind.VELOCITY: "a velocity request", _Kind.INTEGRATE: "an integrate request",
               _Kind.RESPONSE: "a response", _Kind.ERROR: "an error reply"}
_REQUESTS = (_Kind.VELOCITY, _Kind.INTEGRATE)
_REPLIES = (_Kind.RESPONSE, _Kind.ERROR)

_F32, _F16 = np.dtype("<f4"), np.dtype("<f2")
_I32, _I64, _U8 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("u1")
# bfloat16 is left out: NumPy has no native bfloat16, and float16 already halves a reply.
_DTYPES = {1: _F32, 2: _F16, 3: _I32, 4: _I64, 5: _U8}
_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}
_NAMES = {1: "x", 2: "t", 3: "y", 4: "grid", 5: "out", 6: "message"}
_NAME_CODES = {name: code for code, name in _NAMES.items()}


@dataclass(frozen=True)
class _Spec:
    """One tensor slot of a message kind; encoders cast other dtypes to ``dtypes[0]``."""

    name: str
    ndim: int
    dtypes: tuple[np.dtype, ...]


# Each kind carries exactly these tensors, in this order.
_SCHEMAS: dict[_Kind, tuple[_Spec, ...]] = {
    _Kind.VELOCITY: (_Spec("x", 4, (_F32,)), _Spec("t", 1, (_F32,)), _Spec("y", 1, (_I64, _I32))),
    _Kind.INTEGRATE: (_Spec("x", 4, (_F32,)), _Spec("y", 1, (_I64, _I32)),
                      _Spec("grid", 1, (_F32,))),
    _Kind.RESPONSE: (_Spec("out", 4, (_F32, _F16)),),
    _Kind.ERROR: (_Spec("message", 1, (_U8,)),),
}


@dataclass(frozen=True, eq=False)
class VelocityRequest:
    """Ask for ``v(x, t, y)``: ``x`` (B, C, H, W) float32, ``t`` (B,) float32 in [0, 1],
    ``y`` (B,) int64 or int32 class labels. Decoded arrays are read-only views of the body."""

    request_id: int
    x: np.ndarray
    t: np.ndarray
    y: np.ndarray


@dataclass(frozen=True, eq=False)
class IntegrateRequest:
    """Ask the expert to integrate ``dx/dt = v(x, t, y)`` from ``grid[0]`` to ``grid[-1]``
    visiting every time of ``grid`` (S + 1,) float32 with ``solver``; ``x`` is the state at
    ``grid[0]``. Sending the grid, not a step count, keeps the expert on the router's times."""

    request_id: int
    x: np.ndarray
    y: np.ndarray
    grid: np.ndarray
    solver: Solver


@dataclass(frozen=True)
class Limits:
    """What a server accepts, checked while decoding a request.

    ``max_body_bytes`` is checked before parsing, ``max_batch`` and ``max_steps`` before any
    tensor value is read. ``image_shape`` is the expected ``(C, H, W)`` and ``allowed_labels``
    the classes this expert serves (any iterable of ints); ``None`` accepts any.
    """

    max_batch: int = 256
    max_body_bytes: int = 64 << 20
    max_steps: int = MAX_STEPS
    image_shape: tuple[int, int, int] | None = None
    allowed_labels: frozenset[int] | None = None

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_body_bytes", "max_steps"):
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


def encode_request(request: VelocityRequest | IntegrateRequest) -> bytes:
    """The body for a request. Other dtypes are cast to the wire dtype (float32 images and
    times, int64 labels) where NumPy's ``same_kind`` rule allows; values are the server's to
    check."""
    if isinstance(request, VelocityRequest):
        return _encode(_Kind.VELOCITY, request.request_id, 0, (request.x, request.t, request.y))
    if isinstance(request, IntegrateRequest):
        try:
            solver = Solver(request.solver)
        except ValueError:
            raise ProtocolError(f"unknown solver {request.solver!r}") from None
        return _encode(_Kind.INTEGRATE, request.request_id, solver,
                       (request.x, request.y, request.grid))
    raise TypeError(f"not a request: {type(request).__name__}")


def encode_response(request_id: int, out: np.ndarray) -> bytes:
    """The reply to a request: ``out`` (B, C, H, W) is the velocity for a velocity request or
    the state at ``grid[-1]`` for an integrate request; float16 is sent as is, to halve it."""
    return _encode(_Kind.RESPONSE, request_id, 0, (out,))


def max_reply_bytes(shape: tuple[int, ...]) -> int:
    """The size of a float32 response whose ``out`` has ``shape`` (B, C, H, W): the largest
    valid answer to a request whose ``x`` has that shape (float16 is half the data)."""
    return _aligned(_FIXED.size + _DESCRIPTOR.size + 4 * len(shape)) + 4 * math.prod(shape)


def max_error_reply_bytes() -> int:
    """The size of the largest error reply: its header and a message cut to
    :data:`MAX_ERROR_MESSAGE_BYTES`."""
    return _aligned(_FIXED.size + _DESCRIPTOR.size + 4) + MAX_ERROR_MESSAGE_BYTES


def encode_error(request_id: int, code: int, message: str) -> bytes:
    """An error reply; ``code`` is an HTTP status (e.g. ``ProtocolError.status``, 500, 503)."""
    if not 0 <= code <= _MAX_U16:
        raise ProtocolError(f"error code {code} does not fit in u16")
    # Cutting may split the last character; "ignore" drops the piece.
    text = message.encode("utf-8")[:MAX_ERROR_MESSAGE_BYTES].decode("utf-8", "ignore")
    return _encode(_Kind.ERROR, request_id, code, (np.frombuffer(text.encode("utf-8"), _U8),))


def _encode(kind: _Kind, request_id: int, param: int, values: tuple[np.ndarray, ...]) -> bytes:
    if not 0 <= request_id <= _MAX_U64:
        raise ProtocolError(f"request id {request_id} does not fit in u64")
    arrays = [_to_wire(value, spec) for value, spec in zip(values, _SCHEMAS[kind])]
    header = [_FIXED.pack(MAGIC, VERSION, kind, 0, len(arrays), request_id, param)]
    for spec, array in zip(_SCHEMAS[kind], arrays):
        header.append(_DESCRIPTOR.pack(_NAME_CODES[spec.name], _DTYPE_CODES[array.dtype],
                                       array.ndim))
        header.append(struct.pack(f"<{array.ndim}I", *array.shape))
    parts: list[bytes | np.ndarray] = [b"".join(header)]
    offset = len(parts[0])
    for array in arrays:
        start = _aligned(offset)
        parts += [bytes(start - offset), array]
        offset = start + array.nbytes
    return b"".join(parts)


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


def decode_request(body: bytes | bytearray | memoryview,
                   limits: Limits) -> VelocityRequest | IntegrateRequest:
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
        kind = _check_kind(kind, flags, count, _REQUESTS)
        tensors = _read_tensors(view, kind)
        if kind is _Kind.VELOCITY:
            return _check_velocity(request_id, param, tensors, limits)
        return _check_integrate(request_id, param, tensors, limits)
    except ProtocolError as err:
        err.request_id = request_id
        raise


def decode_response(body: bytes | bytearray | memoryview, expected_request_id: int,
                    expected_shape: tuple[int, ...] | None = None) -> np.ndarray:
    """The ``out`` tensor of a reply (B, C, H, W), float32 or float16 as sent, read-only.

    Raises :class:`RemoteExpertError` for an error reply, and :class:`ProtocolError` for a
    malformed one, another request's reply, a shape other than ``expected_shape`` or
    non-finite values, so that a caller can retry elsewhere.
    """
    view = _byte_view(body)
    kind, flags, count, request_id, param = _read_fixed(view)
    kind = _check_kind(kind, flags, count, _REPLIES)
    (tensor,) = _read_tensors(view, kind)
    if kind is _Kind.ERROR:
        # 0 means the expert could not read the request's id.
        if request_id not in (expected_request_id, 0):
            raise ProtocolError(f"error reply is for request {request_id}, "
                                f"expected {expected_request_id}")
        raise RemoteExpertError(param, tensor.tobytes().decode("utf-8", "replace"), request_id)
    if request_id != expected_request_id:
        raise ProtocolError(f"reply is for request {request_id}, expected {expected_request_id}")
    _check_param_zero(param, kind)
    if expected_shape is not None and tensor.shape != tuple(expected_shape):
        raise ProtocolError(f"'out' has shape {tensor.shape}, expected {tuple(expected_shape)}",
                            422)
    if not np.isfinite(tensor).all():
        raise ProtocolError("'out' has non-finite values", 422)
    return tensor


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
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version}; this build speaks {VERSION}")
    return kind, flags, count, request_id, param


def _check_kind(code: int, flags: int, count: int, kinds: tuple[_Kind, ...]) -> _Kind:
    try:
        kind = _Kind(code)
    except ValueError:
        raise ProtocolError(f"unknown message kind {code}") from None
    if kind not in kinds:
        raise ProtocolError(f"{_KIND_NAMES[kind]} is not expected here "
                            f"(want {' or '.join(_KIND_NAMES[k] for k in kinds)})")
    if flags:
        raise ProtocolError(f"reserved flags must be 0, got {flags:#04x}")
    expected = len(_SCHEMAS[kind])
    if count != expected:
        raise ProtocolError(f"{_KIND_NAMES[kind]} carries {expected} tensors, got {count}")
    return kind


def _read_tensors(view: memoryview, kind: _Kind) -> list[np.ndarray]:
    """Descriptors, then data: every size is checked against the body before any view."""
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

    tensors = []
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
            tensor = np.frombuffer(view, dtype, nbytes // dtype.itemsize, start).reshape(dims)
        except ValueError:  # e.g. (2**32 - 1, 2**32 - 1, 0, 0): no bytes, yet too big for NumPy
            raise ProtocolError(f"'{spec.name}' dims {dims} describe no array NumPy can hold "
                                "(more than 64 dimensions, or sizes overflowing its index)"
                                ) from None
        tensors.append(tensor)
        offset = start + nbytes
    if offset != size:
        raise ProtocolError(f"{size - offset} trailing bytes after the last tensor")
    if refused is not None:
        raise ProtocolError(refused, 422)
    return tensors


def _check_velocity(request_id: int, param: int, tensors: list[np.ndarray],
                    limits: Limits) -> VelocityRequest:
    x, t, y = tensors
    _check_param_zero(param, _Kind.VELOCITY)
    _check_batch(x, {"t": t, "y": y}, limits)
    _check_times("t", t)
    _check_labels(y, limits)
    _check_image(x, limits)
    return VelocityRequest(request_id, x, t, y)


def _check_integrate(request_id: int, param: int, tensors: list[np.ndarray],
                     limits: Limits) -> IntegrateRequest:
    x, y, grid = tensors
    _check_batch(x, {"y": y}, limits)
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
    _check_labels(y, limits)
    _check_image(x, limits)
    return IntegrateRequest(request_id, x, y, grid, solver)


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
    if batch > limits.max_batch:
        raise ProtocolError(f"batch of {batch} exceeds the limit of {limits.max_batch}", 422)


def _check_image(x: np.ndarray, limits: Limits) -> None:
    image = x.shape[1:]
    if limits.image_shape is not None and image != limits.image_shape:
        raise ProtocolError(f"'x' images are {image}, this expert serves {limits.image_shape}",
                            422)
    if min(image) == 0:
        raise ProtocolError(f"'x' images {image} are empty", 422)
    if not np.isfinite(x).all():
        raise ProtocolError("'x' has non-finite values", 422)


def _check_times(name: str, times: np.ndarray) -> list[float]:
    """The times as Python floats: at these sizes a list beats NumPy's per-call overhead."""
    values = times.tolist()
    if not all(0.0 <= v <= 1.0 for v in values):  # NaN fails both comparisons
        raise ProtocolError(f"'{name}' must be finite and in [0, 1]", 422)
    return values


def _check_labels(y: np.ndarray, limits: Limits) -> None:
    if limits.allowed_labels is None:
        return
    unknown = set(y.tolist()) - limits.allowed_labels
    if unknown:
        raise ProtocolError(f"labels {sorted(unknown)[:8]} are not served by this expert "
                            f"(serves {sorted(limits.allowed_labels)})", 422)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def _dtype_names(spec: _Spec) -> str:
    return ", ".join(dtype.name for dtype in spec.dtypes)
