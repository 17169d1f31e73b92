"""Prometheus metrics of one expert server, in a registry of its own.

A registry per app (not the process-global one) lets tests and ``ddm up`` run several experts
in one process without their series colliding.
"""

from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram,
                               generate_latest)

from ddm.serving.batching import BatchReport

#: ``Content-Type`` of :meth:`ExpertMetrics.render`.
CONTENT_TYPE = CONTENT_TYPE_LATEST
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# From 50 us (a batch-1 step of a small model) to 2.5 s (a long integrate request).
_SECONDS_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
                    0.25, 0.5, 1.0, 2.5)


class ExpertMetrics:
    """Requests by kind and status, batch sizes, queue delay, model time and images served."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "ddm_expert_requests", "Requests answered, by message kind and HTTP status.",
            ["kind", "status"], registry=self.registry)
        self.images = Counter(
            "ddm_expert_images", "Images answered successfully, by message kind.",
            ["kind"], registry=self.registry)
        self.batch_images = Histogram(
            "ddm_expert_batch_images", "Images per model call (after coalescing requests).",
            buckets=_BATCH_BUCKETS, registry=self.registry)
        self.queue_delay = Histogram(
            "ddm_expert_queue_delay_seconds", "Time a request waited before its batch ran.",
            buckets=_SECONDS_BUCKETS, registry=self.registry)
        self.model_seconds = Histogram(
            "ddm_expert_model_seconds", "Time of one batch in the model (a whole integration "
            "for integrate requests).", buckets=_SECONDS_BUCKETS, registry=self.registry)

    def observe_batch(self, report: BatchReport) -> None:
        self.batch_images.observe(report.images)
        self.model_seconds.observe(report.model_seconds)
        for delay in report.queue_delays:
            self.queue_delay.observe(delay)

    def observe_request(self, kind: str, status: int, images: int) -> None:
        self.requests.labels(kind=kind, status=str(status)).inc()
        if status == 200:
            self.images.labels(kind=kind).inc(images)

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)
