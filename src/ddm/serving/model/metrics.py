"""Prometheus metrics of one expert server, counted in plain Python and exposed at a scrape.

Every request is counted on an event loop, on the request's critical path. prometheus_client's
``labels(...).inc()`` and ``Histogram.observe`` take a lock and walk objects per call, a sizeable
share of a batch-1 call's cost beyond the model with the caches cold after the model ran
(docs/benchmarks.md, ``calls``). The counts are therefore kept in dicts
and lists under one plain lock (an expert serves on two event loops: :mod:`ddm.serving.http.server`)
and turned into metric families when ``/metrics`` is scraped (:class:`_Collector`); the
exposition is prometheus_client's.

A registry per app (not the process-global one) lets tests and ``ddm up`` run several experts
in one process without their series colliding. A pool server keeps one :class:`ExpertMetrics`
per member and exposes them together (:class:`MemberMetrics`), each series labelled
``member="NAME"``.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from typing import Iterator, Mapping, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ddm.serving.batching import BatchReport

#: ``Content-Type`` of :meth:`ExpertMetrics.render`.
CONTENT_TYPE = CONTENT_TYPE_LATEST
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# From 50 us (a batch-1 step of a small model) to 2.5 s (a long integrate request).
_SECONDS_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
                    0.25, 0.5, 1.0, 2.5)


class _Histogram:
    """Observations per bucket (the last one: over every bound) and their sum."""

    def __init__(self, name: str, documentation: str, bounds: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # Bucket i counts bounds[i-1] < value <= bounds[i]: a value on a bound is "le" it.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def add_to(self, family: HistogramMetricFamily, labels: Sequence[str]) -> None:
        cumulative, buckets = 0, []
        for bound, count in zip((*map(float, self.bounds), float("inf")), self.counts):
            cumulative += count
            buckets.append((_bound_label(bound), cumulative))
        family.add_metric(list(labels), buckets, self.sum)


class ExpertMetrics:
    """Requests by kind and status, batch sizes, queue delay, model time and images served."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # guards every count below: the event loops write them
        self.requests: dict[tuple[str, str], int] = {}  # (kind, status) -> requests
        self.images: dict[str, int] = {}  # kind -> images answered with 200
        self.batch_images = _Histogram(
            "ddm_expert_batch_images", "Images per model call (after coalescing requests).",
            _BATCH_BUCKETS)
        self.queue_delay = _Histogram(
            "ddm_expert_queue_delay_seconds", "Time a request waited before its batch ran.",
            _SECONDS_BUCKETS)
        self.model_seconds = _Histogram(
            "ddm_expert_model_seconds", "Time of one batch in the model (a whole integration "
            "for integrate requests).", _SECONDS_BUCKETS)
        self.registry = CollectorRegistry()
        self.registry.register(_Collector({(): self}, ()))

    def observe_batch(self, report: BatchReport) -> None:
        with self.lock:
            self.batch_images.observe(report.images)
            self.model_seconds.observe(report.model_seconds)
            for delay in report.queue_delays:
                self.queue_delay.observe(delay)

    def observe_request(self, kind: str, status: int, images: int) -> None:
        key = (kind, str(status))
        with self.lock:
            self.requests[key] = self.requests.get(key, 0) + 1
            if status == 200:
                self.images[kind] = self.images.get(kind, 0) + images

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)


class MemberMetrics:
    """A pool's members' metrics on one exposition: each series labelled ``member``."""

    def __init__(self, members: Mapping[str, ExpertMetrics]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Collector({(name,): m for name, m in members.items()},
                                          ("member",)))

    def render(self) -> bytes:
        """The Prometheus text exposition of every member's series."""
        return generate_latest(self.registry)


class _Collector(Collector):
    """The counts of :class:`ExpertMetrics` as metric families, made at each scrape: one
    family per metric, a series per (``labels`` values, the metric's own labels)."""

    def __init__(self, sources: Mapping[tuple[str, ...], ExpertMetrics],
                 labels: tuple[str, ...]) -> None:
        self.sources = sources
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        labels = list(self.labels)
        requests = CounterMetricFamily(
            "ddm_expert_requests", "Requests answered, by message kind and HTTP status.",
            labels=[*labels, "kind", "status"])
        images = CounterMetricFamily(
            "ddm_expert_images", "Images answered successfully, by message kind.",
            labels=[*labels, "kind"])
        first = next(iter(self.sources.values()))
        histograms = [HistogramMetricFamily(h.name, h.documentation, labels=labels)
                      for h in (first.batch_images, first.queue_delay, first.model_seconds)]
        for values, metrics in self.sources.items():
            with metrics.lock:
                for (kind, status), count in sorted(metrics.requests.items()):
                    requests.add_metric([*values, kind, status], count)
                for kind, count in sorted(metrics.images.items()):
                    images.add_metric([*values, kind], count)
                for family, histogram in zip(histograms, (metrics.batch_images,
                                                          metrics.queue_delay,
                                                          metrics.model_seconds)):
                    histogram.add_to(family, values)
        yield from (requests, images, *histograms)


def _bound_label(bound: float) -> str:
    """A bucket's ``le`` as prometheus_client writes it (``1.0``, ``0.005``, ``+Inf``)."""
    return "+Inf" if bound == float("inf") else repr(bound)
