"""How a model server serves, as two small frozen objects instead of long keyword lists.

:class:`ServingOptions` is what an operator chooses (``ddm serve expert|stage|pool``'s flags,
built once from the command line): where the server listens, who may call it, where and how
precisely the models run, and the limits and batching every member applies. :class:`Hooks` is
what the running process lends its app (:class:`~ddm.serving.http.server.ServerControl`'s start-up
thread, failure report and draining flag) and what tests replace (the stage loader, the
cgroup root the memory check reads). Both are checked once, when they are made, so that a
wrong flag fails before anything loads.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

from ddm.deploy.limits import (DEFAULT_CONTEXT_CACHE_BYTES, EXPERT_BACKENDS, EXPERT_PORT,
                               GROUPED_FORWARD_MODES, MAX_BATCH, MAX_CONTEXT_CACHE_BYTES,
                               MAX_SERVER_DELAY_MS, MAX_STEPS, PRECISIONS, SERVER_MAX_BATCH,
                               SERVER_MAX_DELAY_MS, SERVER_MAX_PENDING, compile_refusal)
from ddm.serving.http.auth import TokenFile
from ddm.serving.http.server import ServerControl
from ddm.models.stages import Stage, load_stage
from ddm.threads import CpuShare

__all__ = ["Hooks", "ServingOptions", "StageLoader", "StartUp"]

#: Runs the loading off the event loop: ``await start_up(work)`` is ``work()``'s result.
StartUp = Callable[[Callable[[], Any]], Awaitable[Any]]
#: ``(directory, precision, device, backend, batch_sizes, compile_cache) -> Stage``:
#: :func:`~ddm.models.stages.load_stage`, or a replacement that serves a custom stage.
StageLoader = Callable[[Path, str | None, str | None, str, Sequence[int], Path | None], Stage]


@dataclass(frozen=True)
class ServingOptions:
    """Every model server's settings, for each of its members alike.

    ``host``/``port``: where it listens; ``log_level``, ``drain_s`` (serving on after
    SIGTERM), ``metrics_port`` (``/metrics`` there only), ``api_docs`` (Swagger UI at
    ``/docs``) and ``auth_token_file`` (``/v1/*`` needs its bearer token): the process's.
    ``backend``/``device``/``precision``: where the models run and in which dtype
    (``precision`` casts stage checkpoints; label checkpoints serve as stored); ``compile``:
    ``torch.compile``'s mode for the torch networks (experts, router network; ``none``:
    eager; :mod:`ddm.serving.model.compiled`), refused on another backend;
    ``grouped_forward``: whether a pool's same-architecture experts run as one forward
    (:data:`~ddm.deploy.limits.GROUPED_FORWARD_MODES`, :mod:`ddm.serving.model.grouped`).
    ``max_batch`` forward rows per model call, ``max_delay_ms`` of waiting for more,
    ``max_steps`` grid intervals per integrate request, ``max_pending`` requests admitted per
    member, ``context_cache_bytes`` of a text expert's contexts, ``compile_cache`` (Neuron's
    traced models) and ``memory_limit_bytes`` (the memory check's limit; None: the device's
    or the container's)."""

    host: str = "127.0.0.1"
    port: int = EXPERT_PORT
    log_level: str = "info"
    drain_s: float = 0.0
    metrics_port: int | None = None
    api_docs: bool = False
    auth_token_file: str | os.PathLike[str] | None = None
    backend: str = "torch"
    device: str | None = None
    precision: str | None = None
    compile: str = "none"
    grouped_forward: str = "auto"
    max_batch: int = SERVER_MAX_BATCH
    max_delay_ms: float = SERVER_MAX_DELAY_MS
    max_steps: int = MAX_STEPS
    max_pending: int = SERVER_MAX_PENDING
    context_cache_bytes: int = DEFAULT_CONTEXT_CACHE_BYTES
    compile_cache: Path | None = None
    memory_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in EXPERT_BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; known: "
                             f"{', '.join(EXPERT_BACKENDS)}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; expected one of "
                             f"{', '.join(PRECISIONS)}")
        if self.grouped_forward not in GROUPED_FORWARD_MODES:
            raise ValueError(f"--grouped-forward must be one of "
                             f"{', '.join(GROUPED_FORWARD_MODES)}, got {self.grouped_forward!r}")
        refusal = compile_refusal(self.compile, self.backend)
        if refusal is not None:
            raise ValueError(f"--{refusal}")
        # Named by their flags (ddm serve's), where a user sets them.
        for name in ("max_steps", "max_pending"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        # A deployment's bound (its maxBatch): every router refuses the report of a larger
        # batch, so such a server would be ready yet unused.
        if not 1 <= self.max_batch <= MAX_BATCH:
            raise ValueError(f"--max-batch must be in 1..{MAX_BATCH}, got {self.max_batch}")
        if not 0 <= self.max_delay_ms <= MAX_SERVER_DELAY_MS:
            raise ValueError(f"--max-delay-ms must be in 0..{MAX_SERVER_DELAY_MS}, got "
                             f"{self.max_delay_ms}")
        if not 1 <= self.context_cache_bytes <= MAX_CONTEXT_CACHE_BYTES:
            raise ValueError(f"--context-cache-bytes must be in 1..{MAX_CONTEXT_CACHE_BYTES}, "
                             f"got {self.context_cache_bytes}")
        if self.memory_limit_bytes is not None and self.memory_limit_bytes < 1:
            raise ValueError(f"--memory-limit-bytes must be >= 1, got "
                             f"{self.memory_limit_bytes}")
        if self.auth_token_file is not None:
            TokenFile(self.auth_token_file)  # unreadable, empty or malformed: fail now


@dataclass(frozen=True)
class Hooks:
    """What runs the app: ``start_up(work)`` loads off the event loop (a process's
    :meth:`~ddm.serving.http.server.ServerControl.start_up`), ``on_failure(reason)`` is told when a
    member cannot load, ``draining()`` is true after SIGTERM (``/readyz`` answers 503), and
    ``serving_loops`` event loops serve the app (the batcher's rule:
    :class:`~ddm.serving.batching.Batcher`). ``loader`` loads each member's stage
    (replaceable to serve a custom one); ``cgroup_root`` is where the memory check reads the
    container's limit; ``cpu`` shares the process's CPU threads among the members' forwards
    (None: each forward keeps its thread's count, as in a test's process)."""

    start_up: StartUp = asyncio.to_thread
    on_failure: Callable[[str], None] | None = None
    draining: Callable[[], bool] | None = None
    serving_loops: int = 1
    loader: StageLoader = load_stage
    cgroup_root: Path = Path("/sys/fs/cgroup")
    cpu: CpuShare | None = None

    @classmethod
    def of(cls, control: ServerControl, serving_loops: int) -> Hooks:
        """The hooks of a server process run by :func:`~ddm.serving.http.server.run_server`."""
        return cls(start_up=control.start_up, on_failure=control.stop,
                   draining=lambda: control.draining, serving_loops=serving_loops,
                   cpu=CpuShare.for_server())
