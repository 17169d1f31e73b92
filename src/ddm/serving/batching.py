"""Dynamic batching: coalesce concurrent requests into one model call, and pad to compiled sizes.

A router sends one small request per image per step, and a small model costs about as much for
64 images as for one, so the expert answers many routers at once by running their requests as
one batch. :class:`Batcher` holds only a queue: each request carries its own future, so
interleaved requests get exactly their own rows back. The decisions are pure functions
(:func:`plan_batch`, :func:`bucket_for`), unit-tested without a clock.

Requests share a batch only when their ``key`` is equal: every velocity request has the same
key (``t`` is per sample), and an integrate request's key is its solver and grid, so only
requests that step through the same times together are merged.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from dataclasses import dataclass
from queue import Empty, SimpleQueue
from typing import Callable, Hashable, Iterator, Protocol, Sequence

import numpy as np

from ddm.serving.http.polling import WARM_TICK_S, LastTimes, WarmTicks, first_tick_s
from ddm.threads import CpuShare

#: Runs one batch in the model thread: ``(key, inputs) -> output``; every input and the
#: output (an array, or a tuple of arrays) have the batch on axis 0.
Output = np.ndarray | tuple[np.ndarray, ...]
RunFn = Callable[[Hashable, tuple[np.ndarray, ...]], Output]

#: How long closing a batcher waits for the batch its model thread runs to end.
MODEL_STOP_WAIT_S = 10.0


#: The longest a batch may be expected to run on the event loop of a server that has only one
#: (:class:`Batcher`): that loop answers nothing else meanwhile, so this bounds how late a
#: probe, a scrape or a signal is handled; expected from the last batch of the same key,
#: scaled up to the batch's rows. A server with another loop serving has no such bound.
INLINE_MAX_S = 0.05
#: Keys whose last batch time the batcher remembers (a client may send any grid, and each
#: grid is a key: the oldest is forgotten past this many).
KNOWN_KEYS = 64

#: Solver steps of an integration that run as one model-thread job (:func:`grid_slices`): a
#: velocity call arriving meanwhile waits for at most this many (Heun: twice as many model
#: calls), not the whole grid. Each slice costs one batcher job (a thread hop); on the shared
#: test VM, 1000 steps of the smoke model took 4.2-5.9 s whole and 4.2-7.7 s in slices.
INTEGRATE_SLICE_STEPS = 16


class BatcherClosed(RuntimeError):
    """The batcher stopped (server shutdown) before the request ran."""


class Queued(Protocol):
    """What :func:`plan_batch` needs to know about a queued request: its key, the rows the
    model runs for it, and when it arrived."""

    @property
    def key(self) -> Hashable: ...
    @property
    def cost(self) -> int: ...
    @property
    def arrived(self) -> float: ...


@dataclass(frozen=True)
class Pending:
    """A queued request as :func:`plan_batch` sees it (:class:`Queued`)."""

    key: Hashable
    cost: int
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
    """One model call, for metrics: ``queue_delays`` in seconds, one per request, and each
    request's ``tags`` and ``costs`` (its rows), so that a batcher shared by several models
    can report each one's part."""

    images: int
    queue_delays: tuple[float, ...]
    model_seconds: float
    tags: tuple[Hashable, ...] = ()
    costs: tuple[int, ...] = ()


def plan_batch(queue: Sequence[Queued], max_batch: int, max_delay: float,
               now: float) -> Dispatch | Wait:
    """The next batch: the oldest request plus later ones with its key that fit ``max_batch``.

    It is dispatched when full, when a request with its key no longer fits, or once the oldest
    request has waited ``max_delay`` seconds; otherwise the caller waits for more. Later
    requests with other keys wait their turn at the head, so no request starves.
    """
    if not queue:
        raise ValueError("plan_batch needs a non-empty queue")
    head = queue[0]
    chosen, images, overflow = [0], head.cost, False
    for index in range(1, len(queue)):
        item = queue[index]
        if item.key != head.key:
            continue
        if images + item.cost > max_batch:
            overflow = True
            continue
        chosen.append(index)
        images += item.cost
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


def bucket_for(batch: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``batch`` rows."""
    for size in sorted(buckets):
        if size >= batch:
            return size
    raise ValueError(f"batch of {batch} exceeds the largest compiled size {max(buckets)}")


@dataclass(eq=False)
class _Job:
    key: Hashable
    inputs: tuple[np.ndarray, ...]
    arrived: float
    future: asyncio.Future[Output]
    #: The event loop the request came on: only it may complete ``future``.
    loop: asyncio.AbstractEventLoop
    #: Rows the model runs for it (a guided row runs twice): what counts against max_batch.
    cost: int
    #: Whose request it is, for the batch's report (:class:`BatchReport`).
    tag: Hashable = None

    @property
    def size(self) -> int:
        return self.inputs[0].shape[0]


class Batcher:
    """Queue requests, run them in batches, one at a time, and hand each its own rows.

    ``start()``, then ``await submit(...)`` from many tasks on one or more event loops (a
    server's ``serving_loops``, each serving the same clients), then ``await close()`` on one
    of them. Frameworks and accelerators run one call at a time best, so one batch runs at a
    time, in one of two places, chosen per batch:

    - **On the event loop the request came on**, for a lone request on an idle batcher (no
      batch runs, nothing else queued): a router stepping its images through an expert nobody
      else calls. The call pays no thread wake-up, which is slow on a virtual machine whose
      other vCPU sat idle while the model ran (docs/benchmarks.md, ``calls``). Meanwhile that
      loop answers nothing else. With another loop serving (``serving_loops`` > 1), the other
      answers probes, scrapes and other clients, so any lone batch runs here whatever its
      time; with one loop, only a batch expected to take at most :data:`INLINE_MAX_S` (its
      key's last batch time, scaled up to its rows) does, which keeps the loop's absence short
      next to a probe's timeout (seconds).
    - **On one long-lived model thread** otherwise: concurrent requests (which it batches
      while the loops parse the next ones), with one loop requests expected over the bound (a
      big model, or a key not seen yet), and timed waits for more requests (``max_delay_ms``).
      A loop appends the request under a lock and, if the thread waits, rings its doorbell at
      once; the thread forms the batch (:func:`plan_batch`), runs it and completes the
      requests' futures with one ``call_soon_threadsafe`` per loop they came on; the loops go
      on accepting, parsing and queueing requests, since models release the GIL in their
      kernels.

    With one loop, the bound is a limit on the loop's unavailability, not on the model's
    speed: the two paths differ by the two wake-ups, under 1% of any batch past the bound. On
    either path a batch's report (``on_batch``: the metrics) is made after its requests
    resume, off the path of their replies. With ``cpu`` (the server's
    :class:`~ddm.threads.CpuShare`), the batcher tells it when it has work, and a batch runs
    with its share of the process's CPU threads.

    Each wake-up's cost is mostly the Python that runs right after it: on a virtual machine,
    code that runs after its vCPU sat idle for milliseconds runs up to a hundred times slower
    than warm (``docs/bench/history.md``). So the hand-off runs little Python (a plain lock and a
    C-level queue as the doorbell: a ``threading.Condition`` runs a dozen Python lines per wait
    and notify; the queued jobs planned as they are; a lone job taken whole), and the loop
    does not sit idle through a long batch on the thread whose time it knows: it ticks over
    the batch's last fifth (:mod:`ddm.serving.http.polling`), so that the reply's Python runs warm.
    """

    def __init__(self, run: RunFn, max_batch: int, max_delay_ms: float,
                 on_batch: Callable[[BatchReport], None] | None = None, *,
                 serving_loops: int = 1, cpu: CpuShare | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        if max_delay_ms < 0:
            raise ValueError(f"max_delay_ms must be >= 0, got {max_delay_ms}")
        if serving_loops < 1:
            raise ValueError(f"serving_loops must be >= 1, got {serving_loops}")
        self._run = run
        self._any_time_inline = serving_loops > 1
        self._max_batch = max_batch
        self._max_delay = max_delay_ms / 1000.0
        self._on_batch = on_batch
        self._cpu = cpu
        self._lock = threading.Lock()  # guards the seven fields below
        self._queue: list[_Job] = []
        self._running: list[_Job] = []  # the batch that runs now, on the loop or the thread
        self._closed = False
        self._has_work = False  # what ``cpu`` was last told (:meth:`_note_work`)
        self._thread_waits = False  # the model thread waits for its doorbell
        #: Each key's last batch (model seconds, rows), written by whoever ran it.
        self._took: LastTimes[Hashable] = LastTimes(KNOWN_KEYS)
        #: From when (``perf_counter``) the running batch is near its expected end; None for
        #: a batch that does not tick (:func:`~ddm.serving.http.polling.first_tick_s`).
        self._warm_from: float | None = None
        #: A token put here wakes the model thread to look at the queue again (:meth:`_ring`).
        self._doorbell: SimpleQueue[None] = SimpleQueue()
        self._dispatch_due = False  # a submitting task will run _dispatch after its turn
        #: Hybrid polling (:mod:`~ddm.serving.http.polling`), one chain per event loop that submits.
        self._ticks: dict[asyncio.AbstractEventLoop, WarmTicks] = {}
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the model thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="ddm-model", daemon=True)
            self._thread.start()

    async def submit(self, key: Hashable, inputs: tuple[np.ndarray, ...],
                     cost: int | None = None, tag: Hashable = None) -> Output:
        """Queue one request (arrays with its rows on axis 0) and await its rows of output;
        ``cost`` is the rows the model runs for it (default: its rows), which batches count;
        ``tag`` says whose it is in the batch's report."""
        if self._thread is None or self._closed:
            raise BatcherClosed("the batcher is not running")
        size = inputs[0].shape[0] if cost is None else cost
        if not 1 <= size <= self._max_batch:
            raise ValueError(f"a request must have 1..{self._max_batch} rows, got {size}")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Output] = loop.create_future()
        job = _Job(key, inputs, time.perf_counter(), future, loop, size, tag)
        with self._lock:
            if self._closed:  # by another loop since the check above: nobody would fail it
                raise BatcherClosed("the batcher is not running")
            self._queue.append(job)
            # A lone request on an idle batcher that may run here decides after a loop turn
            # (below); anything else is the model thread's now, which batches what is queued
            # when it looks, unless a decision is already due (it sees this request too).
            expected = self._took.expected(key, job.cost)
            dispatch = (not self._running and not self._dispatch_due
                        and len(self._queue) == 1 and self._inline(expected))
            if not dispatch and not self._dispatch_due:
                self._ring()
            self._dispatch_due |= dispatch
            self._note_work()
        if not dispatch:  # the thread's: tick near its end, if it is long and known
            if (first_tick := first_tick_s(expected)) is not None:
                self._ticks_of(loop).due_in(first_tick)
        else:
            # Decide after one loop turn, so that requests read in the same turn join; this
            # task decides, so that a batch run here returns without another turn.
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                future.cancel()  # dropped unrun, as when cancelled while queued
                loop.call_soon(self._dispatch)  # for the others queued meanwhile
                raise
            self._dispatch()
        return await future

    async def close(self) -> None:
        """Fail queued requests and those of the model thread's batch with
        :class:`BatcherClosed` (a batch running on an event loop ends there with its rows:
        that loop answers nothing until it has them) and let the model thread end after the
        batch it runs, waiting for that up to ``MODEL_STOP_WAIT_S`` (a
        model may hang): a model thread still inside the framework's C++ code when the
        interpreter exits aborts the process ("terminate called without an active
        exception")."""
        with self._lock:
            self._closed = True
            jobs, self._queue = self._queue + self._running, []
            self._ring()
            self._note_work()
            chains = list(self._ticks.items())
        for loop, ticks in chains:
            _on_loop(loop, ticks.stop)
        error = BatcherClosed("the server is shutting down")
        for loop, rows in _by_loop(jobs).items():
            _on_loop(loop, functools.partial(_fail, [jobs[row] for row in rows], error))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, MODEL_STOP_WAIT_S)

    def _dispatch(self) -> None:
        """On a loop, while no batch runs: run the next batch here if it is a lone request of
        this loop that may run on it (:class:`Batcher`), else hand the queue to the model
        thread."""
        with self._lock:
            self._dispatch_due = False
            if self._running or self._closed:
                return  # the thread found the queue first, or nobody waits any more
            decision = self._plan()
            lone = self._queue[0] if len(self._queue) == 1 else None
            if not (isinstance(decision, Dispatch) and lone is not None
                    and lone.loop is asyncio.get_running_loop()
                    and self._inline(self._took.expected(lone.key, lone.cost))):
                self._ring()  # a timed wait, concurrent requests or a long batch
                return
            jobs = self._take(decision)
        ran = _timed(self._run, jobs, self._cpu)
        with self._lock:
            self._finish(jobs, *ran)
        self._deliver(jobs, *ran, jobs)

    def _inline(self, expected_s: float | None) -> bool:
        """Whether a lone batch expected to take ``expected_s`` may run on its event loop."""
        return self._any_time_inline or (expected_s is not None and expected_s <= INLINE_MAX_S)

    def _ticks_of(self, loop: asyncio.AbstractEventLoop) -> WarmTicks:
        """The chain of ticks on ``loop`` (the running one)."""
        ticks = self._ticks.get(loop)
        if ticks is None:
            with self._lock:
                ticks = self._ticks.setdefault(loop, WarmTicks(self._next_tick_s))
        return ticks

    def _next_tick_s(self) -> float | None:
        """When a loop ticks next (:class:`~ddm.serving.http.polling.WarmTicks`): while a batch
        of known time runs (on the thread, or on another loop), from its ``_warm_from`` on;
        while requests wait
        for the thread, soon (it takes them now, or waits for companions); never once nothing
        runs or waits, or while a batch of unknown time runs."""
        with self._lock:
            running, waiting, warm_from = bool(self._running), bool(self._queue), self._warm_from
        if running:
            return None if warm_from is None else warm_from - time.perf_counter()
        return WARM_TICK_S if waiting else None

    def _drop_gone(self) -> None:
        """Drop queued requests whose clients went away (their futures cancelled) unrun.
        Holds ``_lock``."""
        self._queue = [job for job in self._queue if not job.future.done()]
        self._note_work()

    def _note_work(self) -> None:
        """Tell ``cpu`` when this batcher turns busy (a batch queued or running) or idle, so
        that forwards elsewhere in the process take their share. Holds ``_lock``."""
        has_work = bool(self._queue or self._running)
        if self._cpu is not None and has_work != self._has_work:
            self._has_work = has_work
            self._cpu.busy(has_work)

    def _ring(self) -> None:
        """Wake the model thread if it waits (one token per wait). Holds ``_lock``."""
        if self._thread_waits:
            self._thread_waits = False
            self._doorbell.put(None)

    def _plan(self) -> Dispatch | Wait | None:
        """plan_batch over the queue, once requests whose clients went away are dropped; None
        for an empty queue. Holds ``_lock``."""
        self._drop_gone()
        if not self._queue:
            return None
        return plan_batch(self._queue, self._max_batch, self._max_delay, time.perf_counter())

    def _take(self, decision: Dispatch) -> list[_Job]:
        """Move the dispatched jobs from the queue to ``_running``, and note from when the
        batch is near its expected end (``_warm_from``: the loops' ticks). Holds ``_lock``."""
        if len(decision.indices) == len(self._queue):  # all of it: a lone request, say
            self._running, self._queue = self._queue, []
        else:
            chosen = set(decision.indices)
            self._running = [self._queue[i] for i in decision.indices]
            self._queue = [job for i, job in enumerate(self._queue) if i not in chosen]
        jobs = self._running
        first_tick = first_tick_s(self._took.expected(jobs[0].key, sum(job.cost for job in jobs)))
        self._warm_from = None if first_tick is None else time.perf_counter() + first_tick
        return jobs

    def _work(self) -> None:
        """The model thread: take a batch, run it, and hand the results to the event loops
        its requests came on (the batch's end is recorded first, so that a request its results
        lead to sees it)."""
        while (jobs := self._next_batch()) is not None:
            ran = _timed(self._run, jobs, self._cpu)
            with self._lock:
                self._finish(jobs, *ran)
            outputs, started, ended = ran
            report: list[_Job] | None = jobs  # made once, by the first loop delivered to
            for loop, rows in _by_loop(jobs).items():
                part = (outputs if isinstance(outputs, Exception) or len(rows) == len(jobs)
                        else [outputs[row] for row in rows])
                try:
                    loop.call_soon_threadsafe(self._deliver, [jobs[row] for row in rows],
                                              part, started, ended, report)
                except RuntimeError:  # that loop is closed (its server stopped): nobody there
                    continue  # waits any more; the other loops' requests still run
                report = None

    def _finish(self, jobs: list[_Job], outputs: list[Output] | Exception, started: float,
                ended: float) -> None:
        """A batch ended: the next may run (the model thread is woken for requests another
        loop queued meanwhile), and one that ran is remembered as its key's time (a failed one
        is not). Holds ``_lock``."""
        self._running = []
        self._drop_gone()
        if self._queue:
            self._ring()
        if isinstance(outputs, Exception):
            return
        self._took.record(jobs[0].key, ended - started, sum(job.cost for job in jobs))

    def _next_batch(self) -> list[_Job] | None:
        """Wait until :func:`plan_batch` dispatches while no batch runs (on the event loop),
        then take those jobs off the queue; None once closed."""
        with self._lock:
            while not self._closed:
                decision = None if self._running else self._plan()
                if isinstance(decision, Dispatch):
                    return self._take(decision)
                self._thread_waits = True
                self._lock.release()
                try:
                    self._doorbell.get(timeout=decision.seconds
                                       if isinstance(decision, Wait) else None)
                except Empty:
                    pass  # the oldest request is due
                finally:
                    self._lock.acquire()
                    self._thread_waits = False
            return None

    def _deliver(self, jobs: list[_Job], outputs: list[Output] | Exception, started: float,
                 ended: float, report: list[_Job] | None) -> None:
        """On the event loop ``jobs`` came on: each request gets its rows, or the model's
        error; with ``report`` (the whole batch, given to one loop), a batch that ran is
        reported once its requests here have resumed (a failed one is not)."""
        if isinstance(outputs, Exception):
            _fail(jobs, outputs)
            return
        for job, output in zip(jobs, outputs):
            if not job.future.done():  # the client may have gone away
                job.future.set_result(output)
        if self._on_batch is not None and report is not None:
            asyncio.get_running_loop().call_soon(self._report, report, started, ended)

    def _report(self, jobs: list[_Job], started: float, ended: float) -> None:
        assert self._on_batch is not None
        self._on_batch(BatchReport(images=sum(job.cost for job in jobs),
                                   queue_delays=tuple(started - job.arrived for job in jobs),
                                   model_seconds=ended - started,
                                   tags=tuple(job.tag for job in jobs),
                                   costs=tuple(job.cost for job in jobs)))


def _timed(run: RunFn, jobs: list[_Job], cpu: CpuShare | None
           ) -> tuple[list[Output] | Exception, float, float]:
    """Run one batch with this thread's share of ``cpu``: its rows per request (or the
    model's error), when it started and ended."""
    if cpu is not None:
        cpu.claim()
    started = time.perf_counter()
    try:
        outputs: list[Output] | Exception = _run_batch(run, jobs)
    except Exception as error:  # noqa: BLE001 - the model's failure goes to its callers
        outputs = error
    return outputs, started, time.perf_counter()


def _run_batch(run: RunFn, jobs: list[_Job]) -> list[Output]:
    """Concatenate the requests, run the model once, split the rows (a lone request's arrays
    go as they are: no copy)."""
    if len(jobs) == 1:
        return [run(jobs[0].key, jobs[0].inputs)]
    inputs = tuple(np.concatenate(column) for column in zip(*(job.inputs for job in jobs)))
    output = run(jobs[0].key, inputs)
    bounds = np.cumsum([job.size for job in jobs])[:-1]
    if isinstance(output, tuple):
        return list(zip(*(np.split(part, bounds) for part in output)))
    return np.split(output, bounds)


def _by_loop(jobs: list[_Job]) -> dict[asyncio.AbstractEventLoop, list[int]]:
    """The indices of ``jobs`` by the event loop each came on."""
    rows: dict[asyncio.AbstractEventLoop, list[int]] = {}
    for index, job in enumerate(jobs):
        rows.setdefault(job.loop, []).append(index)
    return rows


def _on_loop(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    """Run ``callback`` on ``loop``: now if it is the running loop, else soon from it; not
    at all once ``loop`` is closed (nothing there waits any more)."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is running:
        callback()
        return
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:
        pass


def _fail(jobs: list[_Job], error: Exception) -> None:
    for job in jobs:
        if not job.future.done():
            job.future.set_exception(error)
