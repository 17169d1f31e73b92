"""The routers' demand on each expert, read as the operator reads it: from their ``/metrics``.

The operator scrapes each ready router pod's metrics port, the series an HPA or KEDA on
external metrics would use (``ROWS_METRIC``, a counter, and ``WAITING_METRIC``, a gauge;
labelled by expert), rather than ``/v1/demand``: the metrics port needs no bearer token (the
operator can create the routers' token Secrets but never read them) and opens no API.

A router is a peer: its answer has a deadline (``SCRAPE_TIMEOUT_S``) and a size cap
(``MAX_METRICS_BYTES``), is parsed by prometheus-client's parser, and only the named series of
experts the caller asks about are kept, as finite, non-negative numbers; anything else makes
that router's answer unreadable (None), which counts as no reading from it.

:class:`DemandRates` turns successive readings into rows per second over ``DEMAND_WINDOW_S``, as
Prometheus's ``rate()`` does: per router pod, counter increases (a counter that went down
restarted: its whole value is new), the first reading of a pod only a baseline.
"""

from __future__ import annotations

import math
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from typing import Collection, Mapping

from prometheus_client.parser import text_string_to_metric_families

from ddm.deploy.autoscaling import DEMAND_WINDOW_S, ROWS_METRIC, WAITING_METRIC
from ddm.deploy.autoscaler import Demand

#: Deadline for one router's ``/metrics``, and the most of it read.
SCRAPE_TIMEOUT_S = 2.0
MAX_METRICS_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True)
class RouterReading:
    """One router's counters now: rows routed to each expert since it started, and the
    generations waiting for each."""

    rows_total: Mapping[str, float]
    waiting: Mapping[str, float]


def parse_metrics(text: str, experts: Collection[str]) -> RouterReading | None:
    """The demand series of ``experts`` in a router's exposition ``text``; None when the text
    is not a valid exposition or a value of ours is not a finite non-negative number."""
    rows: dict[str, float] = {}
    waiting: dict[str, float] = {}
    wanted = {f"{ROWS_METRIC}_total": rows, WAITING_METRIC: waiting}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                into = wanted.get(sample.name)
                expert = sample.labels.get("expert")
                if into is None or expert not in experts:
                    continue
                if not (math.isfinite(sample.value) and sample.value >= 0):
                    return None
                into[expert] = float(sample.value)
    except (ValueError, TypeError, IndexError, KeyError):
        return None
    return RouterReading(rows, waiting)


def scrape(url: str, experts: Collection[str],
           timeout_s: float = SCRAPE_TIMEOUT_S) -> RouterReading | None:
    """:func:`parse_metrics` of what ``url`` answers within ``timeout_s`` in all and the cap;
    None when it does not answer usably. The deadline is the whole answer's, not each read's:
    a router trickling bytes would otherwise hold the operator's one scaler thread, which
    scrapes every router in turn, for as long as it likes."""
    deadline = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as answer:
            if answer.status != 200:
                return None
            body = b""
            while len(body) <= MAX_METRICS_BYTES:
                if time.monotonic() > deadline:
                    return None
                chunk = answer.read1(MAX_METRICS_BYTES + 1 - len(body))
                if not chunk:
                    break
                body += chunk
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
        return None
    if len(body) > MAX_METRICS_BYTES:
        return None
    try:
        return parse_metrics(body.decode("utf-8"), experts)
    except UnicodeDecodeError:
        return None


@dataclass
class DemandRates:
    """Rows per second per expert over the last ``window_s``, from readings of many router
    pods (keyed by the pod's uid), taken at the caller's times (monotonic seconds)."""

    window_s: float = DEMAND_WINDOW_S
    _last: dict[str, RouterReading] = field(default_factory=dict)
    _increases: deque[tuple[float, str, float]] = field(default_factory=deque)
    _since: float | None = None

    def observe(self, now: float, readings: Mapping[str, RouterReading],
                experts: Collection[str]) -> dict[str, Demand]:
        """Each expert's demand after this round of ``readings`` (pods not read this round
        keep their last counters; pods gone from the round are forgotten)."""
        if self._since is None:
            self._since = now
        active: set[str] = set()
        for pod, reading in readings.items():
            before = self._last.get(pod)
            if before is not None:
                for expert, total in reading.rows_total.items():
                    previous = before.rows_total.get(expert, 0.0)
                    increase = total - previous if total >= previous else total
                    if increase > 0:
                        self._increases.append((now, expert, increase))
                        active.add(expert)
            self._last[pod] = reading
        while self._increases and self._increases[0][0] <= now - self.window_s:
            self._increases.popleft()
        span = min(self.window_s, max(now - self._since, 1.0))
        rows = dict.fromkeys(experts, 0.0)
        for _, expert, increase in self._increases:
            if expert in rows:
                rows[expert] += increase
        waiting = dict.fromkeys(experts, 0)
        for pod, reading in readings.items():
            for expert, count in reading.waiting.items():
                if expert in waiting:
                    waiting[expert] += int(count)
        return {e: Demand(rows[e] / span, waiting[e], e in active) for e in experts}

    def forget_except(self, pods: Collection[str]) -> None:
        """Drop the counters of router pods no longer there."""
        for pod in set(self._last) - set(pods):
            del self._last[pod]
