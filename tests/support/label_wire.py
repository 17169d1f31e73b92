"""Label calls as the wire carries them (issue 36, docs/protocol.md version 4): a label
context holding the call's labels, one row per row of ``x``, then the velocity or integrate
message naming those rows, unguided. Tests and benchmarks build label calls here, so that how a
label request is framed is written once.

A call is two bodies posted one after the other to the same route; :func:`send` and
:func:`send_async` post them and return the call's reply, or the context's when the expert
refused the context (not ready, over a limit, busy), so that a test reads the refusal it was
reading when the labels travelled in the call itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable, Protocol, TypeVar

import httpx
import numpy as np

from ddm.serving.wire.protocol import (CONTENT_TYPE, IntegrateRequest, LabelContext, Solver,
                                       VelocityRequest, context_id, encode_request)


class _Reply(Protocol):
    status_code: int


R = TypeVar("R", bound=_Reply)


@dataclass(frozen=True)
class LabelCall:
    """The two bodies of one label call: ``context`` (a LABEL_CONTEXT of the call's labels)
    and ``call`` (a velocity or integrate message naming its rows), with one request id."""

    context: bytes
    call: bytes

    @property
    def bodies(self) -> tuple[bytes, bytes]:
        return self.context, self.call


@dataclass(frozen=True, eq=False)
class LabelVelocity:
    """The inputs of one label velocity call: ``x`` (B, C, H, W), ``t`` (B,), labels ``y``."""

    request_id: int
    x: np.ndarray
    t: np.ndarray
    y: np.ndarray

    def call(self) -> LabelCall:
        return velocity_call(self.request_id, self.x, self.t, self.y)


def label_context(request_id: int, y: np.ndarray) -> tuple[bytes, bytes]:
    """The body of a label context holding labels ``y`` (B,) and its id."""
    body = encode_request(LabelContext(request_id, np.asarray(y).astype(np.int64)))
    return body, context_id(body)


def velocity_call(request_id: int, x: np.ndarray, t: np.ndarray, y: np.ndarray) -> LabelCall:
    """``v(x, t, y)`` for ``x`` (B, C, H, W), ``t`` (B,), labels ``y`` (B,)."""
    context, identity, rows, unguided = _rows_of(request_id, y)
    return LabelCall(context, encode_request(
        VelocityRequest(request_id, x, t, identity, rows, unguided)))


def integrate_call(request_id: int, x: np.ndarray, y: np.ndarray, grid: np.ndarray,
                   solver: Solver) -> LabelCall:
    """Integrate ``dx/dt = v(x, t, y)`` over ``grid`` with ``solver`` from ``x`` (B, C, H, W)."""
    context, identity, rows, unguided = _rows_of(request_id, y)
    return LabelCall(context, encode_request(
        IntegrateRequest(request_id, x, identity, rows, unguided, grid, solver)))


def _rows_of(request_id: int, y: np.ndarray) -> tuple[bytes, bytes, np.ndarray, np.ndarray]:
    """The label context of ``y``, its id, and the rows naming each label once, unguided."""
    context, identity = label_context(request_id, y)
    return context, identity, np.arange(len(y), dtype=np.int32), np.ones(len(y), np.float32)


def send(post: Callable[[bytes], R], call: LabelCall) -> R:
    """Post the context, then (if it was taken) the call; the last reply."""
    reply = post(call.context)
    return post(call.call) if reply.status_code == 200 else reply


async def send_async(post: Callable[[bytes], Awaitable[R]], call: LabelCall) -> R:
    """:func:`send` for an asynchronous client."""
    reply = await post(call.context)
    return await post(call.call) if reply.status_code == 200 else reply


def post_call(base: str, call: LabelCall | LabelVelocity, path: str = "/v1/velocity"
              ) -> httpx.Response:
    """:func:`send` over HTTP to ``base`` + ``path``."""
    url, headers = f"{base}{path}", {"Content-Type": CONTENT_TYPE}
    return send(lambda body: httpx.post(url, content=body, headers=headers),
                call.call() if isinstance(call, LabelVelocity) else call)
