"""A pool server's one request per step (issue 37): ``POST /v1/pool/velocity``.

A router whose step needs experts held by one pool replica sends their rows in one pool
velocity request (``docs/protocol.md``, version 3) instead of one request per member and
generation: a call per (member, context), so the calls of concurrent generations to one member
travel together. The route hands every call to its member's own batcher
(:meth:`~ddm.serving.model.member.Member.velocity`) at once, so a member's calls with the same
batch key run as one forward (with other requests' rows too), never with another member's
(unless the two share a grouped forward: :mod:`ddm.serving.model.grouped`, where a step's rows
of both run as one), and answers one reply holding each call's output or error: a call naming a
context its member does not hold answers its 412 in the reply while the other calls' rows come
back, those to the same member included, as their own requests would have been answered. An
unknown member name refuses the whole request (404, naming it); so does anything the body
itself gets wrong (400, 413, 422).

The route counts its requests in ``ddm_pool_requests`` (by route, kind and status) on the
pool's ``/metrics``; each member counts each call to it in its own ``ddm_expert_requests``
(kind ``pool_velocity``), so a member's requests and rows add up whichever route carried
them.
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
from typing import Iterator, Mapping

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from ddm.deploy.limits import MAX_CONTEXT_BODY_BYTES
from ddm.serving.model.member import Member
from ddm.serving.model.routes import Binary, Handling, answer_or_error, refusal
from ddm.serving.wire.paths import POOL_VELOCITY_PATH, model_paths
from ddm.serving.wire.protocol import (MAX_MEMBER_NAME_BYTES, CONTEXT_ID_BYTES, Limits,
                                       MemberError, PoolVelocityRequest, ProtocolError,
                                       VelocityRequest, decode_request, encode_pool_response,
                                       request_kind)

__all__ = ["PoolStep", "pool_step_routes"]

_KIND = PoolVelocityRequest.__name__
#: How a member counts its calls carried by this route (``ddm_expert_requests``' ``kind``).
_METRICS_KIND = "pool_velocity"


class StepMetrics(Collector):
    """``ddm_pool_requests``: the pool route's requests by kind and HTTP status, counted on the
    event loops under one lock (as :class:`~ddm.serving.model.metrics.ExpertMetrics`)."""

    def __init__(self, route: str) -> None:
        self.route = route
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str], int] = {}

    def observe_request(self, kind: str, status: int, images: int) -> None:
        key = (kind, str(status))
        with self._lock:
            self._requests[key] = self._requests.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "ddm_pool_requests", "Requests a pool answered on its own routes (one carries a "
            "step's calls to its members), by route, message kind and HTTP status.",
            labels=["route", "kind", "status"])
        with self._lock:
            for (kind, status), count in sorted(self._requests.items()):
                family.add_metric([self.route, kind, status], count)
        yield family


class PoolStep:
    """What the pool route admits and answers with: the pool's expert members, limits over
    them (:func:`_limits`), its own admission count and metrics."""

    def __init__(self, members: Mapping[str, Member]) -> None:
        self.members = dict(members)
        self.experts = tuple(s for s in self.members.values() if s.takes_velocity)
        assert self.experts, "a pool route only where the pool holds experts"
        self.pending = 0
        self.max_pending = max(s.max_pending for s in self.experts)
        self.metrics = StepMetrics(POOL_VELOCITY_PATH)

    @property
    def limits(self) -> Limits:
        """The experts' current limits summed up (they change once a member loads)."""
        return _limits(tuple(s.limits for s in self.experts))


@functools.lru_cache(maxsize=8)
def _limits(experts: tuple[Limits, ...]) -> Limits:
    """A pool request's limits: at most the experts' ``max_batch`` rows summed up, in as
    many calls at most (the decoder's rule; each member checks each of its calls again), the
    latent shape they share (None where they do not: each member checks its rows'), and a
    body of twice the largest such request."""
    shapes = {m.image_shape for m in experts}
    shape = shapes.pop() if len(shapes) == 1 else None
    rows = sum(m.max_batch for m in experts)
    per_call = CONTEXT_ID_BYTES + 4 + 4 + MAX_MEMBER_NAME_BYTES
    body = (MAX_CONTEXT_BODY_BYTES if shape is None else
            2 * rows * (4 * math.prod(shape) + 4 + 4 + 4 + per_call) + 4096)
    return Limits(max_batch=rows, max_body_bytes=body, image_shape=shape)


def pool_step_routes(members: Mapping[str, Member],
                     registry: CollectorRegistry) -> dict[str, Binary]:
    """The pool route, for a pool holding experts (none otherwise), its metrics
    registered in the pool's ``registry``."""
    if not any(s.takes_velocity for s in members.values()):
        return {}
    step = PoolStep(members)
    registry.register(step.metrics)
    return {POOL_VELOCITY_PATH: Binary(step, functools.partial(answer_pool_step, step))}


async def answer_pool_step(step: PoolStep, body: bytes) -> tuple[int, bytes]:
    """One pool velocity request -> (HTTP status, a pool response or an error reply)."""

    async def handle(handling: Handling) -> bytes:
        message = decode_request(body, step.limits)
        handling.request_id, handling.kind = message.request_id, request_kind(message)
        if not isinstance(message, PoolVelocityRequest):
            raise ProtocolError(f"{POOL_VELOCITY_PATH} takes a {_KIND}, not "
                                f"{type(message).__name__} "
                                f"(a member's own requests go to "
                                f"{model_paths('NAME').velocity})", 422, message.request_id)
        unknown = [name for name, _ in message.calls if name not in step.members]
        if unknown:
            raise ProtocolError(f"unknown member {unknown[0]!r}; this pool holds "
                                f"{', '.join(step.members)}", 404, message.request_id)
        # All at once: a member's calls reach its batcher in this turn, to run together.
        results = await asyncio.gather(*(_member(step.members[name], name, call)
                                         for name, call in message.calls))
        handling.rows = sum(call.x.shape[0] for (_, call), result in
                            zip(message.calls, results) if not isinstance(result, MemberError))
        return encode_pool_response(message, results)

    return await answer_or_error(step, handle)


async def _member(server: Member, name: str,
                  call: VelocityRequest) -> np.ndarray | MemberError:
    """One call: its member's velocity, or the error the member's own route would have
    answered."""
    result: np.ndarray | MemberError
    if not server.takes_velocity:
        result = MemberError(422, f"member {name} is a {server.facts()['role']}; a pool "
                                  "velocity request names experts")
    elif not server.ready:
        result = MemberError(503, f"member {name} is not ready; "
                                  f"{model_paths(name).readyz} says why")
    elif call.x.shape[1:] != server.limits.image_shape:
        result = MemberError(422, f"member {name}: 'x' images are {call.x.shape[1:]}, it "
                                  f"serves {server.limits.image_shape}")
    else:
        try:
            result = await server.velocity(call)
        except Exception as error:  # noqa: BLE001 - each member's failure is its own answer
            code, message = refusal(error, call.request_id)
            result = MemberError(code, f"member {name}: {message}")
    status = result.code if isinstance(result, MemberError) else 200
    server.metrics.observe_request(_METRICS_KIND, status, call.x.shape[0])
    return result
