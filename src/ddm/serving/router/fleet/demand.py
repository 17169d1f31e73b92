"""Demand on each expert, as the router's routing sees it: the signal to scale experts by.

Per expert, over a sliding window of ``window_s`` seconds: rows the strategy routed to it (per
velocity evaluation; before any rerouting, so an expert with no replica still shows the demand
it would get), the weight mass of those rows, rows rerouted away from it because it was
missing, and seconds generations waited for it (the ``wait`` policy); and, now, how many
generations are waiting for it. Rates are the window's sums divided by the window, declared
once in the summary; ``idle_s`` is the time since the expert last had any demand (None:
never), what a scale-down delay is measured against.

Pure accounting: callers pass the time (``time.monotonic()``), so tests drive it with known
answers (:class:`DemandMeter` is the router's, on the monotonic clock, with the same
signals as Prometheus series). Memory is bounded: one row of sums per ``bucket_s`` of the window.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

from ddm.deploy.autoscaling import DEMAND_WINDOW_S, ROWS_METRIC, WAITING_METRIC

#: Columns of a bucket: rows routed, their weight, rows rerouted away, seconds waited.
_ROWS, _WEIGHT, _REROUTED, _WAITED = range(4)


@dataclass(frozen=True)
class ExpertDemand:
    """One expert's demand over the window (rates per second) and now."""

    rows_per_s: float
    weight_per_s: float
    rerouted_rows_per_s: float
    waited_s_per_s: float
    waiting: int
    idle_s: float | None

    def as_json(self) -> dict[str, Any]:
        return {"rows_per_s": round(self.rows_per_s, 6),
                "weight_per_s": round(self.weight_per_s, 6),
                "rerouted_rows_per_s": round(self.rerouted_rows_per_s, 6),
                "waited_s_per_s": round(self.waited_s_per_s, 6), "waiting": self.waiting,
                "idle_s": None if self.idle_s is None else round(self.idle_s, 3)}


class DemandWindow:
    """Sums per expert in time buckets of ``bucket_s``, kept for ``window_s``."""

    def __init__(self, experts: Sequence[str], window_s: float = DEMAND_WINDOW_S,
                 bucket_s: float = 1.0) -> None:
        if not (window_s > 0 and bucket_s > 0 and bucket_s <= window_s):
            raise ValueError(f"need 0 < bucket_s <= window_s, got {bucket_s} and {window_s}")
        self.experts = tuple(experts)
        self.window_s = float(window_s)
        self.bucket_s = float(bucket_s)
        self._slots = math.ceil(window_s / bucket_s)
        self._sums = np.zeros((self._slots, len(self.experts), 4), np.float64)
        self._stamp = np.full(self._slots, -1, np.int64)  # which bucket number each slot holds
        self._index = {name: i for i, name in enumerate(self.experts)}
        self._waiting = np.zeros(len(self.experts), np.int64)
        self._last = np.full(len(self.experts), np.nan)

    def routed(self, now: float, rows: Sequence[float], weight: Sequence[float]) -> None:
        """Rows ``(K,)`` the strategy routed to each expert and their weight ``(K,)``."""
        rows_array = np.asarray(rows, np.float64)
        self._add(now, _ROWS, rows_array)
        self._add(now, _WEIGHT, np.asarray(weight, np.float64))
        self._last[rows_array > 0] = now

    def rerouted(self, now: float, expert: str, rows: int) -> None:
        """``rows`` that wanted ``expert`` went to others: it was missing."""
        self._add(now, _REROUTED, self._one(expert, rows))
        self._last[self._index[expert]] = now

    def wait_started(self, now: float, expert: str) -> None:
        self._waiting[self._index[expert]] += 1
        self._last[self._index[expert]] = now

    def wait_ended(self, now: float, expert: str, seconds: float) -> None:
        self._waiting[self._index[expert]] -= 1
        self._add(now, _WAITED, self._one(expert, seconds))
        self._last[self._index[expert]] = now

    def summary(self, now: float) -> dict[str, ExpertDemand]:
        """Each expert's demand over the window ending ``now``."""
        current = self._bucket(now)
        live = (self._stamp > current - self._slots) & (self._stamp <= current)
        totals = self._sums[live].sum(axis=0) / self.window_s
        out = {}
        for i, name in enumerate(self.experts):
            busy = self._waiting[i] > 0
            idle = 0.0 if busy else (None if np.isnan(self._last[i]) else now - self._last[i])
            out[name] = ExpertDemand(*(float(v) for v in totals[i]), waiting=int(
                self._waiting[i]), idle_s=idle)
        return out

    def as_json(self, now: float) -> dict[str, Any]:
        """The summary as ``/v1/demand`` serves it."""
        return {"window_s": self.window_s,
                "experts": {name: d.as_json() for name, d in self.summary(now).items()}}

    def _one(self, expert: str, value: float) -> np.ndarray:
        column = np.zeros(len(self.experts), np.float64)
        column[self._index[expert]] = value
        return column

    def _bucket(self, now: float) -> int:
        return int(math.floor(now / self.bucket_s))

    def _add(self, now: float, column: int, values: np.ndarray) -> None:
        bucket = self._bucket(now)
        slot = bucket % self._slots
        if self._stamp[slot] != bucket:
            self._sums[slot] = 0.0
            self._stamp[slot] = bucket
        self._sums[slot, :, column] += values


class DemandMeter:
    """The router's demand: a :class:`DemandWindow` on the monotonic clock, and the same
    signals as Prometheus series (``ddm_router_expert_*``, by expert), for an HPA or KEDA
    on external metrics."""

    def __init__(self, experts: Sequence[str], registry: CollectorRegistry,
                 window_s: float = DEMAND_WINDOW_S) -> None:
        self.window = DemandWindow(experts, window_s)
        self.experts = tuple(experts)
        self._rows = Counter(ROWS_METRIC, "Rows the routing strategy sent to "
                             "each expert, per velocity evaluation (before rerouting).",
                             ["expert"], registry=registry)
        self._weight = Counter("ddm_router_expert_weight", "Mixture weight mass of those rows.",
                               ["expert"], registry=registry)
        self._rerouted = Counter("ddm_router_expert_rerouted_rows", "Rows that wanted the "
                                 "expert while it was missing and went to others "
                                 "(missing_expert.policy reroute).", ["expert"],
                                 registry=registry)
        self._waited = Counter("ddm_router_expert_wait_seconds", "Seconds generations waited "
                               "for the expert to have a usable replica (policy wait).",
                               ["expert"], registry=registry)
        self._waiting = Gauge(WAITING_METRIC, "Generations waiting "
                              "now for the expert to have a usable replica.", ["expert"],
                              registry=registry)
        self.rerouted_steps = Counter("ddm_router_rerouted_steps", "Steps of images that had "
                                      "a missing expert's share moved to others.",
                                      registry=registry)

    def routed(self, rows: np.ndarray, weight: np.ndarray) -> None:
        self.window.routed(time.monotonic(), rows, weight)
        for name, count, mass in zip(self.experts, rows, weight):
            if count:
                self._rows.labels(name).inc(float(count))
                self._weight.labels(name).inc(float(mass))

    def rerouted(self, expert: str, rows: int) -> None:
        self.window.rerouted(time.monotonic(), expert, rows)
        self._rerouted.labels(expert).inc(rows)

    def wait_started(self, expert: str) -> None:
        self.window.wait_started(time.monotonic(), expert)
        self._waiting.labels(expert).inc()

    def wait_ended(self, expert: str, seconds: float) -> None:
        self.window.wait_ended(time.monotonic(), expert, seconds)
        self._waiting.labels(expert).dec()
        self._waited.labels(expert).inc(seconds)

    def as_json(self) -> dict[str, Any]:
        return self.window.as_json(time.monotonic())
