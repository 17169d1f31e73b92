"""The operator reads the routers' demand from their /metrics (ddm.operator.demand): the
router's own DemandMeter writes the exposition, a loopback HTTP server serves it (and worse)."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ddm.deploy.autoscaler import Demand
from ddm.operator.demand import MAX_METRICS_BYTES, DemandRates, RouterReading, parse_metrics, scrape
from ddm.serving.router.fleet.demand import DemandMeter

EXPERTS = ("a", "b")


def _exposition(rows: list[int], waiting: dict[str, int]) -> str:
    registry = CollectorRegistry()
    meter = DemandMeter(EXPERTS, registry)
    meter.routed(np.array(rows), np.array(rows, np.float64) / 2)
    for expert, count in waiting.items():
        for _ in range(count):
            meter.wait_started(expert)
    return generate_latest(registry).decode()


def test_the_routers_series_are_read_per_expert() -> None:
    reading = parse_metrics(_exposition([12, 0], {"b": 2}), EXPERTS)
    assert reading == RouterReading({"a": 12.0}, {"b": 2.0})


def test_only_the_experts_asked_about_are_kept() -> None:
    assert parse_metrics(_exposition([12, 3], {}), ["b"]) == RouterReading({"b": 3.0}, {})


@pytest.mark.parametrize("text", [
    'ddm_router_expert_rows_total{expert="a"} -5\n',
    'ddm_router_expert_rows_total{expert="a"} NaN\n',
    'ddm_router_expert_rows_total{expert="a" 5\n',
    "\x00\x01 not an exposition",
])
def test_a_malformed_or_negative_answer_is_no_reading(text: str) -> None:
    assert parse_metrics(text, EXPERTS) is None


def test_rates_are_counter_increases_over_the_window() -> None:
    rates = DemandRates(window_s=30)
    assert rates.observe(0, {"p": RouterReading({"a": 100}, {})}, EXPERTS) == {
        "a": Demand(0, 0), "b": Demand(0, 0)}  # the first reading is a baseline
    rates.observe(10, {"p": RouterReading({"a": 400}, {})}, EXPERTS)
    # 300 rows in the 10 s seen so far
    assert rates.observe(10, {"p": RouterReading({"a": 400}, {"b": 1})}, EXPERTS) == {
        "a": Demand(30.0, 0, active=False), "b": Demand(0, 1)}  # no new rows this round
    # a second router's rows add up; after 30 s the first increase leaves the window
    rates.observe(20, {"p": RouterReading({"a": 400}, {}), "q": RouterReading({"a": 0}, {})},
                  EXPERTS)
    demand = rates.observe(30, {"p": RouterReading({"a": 460}, {}),
                                "q": RouterReading({"a": 90}, {})}, EXPERTS)
    assert demand["a"] == Demand((300 + 60 + 90) / 30, 0, active=True)
    assert rates.observe(41, {"p": RouterReading({"a": 460}, {}),
                              "q": RouterReading({"a": 90}, {})}, EXPERTS)["a"] == Demand(5.0, 0)


def test_a_restarted_routers_counter_counts_whole() -> None:
    rates = DemandRates(window_s=10)
    rates.observe(0, {"p": RouterReading({"a": 500}, {})}, EXPERTS)
    restarted = rates.observe(10, {"p": RouterReading({"a": 40}, {})}, EXPERTS)
    assert restarted["a"] == Demand(4, 0, True)


class _Answer(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(type(self).body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def router_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def test_scrape_reads_a_router_over_http(router_url: str) -> None:
    _Answer.body = _exposition([7, 1], {}).encode()
    assert scrape(router_url, EXPERTS) == RouterReading({"a": 7.0, "b": 1.0}, {})


def test_an_answer_past_the_cap_is_not_read(router_url: str) -> None:
    _Answer.body = b"# " + b"x" * MAX_METRICS_BYTES + b"\n"
    assert scrape(router_url, EXPERTS) is None


class _Trickle(http.server.BaseHTTPRequestHandler):
    """A valid exposition, one byte at a time: each read is quick, the whole is not."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()
        try:
            for byte in _exposition([7, 1], {}).encode():
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.02)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the operator gave up

    def log_message(self, *_: object) -> None:
        pass


def test_a_router_trickling_its_answer_past_the_deadline_is_no_reading() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        assert scrape(url, EXPERTS, timeout_s=0.3) is None
    finally:
        server.shutdown()
        server.server_close()


def test_nobody_listening_is_no_reading() -> None:
    assert scrape("http://127.0.0.1:9/metrics", EXPERTS) is None
