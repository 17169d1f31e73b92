"""``python -m benchmarks pools``: what a pool saves (issue 37), for the shipped text-to-image
DDM (checkpoints/text2img) served three ways:

- ``alone``: every component a process of its own (``examples/text2img.yaml`` as ``ddm up``
  runs it: four experts, the text encoder and the decoder, then the router);
- ``pooled``: one pool of everything (``examples/text2img-pooled.yaml``: one ``ddm serve pool``
  process beside the router);
- ``in_process``: ``load_ddm`` + ``generate_text`` in one fresh process, each level's
  prompts as one batch.

At each concurrency (1, 8 and 32 prompts) the served deployments get that many clients, each
sending ``rounds`` one-image requests in turn, and in-process sampling ``rounds`` batches of
that many prompts; images/s is images over the level's wall time, after one warm-up request.
Memory: every process's ``VmHWM`` (its lifetime peak) and sampled ``VmRSS`` peak, summed over
the processes a deployment starts (:mod:`benchmarks.load`'s readers). The sampling settings are
the manifests' (30 Euler steps, top-1, guidance 4), the same as the release's. The targets:
the pool within 1.3x of in-process memory and at least 0.9x of its throughput at the highest
concurrency. The machine's load average is recorded, since on a shared machine it moves every
figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from benchmarks.figures import percentiles
from benchmarks.fleet import BenchError, machine, recorded_path, say
from benchmarks.host_profile import host_profile
from benchmarks.load import local_ddm, memory_mib, sample_rss
from benchmarks.model_time import (exposition, gpu_utilisation, level_model_time,
                                   level_round_trips, round_trips, scrape)
from ddm.deploy.spec import load_manifest
from ddm.runtime.local import REPOSITORY_ROOT

EXAMPLES = REPOSITORY_ROOT / "examples"
CHECKPOINTS = REPOSITORY_ROOT / "checkpoints" / "text2img"
#: The deployments served, by the name the figures use.
DEPLOYMENTS = {"alone": EXAMPLES / "text2img.yaml", "pooled": EXAMPLES / "text2img-pooled.yaml"}
#: The issue's targets: the pool's memory at most this multiple of in-process sampling's ...
MEMORY_RATIO = 1.3
#: ... and its images/s at least this fraction of in-process sampling's, at most concurrency.
THROUGHPUT_RATIO = 0.9
PROMPTS = ("a thick red seven", "the number 3 in blue", "a thin green two", "a yellow five",
           "a thick white nine", "an orange eight")


@dataclass(frozen=True)
class PoolBenchSettings:
    """Concurrent prompts per level, requests per client per level, and denoising steps
    (None: the manifests'); ``timeout_s`` bounds one request and the in-process run;
    ``threads``: ``ddm up --threads`` (default 1 per process; a pool's process gets that
    many per member, up to the machine's CPUs); in-process sampling takes ``ddm.threads``'
    policy: the idle cores. ``host_profile``: each level's processes sampled with py-spy
    (:mod:`benchmarks.host_profile`)."""

    concurrency: tuple[int, ...] = (1, 8, 32)
    rounds: int = 2
    steps: int | None = None
    timeout_s: float = 900.0
    prompts: tuple[str, ...] = PROMPTS
    threads: int = 1
    host_profile: bool = False

    def __post_init__(self) -> None:
        if not self.concurrency or any(not 1 <= c <= 256 for c in self.concurrency):
            raise ValueError(f"concurrency: give levels in 1..256, got {self.concurrency!r}")
        if not 1 <= self.rounds <= 100:
            raise ValueError(f"rounds must be in 1..100, got {self.rounds}")
        if self.steps is not None and not 1 <= self.steps <= 1000:
            raise ValueError(f"steps must be in 1..1000, got {self.steps}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not self.prompts:
            raise ValueError("prompts: give at least one")
        if not 1 <= self.threads <= 256:
            raise ValueError(f"threads must be in 1..256, got {self.threads}")



#: ``--quick``: a smoke run (2 steps, 1 and 2 prompts, one round).
QUICK = PoolBenchSettings(concurrency=(1, 2), rounds=1, steps=2)

def bench_pools(settings: PoolBenchSettings, log: TextIO = sys.stderr) -> dict[str, Any]:
    """Every deployment and in-process sampling at every level; the figures as a JSON-ready
    dict, with the targets judged."""
    started = time.perf_counter()
    sampling = load_manifest(DEPLOYMENTS["pooled"]).spec.sampling
    result: dict[str, Any] = {
        "machine": machine(), "settings": asdict(settings),
        "sampling": {"steps": settings.steps or sampling.steps, "strategy": sampling.strategy,
                     "guidance_scale": sampling.guidance_scale},
        "deployments": {}}
    for name, manifest in DEPLOYMENTS.items():
        say(log, f"pools: {name} ({recorded_path(manifest)})")
        with local_ddm(manifest, max(settings.concurrency), log,
                       threads=settings.threads) as ddm:
            figures = asyncio.run(served(ddm.url, ddm.pids, settings, log, ddm.metrics,
                                         ddm.routers["router"][1]))
        result["deployments"][name] = {"manifest": recorded_path(manifest), **figures}
    say(log, "pools: in-process generate_text")
    result["in_process"] = in_process(settings, result["sampling"], CHECKPOINTS)
    result["targets"] = targets(result)
    result["load_average_after"] = list(os.getloadavg())
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def targets(result: dict[str, Any]) -> dict[str, Any]:
    """The pool against in-process sampling: memory (summed lifetime peaks; the sampled peaks
    where a kernel keeps no ``VmHWM``, as gVisor's) and images/s at the highest concurrency,
    each with its target and whether it is met (None where a figure is missing)."""
    pooled, local = result["deployments"]["pooled"], result["in_process"]
    level = str(max(result["settings"]["concurrency"]))
    pool_mib = pooled["total_mib"]["lifetime_peak"] or pooled["total_mib"].get("sampled_peak")
    throughput = pooled["levels"][level]["images_per_s"] / local["levels"][level]["images_per_s"]
    return {"memory_pooled_to_in_process": ratio_target(pool_mib, local["peak_rss_mib"],
                                                        MEMORY_RATIO, "<="),
            "images_per_s_pooled_to_in_process": {
                "concurrency": int(level), "value": round(throughput, 2),
                "target": THROUGHPUT_RATIO, "comparison": ">=",
                "met": throughput >= THROUGHPUT_RATIO}}


def ratio_target(value: float | None, against: float | None, target: float,
                 comparison: str) -> dict[str, Any]:
    """``value / against`` judged against ``target`` (``<=`` or ``>=``); value and met None
    where either figure is missing."""
    if not value or not against:
        return {"value": None, "target": target, "comparison": comparison, "met": None}
    ratio = value / against
    return {"value": round(ratio, 2), "target": target, "comparison": comparison,
            "met": ratio <= target if comparison == "<=" else ratio >= target}


# ------------------------------------------------------------------------------- served


async def served(url: str, pids: dict[str, int], settings: PoolBenchSettings,
                 log: TextIO, metrics: dict[str, str] | None = None,
                 router_metrics: str | None = None) -> dict[str, Any]:
    """Every level against the router at ``url``, then each process's memory; with the
    model servers' ``metrics`` URLs (by name), where each level's time went, and with the
    router's, its round trips (:mod:`benchmarks.model_time`)."""
    peaks: dict[str, float] = {}
    sampler = asyncio.create_task(sample_rss(dict(pids), peaks))
    timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
    connector = aiohttp.TCPConnector(limit=max(settings.concurrency) + len(metrics or ()))
    levels: dict[str, Any] = {}
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            await _generate(session, url, 0, settings)  # warm-up: first allocations
            for concurrency in settings.concurrency:
                say(log, f"pools: {concurrency} concurrent prompts")
                before = await scrape(session, metrics or {})
                trips = (round_trips(await exposition(session, router_metrics))
                         if router_metrics else {})
                async with gpu_utilisation() as gpu, _profiled(pids, settings) as host:
                    started = time.perf_counter()
                    latencies = await asyncio.gather(*(
                        _client(session, url, client, concurrency, settings)
                        for client in range(concurrency)))
                    elapsed = time.perf_counter() - started
                level = _level(elapsed, [s for one in latencies for s in one])
                if settings.host_profile:
                    level["host_profile"] = host
                if metrics:
                    level["model_time"] = level_model_time(
                        before, await scrape(session, metrics), elapsed)
                if router_metrics:
                    level["round_trips"] = level_round_trips(
                        trips, round_trips(await exposition(session, router_metrics)))
                levels[str(concurrency)] = {**level, "gpu_utilisation": gpu}
    finally:
        sampler.cancel()
    processes = {name: {"pid": pid, "lifetime_peak_mib": memory_mib(pid, "VmHWM"),
                        "sampled_peak_mib": peaks.get(name)} for name, pid in pids.items()}
    return {"processes": processes,
            "total_mib": {"lifetime_peak": _sum(p["lifetime_peak_mib"]
                                                for p in processes.values()),
                          "sampled_peak": _sum(p["sampled_peak_mib"]
                                               for p in processes.values())},
            "levels": levels}


def _profiled(pids: dict[str, int], settings: PoolBenchSettings
              ) -> AbstractAsyncContextManager[dict[str, Any]]:
    return host_profile(pids) if settings.host_profile else contextlib.nullcontext({})


async def _client(session: aiohttp.ClientSession, url: str, client: int, concurrency: int,
                  settings: PoolBenchSettings) -> list[float]:
    """One client's ``rounds`` requests, one after another; their latencies in seconds."""
    latencies = []
    for round_ in range(settings.rounds):
        sent = time.perf_counter()
        await _generate(session, url, 1 + round_ * concurrency + client, settings)
        latencies.append(time.perf_counter() - sent)
    return latencies


async def _generate(session: aiohttp.ClientSession, url: str, seed: int,
                    settings: PoolBenchSettings) -> None:
    body: dict[str, Any] = {"prompt": settings.prompts[seed % len(settings.prompts)], "n": 1,
                            "seed": seed}
    if settings.steps is not None:
        body["steps"] = settings.steps
    async with session.post(f"{url}/v1/images/generations", json=body) as answer:
        reply = await answer.read()
        if answer.status != 200:
            raise BenchError(f"{url} answered {answer.status}: "
                             f"{reply.decode('utf-8', 'replace')[:500]}")


def _level(elapsed_s: float, latencies: list[float]) -> dict[str, Any]:
    return {"images": len(latencies), "elapsed_s": round(elapsed_s, 3),
            "images_per_s": round(len(latencies) / elapsed_s, 3),
            "latency_s": percentiles(latencies)}


def _sum(values: Any) -> float | None:
    """The sum in MiB, None when any process's figure is missing (it ended early)."""
    values = list(values)
    return None if None in values else round(sum(values), 1)


# --------------------------------------------------------------------------- in-process


#: What the fresh process runs: the release loaded as the pool loads it (PyTorch, on the asked
#: device and dtype), one warm-up prompt, then ``rounds`` batches of each level's prompts; it
#: prints each level's seconds per batch, its peak RSS (``ru_maxrss``, KiB: ``VmHWM``) and on
#: CUDA the peak of torch's allocator and the GPU's memory in use at the end (as nvidia-smi
#: reads a served pool's: the allocator's cache and the context included). Only ddm is
#: imported, so that the peak is sampling's own.
_CHILD = """
import json, resource, sys, time
from ddm.threads import apply_cpu_thread_policy
apply_cpu_thread_policy()
from ddm.models.ddm import load_ddm
from ddm.sampling.pipeline import generate_text
asked = json.loads(sys.argv[1])
ddm = load_ddm(asked["checkpoints"], dtype=asked["dtype"], device=asked["device"])
options = {k: asked[k] for k in ("steps", "strategy", "guidance_scale")}
generate_text(ddm, [asked["prompts"][0]], seed=0, **options)
levels = {}
for concurrency in asked["concurrency"]:
    prompts = [asked["prompts"][i % len(asked["prompts"])] for i in range(concurrency)]
    levels[concurrency] = seconds = []
    for round_ in range(asked["rounds"]):
        sent = time.perf_counter()
        generate_text(ddm, prompts, seed=1 + round_, **options)
        seconds.append(time.perf_counter() - sent)
cuda = used = None
if asked["device"] == "cuda":
    import torch
    cuda = torch.cuda.max_memory_allocated() / 2**20
    free, total = torch.cuda.mem_get_info()
    used = (total - free) / 2**20
print(json.dumps({"levels": levels, "cuda_peak_mib": cuda, "gpu_memory_used_mib": used,
                  "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def in_process(settings: PoolBenchSettings, sampling: dict[str, Any], checkpoints: Path,
               device: str = "cpu", dtype: str | None = None) -> dict[str, Any]:
    """In-process sampling of the DDM at ``checkpoints`` in a fresh process (its own peak
    memory, nothing of this one's): each level's images/s, every image's latency being its
    batch's."""
    asked = {"checkpoints": str(checkpoints), "prompts": settings.prompts,
             "rounds": settings.rounds, "concurrency": list(settings.concurrency),
             "device": device, "dtype": dtype, **sampling}
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(asked)],
                              cwd=REPOSITORY_ROOT, capture_output=True, text=True,
                              timeout=settings.timeout_s)
    except subprocess.TimeoutExpired as error:
        raise BenchError(f"in-process sampling took over {settings.timeout_s} s") from error
    if done.returncode != 0:
        raise BenchError(f"in-process sampling failed ({done.returncode}): "
                         f"{done.stderr[-2000:]}")
    try:
        figures = json.loads(done.stdout.splitlines()[-1])
    except (IndexError, ValueError) as error:
        raise BenchError(f"in-process sampling printed no figures ({error}): "
                         f"{done.stdout[-1000:]!r} {done.stderr[-2000:]}") from None
    levels = {}
    for concurrency, seconds in figures["levels"].items():
        latencies = [s for s in seconds for _ in range(int(concurrency))]
        levels[concurrency] = _level(sum(seconds), latencies)
    cuda, used = figures["cuda_peak_mib"], figures["gpu_memory_used_mib"]
    return {"levels": levels, "peak_rss_mib": round(figures["peak_kib"] / 1024, 1),
            **({"cuda_peak_mib": round(cuda, 1), "gpu_memory_used_mib": round(used, 1)}
               if cuda is not None else {})}


def bench_pools_command(settings: PoolBenchSettings, out: TextIO = sys.stdout,
                        log: TextIO = sys.stderr) -> int:
    """``python -m benchmarks pools``: the figures as JSON on ``out``, progress on ``log``."""
    print(json.dumps(bench_pools(settings, log), indent=2), file=out)
    return 0

