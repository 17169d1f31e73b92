"""What ``python -m benchmarks serve`` runs: two deployments of the shipped example started
as ``ddm up`` starts them (experts at ``--max-batch 64`` and at ``--max-batch 1``, each with its
router) and one reference-protocol server per expert, all on loopback, started together and
stopped after."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

from ddm.deploy.spec import DDMManifest
from ddm.deploy.plan import plan_expert
from ddm.runtime.local import (REPOSITORY_ROOT, HeldPorts, LocalPlan, ProcessSpec, Supervisor,
                               free_port, plan_local, resolve_checkpoint)
from benchmarks.figures import BIG_BATCH
from benchmarks.loopback import one_client_router

HOST = "127.0.0.1"
#: Concurrent generations (and one-row velocity calls) in the batching figure.
CONCURRENT = 64


class BenchError(RuntimeError):
    """A server answered something other than a result."""


@dataclass(frozen=True)
class Fleet:
    """What runs: a deployment with dynamic batching, one without, and reference servers."""

    batched: LocalPlan
    unbatched: LocalPlan
    reference: tuple[str, ...]  # host:port per expert, in the manifest's (router's) order
    batched_pids: tuple[int, ...] = ()  # the batched deployment's router and experts


def cpu_seconds(pids: tuple[int, ...]) -> float | None:
    """CPU time the processes' threads have run so far, in seconds, from the scheduler's
    nanosecond counters (``/proc/PID/task/TID/schedstat``); None where Linux does not keep
    them. Threads that ended are not counted, so read it around work, not across restarts."""
    total = 0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return None
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
                    total += int(stat.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # the thread ended meanwhile
    return total / 1e9


def machine() -> dict[str, Any]:
    """Where the figures come from: a shared machine's load matters, so it is recorded."""
    versions = {}
    for module in ("torch", "jax", "numpy", "aiohttp", "uvicorn", "fastapi"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            versions[module] = None
    return {"platform": platform.platform(), "processor": platform.processor() or None,
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "accelerator": None, "versions": versions,
            "load_average_before": list(os.getloadavg())}


@contextmanager
def running_fleet(manifest: DDMManifest, workdir: Path, log: TextIO,
           servers: list[dict[str, Any]]) -> Iterator[Fleet]:
    """Start every process (experts first, as ``ddm up`` does), yield, then stop them all and
    record each one's pid, port and exit status in ``servers``."""
    # As ddm up: no port of its servers is taken while they load.
    with contextlib.closing(HeldPorts(HOST)) as held:
        batched = _plan(manifest, BIG_BATCH, workdir, "batched", held.draw)
        unbatched = _plan(manifest, 1, workdir, "unbatched", held.draw)
        # The reference servers bind their own ports (they take no socket handed over).
        references, endpoints = _reference_specs(manifest, batched.experts[0].env, port_source())
        experts = [*batched.experts, *unbatched.experts, *references]
        routers = [batched.router, unbatched.router]
        supervisor = Supervisor(log, held=held)
        try:
            say(log, f"starting {len(experts)} expert processes and {len(routers)} routers")
            supervisor.start_ready(experts, HOST)
            supervisor.start_ready(routers, HOST)
            pids = tuple(supervisor.processes[spec.name].pid
                         for spec in (*batched.experts, batched.router))
            yield Fleet(batched, unbatched, endpoints, pids)
        finally:
            say(log, "stopping the servers")
            supervisor.stop()
            for spec in [*experts, *routers]:
                process = supervisor.processes.get(spec.name)
                if process is not None:
                    servers.append({"name": spec.name, "port": spec.port, "pid": process.pid,
                                    "exit_code": process.returncode})


def _plan(manifest: DDMManifest, max_batch: int, workdir: Path, tag: str,
          ports: Callable[[], int]) -> LocalPlan:
    """``ddm up``'s plan with every expert at ``max_batch`` and room for 64 generations."""
    spec = manifest.spec
    experts = tuple(dataclasses.replace(e, max_batch=max_batch) for e in spec.experts)
    manifest = dataclasses.replace(manifest, spec=dataclasses.replace(spec, experts=experts))
    config_path = workdir / f"router-{tag}.yaml"
    plan = plan_local(manifest, ports, ports(), HOST, config_path=config_path)

    def named(process: ProcessSpec) -> ProcessSpec:
        return dataclasses.replace(process, name=f"{tag}/{process.name}")

    router = named(one_client_router(plan, CONCURRENT, config_path))
    return dataclasses.replace(plan, experts=tuple(map(named, plan.experts)), router=router)


def _reference_specs(manifest: DDMManifest, env: tuple[tuple[str, str], ...],
                     ports: Callable[[], int]) -> tuple[list[ProcessSpec], tuple[str, ...]]:
    """One reference-protocol server per expert, on the backend ``ddm up`` would use."""
    specs, endpoints = [], []
    for expert in manifest.spec.experts:
        planned = plan_expert(expert)
        port = ports()
        argv = (sys.executable, "-m", "benchmarks.reference_protocol", "--checkpoint",
                str(resolve_checkpoint(expert.checkpoint)), "--host", HOST, "--port", str(port),
                "--backend", planned.backend,
                *(("--device", planned.device) if planned.device else ()))
        specs.append(ProcessSpec(f"reference/{expert.name}", argv, port, env))
        endpoints.append(f"{HOST}:{port}")
    return specs, tuple(endpoints)


def checkouts(trees: list[str]) -> list[Path]:
    """The checkouts a comparison runs, each of this project and with a directory name of its
    own: the figures are keyed by that name, never by a path of this machine."""
    paths = [Path(tree).resolve() for tree in trees]
    for path in paths:
        if not (path / "src" / "ddm").is_dir():
            raise SystemExit(f"{path} is not a checkout of this project (no src/ddm)")
    names = [path.name for path in paths]
    if len(set(names)) != len(names):
        raise SystemExit(f"the checkouts' directory names key the figures, so they must "
                         f"differ: {names}")
    return paths


def recorded_path(path: Path) -> str:
    """``path`` as figures record it: relative to this checkout when inside it, else its
    name (figures are shared: a path of this machine means nothing elsewhere)."""
    resolved = path.resolve()
    if resolved.is_relative_to(REPOSITORY_ROOT):
        return str(resolved.relative_to(REPOSITORY_ROOT))
    return resolved.name


def port_source() -> Callable[[], int]:
    """Free loopback ports, never the same one twice."""
    taken: set[int] = set()

    def port() -> int:
        for _ in range(100):
            candidate = free_port(HOST)
            if candidate not in taken:
                taken.add(candidate)
                return candidate
        raise BenchError("no free loopback port found")

    return port


def say(log: TextIO, message: str) -> None:
    """A progress line on ``log``, stamped with the time of day (UTC): where a run's minutes
    went, read from its log alone."""
    stamp = time.strftime("%H:%M:%S", time.gmtime())
    print(f"bench: {stamp} {message}", file=log, flush=True)
