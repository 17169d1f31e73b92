"""``python -m benchmarks serve``'s arithmetic: the targets, the figures computed from measured
seconds and bytes, and the one-line summary. Pure functions of what :mod:`benchmarks.serve`
measured, so that they are unit-tested without running a server."""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

import numpy as np

from ddm.serving.wire.protocol import encode_response
from tests.support.label_wire import velocity_call
from benchmarks.reference_protocol import encode_npz

BIG_BATCH = 64

# The targets.
DISTRIBUTED_VS_IN_PROCESS = 0.85
STEP_OVERHEAD_MS = 1.0
SPEEDUP_VS_REFERENCE = 5.0
BATCHING_SPEEDUP = 4.0
WIRE_RATIO = 1.02
ACCURACY_GAP_POINTS = 1.0
#: A batch-1 expert call's cost beyond its model and the HTTP floor, any model size (issue 25).
CALL_ABOVE_FLOOR_MS = 0.5


def cpu_per_step(cpu_seconds: dict[str, float], step_count: int) -> dict[str, float | None]:
    """CPU milliseconds per batch-1 step in-process and in the router and experts together,
    and their difference: the data plane's cost in CPU, which, unlike wall time, does not
    count waiting for a core on a busy machine. None where it could not be read."""
    local, served = (cpu_seconds[k] * 1e3 / step_count
                     for k in ("in_process", "router_and_experts"))
    if served != served:  # NaN: no per-thread CPU counters on this platform
        return {"in_process": round(local, 3), "router_and_experts": None, "overhead": None}
    return {"in_process": round(local, 3), "router_and_experts": round(served, 3),
            "overhead": round(served - local, 3)}


def throughput_figures(measured: dict[str, Any], steps: int) -> dict[str, Any]:
    """Images/s and the targets' ratios from :func:`_throughput`'s seconds."""
    figures: dict[str, Any] = {}
    for batch, times in measured["runs"].items():
        local, remote = times["in_process"], times["distributed"]
        figures[f"batch_{batch}"] = {
            "in_process": rate(batch, local),
            "distributed": {**rate(batch, remote), "router_seconds": rounded(times["router"])},
            "ratio": round(images_per_s(batch, remote) / images_per_s(batch, local), 3)}
    big = figures[f"batch_{BIG_BATCH}"]
    big.update(verdict(big["ratio"], DISTRIBUTED_VS_IN_PROCESS, at_least=True))
    figures["max_pixel_difference"] = measured["checks"]["max_pixel_difference"]

    local, remote = measured["runs"][1]["in_process"], measured["runs"][1]["distributed"]
    per_pair = [(r - lo) / steps * 1e3 for lo, r in zip(local, remote)]
    overhead = {"steps": steps, "generations": len(per_pair),
                "in_process_ms_per_step": round(statistics.median(local) / steps * 1e3, 3),
                "distributed_ms_per_step": round(statistics.median(remote) / steps * 1e3, 3),
                "overhead_ms_per_step": rounded(per_pair),
                "cpu_ms_per_step": cpu_per_step(measured["cpu_seconds_batch_1"],
                                                len(per_pair) * steps),
                **verdict(round(statistics.median(per_pair), 3), STEP_OVERHEAD_MS,
                           at_least=False)}

    theirs = rate(1, measured["runs"][1]["reference"])
    ours = figures["batch_1"]["distributed"]["images_per_s"]
    speedup = round(ours / theirs["images_per_s"], 3)
    # What a transport costing nothing would reach: the in-process rate over the reference's.
    ceiling = round(figures["batch_1"]["in_process"]["images_per_s"] / theirs["images_per_s"], 3)
    reference = {"server": "FastAPI on uvicorn (as build_server runs it), model in a worker thread",
                 "client": "http.client.HTTPConnection per call (TCP_NODELAY), closed after it",
                 "encoding": "np.savez_compressed of x, t, y; reply of v",
                 "router_loop": "ddm.sampling.pipeline.generate in the benchmark's process",
                 "reference": theirs, "ours": {"images_per_s": ours},
                 "same_images_as_in_process": measured["checks"]["reference_same_images"],
                 "speedup": speedup, "ceiling": ceiling,
                 **verdict(speedup, SPEEDUP_VS_REFERENCE, at_least=True)}
    return {"throughput": figures, "step_overhead": overhead, "reference_baseline": reference}


def wire_bytes(image_shape: tuple[int, int, int], batch: int) -> dict[str, Any]:
    """Bytes of one velocity step at ``batch`` rows: raw tensors (``x`` float32, ``t`` float32,
    ``y`` int64 out; ``v`` float32 back), our protocol's bodies (the velocity call naming rows
    of a label context, which crosses once per generation, not per step), and the reference
    ``.npz`` bodies of standard-normal ``x`` and ``v`` (what a sampler sends: noise-like
    values)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *image_shape), np.float32)
    t, y = np.full(batch, 0.5, np.float32), np.arange(batch, dtype=np.int64) % 10
    v = rng.standard_normal(x.shape, np.float32)
    raw_request, raw_reply = x.nbytes + t.nbytes + y.nbytes, v.nbytes
    request = len(velocity_call(1, x, t, y).call)
    reply = len(encode_response(1, v))
    npz_request, npz_reply = len(encode_npz(x=x, t=t, y=y)), len(encode_npz(v=v))
    return {"raw_request": raw_request, "raw_reply": raw_reply,
            "body_request": request, "body_reply": reply,
            "ratio": round((request + reply) / (raw_request + raw_reply), 4),
            "reference_npz_request": npz_request, "reference_npz_reply": npz_reply,
            "reference_npz_ratio": round((npz_request + npz_reply)
                                         / (raw_request + raw_reply), 4)}


def images_per_s(batch: int, seconds: Sequence[float]) -> float:
    return batch * len(seconds) / sum(seconds)


def rate(batch: int, seconds: Sequence[float]) -> dict[str, Any]:
    return {"batch": batch, "seconds": rounded(seconds),
            "images_per_s": round(images_per_s(batch, seconds), 3)}


def speedup(figure: dict[str, Any]) -> float:
    return round(figure["batched"]["images_per_s"] / figure["unbatched"]["images_per_s"], 3)


def rounded(values: Sequence[float]) -> list[float]:
    return [round(v, 4) for v in values]


def verdict(value: float, target: float, at_least: bool) -> dict[str, Any]:
    met = value >= target if at_least else value <= target
    return {"value": value, "target": target, "comparison": ">=" if at_least else "<=",
            "met": bool(met)}


def summary_lines(result: dict[str, Any]) -> list[str]:
    """One line per figure with a target: what was measured, the target, met or not."""
    figures = [("throughput, distributed / in-process at batch 64", result["throughput"][
                   f"batch_{BIG_BATCH}"], "x"),
               ("per-step overhead at batch 1, median", result["step_overhead"], " ms"),
               ("ours / reference protocol at batch 1", result["reference_baseline"], "x"),
               ("dynamic batching, 64 concurrent generations", result["concurrency"]["router"],
                "x"),
               *((f"dynamic batching, 64 concurrent calls to {name}", figure, "x")
                 for name, figure in result["concurrency"]["expert"].items()),
               *((f"batch-1 call to {name} beyond its model and the HTTP floor, median",
                  next(iter(trees.values())), " ms")
                 for name, trees in result["expert_call"]["models"].items()),
               ("body bytes / raw tensor bytes", result["wire"], ""),
               ("accuracy gap, per-step vs delegated (points)", result["quality"], "")]
    return [f"{'met ' if f['met'] else 'MISS'}  {name}: {f['value']}{unit} "
            f"(target {f['comparison']} {f['target']}{unit})" for name, f, unit in figures]


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50, p90, p99 (nearest rank) and max, in seconds."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "max": None}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 4)

    return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "max": round(ordered[-1], 4)}
