"""Hypothesis strategies for hostile bodies of the expert wire protocol (``docs/protocol.md``).

Shared by the decoder's fuzz test (``tests/unit/test_protocol_fuzz.py``) and the expert's HTTP
fuzz test (``tests/integration/test_api_fuzz.py``). A hostile body is one of:

- a *valid* velocity or integrate request naming rows of the target's label context (or, for
  a pool, a pool velocity request naming one to three members) built with the real encoder,
  sized for the expert under test (its image shape, labels, batch and step limits) or
  deliberately not (batches over the limit or mismatched between tensors, other image shapes,
  negative rows, guidance out of range, times outside [0, 1], grids that are not increasing);
- such a request with one to three *structure-aware mutations*: a header or descriptor field
  (magic, version, kind, flags, count, id, param, name, dtype and ndim codes, dims) set to an
  edge value, a dim declaring gigabytes, a truncation, trailing or inserted bytes, a deleted
  range, non-zero padding, a NaN, infinity or out-of-range value written into a tensor;
- random bytes, bare or behind a valid magic and version.

The layout below is recomputed here from the tensors' shapes rather than taken from
``ddm.serving.wire.protocol``, so that the mutations aim at the documented byte offsets and the
test does not trust the code it checks.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from hypothesis import strategies as st

from ddm.serving.wire.protocol import (IntegrateRequest, LabelContext, PoolVelocityRequest, Solver,
                                       VelocityRequest, encode_pool_request, encode_request)
from tests.support.label_wire import label_context

MAGIC_AND_VERSION = b"DDMT\x02"
HEADER_BYTES = 18
ALIGNMENT = 8


@dataclass(frozen=True)
class Field:
    """``size`` bytes at ``offset``: an unsigned little-endian integer of the layout."""

    name: str
    offset: int
    size: int


@dataclass(frozen=True)
class Region:
    """Bytes of the body that are not integers: padding, or one tensor's data."""

    name: str
    offset: int
    size: int
    dtype: np.dtype | None  # None for padding


@dataclass(frozen=True)
class Target:
    """What the bodies are sized for: the limits of the decoder or expert under test."""

    image_shape: tuple[int, int, int]
    labels: tuple[int, ...]
    max_batch: int
    max_steps: int
    #: A pool's members that pool requests name, and the ids of text contexts of four rows
    #: they hold (post them first), named by well-formed calls: so that those reach the
    #: members' batchers rather than stopping at an unknown context.
    pool_members: tuple[str, ...] = ("e0", "expert-1", "router-network")
    pool_contexts: tuple[bytes, ...] = ()

    @functools.cached_property
    def context(self) -> bytes:
        """The body of the label context of ``labels`` that velocity and integrate requests
        name rows of: an expert under test must hold it (post it first)."""
        return label_context(0, np.array(self.labels))[0]

    @functools.cached_property
    def context_id(self) -> bytes:
        return label_context(0, np.array(self.labels))[1]


def layout(arrays: Sequence[np.ndarray]) -> tuple[list[Field], list[Region]]:
    """Every field and region of a request body carrying ``arrays`` in wire order."""
    fields = [Field("magic", 0, 4), Field("version", 4, 1), Field("kind", 5, 1),
              Field("flags", 6, 1), Field("count", 7, 1), Field("request_id", 8, 8),
              Field("param", 16, 2)]
    offset = HEADER_BYTES
    for index, array in enumerate(arrays):
        fields += [Field(f"name{index}", offset, 1), Field(f"dtype{index}", offset + 1, 1),
                   Field(f"ndim{index}", offset + 2, 1)]
        offset += 3
        for axis in range(array.ndim):
            fields.append(Field(f"dim{index}.{axis}", offset, 4))
            offset += 4
    regions = []
    for index, array in enumerate(arrays):
        start = -(-offset // ALIGNMENT) * ALIGNMENT
        if start > offset:
            regions.append(Region(f"padding{index}", offset, start - offset, None))
        regions.append(Region(f"data{index}", start, array.nbytes, array.dtype))
        offset = start + array.nbytes
    return fields, regions


@dataclass(frozen=True)
class Valid:
    """A request body from the real encoder, with its layout."""

    body: bytes
    fields: tuple[Field, ...]
    regions: tuple[Region, ...]


_SPECIAL_TIMES = (np.nan, np.inf, -np.inf, -0.5, 1.5, np.float32(1.0000001), -1e-38)
_SPECIAL_FLOATS = (np.nan, np.inf, -np.inf, -1.0, 2.0, 3.4e38, -0.0, 1e-45)
_SPECIAL_INTS = (-1, 5, 9, 10, 2**31 - 1, -2**31)
#: Dims that declare far more data than any body holds (2**32 - 1 is the largest u32).
HUGE_DIMS = (2**32 - 1, 2**31, 2**24 + 1, 10**9, 65536)
_IDS = (0, 1, 2**63, 2**64 - 1)
_MUTATIONS = ("field", "field", "huge_dim", "truncate", "append", "insert", "delete", "byte",
              "padding", "poison")

# Hypothesis draws the plan of a body (what to build: kind, coherent or not) and seeds; the
# details (values, positions, sizes, which mutations) come from generators seeded by them. A
# draw costs far more than a generator call, and ten thousand bodies per test must stay within
# seconds on a shared machine.
_SEEDS = st.integers(0, 2**32 - 1)
_PLANS = st.tuples(_SEEDS, st.integers(0, 3), st.booleans())


def _times(rng: np.random.Generator, n: int, in_range: bool) -> np.ndarray:
    values = rng.uniform(0.0, 1.0, n).astype(np.float32)
    if not in_range and n:
        values[rng.integers(n)] = _SPECIAL_TIMES[rng.integers(len(_SPECIAL_TIMES))]
    return values


def _valid(seed: int, coherent: bool, velocity: bool, target: Target) -> Valid:
    rng = np.random.default_rng(seed)
    flip = lambda: bool(rng.integers(2))  # noqa: E731 - a coin, local to this generator
    batch = int(rng.integers(1, target.max_batch + 1) if coherent
                else rng.integers(0, target.max_batch + 3))
    shape = target.image_shape if coherent or flip() else tuple(
        int(d) for d in rng.integers(0, 4, 3))
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    if not coherent and x.size and flip():
        x.flat[rng.integers(x.size)] = np.nan if flip() else np.inf
    rows = batch if coherent or flip() else int(rng.integers(0, batch + 2))
    size = max(batch, rows)
    held = rng.integers(0, len(target.labels), size).astype(np.int32)
    named = held if coherent or flip() else -held - 1  # rows of the context, or negative
    guidance = np.ones(size, np.float32)
    if not coherent and size and flip():
        guidance[rng.integers(size)] = _SPECIAL_FLOATS[rng.integers(3)]  # not finite
    context = target.context_id
    identity = np.frombuffer(context, np.uint8)
    request_id = int(rng.integers(2**63)) * 2 + int(flip()) if flip() else \
        _IDS[rng.integers(len(_IDS))]
    if velocity:
        t = _times(rng, rows, coherent or flip())
        request: VelocityRequest | IntegrateRequest = VelocityRequest(
            request_id, x, t, context, named[:rows], guidance[:rows])
        arrays = (x, t, identity, request.rows, request.guidance)
    else:
        steps = int(rng.integers(1, min(target.max_steps, 6) + 1) if coherent
                    else rng.integers(0, target.max_steps + 2))
        grid = np.linspace(0.0, 1.0, steps + 1, dtype=np.float32)
        if not coherent:
            grid = np.sort(_times(rng, steps + 1, True))
            if steps >= 1 and flip():
                grid[[0, -1]] = grid[[-1, 0]]  # not increasing
        solver = Solver.EULER if flip() else Solver.HEUN
        request = IntegrateRequest(request_id, x, context, named[:batch], guidance[:batch],
                                       grid, solver)
        arrays = (x, identity, request.rows, request.guidance, grid)
    body = encode_request(request)
    fields, regions = layout(arrays)
    assert regions[-1].offset + regions[-1].size == len(body), "layout out of step with encoder"
    return Valid(body, tuple(fields), tuple(regions))


def valid_requests(target: Target) -> st.SearchStrategy[Valid]:
    """A velocity or integrate request. Mostly what ``target`` accepts; one time in four it is
    well formed but over a limit or semantically off (a decodable body the expert refuses)."""
    return _PLANS.map(lambda plan: _valid(plan[0], plan[1] > 0, plan[2], target))


#: Member names a pool request draws from; the last is longer than any the wire takes.
#: A member's name one byte over the protocol's limit.
_LONG_NAME = "x" * 64


def _valid_pool(seed: int, coherent: bool, target: Target) -> Valid:
    """A pool velocity request: one to four calls of three members' text velocity rows (a
    member may recur: one call per context), or (incoherent) more calls than rows allowed."""
    rng = np.random.default_rng(seed)
    flip = lambda: bool(rng.integers(2))  # noqa: E731 - a coin, local to this generator
    many = not coherent and not rng.integers(4)
    count = target.max_batch + 1 if many else int(rng.integers(1, 5))
    members = (*target.pool_members, _LONG_NAME)
    names = [members[i] for i in rng.integers(0, len(members) - 1 if coherent else len(members),
                                              count)]
    sizes = [1 if many else int(rng.integers(1, max(2, target.max_batch // count + 1)))
             if coherent else int(rng.integers(0, target.max_batch + 2)) for _ in names]
    shape = target.image_shape if coherent or flip() else tuple(
        int(d) for d in rng.integers(0, 4, 3))
    calls = []
    for name, size in zip(names, sizes):
        x = rng.standard_normal((size, *shape)).astype(np.float32)
        if not coherent and x.size and flip():
            x.flat[rng.integers(x.size)] = np.nan
        guidance = rng.uniform(0.0, 10.0, size).astype(np.float32)
        if not coherent and size and flip():
            guidance[0] = _SPECIAL_FLOATS[rng.integers(len(_SPECIAL_FLOATS))]
        rows = rng.integers(-1 if not coherent and flip() else 0, 4, size).astype(np.int32)
        times, context = _times(rng, size, coherent or flip()), rng.bytes(32)
        if coherent and target.pool_contexts:
            context = target.pool_contexts[int(rng.integers(len(target.pool_contexts)))]
        calls.append((name, VelocityRequest(0, x, times, context, rows, guidance)))
    request = PoolVelocityRequest(int(rng.integers(2**63)), tuple(calls))
    body = encode_pool_request(request)
    encoded = [name.encode() for name in names]
    arrays = (np.concatenate([c.x for _, c in calls]), np.concatenate([c.t for _, c in calls]),
              np.concatenate([c.rows for _, c in calls]),
              np.concatenate([c.guidance for _, c in calls]),
              np.zeros((count, 32), np.uint8), np.frombuffer(b"".join(encoded), np.uint8),
              np.array([len(n) for n in encoded], np.int32), np.array(sizes, np.int32))
    fields, regions = layout(arrays)
    assert regions[-1].offset + regions[-1].size == len(body), "layout out of step with encoder"
    return Valid(body, tuple(fields), tuple(regions))


def valid_pool_requests(target: Target) -> st.SearchStrategy[Valid]:
    """A pool velocity request. Mostly what ``target`` accepts (a pool of its image shape and
    ``max_batch`` rows in all, a member named by several calls at times); one time in four
    well formed but off (a name too long, no rows, rows or calls over the limit, bad times,
    rows or guidance)."""
    return _PLANS.map(lambda plan: _valid_pool(plan[0], plan[1] > 0, target))


#: Labels no expert serves: negative, past MAX_CLASS (999), past int32.
_BAD_LABELS = (-1, 1000, 2**40)


def _valid_label_context(seed: int, coherent: bool, target: Target) -> Valid:
    """A label context: a few of ``target``'s labels, or (incoherent) no rows, more than a
    context holds, or labels no expert serves."""
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(1, 9) if coherent else rng.choice((0, 1, 300)))
    labels = rng.choice(target.labels if coherent or rng.integers(2) else _BAD_LABELS, rows)
    body = encode_request(LabelContext(int(rng.integers(2**63)), labels.astype(np.int64)))
    fields, regions = layout((labels,))
    assert regions[-1].offset + regions[-1].size == len(body), "layout out of step with encoder"
    return Valid(body, tuple(fields), tuple(regions))


def valid_label_contexts(target: Target) -> st.SearchStrategy[Valid]:
    """A label context (version 4). Mostly what ``target`` accepts; one time in four well
    formed but off (empty, over the rows or body limit, labels out of range)."""
    return _PLANS.map(lambda plan: _valid_label_context(plan[0], plan[1] > 0, target))


# ---------------------------------------------------------------------------------- mutations

def _edge_value(rng: np.random.Generator, size: int) -> int:
    top = 2 ** (8 * size) - 1
    edges = (0, 1, 2, 3, 4, 5, 6, 7, 8, 255 & top, top, top - 1, top // 2 + 1)
    if rng.integers(3):
        return edges[rng.integers(len(edges))]
    return int.from_bytes(rng.bytes(size), "little")


def _put(body: bytearray, offset: int, size: int, value: int) -> None:
    if offset + size <= len(body):
        body[offset:offset + size] = value.to_bytes(size, "little")


def _poison(rng: np.random.Generator, body: bytearray, region: Region) -> None:
    """Write one bad value into one element of a tensor's data."""
    assert region.dtype is not None
    count = region.size // region.dtype.itemsize
    if count == 0:
        return
    at = region.offset + region.dtype.itemsize * int(rng.integers(count))
    if region.dtype.kind == "f":
        raw = np.array([_SPECIAL_FLOATS[rng.integers(len(_SPECIAL_FLOATS))]],
                       region.dtype).tobytes()
    else:
        raw = np.array([_SPECIAL_INTS[rng.integers(len(_SPECIAL_INTS))]],
                       np.int64).astype(region.dtype).tobytes()
    if at + len(raw) <= len(body):
        body[at:at + len(raw)] = raw


def _mutate(valid: Valid, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    body = bytearray(valid.body)
    for what in rng.choice(_MUTATIONS, int(rng.integers(1, 4))):
        if what == "field":
            field = valid.fields[rng.integers(len(valid.fields))]
            _put(body, field.offset, field.size, _edge_value(rng, field.size))
        elif what == "huge_dim":
            dims = [f for f in valid.fields if f.name.startswith("dim")]
            field = dims[rng.integers(len(dims))]
            _put(body, field.offset, field.size, HUGE_DIMS[rng.integers(len(HUGE_DIMS))])
        elif what == "truncate" and body:
            del body[rng.integers(len(body)):]
        elif what == "append":
            body += (rng.bytes(int(rng.integers(1, 17))) if rng.integers(2)
                     else bytes((1, 8, 4096)[rng.integers(3)]))
        elif what == "insert":
            at = int(rng.integers(len(body) + 1))
            body[at:at] = rng.bytes(int(rng.integers(1, 9)))
        elif what == "delete" and body:
            at = int(rng.integers(len(body)))
            del body[at:at + int(rng.integers(1, 9))]
        elif what == "byte" and body:
            body[rng.integers(len(body))] = int(rng.integers(256))
        elif what == "padding":
            pads = [r for r in valid.regions if r.dtype is None]
            if pads:
                pad = pads[rng.integers(len(pads))]
                at = pad.offset + int(rng.integers(pad.size))
                if at < len(body):
                    body[at] = int(rng.integers(1, 256))
        elif what == "poison":
            tensors = [r for r in valid.regions if r.dtype is not None]
            _poison(rng, body, tensors[rng.integers(len(tensors))])
    return bytes(body)


def request_bodies(target: Target, pool: bool = False,
                   label_contexts: bool = False) -> st.SearchStrategy[bytes]:
    """Hostile request bodies: mostly mutated requests, some valid ones, some random bytes;
    ``pool``: built from pool velocity requests; ``label_contexts``: from label contexts."""
    valid = (valid_pool_requests(target) if pool else
             valid_label_contexts(target) if label_contexts else valid_requests(target))
    mutated = st.tuples(valid, _SEEDS).map(lambda drawn: _mutate(*drawn))  # 1 to 3 mutations
    return st.one_of(
        mutated,
        mutated,
        mutated,
        valid.map(lambda valid: valid.body),
        st.binary(max_size=512),
        st.binary(max_size=256).map(lambda tail: MAGIC_AND_VERSION + tail),
    )


def huge_header(dims: Sequence[int], kind: int = 7, ndim: int = 4) -> bytes:
    """A velocity-request header whose ``x`` declares ``dims``, with no data behind it."""
    fixed = struct.pack("<4sBBBBQH", b"DDMT", 2, kind, 0, 5, 1, 0)
    return fixed + struct.pack(f"<BBB{len(dims)}I", 1, 1, ndim, *dims)


#: The descriptors after ``x`` of a one-row velocity request: ``t``, ``context``, ``rows``,
#: ``guidance`` (name code, dtype code, ndim, dims).
ONE_ROW_DESCRIPTORS = b"".join(struct.pack("<BBBI", *d) for d in (
    (2, 1, 1, 1), (10, 5, 1, 32), (11, 3, 1, 1), (12, 1, 1, 1)))
