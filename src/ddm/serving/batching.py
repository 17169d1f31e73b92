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
import threading
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator, Sequence

import numpy as np

#: Runs one batch in the model thread: ``(key, inputs) -> output``; every input and the
#: output (an array, or a tuple of arrays) have the batch on axis 0.
Output = np.ndarray | tuple[np.ndarray, ...]
RunFn = Callable[[Hashable, tuple[np.ndarray, ...]], Output]

#: How long closing a batcher waits for the batch its model thread runs to end.
MODEL_STOP_WAIT_S = 10.0


#: Solver steps of an integration that run as one model-thread job (:func:`grid_slices`): a
#: velocity call arriving meanwhile waits for at most this many (Heun: twice as many model
#: calls), not the whole grid. Each slice costs one batcher job (a thread hop); on the shared
#: test VM, 1000 steps of the smoke model took 4.2-5.9 s whole and 4.2-7.7 s in slices.
INTEGRATE_SLICE_STEPS = 16


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


def grid_slices(grid: np.ndarray) -> Iterator[np.ndarray]:
    """``grid`` as consecutive pieces of at most :data:`INTEGRATE_SLICE_STEPS` steps (each
    piece starts where the last ended), one batcher job each, so that velocity calls queued
    meanwhile run between slices (one job of 1000 steps held the model for all of them). The
    solvers are one-step methods, so slicing the grid changes no value."""
    for start in range(0, len(grid) - 1, INTEGRATE_SLICE_STEPS):
        yield grid[start:start + INTEGRATE_SLICE_STEPS + 1]


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
    future: asyncio.Future[Output]
    #: Rows the model runs for it (a guided row runs twice): what counts against max_batch.
    cost: int

    @property
    def size(self) -> int:
        return self.inputs[0].shape[0]


class Batcher:
    """Queue requests, run them in batches on one model thread, hand each its own rows.

    One long-lived thread keeps the model single-threaded (frameworks and accelerators run one
    call at a time best) and keeps the event loop free to accept the next requests, which
    queue up meanwhile and form the next batch. Use it from one event loop:
    ``start()``, then ``await submit(...)`` from many tasks, then ``await close()``.

    Every request takes the same path whatever the model's size: the event loop appends it to
    the queue and wakes the thread (a condition variable); the thread forms the batch
    (:func:`plan_batch`), runs it, and completes the requests' futures with one
    ``call_soon_threadsafe``. That is two thread wake-ups per batch and little else, where an
    executor plus a dispatching task on the loop cost several loop turns more (and made
    running small models on the loop, behind a measured time budget, worth its cliff).
    """

    def __init__(self, run: RunFn, max_batch: int, max_delay_ms: float,
                 on_batch: Callable[[BatchReport], None] | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        if max_delay_ms < 0:
            raise ValueError(f"max_delay_ms must be >= 0, got {max_delay_ms}")
        self._run = run
        self._max_batch = max_batch
        self._max_delay = max_delay_ms / 1000.0
        self._on_batch = on_batch
        self._changed = threading.Condition()  # guards the three fields below
        self._queue: list[_Job] = []
        self._running: list[_Job] = []  # the batch the model thread runs now
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the model thread, delivering to the running event loop (idempotent)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._work, name="ddm-model", daemon=True)
            self._thread.start()

    async def submit(self, key: Hashable, inputs: tuple[np.ndarray, ...],
                     cost: int | None = None) -> Output:
        """Queue one request (arrays with its rows on axis 0) and await its rows of output;
        ``cost`` is the rows the model runs for it (default: its rows), which batches count."""
        if self._loop is None or self._closed:
            raise BatcherClosed("the batcher is not running")
        size = inputs[0].shape[0] if cost is None else cost
        if not 1 <= size <= self._max_batch:
            raise ValueError(f"a request must have 1..{self._max_batch} rows, got {size}")
        future: asyncio.Future[Output] = self._loop.create_future()
        with self._changed:
            self._queue.append(_Job(key, inputs, time.perf_counter(), future, size))
            self._changed.notify()
        return await future

    async def close(self) -> None:
        """Fail queued and running requests with :class:`BatcherClosed` and let the model
        thread end after the batch it runs, waiting for that up to ``MODEL_STOP_WAIT_S`` (a
        model may hang): a model thread still inside the framework's C++ code when the
        interpreter exits aborts the process ("terminate called without an active
        exception")."""
        with self._changed:
            self._closed = True
            jobs, self._queue = self._queue + self._running, []
            self._changed.notify()
        _fail(jobs, BatcherClosed("the server is shutting down"))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, MODEL_STOP_WAIT_S)

    def _work(self) -> None:
        """The model thread: take a batch, run it, hand the results to the event loop."""
        assert self._loop is not None
        while (jobs := self._next_batch()) is not None:
            started = time.perf_counter()
            try:
                outputs: list[Output] | Exception = _run_batch(self._run, jobs)
            except Exception as error:  # noqa: BLE001 - the model's failure goes to its callers
                outputs = error
            report = BatchReport(images=sum(job.cost for job in jobs),
                                 queue_delays=tuple(started - job.arrived for job in jobs),
                                 model_seconds=time.perf_counter() - started)
            try:
                self._loop.call_soon_threadsafe(self._deliver, jobs, outputs, report)
            except RuntimeError:  # the event loop is closed: nobody is waiting any more
                return

    def _next_batch(self) -> list[_Job] | None:
        """Wait until :func:`plan_batch` dispatches, then take those jobs off the queue;
        None once closed."""
        with self._changed:
            self._running = []
            while not self._closed:
                # A request whose client went away (its future cancelled) is dropped unrun.
                self._queue = [job for job in self._queue if not job.future.done()]
                if not self._queue:
                    self._changed.wait()
                    continue
                pending = [Pending(job.key, job.cost, job.arrived) for job in self._queue]
                decision = plan_batch(pending, self._max_batch, self._max_delay,
                                      time.perf_counter())
                if isinstance(decision, Wait):
                    self._changed.wait(decision.seconds)
                    continue
                chosen = set(decision.indices)
                self._running = [self._queue[i] for i in decision.indices]
                self._queue = [job for i, job in enumerate(self._queue) if i not in chosen]
                return self._running
            return None

    def _deliver(self, jobs: list[_Job], outputs: list[Output] | Exception,
                 report: BatchReport) -> None:
        """On the event loop: each request gets its rows, or the model's error (a failed
        batch is not reported)."""
        if isinstance(outputs, Exception):
            _fail(jobs, outputs)
            return
        for job, output in zip(jobs, outputs):
            if not job.future.done():  # the client may have gone away
                job.future.set_result(output)
        if self._on_batch is not None:
            self._on_batch(report)


def _run_batch(run: RunFn, jobs: list[_Job]) -> list[Output]:
    """Model-thread side: concatenate the requests, run the model once, split the rows."""
    inputs = tuple(np.concatenate(column) for column in zip(*(job.inputs for job in jobs)))
    output = run(jobs[0].key, inputs)
    bounds = np.cumsum([job.size for job in jobs])[:-1]
    if isinstance(output, tuple):
        return list(zip(*(np.split(part, bounds) for part in output)))
    return np.split(output, bounds)


def _fail(jobs: list[_Job], error: Exception) -> None:
    for job in jobs:
        if not job.future.done():
            job.future.set_exception(error)
