"""Where a served level's time went: each model server's time in its model, the router's round
trips, and the GPU's.

A deployment slower than in-process sampling loses its time either in its model calls (small
batches, a slow forward, preparing each batch's inputs) or around them (the router, HTTP,
waiting for each other). Each model server counts, per member, its batches, their rows and
their seconds in the model (``ddm_expert_batch_images``, ``ddm_expert_model_seconds`` on its
``/metrics``: the time of the batch's whole run, inputs moved to the device and outputs back
included); read before and after a level, their differences say how busy each server was and
how many rows its batches held. The router times each call it makes to a model server, sent
to answered (``ddm_router_expert_call_seconds``, ``ddm_router_stage_call_seconds``): a round
trip longer than the model's time for it is spent in HTTP, coding and queues. On an NVIDIA
machine ``nvidia-smi`` samples how busy the GPU was meanwhile (the share of each sample
period in which a kernel ran).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from dataclasses import dataclass
from typing import Any, AsyncIterator

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.fleet import BenchError

#: The families read, by what they count.
BATCH_ROWS, MODEL_SECONDS = "ddm_expert_batch_images", "ddm_expert_model_seconds"
#: How often nvidia-smi samples the GPU's utilisation during a level.
GPU_SAMPLE_MS = 200


@dataclass(frozen=True)
class ModelTime:
    """One member's counts so far: batches run, rows in them, seconds in the model."""

    batches: int = 0
    rows: int = 0
    seconds: float = 0.0

    def since(self, earlier: ModelTime) -> ModelTime:
        return ModelTime(self.batches - earlier.batches, self.rows - earlier.rows,
                         self.seconds - earlier.seconds)


def model_times(exposition: str) -> dict[str, ModelTime]:
    """A model server's ``/metrics`` text -> each member's counts, by its ``member`` label (a
    server of one model, whose series carry none: ``""``)."""
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(exposition):
        if family.name not in (BATCH_ROWS, MODEL_SECONDS):
            continue
        for sample in family.samples:
            member = sample.labels.get("member", "")
            counts = found.setdefault(member, {})
            if sample.name == f"{BATCH_ROWS}_count":
                counts["batches"] = sample.value
            elif sample.name == f"{BATCH_ROWS}_sum":
                counts["rows"] = sample.value
            elif sample.name == f"{MODEL_SECONDS}_sum":
                counts["seconds"] = sample.value
    return {member: ModelTime(int(c.get("batches", 0)), int(c.get("rows", 0)),
                              float(c.get("seconds", 0.0)))
            for member, c in found.items()}


#: The router's round-trip histograms, by what they time: its calls to experts (by kind) and
#: to its served stages (by stage).
ROUND_TRIPS = {"ddm_router_expert_call_seconds": "expert",
               "ddm_router_stage_call_seconds": "stage"}


@dataclass(frozen=True)
class RoundTrips:
    """A router's successful calls of one kind so far and their seconds, sent to answered."""

    calls: int = 0
    seconds: float = 0.0

    def since(self, earlier: RoundTrips) -> RoundTrips:
        return RoundTrips(self.calls - earlier.calls, self.seconds - earlier.seconds)


def round_trips(exposition: str) -> dict[str, RoundTrips]:
    """A router's ``/metrics`` text -> its calls so far by what they called: ``expert
    velocity`` (every expert's together; a pool request carrying several counts once per
    member call it carried), ``expert integrate``, and each served stage (``stage router``,
    ``stage text_encoder``, ``stage decoder``)."""
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(exposition):
        subject = ROUND_TRIPS.get(family.name)
        if subject is None:
            continue
        for sample in family.samples:
            counts = found.setdefault(f"{subject} {sample.labels['kind']}", {})
            if sample.name == f"{family.name}_count":
                counts["calls"] = counts.get("calls", 0.0) + sample.value
            elif sample.name == f"{family.name}_sum":
                counts["seconds"] = counts.get("seconds", 0.0) + sample.value
    return {key: RoundTrips(int(c.get("calls", 0)), float(c.get("seconds", 0.0)))
            for key, c in found.items()}


def level_round_trips(before: dict[str, RoundTrips], after: dict[str, RoundTrips]
                      ) -> dict[str, Any]:
    """A level's calls of each kind that the router made, and their mean round trip."""
    level = {}
    for key, counts in sorted(after.items()):
        spent = counts.since(before.get(key, RoundTrips()))
        if spent.calls:
            level[key] = {"calls": spent.calls,
                          "mean_ms": round(spent.seconds / spent.calls * 1000, 3)}
    return level


#: The router's count of the calls it started beside a served router network's pass.
CALLS_AHEAD = "ddm_router_calls_ahead"


def calls_ahead(exposition: str) -> dict[str, int]:
    """A router's ``/metrics`` text -> its calls ahead so far by outcome (``used``,
    ``unused``; zero where it started none)."""
    counts = {"used": 0, "unused": 0}
    for family in text_string_to_metric_families(exposition):
        if family.name == CALLS_AHEAD:
            for sample in family.samples:
                if sample.name == f"{CALLS_AHEAD}_total":
                    counts[sample.labels["outcome"]] = int(sample.value)
    return counts


async def exposition(session: aiohttp.ClientSession, url: str) -> str:
    """The ``/metrics`` text at ``url``."""
    async with session.get(url) as answer:
        text = await answer.text()
        if answer.status != 200:
            raise BenchError(f"{url} answered {answer.status}: {text[:200]}")
        return text


async def scrape(session: aiohttp.ClientSession,
                 metrics: dict[str, str]) -> dict[str, dict[str, ModelTime]]:
    """Every server's counts, by server name then member, from its ``/metrics`` URL."""
    read = await asyncio.gather(*(exposition(session, url) for url in metrics.values()))
    return {name: model_times(text) for name, text in zip(metrics, read)}


def level_model_time(before: dict[str, dict[str, ModelTime]],
                     after: dict[str, dict[str, ModelTime]],
                     elapsed_s: float) -> dict[str, Any]:
    """A level's figures per server: its members' seconds in the model together, that as a
    share of the level's wall time (over 1 where members ran side by side), and per member
    that ran a batch its batches, rows per batch and seconds."""
    servers: dict[str, Any] = {}
    for server, members in after.items():
        spent = {member: counts.since(before.get(server, {}).get(member, ModelTime()))
                 for member, counts in members.items()}
        ran = {member: counts for member, counts in spent.items() if counts.batches}
        seconds = sum(counts.seconds for counts in ran.values())
        servers[server] = {
            "model_s": round(seconds, 3), "busy": round(seconds / elapsed_s, 3),
            "members": {member or server: {"batches": c.batches,
                                           "rows_per_batch": round(c.rows / c.batches, 2),
                                           "model_s": round(c.seconds, 3)}
                        for member, c in sorted(ran.items())}}
    return servers


@contextlib.asynccontextmanager
async def gpu_utilisation() -> AsyncIterator[dict[str, Any]]:
    """Samples ``nvidia-smi``'s utilisation of the first GPU while the block runs; the dict
    it yields then holds their mean and count (``percent``, ``samples``), or None values
    without nvidia-smi or where it printed none (a failed reading is recorded, not
    raised)."""
    figures: dict[str, Any] = {"percent": None, "samples": 0}
    if shutil.which("nvidia-smi") is None:
        yield figures
        return
    process = await asyncio.create_subprocess_exec(
        "nvidia-smi", "--id=0", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
        f"--loop-ms={GPU_SAMPLE_MS}", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    try:
        yield figures
    finally:
        if process.returncode is None:
            process.terminate()
        out, _ = await process.communicate()
        values = [float(line) for line in out.decode("ascii", "replace").split()
                  if line.replace(".", "", 1).isdigit()]
        figures["samples"] = len(values)
        if values:
            figures["percent"] = round(sum(values) / len(values), 1)
        else:
            figures["error"] = f"nvidia-smi printed no sample (exit status {process.returncode})"
