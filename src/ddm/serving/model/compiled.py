"""A model server's torch networks under ``torch.compile`` (``--compile MODE``; issue 37).

A compiled network runs at a few batch sizes only, so that each compiles once and, in
``reduce-overhead`` mode, its CUDA graph (recorded for one static shape) is replayed: every
call is padded to the smallest bucket of :func:`~ddm.deploy.limits.compile_buckets` that
holds its rows (repeating the last row, so padded rows stay valid inputs) and its output
sliced back (:func:`bucketed`), and the member runs every bucket once while it warms up,
before ``/readyz`` says ready. Rows are independent in every network we serve, so padding
changes no row's value.

Every compiled call of the process runs on one thread (:func:`on_compiled_thread`):
``torch.compile``'s CUDA-graph trees are kept per thread, so graphs recorded at warm-up
(in a start-up worker) would be recorded again, and their memory pool held twice, by each
thread a batch later runs on (the batcher's model thread, the event loops). Before each call
in ``reduce-overhead`` mode the thread marks a new step
(``torch.compiler.cudagraph_mark_step_begin``): each call is a generation of its own, whose
outputs are copied to NumPy before the next.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

import numpy as np

from ddm.conditioning import Conditioning
from ddm.serving.batching import bucket_for

__all__ = ["CUDA_GRAPHS", "WARM_TEXT_TOKENS", "bucketed", "on_compiled_thread"]

#: The compile mode that records CUDA graphs (on a GPU; on a CPU it compiles as ``default``).
CUDA_GRAPHS = "reduce-overhead"
#: The tokens per row a compiled text expert warms up with: CLIP's 77, what Paris's (every
#: ``clip-text`` encoder with CLIP's tokenizer) contexts carry. Contexts of another length
#: compile at their first call (then dynamo makes the length dynamic: one compile more).
WARM_TEXT_TOKENS = 77

Result = TypeVar("Result")
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def on_compiled_thread(mode: str, run: Callable[..., Result]) -> Callable[..., Result]:
    """``run`` made to run on the process's one compiled-model thread (module doc), a new
    CUDA-graph step marked first in ``reduce-overhead`` mode; the caller waits for it."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddm-compiled")
        executor = _executor

    def call(*args: Any) -> Result:
        if mode == CUDA_GRAPHS:
            import torch

            torch.compiler.cudagraph_mark_step_begin()
        return run(*args)

    def on_thread(*args: Any) -> Result:
        return executor.submit(call, *args).result()

    return on_thread


def bucketed(forward: Callable[..., np.ndarray], buckets: Sequence[int]
             ) -> Callable[..., np.ndarray]:
    """``forward(*rows)`` (arrays or :class:`~ddm.conditioning.Conditioning` with the batch
    on axis 0, or None) padded to the smallest of ``buckets`` that holds the rows, its
    output (B, ...) cut back to them."""

    def padded(*args: np.ndarray | Conditioning | None) -> np.ndarray:
        first = args[0]
        assert first is not None, "the first input carries the rows"
        rows = len(first)
        index = np.minimum(np.arange(bucket_for(rows, buckets)), rows - 1)
        return forward(*(_take(arg, index) for arg in args))[:rows]

    return padded


def _take(arg: np.ndarray | Conditioning | None, index: np.ndarray
          ) -> np.ndarray | Conditioning | None:
    if arg is None:
        return None
    if isinstance(arg, Conditioning):
        return arg.take(index)
    return np.asarray(arg)[index]
