"""What an expert served on two event loops (ddm.serving.http.server's ``loops``) shares between
them: state touched from both loops' threads."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ddm.serving.http.auth import TokenFile
from ddm.serving.batching import Batcher, BatcherClosed
from ddm.serving.model.member import Member
from ddm.serving.model.options import Hooks


def _replace(path: Path, content: bytes) -> None:
    """Rewrite ``path`` as the kubelet updates a Secret: a new file renamed over the old."""
    fresh = path.with_name(path.name + ".new")
    fresh.write_bytes(content)
    os.replace(fresh, path)


def test_a_token_read_on_one_loop_during_a_rotation_read_on_another_never_sticks(tmp_path):
    """Two loops re-read a rotated token at once; the one whose read finishes last read the
    older file. The token kept afterwards is the file's, not the older one for good (which
    would refuse the router's new token until the Secret changes again)."""
    path = tmp_path / "token"
    path.write_bytes(b"zero")
    held, reached, go = [], threading.Event(), threading.Event()

    class HeldTokenFile(TokenFile):
        def _read(self):  # type: ignore[no-untyped-def]
            result = super()._read()
            if threading.current_thread() in held:  # preempted just after reading
                reached.set()
                assert go.wait(10)
            return result

    tokens = HeldTokenFile(path)
    _replace(path, b"one11")
    first = threading.Thread(target=tokens.token, name="loop-a")
    held.append(first)
    first.start()
    assert reached.wait(10)  # loop A read "one11" and is about to keep it
    _replace(path, b"two222")
    assert tokens.token() == b"two222"  # loop B reads the newest
    go.set()
    first.join(10)
    assert tokens.token() == b"two222"


def test_the_backend_is_published_only_once_the_batcher_runs():
    """The routes on the other loop take ``expert.backend`` set as "ready" and submit at once:
    it must not be seen before the batcher has started (that request would get a 503 "the
    batcher is not running" from a server about to say it is ready)."""
    seen_at_start = []

    class Recording(Batcher):
        def start(self) -> None:
            seen_at_start.append(expert.backend)
            super().start()

    backend = SimpleNamespace(info=lambda: SimpleNamespace(backend="fake", framework="fake",
                                                           device="cpu"))
    expert = SimpleNamespace(who="expert e", backend=None, failure=None,
                             batcher=Recording(lambda key, inputs: inputs[0], 4, 0.0,
                                               serving_loops=2),
                             load_and_warm=lambda: None)
    expert.publish = lambda loaded: setattr(expert, "backend", loaded)

    async def start_up(work):  # the loaded backend, without loading anything
        return backend

    async def scenario() -> None:
        await Member.load(expert, Hooks(start_up=start_up))  # type: ignore[arg-type]
        await expert.batcher.close()

    asyncio.run(scenario())
    assert expert.backend is backend
    assert seen_at_start == [None]


def test_a_request_submitted_on_one_loop_as_another_closes_the_batcher_is_failed():
    """close() on one loop while another loop's submit() has passed its "closed?" check but
    not yet queued: that request must fail with BatcherClosed, not wait for ever (the model
    thread is gone and close() has already failed the queue it saw)."""
    reached, go = threading.Event(), threading.Event()

    class HeldRows:
        """An input whose row count is read by submit() between its check and its queueing."""

        def __init__(self) -> None:
            self.array = np.ones((1, 1), np.float32)

        @property
        def shape(self):  # type: ignore[no-untyped-def]
            reached.set()
            assert go.wait(10)
            return self.array.shape

    batcher = Batcher(lambda key, inputs: inputs[0], 4, 0.0, serving_loops=2)
    batcher.start()
    other = asyncio.new_event_loop()
    runner = threading.Thread(target=other.run_forever, name="loop-b", daemon=True)
    runner.start()
    try:
        late = asyncio.run_coroutine_threadsafe(batcher.submit("v", (HeldRows(),)), other)
        assert reached.wait(10)
        asyncio.run(batcher.close())  # on this thread's loop, meanwhile
        go.set()
        with pytest.raises(BatcherClosed):
            late.result(10)
    finally:
        go.set()
        other.call_soon_threadsafe(other.stop)
        runner.join(10)
        other.close()
