"""Dynamic batching: coalesce concurrent requests into one model call, and pad to compiled sizes.

A router sends one small request per image per step, and a small model costs about as much for
64 images as for one, so the expert answers many routers at once by running their requests as
one batch. :class:`Batcher` holds only a queue: each request carries its own future, so
interleaved requests get exactly their own rows back. The decisions are pure functions
(:func:`plan_batch`, :func:`bucket_for`, :func:`pad_rows`), unit-tested without a clock.

Requests share a batch only when their ``key`` is equal: every velocity request has the same
key (``t`` is per sample), and an integrate request's key is its solver and grid, so only
requests that step through the same times together are merged.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

#: Runs one batch in the worker thread: ``(key, inputs) -> output``; every input and the
#: output have the batch on axis 0.
RunFn = Callable[[Hashable, tuple[np.ndarray, ...]], np.ndarray]


class BatcherClosed(RuntimeError):
    """The batcher stopped (server shutdown) before the request ran."""


@dataclass(frozen=True)
class Pending:
    """What :func:`plan_batch` needs to know about a queued request."""

    key: Hashable
    size: int
    arrived: float


@dataclass(frozen=True)
class Dispatch:
    """Run the queued requests at ``indices`` (in queue order) now, as one batch."""

    indices: tuple[int, ...]


@dataclass(frozen=True)
class Wait:
    """Wait up to ``seconds`` for more requests to join the head of the queue."""

    seconds: float


@dataclass(frozen=True)
class BatchReport:
    """One model call, for metrics: ``queue_delays`` in seconds, one per request."""

    images: int
    queue_delays: tuple[float, ...]
    model_seconds: float


def plan_batch(queue: Sequence[Pending], max_batch: int, max_delay: float,
               now: float) -> Dispatch | Wait:
    """The next batch: the oldest request plus later ones with its key that fit ``max_batch``.

    It is dispatched when full, when a request with its key no longer fits, or once the oldest
    request has waited ``max_delay`` seconds; otherwise the caller waits for more. Later
    requests with other keys wait their turn at the head, so no request starves.
    """
    if not queue:
        raise ValueError("plan_batch needs a non-empty queue")
    head = queue[0]
    chosen, images, overflow = [0], head.size, False
    for index in range(1, len(queue)):
        item = queue[index]
        if item.key != head.key:
            continue
        if images + item.size > max_batch:
            overflow = True
            continue
        chosen.append(index)
        images += item.size
    remaining = head.arrived + max_delay - now
    if images >= max_batch or overflow or remaining <= 0:
        return Dispatch(tuple(chosen))
    return Wait(remaining)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes to compile for: powers of two below ``max_batch``, then ``max_batch``.

    Compiled backends (JAX, Neuron) need one program per batch size; padding to these few
    sizes wastes at most half a batch and bounds compilation to ``log2(max_batch) + 1``.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    sizes = []
    size = 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return (*sizes, max_batch)


def bucket_for(batch: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``batch`` rows."""
    for size in sorted(buckets):
        if size >= batch:
            return size
    raise ValueError(f"batch of {batch} exceeds the largest compiled size {max(buckets)}")


def pad_rows(arrays: Sequence[np.ndarray], size: int) -> tuple[np.ndarray, ...]:
    """Pad every array along axis 0 to ``size`` rows by repeating its last row.

    Repeating a real row keeps padded labels and times valid for the model; callers slice
    the output back to the original rows.
    """
    out = []
    for array in arrays:
        missing = size - array.shape[0]
        if missing < 0:
            raise ValueError(f"cannot pad {array.shape[0]} rows down to {size}")
        widths = [(0, missing)] + [(0, 0)] * (array.ndim - 1)
        out.append(np.pad(array, widths, mode="edge") if missing else array)
    return tuple(out)


@dataclass(eq=False)
class _Job:
    key: Hashable
    inputs: tuple[np.ndarray, ...]
    arrived: float
    future: asyncio.Future[np.ndarray]

    @property
    def size(self) -> int:
        return self.inputs[0].shape[0]


class Batcher:
    """Queue requests, run them in batches on one worker thread, hand each its own rows.

    One worker thread keeps the model single-threaded (frameworks and accelerators run one
    call at a time best) and keeps the event loop free to accept the next requests, which
    queue up meanwhile and form the next batch. Use it from one event loop:
    ``start()``, then ``await submit(...)`` from many tasks, then ``await close()``.

    A request that ``inline(key, rows)`` accepts and that finds the model idle, nothing queued
    and no other request arriving runs at once on the event loop instead (only with
    ``max_delay_ms`` 0, which asks for no waiting): a lone router stepping one image through
    the DDM would otherwise pay two thread hops per step. Requests arriving meanwhile wait
    unread in the socket, as they would wait for the busy worker, and form the next batch.
    """

    def __init__(self, run: RunFn, max_batch: int, max_delay_ms: float,
                 on_batch: Callable[[BatchReport], None] | None = None,
                 inline: Callable[[Hashable, int], bool] | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        if max_delay_ms < 0:
            raise ValueError(f"max_delay_ms must be >= 0, got {max_delay_ms}")
        self._run = run
        self._max_batch = max_batch
        self._max_delay = max_delay_ms / 1000.0
        self._on_batch = on_batch
        self._inline = inline if max_delay_ms == 0 else None
        self._busy = False  # the worker thread is running a batch
        self._arriving = 0  # inline candidates yielding once to see whether others came too
        self._queue: list[_Job] = []
        self._arrival = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddm-model")
        self._loop_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start dispatching on the running event loop (idempotent)."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._dispatch_forever())

    async def submit(self, key: Hashable, inputs: tuple[np.ndarray, ...]) -> np.ndarray:
        """Queue one request (arrays with its rows on axis 0) and await its rows of output."""
        if self._loop_task is None or self._loop_task.done():
            raise BatcherClosed("the batcher is not running")
        size = inputs[0].shape[0]
        if not 1 <= size <= self._max_batch:
            raise ValueError(f"a request must have 1..{self._max_batch} rows, got {size}")
        if self._inline is not None and self._inline(key, size):
            # Requests read in the same turn of the loop (a burst) each get here before any
            # runs: seeing each other, they queue and form one batch instead.
            self._arriving += 1
            try:
                await asyncio.sleep(0)
            finally:
                self._arriving -= 1
            if not self._busy and not self._queue and not self._arriving:
                started = time.perf_counter()
                output = self._run(key, inputs)
                self._report(size, (0.0,), started)
                return output
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        self._queue.append(_Job(key, inputs, time.perf_counter(), future))
        self._arrival.set()
        return await future

    async def close(self) -> None:
        """Stop dispatching, fail queued requests with :class:`BatcherClosed`, free the thread."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        _fail(self._queue, BatcherClosed("the server is shutting down"))
        self._queue.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _dispatch_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = await self._next_batch()
            started = time.perf_counter()
            self._busy = True
            try:
                outputs = await loop.run_in_executor(self._executor, _run_batch, self._run, jobs)
            except asyncio.CancelledError:
                _fail(jobs, BatcherClosed("the server is shutting down"))
                raise
            except Exception as error:  # noqa: BLE001 - the model's failure goes to its callers
                _fail(jobs, error)
                continue
            finally:
                self._busy = False
            for job, output in zip(jobs, outputs):
                if not job.future.done():  # the client may have gone away
                    job.future.set_result(output)
            self._report(sum(job.size for job in jobs),
                         tuple(started - job.arrived for job in jobs), started)

    def _report(self, images: int, queue_delays: tuple[float, ...], started: float) -> None:
        if self._on_batch is not None:
            self._on_batch(BatchReport(images=images, queue_delays=queue_delays,
                                       model_seconds=time.perf_counter() - started))

    async def _next_batch(self) -> list[_Job]:
        """Wait until :func:`plan_batch` dispatches, then take those jobs off the queue."""
        while True:
            self._queue = [job for job in self._queue if not job.future.done()]
            if not self._queue:
                self._arrival.clear()
                await self._arrival.wait()
                continue
            pending = [Pending(job.key, job.size, job.arrived) for job in self._queue]
            decision = plan_batch(pending, self._max_batch, self._max_delay, time.perf_counter())
            if isinstance(decision, Dispatch):
                chosen = set(decision.indices)
                jobs = [self._queue[i] for i in decision.indices]
                self._queue = [job for i, job in enumerate(self._queue) if i not in chosen]
                return jobs
            self._arrival.clear()
            try:
                async with asyncio.timeout(decision.seconds):
                    await self._arrival.wait()
            except TimeoutError:
                pass


def _run_batch(run: RunFn, jobs: list[_Job]) -> list[np.ndarray]:
    """Worker-thread side: concatenate the requests, run the model once, split the rows."""
    inputs = tuple(np.concatenate(column) for column in zip(*(job.inputs for job in jobs)))
    output = run(jobs[0].key, inputs)
    bounds = np.cumsum([job.size for job in jobs])[:-1]
    return np.split(output, bounds)


def _fail(jobs: list[_Job], error: Exception) -> None:
    for job in jobs:
        if not job.future.done():
            job.future.set_exception(error)
