"""How many CPU threads a command that computes in this process (``ddm sample``, ``ddm eval``,
``ddm report``) gives PyTorch, OpenMP and XLA.

The frameworks' default, a spinning thread per core, collapses on a shared machine: an OpenMP
barrier waits for its slowest thread, and a thread the kernel gave to another process leaves the
others spinning on the cores that remain (docs/benchmarks.md, "In-process sampling and CPU
threads"). So a command takes the cores it may use (its CPU affinity and its cgroup's quota)
less those the machine's other work keeps busy (the one-minute load average), at least one, and
lets waiting threads sleep. ``DDM_CPU_THREADS`` overrides: a count, or ``framework`` for the
frameworks' own defaults; an ``OMP_NUM_THREADS`` the user set is respected.

A model server shares its threads among its members' forwards (:class:`CpuShare`).

``DDM_EXPERT_WORKERS`` (:func:`expert_parallelism`) runs a sampling step's experts in that many
threads sharing the same budget; off by default, as it was not measured faster.

A model server caps glibc's malloc arenas (:func:`cap_malloc_arenas`): its event loops and
batcher threads would each get an arena of their own, whose freed pages stay in the process.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import threading
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

#: The variable that overrides the policy: a positive count, or ``framework``.
THREADS_ENV = "DDM_CPU_THREADS"
LEAVE_TO_FRAMEWORKS = "framework"
_CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cpus(affinity: int | None = None, cpu_max: str | None = None) -> int:
    """The CPUs this process may run on: its affinity mask, capped by a cgroup v2 quota
    (``cpu.max``: ``QUOTA PERIOD`` or ``max PERIOD``), rounded up; at least 1."""
    if affinity is None:
        affinity = len(os.sched_getaffinity(0))
    if cpu_max is None:
        try:
            cpu_max = _CGROUP_CPU_MAX.read_text()
        except OSError:
            cpu_max = "max"
    quota, _, period = cpu_max.strip().partition(" ")
    if quota.isdigit() and period.isdigit() and int(period) > 0:
        affinity = min(affinity, math.ceil(int(quota) / int(period)))
    return max(1, affinity)


def cpu_threads(env: Mapping[str, str], usable: int, load: float) -> int | None:
    """The intra-op thread count for ``usable`` CPUs at a one-minute ``load`` average, or None
    to leave the frameworks to their defaults (``framework``, or ``OMP_NUM_THREADS`` set)."""
    raw = env.get(THREADS_ENV, "").strip()
    if raw == LEAVE_TO_FRAMEWORKS or (not raw and env.get("OMP_NUM_THREADS")):
        return None
    if raw:
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{THREADS_ENV}={raw!r}: give a positive thread count, or "
                             f"{LEAVE_TO_FRAMEWORKS!r} for the frameworks' defaults")
        return int(raw)
    return max(1, min(usable, usable - round(load)))


def apply_cpu_thread_policy(env: MutableMapping[str, str] | None = None,
                            set_torch_threads: Callable[[int], None] | None = None
                            ) -> int | None:
    """Choose the thread count (:func:`cpu_threads`) and set it where the frameworks read it:
    OpenMP's and MKL's variables (with ``OMP_WAIT_POLICY=PASSIVE``: waiting threads sleep) and
    XLA's flags before they load, and PyTorch's pool if it already has. Returns the count, or
    None where the frameworks keep their defaults."""
    env = os.environ if env is None else env
    threads = cpu_threads(env, usable_cpus(), os.getloadavg()[0])
    if threads is None:
        return None
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads == 1 and "--xla_cpu_multi_thread_eigen" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                            + " --xla_cpu_multi_thread_eigen=false").strip()
    if set_torch_threads is None and "torch" in sys.modules:
        set_torch_threads = sys.modules["torch"].set_num_threads
    if set_torch_threads is not None:
        set_torch_threads(threads)
    return threads


#: Inter-op parallelism: how many experts of one step an in-process sampler runs at once
#: (a positive count; 1: one after the other).
EXPERT_WORKERS_ENV = "DDM_EXPERT_WORKERS"
#: Off unless asked for: on the 2-core machines measured it was not faster (docs/benchmarks.md,
#: "threads"), and each worker holds its own activations.
DEFAULT_EXPERT_WORKERS = 1


def expert_parallelism(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(workers, intra-op threads of each) for the experts one sampling step calls: the
    workers share the intra-op budget (``OMP_NUM_THREADS`` as the policy set it, else the
    usable CPUs), so that the total stays within it; never more workers than threads."""
    env = os.environ if env is None else env
    raw = env.get(EXPERT_WORKERS_ENV, "").strip()
    if raw and (not raw.isdigit() or int(raw) < 1):
        raise ValueError(f"{EXPERT_WORKERS_ENV}={raw!r}: give a positive number of experts "
                         "run at once (1: one after the other)")
    budget = env.get("OMP_NUM_THREADS", "")
    threads = int(budget) if budget.isdigit() and int(budget) > 0 else usable_cpus()
    workers = min(int(raw) if raw else DEFAULT_EXPERT_WORKERS, threads)
    return workers, max(1, threads // workers)


#: The malloc arenas a server keeps (glibc's default: eight per core). Two: fewer arenas lower
#: the text2img pool's peak RSS (docs/benchmarks.md, ``pools``).
SERVER_MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's malloc.h
ARENAS_ENV = "MALLOC_ARENA_MAX"


def cap_malloc_arenas(arenas: int = SERVER_MALLOC_ARENAS,
                      env: Mapping[str, str] | None = None) -> bool:
    """Cap this process's glibc malloc arenas at ``arenas`` (``mallopt(M_ARENA_MAX)``), for
    the threads that start after the call; ``MALLOC_ARENA_MAX`` set in the environment is
    left to glibc, which read it at start. Whether the cap was set (False off glibc)."""
    if not arenas >= 1:
        raise ValueError(f"arenas must be >= 1, got {arenas}")
    if ARENAS_ENV in (os.environ if env is None else env):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS): nothing to cap
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, arenas))


def set_torch_threads_here(threads: int) -> None:
    """Give the calling thread's PyTorch ops ``threads`` intra-op threads (OpenMP's count is
    per calling thread), if PyTorch is loaded."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def server_cpu_budget(env: Mapping[str, str] | None = None) -> int:
    """A model server's intra-op threads: ``OMP_NUM_THREADS`` where set (``ddm up`` sets it,
    a user may), else the CPUs the process may use (:func:`usable_cpus`). Not the
    frameworks' default: a thread per core of the node, whatever the container's CPU limit."""
    env = os.environ if env is None else env
    raw = env.get("OMP_NUM_THREADS", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else usable_cpus()


class CpuShare:
    """A model server's intra-op threads (``budget``), shared by its members' forwards: a
    forward takes ``budget // busy`` of them (at least one) on the thread that runs it,
    ``busy`` being the members with a batch queued or running. So a forward that runs alone
    (a pool's router network between two expert steps, its text encoder, its decoder) takes
    them all, and experts that run at once split them instead of each spinning ``budget``
    threads on the same cores. A count is set only where it changes (PyTorch's is per calling
    thread, as OpenMP's; setting it clears oneDNN's primitive cache); JAX's are fixed at
    start."""

    def __init__(self, budget: int,
                 set_threads: Callable[[int], None] = set_torch_threads_here) -> None:
        if budget < 1:
            raise ValueError(f"a CPU budget is at least one thread, got {budget}")
        self.budget = budget
        self._set_threads = set_threads
        self._busy = 0
        self._lock = threading.Lock()
        self._here = threading.local()  # the count last set on each thread

    @classmethod
    def for_server(cls, env: MutableMapping[str, str] | None = None) -> CpuShare:
        """The share of this server process (:func:`server_cpu_budget`), made the process's
        default too (threads that run no forward, those a framework starts later)."""
        env = os.environ if env is None else env
        budget = server_cpu_budget(env)
        env.setdefault("OMP_NUM_THREADS", str(budget))
        env.setdefault("MKL_NUM_THREADS", str(budget))
        set_torch_threads_here(budget)
        return cls(budget)

    def busy(self, now: bool) -> None:
        """A member turned busy (a batch queued or running: True) or idle (False)."""
        with self._lock:
            self._busy += 1 if now else -1
            assert self._busy >= 0, "a member turned idle twice"

    def threads(self) -> int:
        """A forward's share now."""
        return max(1, self.budget // max(1, self._busy))

    def claim(self) -> int:
        """Before a forward, on the thread that runs it: give the thread its share."""
        threads = self.threads()
        if getattr(self._here, "threads", None) != threads:
            self._set_threads(threads)
            self._here.threads = threads
        return threads
