"""The protocol decoder against hostile bodies: property-based, structure-aware fuzzing.

Ten thousand bodies (``tests/protocol_strategies.py``: valid requests, the same with mutated
header fields, codes, dims, truncations, inserted bytes, poisoned values, and random bytes) go
through ``decode_request``. For each one:

- it returns a request or raises ``ProtocolError`` with a message and a 400, 413 or 422 status;
  nothing else escapes;
- the memory it allocates (tracemalloc's peak, which counts NumPy's buffers) stays within a
  bound proportional to the body, so a 100-byte header declaring 2**32 - 1 rows costs nothing;
- a body it accepts is within the limits and round-trips: encoding the decoded request gives
  the same bytes back (the format has exactly one encoding per request).

The outcomes are tallied, so that a strategy that stops reaching the deep checks (the 413, the
422s after a well-formed layout, valid requests) fails the test instead of passing quietly.
"""

from __future__ import annotations

import hashlib
import re
import tracemalloc
from collections import Counter
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.strategies import SearchStrategy

from protocol_strategies import (HUGE_DIMS, ONE_ROW_DESCRIPTORS, Target, huge_header,
                                 request_bodies)
from ddm.serving.wire.protocol import (LabelContext, Limits, PoolVelocityRequest, ProtocolError,
                                       IntegrateRequest, VelocityRequest, decode_request,
                                       encode_pool_request, encode_request)

TARGET = Target(image_shape=(1, 4, 4), labels=(0, 1, 2, 3, 4), max_batch=4, max_steps=8)
#: Small enough that the strategies' 4 KiB appends go over it (413).
MAX_BODY_BYTES = 2048
LIMITS = Limits(max_batch=TARGET.max_batch, max_body_bytes=MAX_BODY_BYTES,
                max_steps=TARGET.max_steps, image_shape=TARGET.image_shape,
                allowed_labels=frozenset(TARGET.labels))
CASES = 10_000
FUZZ = settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
#: What a decode may allocate: a fixed allowance for exception objects, message strings and
#: header tuples, plus what the value checks build from the tensors (the finiteness mask of
#: ``x``, the times and labels as Python lists: at most ~8 bytes per body byte).
FIXED_ALLOWANCE = 16 * 1024
PER_BODY_BYTE = 8


def memory_bound(body_size: int) -> int:
    return FIXED_ALLOWANCE + PER_BODY_BYTE * body_size


def decode_traced(body: bytes, limits: Limits = LIMITS
                  ) -> tuple[VelocityRequest | IntegrateRequest | PoolVelocityRequest
                             | ProtocolError, int]:
    """The decoder's outcome and the peak bytes it allocated (tracemalloc counts NumPy's
    buffers too). A first, untraced decode warms process-wide caches (``struct``'s compiled
    formats, NumPy's dispatch caches), and the smaller of two traced decodes is kept, so that a
    cache growing now and then is not charged to the body, while anything a body makes the
    decoder allocate shows every time. Tracing runs only around the decoder: under tracing
    every allocation of Hypothesis would cost several times more."""
    peaks = []
    for attempt in range(3):
        if attempt:
            tracemalloc.start()
        try:
            outcome = decode_request(body, limits)
        except ProtocolError as error:
            outcome = error
        finally:
            if attempt:
                peaks.append(tracemalloc.get_traced_memory()[1])
                tracemalloc.stop()
    return outcome, min(peaks)


def assert_within_limits(request: VelocityRequest | IntegrateRequest) -> None:
    batch = request.x.shape[0]
    assert 1 <= batch <= LIMITS.max_batch
    assert request.x.shape[1:] == LIMITS.image_shape
    assert request.rows.shape == request.guidance.shape == (batch,)
    assert (request.rows >= 0).all() and len(request.context) == 32
    assert ((request.guidance >= 0) & (request.guidance <= 50)).all()
    assert np.isfinite(request.x).all()
    if isinstance(request, VelocityRequest):
        assert request.t.shape == (batch,)
        assert ((request.t >= 0) & (request.t <= 1)).all()
    else:
        grid = request.grid
        assert 2 <= grid.shape[0] <= LIMITS.max_steps + 1
        assert grid[0] >= 0 and grid[-1] <= 1 and (np.diff(grid) > 0).all()


def reason(error: ProtocolError) -> str:
    """The kind of refusal: the message with its numbers and quoted names taken out."""
    return re.sub(r"'[^']*'|b'.*'|0x[0-9a-f]+|-?\d[\d.e+-]*|\(.*?\)|\[.*?\]", "_", str(error))


def fuzzed(bodies: SearchStrategy[bytes], limits: Limits, cases: int,
           accepted: Callable[[Any, bytes], None]
           ) -> tuple[Counter[int], set[str], tuple[float, bytes]]:
    """Decode ``cases`` of ``bodies``: each gives a request, which ``accepted(request, body)``
    checks, or a ``ProtocolError`` with a message and a 400, 413 or 422 (anything else escapes
    and fails), in bounded memory. The outcomes by status, the kinds of refusal, and the worst
    body (its peak as a share of the bound)."""
    outcomes: Counter[int] = Counter()  # HTTP status, 200 for an accepted body
    reasons: set[str] = set()
    worst = [(0.0, b"")]

    @settings(FUZZ, max_examples=cases)
    @given(bodies)
    def decode(body: bytes) -> None:
        outcome, peak = decode_traced(body, limits)
        assert peak <= memory_bound(len(body)), (peak, len(body), body[:64])
        worst[0] = max(worst[0], (peak / memory_bound(len(body)), body))
        if isinstance(outcome, ProtocolError):
            assert outcome.status in (400, 413, 422), (outcome.status, outcome)
            assert str(outcome).strip(), body[:64]
            outcomes[outcome.status] += 1
            reasons.add(reason(outcome))
        else:
            accepted(outcome, body)
            outcomes[200] += 1

    decode()
    return outcomes, reasons, worst[0]


@pytest.mark.slow
def test_10000_hostile_bodies_get_a_request_or_a_protocol_error_in_bounded_memory() -> None:
    def accepted(request: VelocityRequest | IntegrateRequest, body: bytes) -> None:
        assert_within_limits(request)
        assert encode_request(request) == body

    outcomes, reasons, worst = fuzzed(request_bodies(TARGET), LIMITS, CASES, accepted)
    assert sum(outcomes.values()) >= CASES
    # Every class of answer is reached, often enough to mean something.
    assert outcomes[400] >= CASES // 3 and outcomes[422] >= CASES // 20, outcomes
    assert outcomes[413] >= 20 and outcomes[200] >= CASES // 20, outcomes
    assert len(reasons) >= 30, sorted(reasons)
    assert worst[0] <= 1.0, worst


#: A pool of ``TARGET``'s image shape, at most ``max_batch`` rows (and calls) in all.
POOL_LIMITS = Limits(max_batch=TARGET.max_batch, max_body_bytes=MAX_BODY_BYTES,
                     image_shape=TARGET.image_shape)
POOL_CASES = CASES // 4


def assert_pool_within_limits(request: PoolVelocityRequest) -> None:
    names = [name for name, _ in request.calls]
    assert 1 <= len(names) <= POOL_LIMITS.max_batch
    assert all(1 <= len(name.encode()) <= 63 for name in names)
    rows = [call.x.shape[0] for _, call in request.calls]
    assert min(rows) >= 1 and sum(rows) <= POOL_LIMITS.max_batch
    for _, call in request.calls:
        assert call.x.shape[1:] == POOL_LIMITS.image_shape and np.isfinite(call.x).all()
        assert ((call.t >= 0) & (call.t <= 1)).all() and (call.rows >= 0).all()
        assert ((call.guidance >= 0) & (call.guidance <= 50)).all()
        assert len(call.context) == 32


@pytest.mark.slow
def test_hostile_pool_bodies_get_a_request_or_a_protocol_error_in_bounded_memory() -> None:
    """The same for bodies made from pool velocity requests (version 3): a member named by
    several calls is accepted, more calls than ``max_batch`` refused."""
    repeated = []

    def accepted(request: PoolVelocityRequest, body: bytes) -> None:
        assert isinstance(request, PoolVelocityRequest), request
        assert_pool_within_limits(request)
        assert encode_pool_request(request) == body
        names = [name for name, _ in request.calls]
        repeated.append(len(set(names)) < len(names))

    outcomes, reasons, worst = fuzzed(request_bodies(TARGET, pool=True), POOL_LIMITS,
                                      POOL_CASES, accepted)
    assert any(repeated), "no accepted request named a member twice"
    assert any(r.startswith("a pool velocity request carries _ to _ calls") for r in reasons)
    assert sum(outcomes.values()) >= POOL_CASES
    assert outcomes[400] >= POOL_CASES // 3 and outcomes[422] >= POOL_CASES // 20, outcomes
    assert outcomes[413] >= 5 and outcomes[200] >= POOL_CASES // 20, outcomes
    assert len(reasons) >= 30, sorted(reasons)
    assert worst[0] <= 1.0, worst


LABEL_CONTEXT_CASES = CASES // 4


@pytest.mark.slow
def test_hostile_label_contexts_get_a_context_or_a_protocol_error_in_bounded_memory() -> None:
    """The same for bodies made from label contexts (version 4): an accepted one holds 1 to
    max_context_rows labels in 0..999, round-trips, and is named by its content."""

    def accepted(request: LabelContext, body: bytes) -> None:
        assert isinstance(request, LabelContext), request
        assert 1 <= request.labels.shape[0] <= LIMITS.max_context_rows
        assert ((request.labels >= 0) & (request.labels <= 999)).all()
        assert encode_request(request) == body
        assert request.id == hashlib.sha256(body[18:]).digest()

    outcomes, reasons, worst = fuzzed(request_bodies(TARGET, label_contexts=True), LIMITS,
                                      LABEL_CONTEXT_CASES, accepted)
    assert sum(outcomes.values()) >= LABEL_CONTEXT_CASES
    assert (outcomes[400] >= LABEL_CONTEXT_CASES // 3
            and outcomes[422] >= LABEL_CONTEXT_CASES // 50), outcomes
    assert outcomes[413] >= 5 and outcomes[200] >= LABEL_CONTEXT_CASES // 20, outcomes
    assert len(reasons) >= 20, sorted(reasons)
    assert worst[0] <= 1.0, worst


@pytest.mark.parametrize("dims", [(d,) * 4 for d in HUGE_DIMS] + [(2**32 - 1, 1, 1, 1),
                                                                  (1, 2**32 - 1, 2**32 - 1, 8)])
def test_a_header_declaring_gigabytes_is_refused_without_allocating_them(
        dims: tuple[int, ...]) -> None:
    body = huge_header(dims)  # 35 bytes
    outcome, peak = decode_traced(body)
    assert isinstance(outcome, ProtocolError) and outcome.status == 400
    assert "cut off" in str(outcome) or "truncated" in str(outcome), outcome
    assert peak <= memory_bound(len(body)), peak


def test_a_huge_declared_tensor_behind_its_full_header_is_refused_in_bounded_memory() -> None:
    """All five descriptors present, ``x`` declaring 2**128 bytes: the size check is exact."""
    body = huge_header((2**32 - 1,) * 4) + ONE_ROW_DESCRIPTORS
    body += bytes(-len(body) % 8)
    outcome, peak = decode_traced(body)
    assert isinstance(outcome, ProtocolError) and outcome.status == 400
    assert "needs" in str(outcome) and str(2**32 - 1) in str(outcome), outcome
    assert peak <= memory_bound(len(body)), peak


def test_empty_dims_numpy_cannot_describe_are_refused_with_400() -> None:
    """``x`` declares (2**32 - 1, 2**32 - 1, 0, 0): zero bytes of data, but not a NumPy shape."""
    body = huge_header((2**32 - 1, 2**32 - 1, 0, 0)) + ONE_ROW_DESCRIPTORS
    body += (bytes(-len(body) % 8) + np.float32(0.5).tobytes() + bytes(4) + bytes(32)
             + bytes(4) + bytes(4) + np.float32(1).tobytes())
    with pytest.raises(ProtocolError) as refused:
        decode_request(body, LIMITS)
    assert refused.value.status == 400, refused.value
