"""Dynamic batching: the pure batch-forming rules, bucket padding, and the Batcher's routing of
results back to their own requests. No sleeps: tests hold the worker on events."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from ddm.deploy.limits import batch_buckets, compile_buckets
from ddm.serving.batching import (INLINE_MAX_S, INTEGRATE_SLICE_STEPS, Batcher, BatcherClosed,
                                  Dispatch, Pending, Wait, bucket_for, grid_slices, plan_batch)
from ddm.serving.http.polling import WARM_AFTER, WARM_TICK_S
from ddm.threads import CpuShare

V, A, B = "velocity", ("euler", b"grid-a"), ("euler", b"grid-b")


# -- plan_batch ---------------------------------------------------------------------------------

def test_plan_waits_for_more_until_the_oldest_request_is_due():
    queue = [Pending(V, 1, arrived=10.0), Pending(V, 2, arrived=10.001)]
    assert plan_batch(queue, max_batch=8, max_delay=0.005, now=10.002) == Wait(pytest.approx(0.003))
    assert plan_batch(queue, max_batch=8, max_delay=0.005, now=10.005) == Dispatch((0, 1))


def test_plan_dispatches_a_full_batch_at_once():
    queue = [Pending(V, 3, 0.0), Pending(V, 5, 0.0), Pending(V, 1, 0.0)]
    assert plan_batch(queue, max_batch=8, max_delay=1.0, now=0.0) == Dispatch((0, 1))


def test_plan_skips_what_does_not_fit_and_dispatches():
    # 4 + 6 > 8, so the 6 waits for the next batch; the 2 behind it still fits.
    queue = [Pending(V, 4, 0.0), Pending(V, 6, 0.0), Pending(V, 2, 0.0)]
    assert plan_batch(queue, max_batch=8, max_delay=1.0, now=0.0) == Dispatch((0, 2))


def test_plan_merges_only_requests_with_the_head_key():
    queue = [Pending(A, 1, 0.0), Pending(V, 1, 0.0), Pending(B, 1, 0.0), Pending(A, 2, 0.0)]
    assert plan_batch(queue, max_batch=64, max_delay=0.0, now=0.0) == Dispatch((0, 3))


def test_plan_with_no_delay_takes_what_is_queued():
    queue = [Pending(V, 1, 5.0)]
    assert plan_batch(queue, max_batch=64, max_delay=0.0, now=5.0) == Dispatch((0,))


def test_plan_refuses_an_empty_queue():
    with pytest.raises(ValueError, match="non-empty"):
        plan_batch([], max_batch=1, max_delay=0.0, now=0.0)


# -- buckets and padding ------------------------------------------------------------------------

def test_buckets_are_powers_of_two_then_max_batch():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert batch_buckets(1) == (1,)
    with pytest.raises(ValueError):
        batch_buckets(0)


def test_compiled_networks_add_the_halfway_sizes_from_eight_rows():
    """A torch.compile'd network serves every size with one compiled code, so it pads less:
    the H200's expert batches of 33-48 rows run at 48, not 64."""
    assert compile_buckets(64) == (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
    assert compile_buckets(48) == (1, 2, 4, 8, 12, 16, 24, 32, 48)
    assert compile_buckets(40) == (1, 2, 4, 8, 12, 16, 24, 32, 40)
    assert compile_buckets(8) == (1, 2, 4, 8) and compile_buckets(1) == (1,)
    assert bucket_for(33, compile_buckets(64)) == 48 and bucket_for(49, compile_buckets(64)) == 64
    with pytest.raises(ValueError):
        compile_buckets(0)


@pytest.mark.parametrize("rows, bucket", [(1, 1), (3, 4), (4, 4), (17, 32), (33, 48), (48, 48)])
def test_bucket_is_the_smallest_that_fits(rows, bucket):
    assert bucket_for(rows, batch_buckets(48)) == bucket


def test_bucket_refuses_a_batch_over_the_largest():
    with pytest.raises(ValueError, match="exceeds the largest compiled size 8"):
        bucket_for(9, batch_buckets(8))


# -- Batcher ------------------------------------------------------------------------------------

class GatedModel:
    """``run`` doubles x plus the key's offset, records batch sizes, and holds its first call
    until released, so that the test controls what queues up meanwhile."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, key, inputs):
        (x,) = inputs
        self.sizes.append(x.shape[0])
        self.started.set()
        self.release.wait(timeout=10)
        return 2 * x + (100 if key == A else 0)


def rows(values):
    return (np.asarray(values, dtype=np.float32).reshape(-1, 1),)


def test_concurrent_requests_get_their_own_rows_in_one_batch():
    async def scenario():
        model, reports = GatedModel(), []
        batcher = Batcher(model, max_batch=64, max_delay_ms=0, on_batch=reports.append)
        batcher.start()
        first = asyncio.create_task(batcher.submit(V, rows([-1])))
        await asyncio.to_thread(model.started.wait, 10)  # the worker holds the first batch
        values = [[i, i + 0.5] if i % 3 else [i] for i in range(20)]
        tasks = [asyncio.create_task(batcher.submit(V, rows(v))) for v in values]
        await asyncio.sleep(0)  # let every task enqueue (one loop turn, no wall-clock wait)
        model.release.set()
        results = await asyncio.gather(first, *tasks)
        await batcher.close()
        return model.sizes, reports, values, results

    sizes, reports, values, results = asyncio.run(scenario())
    assert sizes == [1, sum(len(v) for v in values)]
    assert [r.images for r in reports] == sizes and len(reports[1].queue_delays) == 20
    np.testing.assert_array_equal(results[0], [[-2]])
    for value, result in zip(values, results[1:]):
        np.testing.assert_array_equal(result, 2 * rows(value)[0])


def test_a_batch_s_report_says_whose_each_request_was_and_its_rows():
    """A batcher shared by several models (a pool's group of experts) splits each batch's
    report by the requests' tags."""
    async def scenario():
        model, reports = GatedModel(), []
        batcher = Batcher(model, max_batch=64, max_delay_ms=0, on_batch=reports.append)
        batcher.start()
        first = asyncio.create_task(batcher.submit(V, rows([0]), tag="a"))
        await asyncio.to_thread(model.started.wait, 10)
        later = [asyncio.create_task(batcher.submit(V, rows(v), cost=len(v) + 1, tag=tag))
                 for v, tag in (([1, 2], "b"), ([3], "a"), ([4], None))]
        await asyncio.sleep(0)
        model.release.set()
        await asyncio.gather(first, *later)
        await batcher.close()
        return reports

    first, second = asyncio.run(scenario())
    assert (first.tags, first.costs) == (("a",), (1,))
    assert (second.tags, second.costs, second.images) == (("b", "a", None), (3, 2, 2), 7)
    assert len(second.queue_delays) == 3


def test_different_keys_run_in_separate_batches():
    async def scenario():
        model = GatedModel()
        batcher = Batcher(model, max_batch=64, max_delay_ms=0)
        batcher.start()
        first = asyncio.create_task(batcher.submit(V, rows([0])))
        await asyncio.to_thread(model.started.wait, 10)
        tasks = [asyncio.create_task(batcher.submit(k, rows([i])))
                 for i, k in enumerate([A, V, A, V])]
        await asyncio.sleep(0)
        model.release.set()
        results = await asyncio.gather(first, *tasks)
        await batcher.close()
        return model.sizes, results

    sizes, results = asyncio.run(scenario())
    assert sizes == [1, 2, 2]
    assert [r.item() for r in results[1:]] == [100, 2, 104, 6]


def test_a_model_error_reaches_every_request_of_the_batch_and_the_batcher_goes_on():
    calls = []

    def run(key, inputs):
        calls.append(inputs[0].shape[0])
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return inputs[0]

    async def scenario():
        batcher = Batcher(run, max_batch=4, max_delay_ms=0)
        batcher.start()
        with pytest.raises(RuntimeError, match="device lost"):
            await batcher.submit(V, rows([1]))
        result = await batcher.submit(V, rows([3]))
        await batcher.close()
        return result

    np.testing.assert_array_equal(asyncio.run(scenario()), [[3]])


def test_close_fails_queued_and_running_requests():
    async def scenario():
        model = GatedModel()
        batcher = Batcher(model, max_batch=1, max_delay_ms=0)
        batcher.start()
        running = asyncio.create_task(batcher.submit(V, rows([1])))
        await asyncio.to_thread(model.started.wait, 10)
        queued = asyncio.create_task(batcher.submit(V, rows([2])))
        await asyncio.sleep(0)
        closing = asyncio.create_task(batcher.close())
        await asyncio.sleep(0)  # close() failed both requests and now waits for the thread
        model.release.set()
        await closing
        outcomes = await asyncio.gather(running, queued, return_exceptions=True)
        with pytest.raises(BatcherClosed):
            await batcher.submit(V, rows([3]))
        return outcomes

    assert all(isinstance(o, BatcherClosed) for o in asyncio.run(scenario()))


def test_submit_refuses_a_request_over_max_batch():
    async def scenario():
        batcher = Batcher(lambda key, inputs: inputs[0], max_batch=2, max_delay_ms=0)
        batcher.start()
        try:
            await batcher.submit(V, rows([1, 2, 3]))
        finally:
            await batcher.close()

    with pytest.raises(ValueError, match="1..2 rows, got 3"):
        asyncio.run(scenario())


class ThreadRecorder:
    """A model that records the thread of every batch and sleeps ``seconds[key]`` (a GIL-free
    wait, as a model's kernels are), returning its input."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds
        self.threads: list[tuple[str, int, str]] = []

    def __call__(self, key, inputs):
        self.threads.append((key, inputs[0].shape[0], threading.current_thread().name))
        time.sleep(self.seconds.get(key, 0.0))
        return inputs[0]


def test_a_short_batch_of_a_known_key_runs_on_the_idle_event_loop():
    model = ThreadRecorder({})

    async def scenario():
        batcher = Batcher(model, max_batch=8, max_delay_ms=0)
        batcher.start()
        first = await batcher.submit(V, rows([1]))  # V unknown: the model thread
        second = await batcher.submit(V, rows([2, 3]))  # V took ~0 s: on the loop
        third = await batcher.submit(A, rows([4]))  # A unknown: the model thread
        await batcher.close()
        return first, second, third

    first, second, third = asyncio.run(scenario())  # the loop runs on this, the main, thread
    assert model.threads == [(V, 1, "ddm-model"), (V, 2, "MainThread"), (A, 1, "ddm-model")]
    assert [r.ravel().tolist() for r in (first, second, third)] == [[1], [2, 3], [4]]


def test_concurrent_requests_batch_on_the_model_thread_even_for_a_fast_key():
    """Requests read in the same loop turn form one batch, and several requests mean others
    are waiting: the thread runs it while the loop goes on parsing."""
    model = ThreadRecorder({})

    async def scenario():
        batcher = Batcher(model, max_batch=8, max_delay_ms=0)
        batcher.start()
        await batcher.submit(V, rows([0]))  # V known and fast from here on
        results = await asyncio.gather(*(batcher.submit(V, rows([i])) for i in (1, 2, 3)))
        await batcher.close()
        return results

    results = asyncio.run(scenario())
    assert model.threads == [(V, 1, "ddm-model"), (V, 3, "ddm-model")]
    assert [r.item() for r in results] == [1, 2, 3]


def test_a_batch_expected_over_the_inline_bound_runs_on_the_model_thread():
    """A's first batch took over INLINE_MAX_S; V's batch of 1 took a fifth of it, so a batch of
    6 (expected 1.2 times the bound) goes to the thread, and a batch of 1 (expected what the
    batch of 6 took: never scaled down) to the loop."""
    model = ThreadRecorder({A: INLINE_MAX_S * 1.2, V: INLINE_MAX_S * 0.2})

    async def scenario():
        batcher = Batcher(model, max_batch=8, max_delay_ms=0)
        batcher.start()
        for key, values in ((A, [1]), (A, [2]), (V, [3]), (V, [4, 5, 6, 7, 8, 9]), (V, [6])):
            await batcher.submit(key, rows(values))
        await batcher.close()

    asyncio.run(scenario())
    assert [thread for _, _, thread in model.threads] == [
        "ddm-model", "ddm-model", "ddm-model", "ddm-model", "MainThread"]


def test_the_loop_ticks_from_near_a_thread_batch_s_expected_end_until_it_is_delivered():
    """Hybrid polling: while the model thread runs a batch whose time is known, the loop
    wakes every WARM_TICK_S from WARM_AFTER of that time on (never before), and stops once
    nothing runs; a key not seen yet, or a batch run on the loop, schedules no tick."""
    first_s = INLINE_MAX_S * 1.2
    model = ThreadRecorder({A: first_s})
    ticks: list[float] = []

    class Recording(Batcher):
        def _next_tick_s(self) -> float | None:  # asked at each tick
            ticks.append(asyncio.get_running_loop().time())
            return super()._next_tick_s()

    async def idle(batcher: Batcher) -> None:
        ticks_here = batcher._ticks[asyncio.get_running_loop()]
        while ticks_here.ticking:  # the chain ends at its first tick after the batch
            await asyncio.sleep(WARM_TICK_S)

    async def scenario():
        loop = asyncio.get_running_loop()
        batcher = Recording(model, max_batch=8, max_delay_ms=0)
        batcher.start()
        await batcher.submit(A, rows([1]))  # A not seen yet: the thread, no estimate, no tick
        after_unknown = len(ticks)
        model.seconds[A] = 10 * first_s  # longer than expected: ticks until it ends
        submitted = loop.time()
        await batcher.submit(A, rows([2]))  # expected past the bound: the thread, ticks
        delivered = loop.time()
        await asyncio.wait_for(idle(batcher), 10)
        on_thread = list(ticks)
        await batcher.submit(V, rows([3]))  # V not seen yet: the thread, no tick
        await batcher.submit(V, rows([4]))  # V fast: the loop, no tick
        await batcher.close()
        return after_unknown, submitted, delivered, on_thread

    after_unknown, submitted, delivered, on_thread = asyncio.run(scenario())
    assert after_unknown == 0
    assert on_thread[0] >= submitted + WARM_AFTER * first_s - 0.002  # the loop's clock: ms
    assert sum(tick < delivered for tick in on_thread) >= 2  # while the batch ran
    assert ticks == on_thread  # they stopped (idle() returned), and none came for V
    assert [thread for _, _, thread in model.threads][-2:] == ["ddm-model", "MainThread"]


# -- Batcher on several event loops (an expert server's loops: ddm.serving.http.server) ------------

class LoopThread:
    """An event loop running in a thread of its own, as each of a server's loops does."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coroutine):
        """Start ``coroutine`` on this loop; its concurrent future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def turn(self) -> None:
        """Return once everything scheduled on this loop so far has taken its first step."""
        async def nothing() -> None:
            pass
        self.run(nothing()).result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def loop_threads():
    made: list[LoopThread] = []

    def make(*names: str) -> list[LoopThread]:
        made.extend(LoopThread(name) for name in names)
        return made[-len(names):]

    yield make
    for loop in made:
        loop.close()


class GatedRecorder(GatedModel):
    """A GatedModel that also records each batch's size and thread."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[tuple[int, str]] = []

    def __call__(self, key, inputs):
        self.threads.append((inputs[0].shape[0], threading.current_thread().name))
        return super().__call__(key, inputs)


def test_with_another_loop_serving_a_lone_batch_of_any_time_runs_on_the_loop_it_came_on():
    """With ``serving_loops=2`` another loop answers meanwhile, so the bound no longer
    applies: a key not seen yet and one known to take over INLINE_MAX_S both run on the
    submitting loop, with no thread hop (the same requests go to the thread with one loop:
    test_a_batch_expected_over_the_inline_bound_runs_on_the_model_thread)."""
    model = ThreadRecorder({A: INLINE_MAX_S * 1.2})

    async def scenario():
        batcher = Batcher(model, max_batch=8, max_delay_ms=0, serving_loops=2)
        batcher.start()
        results = [await batcher.submit(A, rows([value])) for value in (1, 2)]
        await batcher.close()
        return results

    results = asyncio.run(scenario())
    assert model.threads == [(A, 1, "MainThread"), (A, 1, "MainThread")]
    assert [r.item() for r in results] == [1, 2]


def test_requests_from_several_loops_batch_together_and_each_loop_gets_its_own_rows(
        loop_threads):
    """A lone request runs on loop B (held there); requests that loops C and D queue
    meanwhile wait for it, then run as one batch on the model thread, and each comes back on
    the loop it came on; the batch is reported once."""
    model, reports = GatedRecorder(), []
    batcher = Batcher(model, max_batch=64, max_delay_ms=0, on_batch=reports.append,
                      serving_loops=2)
    batcher.start()
    b, c, d = loop_threads("loop-b", "loop-c", "loop-d")
    first = b.run(batcher.submit(V, rows([-1])))
    assert model.started.wait(10)  # running on loop B, which answers nothing until released
    on_c = c.run(batcher.submit(V, rows([1])))
    on_d = d.run(batcher.submit(V, rows([2, 3])))
    c.turn()
    d.turn()  # both are queued behind B's batch
    model.release.set()
    results = [future.result(10) for future in (first, on_c, on_d)]
    c.run(batcher.close()).result(20)
    assert model.threads == [(1, "loop-b"), (3, "ddm-model")]
    assert [r.ravel().tolist() for r in results] == [[-2], [2], [4, 6]]
    # each batch reported once, by a loop of its own: in either order
    assert sorted(report.images for report in reports) == [1, 3]


def test_close_on_one_loop_fails_the_requests_queued_on_another(loop_threads):
    """close() on loop D fails loop C's queued request on loop C at once; the batch loop B
    runs meanwhile ends there with its rows (B answers nothing until then, so it is
    delivered before the failure close() sent it)."""
    model = GatedRecorder()
    batcher = Batcher(model, max_batch=64, max_delay_ms=0, serving_loops=2)
    batcher.start()
    b, c, d = loop_threads("loop-b", "loop-c", "loop-d")
    running = b.run(batcher.submit(V, rows([1])))
    assert model.started.wait(10)
    queued = c.run(batcher.submit(V, rows([2])))
    c.turn()
    closing = d.run(batcher.close())
    with pytest.raises(BatcherClosed):
        queued.result(10)  # failed on loop C while loop B still runs its batch
    model.release.set()
    closing.result(20)
    assert running.result(10).ravel().tolist() == [2]
    assert model.threads == [(1, "loop-b")]


def test_while_a_batch_runs_new_requests_queue_for_the_model_thread_and_the_loop_stays_free():
    """A busy batcher hands arrivals to the thread, so the event loop keeps answering (here:
    a coroutine that only sleeps) while they wait; they form one batch."""
    model = GatedModel()

    async def scenario():
        batcher = Batcher(model, max_batch=8, max_delay_ms=0)
        batcher.start()
        await asyncio.to_thread(model.release.set)
        await batcher.submit(V, rows([0]))  # V is known and fast from here on
        model.release.clear()
        model.started.clear()
        running = asyncio.create_task(batcher.submit(A, rows([1])))  # unknown: the thread
        await asyncio.to_thread(model.started.wait, 10)
        queued = [asyncio.create_task(batcher.submit(V, rows([i]))) for i in (2, 3)]
        await asyncio.sleep(0.01)  # the loop is free while the model thread is held
        model.release.set()
        results = await asyncio.gather(running, *queued)
        await batcher.close()
        return results

    results = asyncio.run(scenario())
    assert model.sizes == [1, 1, 2]
    assert [r.item() for r in results] == [102, 4, 6]


def test_with_a_delay_requests_wait_for_each_other_until_the_batch_is_full():
    """A delay long enough never to expire here: the batch leaves because it is full."""
    model = GatedModel()
    model.release.set()

    async def scenario():
        batcher = Batcher(model, max_batch=3, max_delay_ms=60_000)
        batcher.start()
        results = await asyncio.gather(*(batcher.submit(V, rows([i])) for i in range(3)))
        await batcher.close()
        return results

    results = asyncio.run(scenario())
    assert model.sizes == [3]
    assert [r.item() for r in results] == [0, 2, 4]


def test_a_request_cancelled_while_queued_is_dropped_unrun():
    async def scenario():
        model = GatedModel()
        batcher = Batcher(model, max_batch=1, max_delay_ms=0)
        batcher.start()
        first = asyncio.create_task(batcher.submit(V, rows([1])))
        await asyncio.to_thread(model.started.wait, 10)
        gone = asyncio.create_task(batcher.submit(V, rows([2])))
        kept = asyncio.create_task(batcher.submit(V, rows([3])))
        await asyncio.sleep(0)
        gone.cancel()
        model.release.set()
        results = await asyncio.gather(first, kept)
        await batcher.close()
        return model.sizes, results, gone.cancelled()

    sizes, results, cancelled = asyncio.run(scenario())
    assert cancelled and sizes == [1, 1]
    assert [r.item() for r in results] == [2, 6]


def test_an_integration_grid_is_sliced_into_pieces_that_chain_end_to_start():
    grid = np.linspace(0.0, 1.0, 2 * INTEGRATE_SLICE_STEPS + 6, dtype=np.float32)
    pieces = list(grid_slices(grid))
    assert [len(p) - 1 for p in pieces] == [INTEGRATE_SLICE_STEPS, INTEGRATE_SLICE_STEPS, 5]
    assert all(a[-1] == b[0] for a, b in zip(pieces, pieces[1:]))
    np.testing.assert_array_equal(np.concatenate([pieces[0], *(p[1:] for p in pieces[1:])]),
                                  grid)


def test_a_request_cancelled_before_its_batch_is_decided_is_dropped_and_the_rest_still_run():
    """The first request of an idle batcher decides the batch one loop turn later; cancelled
    in that turn, it is dropped unrun and the request queued behind it still runs."""
    model = ThreadRecorder({})

    async def scenario():
        batcher = Batcher(model, max_batch=1, max_delay_ms=0)
        batcher.start()
        first = asyncio.create_task(batcher.submit(V, rows([1])))
        second = asyncio.create_task(batcher.submit(V, rows([2])))
        await asyncio.sleep(0)  # both queued; the first waits out its turn
        first.cancel()
        result = await asyncio.wait_for(second, 10)  # not left queued for ever
        await batcher.close()
        return result, first.cancelled()

    result, cancelled = asyncio.run(scenario())
    assert cancelled and result.item() == 2
    assert [size for _, size, _ in model.threads] == [1]


class ThreadCounts:
    """A model that records the PyTorch intra-op threads each batch ran with; with ``gate``,
    it holds its first call until released."""

    def __init__(self, gate: bool = False) -> None:
        self.counts: list[int] = []
        self.started = threading.Event()
        self.release = threading.Event()
        if not gate:
            self.release.set()

    def __call__(self, key, inputs):
        import torch

        self.counts.append(torch.get_num_threads())
        self.started.set()
        self.release.wait(timeout=10)
        return inputs[0]


def test_members_of_one_process_split_its_threads_while_both_have_work():
    import torch

    async def scenario():
        share = CpuShare(2)
        first, second = ThreadCounts(gate=True), ThreadCounts()
        batchers = [Batcher(first, 8, 0, cpu=share), Batcher(second, 8, 0, cpu=share)]
        for batcher in batchers:
            batcher.start()
        held = asyncio.create_task(batchers[0].submit(V, rows([1])))
        await asyncio.to_thread(first.started.wait, 10)  # alone: both threads
        await batchers[1].submit(V, rows([2]))  # while the first runs: one each
        dropped = asyncio.create_task(batchers[0].submit(V, rows([3])))  # queued, then gone
        await asyncio.sleep(0)
        dropped.cancel()
        first.release.set()
        await held
        await batchers[1].submit(V, rows([4]))  # alone again: the queue dropped the gone one
        for batcher in batchers:
            await batcher.close()
        return first.counts, second.counts, share.threads()

    before = torch.get_num_threads()
    try:
        first, second, idle = asyncio.run(scenario())
    finally:
        torch.set_num_threads(before)
    assert first == [2] and second == [1, 2] and idle == 2
