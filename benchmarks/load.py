"""``python -m benchmarks load``: many concurrent clients against a router on loopback, for a
bounded time.

With no router URL, the shipped example (``examples/digits.yaml``) runs as ``ddm up`` runs it
(``ddm.runtime.local.plan_local`` and ``Supervisor``: one ``ddm serve expert`` process per
expert replica, then ``ddm serve router``, with room for every client's generation at once).
``clients`` coroutines then each send ``POST /v1/generate`` with one label (classes in turn) and
the router's default steps, one request after another, until ``duration_s`` has passed or
``max_requests`` have been sent; a request still running then gets ``request_timeout_s`` to
finish. Only loopback addresses are accepted: this is a load test of one machine's servers.

The result: requests, errors by status (or by exception for a transport failure), images/s,
client latency percentiles, and the peak resident memory of the router and of each expert
(``VmHWM``, the process's lifetime peak, and ``VmRSS`` sampled during the run), found from the
processes listening on their ports. The machine's load average is recorded with it, since on a
shared machine it moves every figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple, TextIO
from urllib.parse import urlsplit

import aiohttp

from benchmarks.figures import percentiles
from benchmarks.fleet import recorded_path
from benchmarks.loopback import another_router, one_client_router

from ddm.deploy.spec import load_manifest
from ddm.runtime.local import REPOSITORY_ROOT, HeldPorts, Supervisor, plan_local
from ddm.termination import sigterm_handled
from tests.support.processes import listening_pid

HOST = "127.0.0.1"
MANIFEST = REPOSITORY_ROOT / "examples" / "digits.yaml"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: Seconds between two samples of the servers' resident memory.
SAMPLE_S = 0.5


class LoadTestError(RuntimeError):
    """The load test cannot run as asked (not loopback, no router, a server that died)."""


@dataclass(frozen=True)
class LoadSettings:
    """``clients`` concurrent clients for ``duration_s`` seconds, at most ``max_requests``
    requests in all (None: ``clients * duration_s * 20``, more than a loopback router serves)."""

    clients: int = 64
    duration_s: float = 60.0
    max_requests: int | None = None
    request_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not isinstance(self.clients, int) or not 1 <= self.clients <= 1024:
            raise ValueError(f"clients must be an integer in 1..1024, got {self.clients!r}")
        if not 0 < self.duration_s <= 3600:
            raise ValueError(f"duration must be in (0, 3600] seconds, got {self.duration_s}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")

    @property
    def request_budget(self) -> int:
        if self.max_requests is not None:
            return self.max_requests
        return int(self.clients * self.duration_s * 20)


def run_load(settings: LoadSettings, router: str | None = None, manifest: Path = MANIFEST,
             log: TextIO = sys.stderr) -> dict[str, Any]:
    """Run the load test (starting ``manifest``'s servers unless ``router`` is given) and
    return its figures as a JSON-ready dict."""
    started = time.perf_counter()
    result: dict[str, Any] = {"settings": {**dataclasses.asdict(settings),
                                           "request_budget": settings.request_budget},
                              "load_average_before": list(os.getloadavg())}
    if router is not None:
        result["router_url"] = _loopback(router)
        result.update(asyncio.run(_measure(settings, result["router_url"], log)))
    else:
        with local_ddm(manifest, settings.clients, log) as (url, *_):
            result["router_url"] = url
            result["manifest"] = recorded_path(manifest)
            result.update(asyncio.run(_measure(settings, url, log)))
    result["load_average_after"] = list(os.getloadavg())
    result["cpu_count"] = os.cpu_count()
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def load_test_command(clients: int = 64, duration_s: float = 60.0, router: str | None = None,
                      as_json: bool = False, out: TextIO = sys.stdout,
                      log: TextIO = sys.stderr) -> int:
    """``python -m benchmarks load``: the figures as JSON (``as_json``) or a summary; exit
    status 1 when any request failed."""
    result = run_load(LoadSettings(clients=clients, duration_s=duration_s), router, log=log)
    if as_json:
        print(json.dumps(result, indent=2), file=out)
    else:
        latency = result["latency_s"]
        print(f"{result['requests']} requests from {clients} clients in "
              f"{result['elapsed_s']} s: {result['images_per_s']} images/s, "
              f"errors {result['errors'] or 'none'}, latency p50 {latency['p50']} s, "
              f"p99 {latency['p99']} s, max {latency['max']} s", file=out)
    return 1 if result["errors"] else 0


# ---------------------------------------------------------------------------------- servers


def _loopback(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname not in LOOPBACK or parts.port is None:
        raise LoadTestError(f"the load test runs on loopback only: give http://127.0.0.1:PORT, "
                            f"got {url!r}")
    return url.rstrip("/")


class LocalDDM(NamedTuple):
    """What :func:`local_ddm` started: the router's URL, every process's PID by name, each
    model server's ``/metrics`` URL by name, the other routers' (``also``) URLs and their
    ``/metrics`` URLs by name, the first router's too (as ``router``), and each model
    server's base URL by name."""

    url: str
    pids: dict[str, int]
    metrics: dict[str, str]
    routers: dict[str, tuple[str, str]]
    servers: dict[str, str]


@contextmanager
def local_ddm(manifest: Path, clients: int, log: TextIO, threads: int = 1,
              also: Mapping[str, Mapping[str, str]] | None = None) -> Iterator[LocalDDM]:
    """``ddm up``'s processes for ``manifest`` (every model server: experts, separate stages,
    pools), each with ``threads`` intra-op threads (``ddm up --threads``), the router allowing
    ``clients`` generations at once, each ready within its plan's budget, as ``ddm up``'s; with
    ``also`` (name -> environment), more routers over the same servers, each with that
    environment added. Yields a :class:`LocalDDM`, and stops them all after."""
    held = HeldPorts(HOST)  # as ddm up: no port taken while the servers load
    with contextlib.closing(held), tempfile.TemporaryDirectory(prefix="ddm-load-") as workdir:
        config_path = Path(workdir) / "router.yaml"
        plan = plan_local(load_manifest(manifest), held.draw, held.draw(), HOST,
                          threads=threads, config_path=config_path)
        router = one_client_router(plan, clients, config_path)
        routers = [router, *(another_router(router, name, held.draw(), held.draw(),
                                            tuple(env.items()))
                             for name, env in (also or {}).items())]
        supervisor = Supervisor(log, held=held)
        try:
            print(f"load: starting {len(plan.servers)} model servers and "
                  f"{len(routers)} router(s)", file=log, flush=True)
            supervisor.start_ready(plan.servers, HOST)
            supervisor.start_ready(routers, HOST)
            yield LocalDDM(plan.url, {name: process.pid
                                      for name, process in supervisor.processes.items()},
                           {server.name: f"http://{HOST}:{server.metrics_port}/metrics"
                            for server in plan.servers if server.metrics_port is not None},
                           {r.name: (f"http://{HOST}:{r.port}",
                                     f"http://{HOST}:{r.metrics_port}/metrics")
                            for r in routers},
                           {server.name: f"http://{HOST}:{server.port}"
                            for server in plan.servers})
            exited = supervisor.first_exit()
            if exited is not None:
                raise LoadTestError(f"{exited[0]} exited with status {exited[1]} during the run")
        finally:  # as ddm up's stop: a second SIGTERM must not abort it and leave servers
            with sigterm_handled(signal.SIG_IGN):
                supervisor.stop()


def memory_mib(pid: int, field: str) -> float | None:
    """``field`` (``VmRSS``, ``VmHWM``) of ``/proc/PID/status`` in MiB; None once it ended."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


async def _router_info(session: aiohttp.ClientSession, url: str
                       ) -> tuple[int, dict[str, int | None]]:
    """The router's number of classes, and the PID of the router and of every expert replica
    it lists, by name."""
    async with session.get(f"{url}/v1/info") as answer:
        if answer.status != 200:
            raise LoadTestError(f"{url}/v1/info answered {answer.status}: is it a ddm router?")
        info = await answer.json()
    servers = {"router": listening_pid(urlsplit(url).port)}
    for expert in info["experts"]:
        for index, endpoint in enumerate(sorted(expert["replicas"])):
            servers[f"{expert['name']}/{index}"] = listening_pid(int(endpoint.rsplit(":", 1)[1]))
    return info["num_classes"], servers


# -------------------------------------------------------------------------------- measuring


@dataclass
class _Tally:
    latencies: list[float] = dataclasses.field(default_factory=list)
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    error_examples: dict[str, str] = dataclasses.field(default_factory=dict)
    images: int = 0
    last_done: float = 0.0

    def error(self, key: str, detail: str) -> None:
        self.errors[key] = self.errors.get(key, 0) + 1
        self.error_examples.setdefault(key, detail[:300])


async def _measure(settings: LoadSettings, url: str, log: TextIO) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=settings.clients)
    timeout = aiohttp.ClientTimeout(total=settings.request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        num_classes, servers = await _router_info(session, url)
        peaks: dict[str, float] = {}
        print(f"load: {settings.clients} clients for {settings.duration_s} s against {url}",
              file=log, flush=True)
        tally, labels = _Tally(), itertools.count()
        budget = iter(range(settings.request_budget))
        started = time.perf_counter()
        end = started + settings.duration_s
        sampler = asyncio.create_task(sample_rss(servers, peaks))
        try:
            await asyncio.gather(*(_client(session, url, end, budget, labels, num_classes,
                                           tally)
                                   for _ in range(settings.clients)))
        finally:
            sampler.cancel()
        elapsed = (tally.last_done or end) - started
    requests = len(tally.latencies) + sum(tally.errors.values())
    return {"requests": requests, "succeeded": len(tally.latencies), "errors": tally.errors,
            "error_examples": tally.error_examples, "elapsed_s": round(elapsed, 3),
            "images_per_s": round(tally.images / elapsed, 3),
            "requests_per_s": round(requests / elapsed, 3),
            "latency_s": percentiles(tally.latencies),
            "peak_rss_mib": {name: {"pid": pid, "lifetime_peak": memory_mib(pid, "VmHWM")
                                    if pid else None,
                                    "sampled_peak": peaks.get(name)}
                             for name, pid in servers.items()}}


async def _client(session: aiohttp.ClientSession, url: str, end: float, budget: Iterator[int],
                  labels: Iterator[int], num_classes: int, tally: _Tally) -> None:
    """One client: a request at a time until the time is up or the budget is spent; the
    clients share ``labels``, so the classes come in turn."""
    while time.perf_counter() < end and next(budget, None) is not None:
        body = {"labels": [next(labels) % num_classes]}
        sent = time.perf_counter()
        try:
            async with session.post(f"{url}/v1/generate", json=body) as answer:
                reply = await answer.read()
                if answer.status == 200:
                    tally.images += len(json.loads(reply)["images"])
                    tally.latencies.append(time.perf_counter() - sent)
                else:
                    tally.error(str(answer.status), reply.decode("utf-8", "replace"))
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            tally.error(type(error).__name__, str(error))
        tally.last_done = time.perf_counter()


async def sample_rss(servers: dict[str, int | None], peaks: dict[str, float]) -> None:
    """Keep each server's highest ``VmRSS`` in ``peaks`` by name, every ``SAMPLE_S``, until
    cancelled."""
    while True:
        for name, pid in servers.items():
            rss = memory_mib(pid, "VmRSS") if pid else None
            if rss is not None:
                peaks[name] = max(peaks.get(name, 0.0), rss)
        await asyncio.sleep(SAMPLE_S)
