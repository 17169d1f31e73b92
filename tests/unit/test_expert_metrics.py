"""The expert's metrics as Prometheus reads them: counted per request in plain Python, exposed
with the names, labels and cumulative buckets the dashboards and tests use."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from ddm.serving.batching import BatchReport
from ddm.serving.model.metrics import ExpertMetrics


def samples(metrics: ExpertMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, parsed by prometheus_client's own text parser."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(metrics.render().decode())
            for sample in family.samples}


def test_requests_and_images_count_by_kind_and_status():
    metrics = ExpertMetrics()
    metrics.observe_request("velocity", 200, 3)
    metrics.observe_request("velocity", 200, 2)
    metrics.observe_request("velocity", 429, 0)
    metrics.observe_request("integrate", 422, 4)  # refused: no images
    seen = samples(metrics)
    assert seen["ddm_expert_requests_total", (("kind", "velocity"), ("status", "200"))] == 2
    assert seen["ddm_expert_requests_total", (("kind", "velocity"), ("status", "429"))] == 1
    assert seen["ddm_expert_requests_total", (("kind", "integrate"), ("status", "422"))] == 1
    assert seen["ddm_expert_images_total", (("kind", "velocity"),)] == 5
    assert ("ddm_expert_images_total", (("kind", "integrate"),)) not in seen


def test_histogram_buckets_are_cumulative_and_a_value_on_a_bound_is_in_its_bucket():
    metrics = ExpertMetrics()
    metrics.observe_batch(BatchReport(images=4, queue_delays=(0.001, 0.0001, 5.0),
                                      model_seconds=0.003))
    metrics.observe_batch(BatchReport(images=1, queue_delays=(0.0,), model_seconds=0.003))
    seen = samples(metrics)

    def bucket(name: str, le: str) -> float:
        return seen[f"{name}_bucket", (("le", le),)]

    # batch sizes 4 and 1: buckets le=1 (1), le=2 (1), le=4 (2) and every one above
    assert [bucket("ddm_expert_batch_images", le) for le in ("1.0", "2.0", "4.0", "256.0",
                                                             "+Inf")] == [1, 1, 2, 2, 2]
    assert seen["ddm_expert_batch_images_sum", ()] == 5
    assert seen["ddm_expert_batch_images_count", ()] == 2
    # delays 0, 1e-4, 1e-3 and 5 s: 5 s is over the last bound (2.5 s)
    assert [bucket("ddm_expert_queue_delay_seconds", le)
            for le in ("5e-05", "0.0001", "0.0005", "0.001", "2.5", "+Inf")] == [1, 2, 2, 3, 3, 4]
    assert seen["ddm_expert_queue_delay_seconds_count", ()] == 4
    assert abs(seen["ddm_expert_queue_delay_seconds_sum", ()] - 5.0011) < 1e-12
    assert bucket("ddm_expert_model_seconds", "0.0025") == 0
    assert bucket("ddm_expert_model_seconds", "0.005") == 2
