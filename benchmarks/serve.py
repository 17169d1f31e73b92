"""``python -m benchmarks serve``: what serving the shipped DDM over HTTP costs, measured in one
run.

On loopback, with the shipped experts and router started as ``ddm up`` starts them
(``ddm.runtime.local.plan_local`` and ``Supervisor``: one ``ddm serve expert`` process per expert
with one CPU thread, then ``ddm serve router``), it measures the figures of the "Serving" issue:

1. images/s in-process (``load_ddm`` + ``generate``) and through the router (``POST
   /v1/generate`` on a keep-alive client) at batch 1 and 64; target: >= 0.85x at batch 64;
2. per-step overhead at batch 1: distributed minus in-process seconds per step, paired per
   generation (same label and seed), median; target: <= 1 ms;
3. the reference demo's protocol (:mod:`benchmarks.reference_protocol`) at batch 1; target:
   ours >= 5x its images/s;
4. 64 concurrent single-image requests with dynamic batching (experts at ``--max-batch 64``) and
   without (``--max-batch 1``), through the router and straight to each expert; target: >= 4x;
5. body bytes per step (request and reply) over raw tensor bytes; target: <= 1.02;
6. round trips and time per image with ``delegate_steps``, and the shipped classifier's accuracy
   of per-step routing against delegation; target: within 1 point;
7. a text DDM's bytes per step with and without the context cache (target: a step within 5%
   of the latent's bytes), guided vs unguided time per step, and the decode stage's share of a
   generation (:mod:`benchmarks.text_serving`);
8. the shipped text2img's one prompt, 30 steps, top-2 with guidance, served by ``ddm up`` vs
   in-process; target: under one second (:mod:`benchmarks.text2img_latency`).
9. a batch-1 velocity call's cost beyond its model (as timed inside the server) and the HTTP
   floor, for a fast and a slow expert on both sides of the event loop's bound
   (:mod:`benchmarks.calls`); target: <= 0.5 ms for every model.

Every process (both deployments and the reference servers) starts at once and idles while the
others are measured, so that ratios compare numbers taken under the same conditions. In-process
sampling runs in this process with one torch thread, as each server process does. Each figure
keeps its raw numbers and, where the issue sets one, ``value``, ``target``, ``comparison`` and
``met``. Progress goes to ``log``; the result is a JSON-ready dict.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, TextIO

import aiohttp
import numpy as np

from ddm.deploy.spec import load_manifest
from ddm.runtime.local import REPOSITORY_ROOT
from ddm.checkpoints.discovery import shipped_checkpoints
from ddm.conditioning import Conditioning
from ddm.models.ddm import DDM, load_ddm
from ddm.sampling.pipeline import generate
from benchmarks.figures import (ACCURACY_GAP_POINTS, BATCHING_SPEEDUP, BIG_BATCH,
                                       WIRE_RATIO, images_per_s, rate, speedup, summary_lines,
                                       throughput_figures, verdict, wire_bytes)
from benchmarks.fleet import (CONCURRENT, HOST, BenchError, Fleet, cpu_seconds,
                                     machine, recorded_path, running_fleet, say)
from ddm.serving.router.fleet.servers import KEEP_ALIVE_S
from ddm.serving.wire.protocol import CONTENT_TYPE, decode_response
from tests.support.label_wire import LabelCall, velocity_call
from benchmarks.reference_protocol import npz_velocity, reference_ddm
from benchmarks.calls import ROUNDS as CALL_ROUNDS, measure as measure_calls
from benchmarks.text2img_latency import text2img_latency, text2img_summary_lines
from benchmarks.text_serving import text_figures, text_summary_lines

MANIFEST = REPOSITORY_ROOT / "examples" / "digits.yaml"
STRATEGY = "top1"
#: The router's ``--max-batch``: a quality run of 100 images goes in chunks of this many.
QUALITY_CHUNK = 50
REQUEST_TIMEOUT_S = 300.0
#: Bounds the whole measurement, whatever the machine's load.
MEASURE_TIMEOUT_S = 1200.0


@dataclass(frozen=True)
class BenchSettings:
    """``steps`` per generation; ``quick`` repeats less (for tests), measuring everything."""

    steps: int = 40
    quick: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or not 1 <= self.steps <= 200:
            raise ValueError(f"steps must be an integer in 1..200 (the router's limit), "
                             f"got {self.steps!r}")

    @property
    def repeats(self) -> int:
        """Batch-1 generations per figure."""
        return 2 if self.quick else 12

    @property
    def big_repeats(self) -> int:
        """Batch-64 and 64-concurrent runs per figure."""
        return 1 if self.quick else 3

    @property
    def rounds(self) -> int:
        """Rounds of 64 concurrent velocity calls per expert."""
        return 2 if self.quick else 10

    @property
    def call_rounds(self) -> int:
        """Rounds of :mod:`benchmarks.calls` (5 calls per model each)."""
        return 2 if self.quick else CALL_ROUNDS

    @property
    def per_digit(self) -> int:
        """Images per digit for the quality comparison."""
        return 1 if self.quick else 10

    @property
    def delegations(self) -> tuple[int, ...]:
        return tuple(sorted({0, min(10, self.steps), self.steps}))

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "repeats": self.repeats,
                "big_repeats": self.big_repeats, "rounds": self.rounds,
                "call_rounds": self.call_rounds,
                "per_digit": self.per_digit, "delegations": list(self.delegations),
                "strategy": STRATEGY, "solver": "euler", "big_batch": BIG_BATCH,
                "concurrent": CONCURRENT, "manifest": recorded_path(MANIFEST), "host": HOST,
                "in_process_torch_threads": 1, "server_threads": 1}


# ---------------------------------------------------------------------------------- running


def run_bench(settings: BenchSettings, log: TextIO = sys.stderr) -> dict[str, Any]:
    """Start the servers, measure everything, stop the servers; the results as a dict."""
    started = time.perf_counter()
    result: dict[str, Any] = {"machine": machine(), "settings": settings.to_dict()}
    checkpoints = shipped_checkpoints("digits")  # what examples/digits.yaml serves
    say(log, f"loading the DDM in-process from {checkpoints}")
    ddm = load_ddm(checkpoints)
    manifest = load_manifest(MANIFEST)
    served = [tuple(e.classes) for e in manifest.spec.experts]
    if served != list(ddm.expert_classes):
        raise BenchError(f"{MANIFEST} serves experts of classes {served}, the in-process DDM "
                         f"has {list(ddm.expert_classes)}")
    servers: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ddm-bench-") as workdir, _one_torch_thread():
        try:
            with running_fleet(manifest, Path(workdir), log, servers) as fleet:
                result.update(asyncio.run(_measure(settings, ddm, fleet, log)))
        finally:
            result["servers"] = servers
    result["machine"]["load_average_after"] = list(os.getloadavg())
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def client_session() -> aiohttp.ClientSession:
    """The benchmark's keep-alive client, sending none of aiohttp's automatic
    ``User-Agent``, ``Accept`` and ``Accept-Encoding`` headers (as the router sends none)."""
    connector = aiohttp.TCPConnector(limit=256, keepalive_timeout=KEEP_ALIVE_S)
    return aiohttp.ClientSession(connector=connector, raise_for_status=False,
                                 skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"))


# ------------------------------------------------------------------------------- measuring


async def _measure(settings: BenchSettings, ddm: DDM, fleet: Fleet,
                   log: TextIO) -> dict[str, Any]:
    """Every figure, one after the other. In-process sampling blocks this event loop on
    purpose: nothing else of the benchmark runs meanwhile."""
    async with asyncio.timeout(MEASURE_TIMEOUT_S), client_session() as session:
        url = fleet.batched.url
        say(log, "warming up (JAX compiles per batch shape in-process)")
        for labels in ([0], [5], _big_labels()):
            _sample_here(ddm, labels, settings.steps, settings.seed)
            await _generate(session, url, labels, settings.steps, settings.seed)
        await _generate(session, fleet.unbatched.url, [0], settings.steps, settings.seed)
        say(log, "throughput, per-step overhead and the reference demo's protocol")
        figures = throughput_figures(await _throughput(settings, ddm, session, fleet),
                                      settings.steps)
        figures["reference_baseline"]["call_latency"] = await _call_latency(
            ddm, session, fleet, settings.repeats * 20)
        say(log, "one expert call beyond its model and the HTTP floor, fast and slow models")
        figures["expert_call"] = await measure_calls([REPOSITORY_ROOT], settings.call_rounds)
        say(log, "64 concurrent requests, with and without dynamic batching")
        concurrency = await _concurrency(settings, ddm, session, fleet)
        say(log, "bytes on the wire")
        wire = await _wire(ddm, session, fleet)
        say(log, "delegation and quality")
        delegation = await _delegation(settings, session, url)
        quality = await _quality(settings, session, url)
    return {**figures, "concurrency": concurrency, "wire": wire, "delegation": delegation,
            "quality": quality}


async def _throughput(settings: BenchSettings, ddm: DDM, session: aiohttp.ClientSession,
                      fleet: Fleet) -> dict[str, Any]:
    """In-process, distributed and (at batch 1) reference generations, alternated within each
    repetition so that the machine's drifting load hits all of them alike."""
    steps, baseline = settings.steps, reference_ddm(ddm, fleet.reference)
    for label in (0, 5):  # the reference servers' first calls
        _sample_here(baseline, [label], steps, settings.seed)
    runs: dict[int, dict[str, list[float]]] = {}
    checks = {"max_pixel_difference": 0, "reference_same_images": True}
    cpu = {"in_process": 0.0, "router_and_experts": 0.0}
    for batch, repeats in ((1, settings.repeats), (BIG_BATCH, settings.big_repeats)):
        times: dict[str, list[float]] = {"in_process": [], "distributed": [], "router": [],
                                         "reference": []}
        for i in range(repeats):
            # Batch 64 repeats one seed: in-process JAX compiles per row count, and another
            # seed may route another number of rows to an expert.
            labels, seed = (([i % 10], settings.seed + i) if batch == 1
                            else (_big_labels(), settings.seed))
            started_cpu = time.process_time()
            seconds, images = _sample_here(ddm, labels, steps, seed)
            if batch == 1:
                cpu["in_process"] += time.process_time() - started_cpu
            times["in_process"].append(seconds)
            servers_before = cpu_seconds(fleet.batched_pids)
            seconds, reply = await _generate(session, fleet.batched.url, labels, steps, seed)
            servers_after = cpu_seconds(fleet.batched_pids)
            if batch == 1:
                cpu["router_and_experts"] += (
                    servers_after - servers_before
                    if servers_before is not None and servers_after is not None else float("nan"))
            times["distributed"].append(seconds)
            times["router"].append(reply["seconds"])
            served = _decode_pngs(reply["images"]).astype(int)
            checks["max_pixel_difference"] = max(checks["max_pixel_difference"],
                                                 int(np.abs(served - images).max()))
            if batch == 1:
                seconds, theirs = _sample_here(baseline, labels, steps, seed)
                times["reference"].append(seconds)
                checks["reference_same_images"] &= bool(np.array_equal(theirs, images))
        runs[batch] = times
    return {"runs": runs, "checks": checks, "cpu_seconds_batch_1": cpu}


async def _held(session: aiohttp.ClientSession, endpoint: str, call: LabelCall) -> bytes:
    """``call``'s velocity body, once the expert at ``endpoint`` holds its label context (a
    generation's labels cross once; each step sends only the call)."""
    async with session.post(f"{endpoint}/v1/velocity", data=call.context,
                            headers={"Content-Type": CONTENT_TYPE}) as response:
        if response.status != 200:
            raise BenchError(f"{endpoint} refused a label context: {response.status} "
                             f"{(await response.read())[:200]!r}")
    return call.call


async def _call_latency(ddm: DDM, session: aiohttp.ClientSession, fleet: Fleet,
                        calls: int) -> dict[str, Any]:
    """Median ms of one batch-1 velocity of the first expert: the model alone in this
    process, our protocol on a keep-alive connection, the reference protocol; and of a
    ``GET /healthz`` of that expert (HTTP and FastAPI with no model: the transport's floor)."""
    velocity = ddm.experts[0]
    x = np.random.default_rng(0).standard_normal((1, *ddm.latent_shape), np.float32)
    t, y = np.full(1, 0.5, np.float32), np.full(1, min(ddm.expert_classes[0]), np.int64)
    cond = Conditioning.from_labels(y)
    endpoint = f"http://{HOST}:{fleet.batched.experts[0].port}"
    body = await _held(session, endpoint, velocity_call(1, x, t, y))
    reference = npz_velocity(fleet.reference[0])

    async def model() -> None:
        velocity(x, t, cond)

    async def ours() -> None:
        async with session.post(f"{endpoint}/v1/velocity", data=body,
                                headers={"Content-Type": CONTENT_TYPE}) as response:
            decode_response(await response.read(), 1, x.shape)

    async def theirs() -> None:
        reference(x, t, cond)

    async def floor() -> None:
        async with session.get(f"{endpoint}/healthz") as response:
            await response.read()

    medians = {}
    for name, call in (("model_only", model), ("ours", ours), ("reference", theirs),
                       ("http_floor", floor)):
        runs = []
        for _ in range(calls + 10):  # the first 10 warm up
            started = time.perf_counter()
            await call()
            runs.append(time.perf_counter() - started)
        medians[f"{name}_ms"] = round(statistics.median(runs[10:]) * 1e3, 3)
    return {"expert": ddm.expert_names[0], "calls": calls, **medians}


async def _concurrency(settings: BenchSettings, ddm: DDM,
                       session: aiohttp.ClientSession, fleet: Fleet) -> dict[str, Any]:
    """64 single-image generations at once through each router; 64 single-row velocity
    calls at once straight to each expert, with the model alone for scale."""
    steps = settings.steps

    async def generations(url: str) -> float:
        started = time.perf_counter()
        await asyncio.gather(*(_generate(session, url, [i % 10], steps, settings.seed + i)
                               for i in range(CONCURRENT)))
        return time.perf_counter() - started

    router: dict[str, Any] = {"requests": CONCURRENT, "images_per_request": 1, "steps": steps}
    for name, plan in (("batched", fleet.batched), ("unbatched", fleet.unbatched)):
        seconds = [await generations(plan.url) for _ in range(settings.big_repeats)]
        router[name] = rate(CONCURRENT, seconds)
    router["speedup"] = speedup(router)
    router.update(verdict(router["speedup"], BATCHING_SPEEDUP, at_least=True))

    experts = {}
    for index, (expert_name, velocity) in enumerate(zip(ddm.expert_names, ddm.experts)):
        label = min(ddm.expert_classes[index])
        figure: dict[str, Any] = {"requests": CONCURRENT, "rows_per_request": 1,
                                  "rounds": settings.rounds}
        for name, plan in (("batched", fleet.batched), ("unbatched", fleet.unbatched)):
            endpoint = f"{HOST}:{plan.experts[index].port}"
            seconds = await _velocity_rounds(session, endpoint, ddm.latent_shape, label,
                                             settings.rounds)
            figure[name] = {"seconds": round(seconds, 4),
                            "evaluations_per_s": round(settings.rounds * CONCURRENT / seconds, 1)}
        figure["speedup"] = round(figure["batched"]["evaluations_per_s"]
                                  / figure["unbatched"]["evaluations_per_s"], 3)
        figure["model_only"] = _model_scaling(velocity, ddm.latent_shape, label)
        figure.update(verdict(figure["speedup"], BATCHING_SPEEDUP, at_least=True))
        experts[expert_name] = figure
    return {"router": router, "expert": experts}


async def _velocity_rounds(session: aiohttp.ClientSession, endpoint: str,
                           shape: tuple[int, int, int], label: int, rounds: int) -> float:
    """Seconds for ``rounds`` rounds of 64 concurrent one-row velocity requests."""
    rng = np.random.default_rng(0)
    bodies = [await _held(session, f"http://{endpoint}", velocity_call(
        i + 1, rng.standard_normal((1, *shape), np.float32),
        np.full(1, (i + 0.5) / CONCURRENT, np.float32), np.full(1, label, np.int64)))
        for i in range(CONCURRENT)]  # one context: the same label in every call

    async def call(i: int) -> None:
        async with session.post(f"http://{endpoint}/v1/velocity", data=bodies[i],
                                headers={"Content-Type": CONTENT_TYPE}) as response:
            decode_response(await response.read(), i + 1, (1, *shape))

    await asyncio.gather(*(call(i) for i in range(CONCURRENT)))  # connections, warm-up
    started = time.perf_counter()
    for _ in range(rounds):
        await asyncio.gather(*(call(i) for i in range(CONCURRENT)))
    return time.perf_counter() - started


def _model_scaling(velocity: Callable[..., np.ndarray], shape: tuple[int, int, int],
                   label: int) -> dict[str, Any]:
    """The model alone in this process at 1 and 64 rows: 64 x t(1) / t(64) bounds what
    batching can gain."""
    times = {}
    for batch in (1, CONCURRENT):
        x = np.random.default_rng(0).standard_normal((batch, *shape), np.float32)
        t, cond = np.full(batch, 0.5, np.float32), Conditioning.from_labels(np.full(batch, label))
        velocity(x, t, cond)
        runs = []
        for _ in range(5):
            started = time.perf_counter()
            velocity(x, t, cond)
            runs.append(time.perf_counter() - started)
        times[batch] = statistics.median(runs)
    return {"ms_batch_1": round(times[1] * 1e3, 3),
            "ms_batch_64": round(times[CONCURRENT] * 1e3, 3),
            "batching_ceiling": round(CONCURRENT * times[1] / times[CONCURRENT], 2)}


async def _wire(ddm: DDM, session: aiohttp.ClientSession, fleet: Fleet) -> dict[str, Any]:
    """Body bytes of one step's request and reply against the raw tensors; the HTTP headers
    of a real exchange; and the reference protocol's compressed bodies, for comparison."""
    figure: dict[str, Any] = {}
    for batch in (1, BIG_BATCH):
        sizes = wire_bytes(ddm.latent_shape, batch)
        figure[f"batch_{batch}"] = {**sizes,
                                    **verdict(sizes["ratio"], WIRE_RATIO, at_least=False)}
    figure["http_headers"] = await _header_bytes(session, fleet, ddm.latent_shape)
    worst = max(figure[f"batch_{b}"]["ratio"] for b in (1, BIG_BATCH))
    figure.update(verdict(worst, WIRE_RATIO, at_least=False))
    figure["value_is"] = "the worse of the batch-1 and batch-64 body ratios"
    return figure


async def _header_bytes(session: aiohttp.ClientSession, fleet: Fleet,
                        shape: tuple[int, int, int]) -> dict[str, int]:
    """HTTP/1.1 header bytes of one velocity exchange with the router's client, rebuilt
    from the header lines sent and received (``Name: value`` and CRLF each)."""
    endpoint = f"{HOST}:{fleet.batched.experts[0].port}"
    body = await _held(session, f"http://{endpoint}", velocity_call(
        1, np.zeros((1, *shape), np.float32), np.zeros(1, np.float32), np.zeros(1, np.int64)))
    async with session.post(f"http://{endpoint}/v1/velocity", data=body,
                            headers={"Content-Type": CONTENT_TYPE}) as response:
        await response.read()
        info = response.request_info
        sent = len(f"{info.method} {info.url.raw_path_qs} HTTP/1.1\r\n") + 2 + sum(
            len(k) + len(v) + 4 for k, v in info.headers.items())
        status = f"HTTP/1.1 {response.status} {response.reason}\r\n"
        received = len(status) + 2 + sum(len(k) + len(v) + 4 for k, v in response.raw_headers)
    return {"request": sent, "reply": received}


async def _delegation(settings: BenchSettings, session: aiohttp.ClientSession,
                      url: str) -> dict[str, Any]:
    """Round trips and seconds per image at batch 1 for each ``delegate_steps``."""
    rows = []
    for delegate in settings.delegations:
        seconds, trips = [], []
        for i in range(settings.repeats):
            elapsed, reply = await _generate(session, url, [i % 10], settings.steps,
                                             settings.seed + i, delegate)
            seconds.append(elapsed)
            trips.extend(reply["round_trips"])
        rows.append({"delegate_steps": delegate, "round_trips_per_image": statistics.mean(trips),
                     "seconds_per_image": round(statistics.median(seconds), 4),
                     "images_per_s": round(images_per_s(1, seconds), 2)})
    return {"steps": settings.steps, "batch": 1, "runs": rows}


async def _quality(settings: BenchSettings, session: aiohttp.ClientSession,
                   url: str) -> dict[str, Any]:
    """Classifier accuracy of per-step routing and of delegation on the same noise, and how
    many images came out identical (the expert integrates with the router's own updates, so
    a sample whose expert never changes within a chunk gets the same bits)."""
    from ddm.evaluation.commands import evaluate_images

    labels = [d for d in range(10) for _ in range(settings.per_digit)]
    delegate = min(10, settings.steps)
    scores, images = {}, {}
    for steps_per_call in (0, delegate):
        chunks = []
        for chunk, start in enumerate(range(0, len(labels), QUALITY_CHUNK)):
            _, reply = await _generate(session, url, labels[start:start + QUALITY_CHUNK],
                                       settings.steps, settings.seed + chunk, steps_per_call)
            chunks.append(_decode_pngs(reply["images"]))
        images[steps_per_call] = np.concatenate(chunks)
        result = evaluate_images(images[steps_per_call], np.asarray(labels))
        scores[steps_per_call] = {"delegate_steps": steps_per_call,
                                  "accuracy": round(result["accuracy"], 4),
                                  "fd": round(result["fd"], 3)}
    gap = round(abs(scores[0]["accuracy"] - scores[delegate]["accuracy"]) * 100, 2)
    same = np.all(images[0] == images[delegate], axis=(1, 2))
    return {"images": len(labels), "steps": settings.steps, "per_step": scores[0],
            "delegated": scores[delegate], "identical_images": int(same.sum()),
            "gap_points": gap, **verdict(gap, ACCURACY_GAP_POINTS, at_least=False)}


# --------------------------------------------------------------------------------- helpers


def _big_labels() -> list[int]:
    return [i % 10 for i in range(BIG_BATCH)]


def _sample_here(ddm: DDM, labels: Sequence[int], steps: int,
                 seed: int) -> tuple[float, np.ndarray]:
    """(seconds, uint8 images) of ``generate`` in this process: in-process sampling, or for
    :func:`reference_ddm` the reference router loop, whose experts are remote."""
    started = time.perf_counter()
    images = generate(ddm, labels, steps, seed, STRATEGY).images
    return time.perf_counter() - started, images


async def _generate(session: aiohttp.ClientSession, url: str, labels: Sequence[int], steps: int,
                    seed: int, delegate_steps: int = 0) -> tuple[float, dict[str, Any]]:
    """One ``POST /v1/generate``: (seconds on this client, the JSON reply)."""
    body = {"labels": list(labels), "steps": steps, "seed": seed, "strategy": STRATEGY,
            "delegate_steps": delegate_steps}
    started = time.perf_counter()
    async with session.post(f"{url}/v1/generate", json=body,
                            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as response:
        reply = await response.json(content_type=None)
        if response.status != 200:
            raise BenchError(f"{url}/v1/generate answered {response.status}: {reply}")
    return time.perf_counter() - started, reply


def _decode_pngs(encoded: Sequence[str]) -> np.ndarray:
    from PIL import Image

    return np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(text))))
                     for text in encoded])


# --------------------------------------------------------------------------------- command


def bench_serve_command(steps: int = 40, quick: bool = False, as_json: bool = False,
                        out: TextIO = sys.stdout, log: TextIO = sys.stderr,
                        text_only: bool = False) -> int:
    """``python -m benchmarks serve``: the results as JSON (``as_json``) or a summary on ``out``;
    ``text_only``: the text DDM's figures alone."""
    settings = BenchSettings(steps=steps, quick=quick)
    text_steps = min(steps, 30)
    if text_only:
        result = {"machine": machine(), **text_figures(text_steps, settings.rounds, log),
                  **text2img_latency(settings.rounds, log)}
        print(json.dumps(result, indent=2) if as_json else "\n".join(
            text_summary_lines(result) + text2img_summary_lines(result)), file=out)
        return 0
    result = run_bench(settings, log)
    result.update(text_figures(text_steps, settings.rounds, log))
    result.update(text2img_latency(settings.rounds, log))
    if as_json:
        print(json.dumps(result, indent=2), file=out)
    else:
        print("\n".join(summary_lines(result) + text_summary_lines(result)
                        + text2img_summary_lines(result)), file=out)
    return 0
