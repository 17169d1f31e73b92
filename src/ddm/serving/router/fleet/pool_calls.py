"""One request per pool replica per step (issue 37): the router's side of
``POST /v1/pool/velocity`` (``docs/protocol.md``, version 3).

Experts served by one pool server (``router.yaml`` discoveries naming a ``member`` at the same
endpoints) each keep their replica set, coalescer, retries and missing-expert policy in
:class:`~ddm.serving.router.fleet.pool.ExpertPool`; only the last hop changes. An attempt of a
velocity call to a member hands its rows to :class:`PoolCalls`, which gathers the attempts made
to one endpoint in the same turn of the event loop (the calls of one step, which the sampling
loop makes together, and those of concurrent generations, a member's once per context) and
sends them as one pool request after that turn; no timer, so a lone call never waits. A
request stays within what the pool takes: a member's rows in it at most the ``max_batch`` its
replica reports (so the whole at most the pool's experts' together); a call that would pass
that opens the endpoint's next request of the turn. The contexts a member lacks on that
replica are sent to the member's own route first (once per generation, as before), and a
call answered ``UNKNOWN_CONTEXT`` in the reply is sent its context again and its rows once
more, in a request of those that were. Each attempt then gets its own call's answer: its
rows, its error (a :class:`~ddm.serving.wire.protocol.RemoteExpertError`, judged by the pool
as it judges a member's own reply), or the whole request's failure, so a dead pool is a
transport failure for every member, each marked down and retried as before.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterator

import numpy as np

from ddm.serving.wire.paths import POOL_VELOCITY_PATH
from ddm.serving.wire.protocol import (UNKNOWN_CONTEXT, PoolVelocityRequest, RemoteExpertError,
                                       VelocityRequest, decode_pool_response,
                                       encode_pool_request, max_pool_reply_bytes)
from ddm.serving.router.fleet.replicas import Replica

__all__ = ["PoolCalls", "Post", "SendContext"]

#: ``(replica, path, body, max_reply_bytes, ends) -> reply body``: one POST within ``ends``.
Post = Callable[[Replica, str, bytes, int, float], Awaitable[bytes]]
#: ``(replica, context id, context body, ends)``: sends a member's replica the context.
SendContext = Callable[[Replica, bytes, bytes, float], Awaitable[None]]


@dataclass(eq=False)
class _Part:
    """One member's attempt: its replica (whose ``contexts`` say what it holds), rows,
    context and deadline."""

    replica: Replica
    member: str
    request: VelocityRequest
    context: bytes  # the context's body; its id is the request's
    ends: float
    future: asyncio.Future[np.ndarray]


@dataclass(eq=False)
class _Open:
    """An endpoint's pool request of this turn, still open: its parts, and each member's rows
    in them."""

    parts: list[_Part] = field(default_factory=list)
    rows: Counter[str] = field(default_factory=Counter)


class PoolCalls:
    """Gathers velocity attempts to pool members into pool requests, per endpoint."""

    def __init__(self, post: Post, send_context: SendContext, ids: Iterator[int]) -> None:
        self._post = post
        self._send_context = send_context
        self._ids = ids
        self._open: dict[str, _Open] = {}  # endpoint -> its request of this turn
        self._requests: set[asyncio.Task[None]] = set()

    def joins(self, replica: Replica, member: str, rows: int) -> bool:
        """An attempt of ``rows`` rows to ``member`` on ``replica`` would join a request of
        this turn: one is open there, and ``member``'s rows in it stay within the
        ``max_batch`` the replica reports (none reported: the attempt goes alone)."""
        opened = self._open.get(replica.endpoint)
        limit = replica.info.max_batch if replica.info is not None else 0
        return opened is not None and opened.rows[member] + rows <= limit

    async def velocity(self, replica: Replica, member: str, request: VelocityRequest,
                       context: bytes, ends: float) -> np.ndarray:
        """``member``'s answer to ``request`` from ``replica``'s pool server, within
        ``ends`` (``time.monotonic()``); raises what the exchange raises."""
        loop = asyncio.get_running_loop()
        part = _Part(replica, member, request, context, ends, loop.create_future())
        # An attempt that timed out no longer awaits it: its failure is read here, not logged.
        part.future.add_done_callback(lambda f: f.cancelled() or f.exception())
        rows = request.x.shape[0]
        if not self.joins(replica, member, rows):  # the next request of this turn
            self._open[replica.endpoint] = _Open()
            loop.call_soon(self._flush, replica.endpoint, self._open[replica.endpoint])
        opened = self._open[replica.endpoint]
        opened.parts.append(part)
        opened.rows[member] += rows
        remaining = ends - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        return await asyncio.wait_for(asyncio.shield(part.future), remaining)

    def _flush(self, endpoint: str, opened: _Open) -> None:
        if self._open.get(endpoint) is opened:
            del self._open[endpoint]
        task = asyncio.get_running_loop().create_task(self._exchange(opened.parts))
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)

    async def _exchange(self, parts: list[_Part]) -> None:
        """One pool request for ``parts`` (a second for those whose context was unknown);
        every part's future gets its own call's answer or the request's failure."""
        for resent in (False, True):
            try:
                parts = await self._with_contexts(parts, per_member=resent)
                results = await self._request(parts) if parts else []
            except Exception as error:  # noqa: BLE001 - every part of the request fails alike
                for part in parts:
                    if not part.future.done():
                        part.future.set_exception(error)
                return
            except BaseException:  # cancelled (closing)
                for part in parts:
                    part.future.cancel()
                raise
            again = []
            for part, result in zip(parts, results):
                if part.future.done():
                    continue
                if isinstance(result, RemoteExpertError):
                    if result.code == UNKNOWN_CONTEXT and not resent:
                        part.replica.contexts.pop(part.request.context, None)  # evicted
                        again.append(part)
                    else:
                        part.future.set_exception(result)
                else:
                    part.future.set_result(result)
            if not again:
                return
            parts = again

    async def _with_contexts(self, parts: list[_Part], per_member: bool) -> list[_Part]:
        """Send the contexts the pool lacks, each once (to one of its members' own routes:
        the pool's experts share one cache), or with ``per_member`` (a retry after
        ``UNKNOWN_CONTEXT``: a pool that shares none) to each member lacking it, all at once;
        the parts whose member now holds it. A part whose context could not be sent fails
        with that failure, as its own call would."""
        lacking: dict[tuple[int, bytes], list[_Part]] = {}
        for part in parts:
            if part.request.context not in part.replica.contexts:
                holder = part.replica if per_member else part.replica.contexts
                lacking.setdefault((id(holder), part.request.context), []).append(part)
        sent = await asyncio.gather(*(self._send_context(p[0].replica, p[0].request.context,
                                                         p[0].context, p[0].ends)
                                      for p in lacking.values()), return_exceptions=True)
        for failed, outcome in zip(lacking.values(), sent):
            if isinstance(outcome, Exception):
                for part in failed:
                    if not part.future.done():
                        part.future.set_exception(outcome)
        return [p for p in parts if not p.future.done()]

    async def _request(self, parts: list[_Part]) -> list[np.ndarray | RemoteExpertError]:
        """The pool request of ``parts``: its decoded reply."""
        ends = max(p.ends for p in parts)
        request = PoolVelocityRequest(next(self._ids), tuple((p.member, p.request)
                                                             for p in parts))
        rows = sum(p.request.x.shape[0] for p in parts)
        reply = await self._post(parts[0].replica, POOL_VELOCITY_PATH,
                                 encode_pool_request(request),
                                 max_pool_reply_bytes((rows, *parts[0].request.x.shape[1:]),
                                                      len(parts)), ends)
        return decode_pool_response(reply, request)

    async def close(self) -> None:
        """Cancel the requests in flight (their attempts get ``CancelledError``)."""
        for task in list(self._requests):
            task.cancel()
        await asyncio.gather(*self._requests, return_exceptions=True)
