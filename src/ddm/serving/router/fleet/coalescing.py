"""Router-side coalescing: the calls concurrent generations make to one expert, as one request.

The router steps every generation in its own coroutine, so 64 concurrent single-image
generations make 64 one-row calls to an expert at each step. The expert's batcher
(:mod:`ddm.serving.batching`) merges them again into one model call, but each still costs a
whole HTTP exchange: encoding, a request on both sides, decoding, a future, on the router and
on the expert, more than a batched row of the model itself costs on a CPU (docs/benchmarks.md,
``router``).

A :class:`Coalescer` (one per expert) sends a call at once while fewer than
``in_flight_limit()`` requests to its expert are outstanding; otherwise the call waits, and when
a request returns, the waiting calls go out together as one request of at most ``max_rows()``
rows (:func:`ddm.serving.batching.plan_batch` picks them, oldest first, same key only); a call
that fills a request alone waits its turn like the others, so that every request counts against
the limit. There is
no timer: a lone generation never waits, and while the expert works on one batch the calls for
the next one gather. Calls made in the same turn of the event loop (every generation a returning
request woke) are merged even below the limit: a call is sent after the turn that made it.

Only calls with the same key merge: every velocity call shares one key (``t`` is per row); an
integrate call's key holds its solver and time grid. A failed request fails every call in it.
Given a ``scope``, the in-flight limit counts each scope's requests on its own, so that a call
waits only behind calls of its scope. A pool member's velocity calls are scoped by key: its
calls of different keys (each generation's context) travel together in one pool request
(:mod:`ddm.serving.router.fleet.pool_calls`), and holding them back would only split a step's
calls over several pool requests; its integrate calls, each a request of its own, share the
one limit.
``send`` is told when the oldest call in a request was made (``time.monotonic()``), so that
time spent waiting here counts against the caller's deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass
from typing import Awaitable, Callable, Hashable

import numpy as np

from ddm.serving.batching import Dispatch, Pending, plan_batch

#: Sends one request: ``(key, inputs, since) -> output``, with the rows on axis 0 of every
#: array; ``since`` is when its oldest call was made (``time.monotonic()``).
SendFn = Callable[[Hashable, tuple[np.ndarray, ...], float], Awaitable[np.ndarray]]


@dataclass(eq=False)
class _Call:
    key: Hashable
    inputs: tuple[np.ndarray, ...]
    future: asyncio.Future[np.ndarray]
    made: float

    @property
    def rows(self) -> int:
        return self.inputs[0].shape[0]


class Coalescer:
    """Merges one expert's waiting calls into requests (see the module docstring).

    ``max_rows()`` and ``in_flight_limit()`` are asked at every decision, so they follow the
    expert's batch limit and its number of ready replicas as these change. With
    ``max_rows() <= 1`` nothing can merge and calls go straight to ``send`` (still counted in
    :attr:`in_flight`). ``scope(key)``: what a request of ``key`` counts against (the module
    docstring); without it, every request counts against the one limit.
    """

    def __init__(self, send: SendFn, max_rows: Callable[[], int],
                 in_flight_limit: Callable[[], int], *,
                 scope: Callable[[Hashable], Hashable] | None = None) -> None:
        self._send = send
        self._max_rows = max_rows
        self._in_flight_limit = in_flight_limit
        self._scope_of = scope
        self._waiting: list[_Call] = []
        #: Requests in flight by scope (all under None without one).
        self._in_flight: Counter[Hashable] = Counter()
        self._pump_scheduled = False
        self._requests: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def in_flight(self) -> int:
        """Requests sent and not answered yet."""
        return self._in_flight.total()

    def _scope(self, key: Hashable) -> Hashable:
        """What a request of ``key`` counts against: its scope's limit, or the one limit."""
        return None if self._scope_of is None else self._scope_of(key)

    def _answered(self, key: Hashable) -> None:
        """A request of ``key`` is no longer in flight (a key with none is forgotten)."""
        scope = self._scope(key)
        self._in_flight[scope] -= 1
        if not self._in_flight[scope]:
            del self._in_flight[scope]

    async def submit(self, key: Hashable, inputs: tuple[np.ndarray, ...],
                     made: float | None = None) -> np.ndarray:
        """One call's output rows, sent alone or merged with other waiting calls; ``made``
        (``time.monotonic()``, default now) is when the caller made it."""
        made = time.monotonic() if made is None else made
        if self._closed:
            raise RuntimeError("the coalescer is closed (the router is shutting down)")
        if self._max_rows() <= 1:  # nothing can merge: at once, and still counted in flight
            self._in_flight[self._scope(key)] += 1
            try:
                return await self._send(key, inputs, made)
            finally:
                self._answered(key)
                self._pump()
        loop = asyncio.get_running_loop()
        call = _Call(key, inputs, loop.create_future(), made)
        self._waiting.append(call)
        if not self._pump_scheduled:
            self._pump_scheduled = True
            loop.call_soon(self._pump)
        return await call.future

    def _pump(self) -> None:
        """Send waiting calls, merged, while the in-flight limit allows."""
        self._pump_scheduled = False
        while not self._closed:
            self._waiting = [c for c in self._waiting if not c.future.done()]  # callers gone
            limit = max(1, self._in_flight_limit())
            free = [c for c in self._waiting if self._in_flight[self._scope(c.key)] < limit]
            if not free:
                return
            pending = [Pending(c.key, c.rows, 0.0) for c in free]
            decision = plan_batch(pending, max(1, self._max_rows()), 0.0, 0.0)
            assert isinstance(decision, Dispatch), "with no delay, plan_batch always dispatches"
            calls = [free[i] for i in decision.indices]
            taken = {id(c) for c in calls}
            self._waiting = [c for c in self._waiting if id(c) not in taken]
            self._in_flight[self._scope(calls[0].key)] += 1
            request = asyncio.get_running_loop().create_task(self._request(calls))
            self._requests.add(request)
            request.add_done_callback(self._requests.discard)

    async def _request(self, calls: list[_Call]) -> None:
        try:
            inputs = (calls[0].inputs if len(calls) == 1 else
                      tuple(np.concatenate(column) for column in zip(*(c.inputs for c in calls))))
            output = await self._send(calls[0].key, inputs, min(c.made for c in calls))
        except Exception as error:  # noqa: BLE001 - every merged caller gets the failure
            for call in calls:
                if not call.future.done():
                    call.future.set_exception(error)
        except BaseException:  # cancelled (closing): so are the calls it carried
            for call in calls:
                call.future.cancel()
            raise
        else:
            start = 0
            for call in calls:
                if not call.future.done():
                    call.future.set_result(output[start:start + call.rows])
                start += call.rows
        finally:
            self._answered(calls[0].key)
            self._pump()

    async def close(self) -> None:
        """Cancel the requests in flight and the waiting calls (their callers get
        ``CancelledError``); later calls are refused."""
        self._closed = True
        for call in self._waiting:
            call.future.cancel()
        self._waiting.clear()
        for request in list(self._requests):
            request.cancel()
        await asyncio.gather(*self._requests, return_exceptions=True)
