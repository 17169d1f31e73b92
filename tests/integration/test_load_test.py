"""``python -m benchmarks load`` end to end, short: 8 clients for 5 s against a smoke DDM it
starts itself.

The command runs a manifest's experts and router as local processes (as ``ddm up`` does), so
the test hands it a manifest of the random-init ``smoke`` expert (classes 0-4, oracle routing,
4 steps): cheap requests, the same code path as the shipped example's 60-second run.
"""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path

import pytest
import yaml

from benchmarks.load import LoadSettings, LoadTestError, load_test_command, run_load


def _smoke_manifest(directory: Path, checkpoint: Path) -> Path:
    manifest = {"apiVersion": "ddm.dev/v1alpha1", "kind": "DDMDeployment",
                "metadata": {"name": "smoke"},
                "spec": {"numClasses": 5,
                         "sampling": {"steps": 4, "solver": "euler", "strategy": "oracle"},
                         "experts": [{"name": "smoke", "framework": "torch",
                                      "accelerator": {"type": "cpu"},
                                      "checkpoint": {"uri": f"file://{checkpoint}"},
                                      "classes": [0, 1, 2, 3, 4]}]}}
    path = directory / "smoke.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


@pytest.mark.slow
def test_8_clients_for_5_seconds_give_figures_and_no_errors(
        tmp_path: Path, smoke_expert_checkpoint: Path) -> None:
    manifest = _smoke_manifest(tmp_path, smoke_expert_checkpoint)
    log = io.StringIO()
    settings = LoadSettings(clients=8, duration_s=5)
    result = run_load(settings, manifest=manifest, log=log)
    assert result["errors"] == {}, (result["error_examples"], log.getvalue()[-2000:])
    assert result["requests"] == result["succeeded"] >= 8
    # It stops at the deadline, or earlier when the request budget is spent (a quiet machine
    # serves the smoke DDM's 4-step requests faster than the budget's 20 per client-second).
    assert result["elapsed_s"] >= 5 or result["requests"] == settings.request_budget, result
    assert result["images_per_s"] == pytest.approx(result["succeeded"] / result["elapsed_s"],
                                                   rel=1e-2)
    latency = result["latency_s"]
    assert 0 < latency["p50"] <= latency["p90"] <= latency["p99"] <= latency["max"]
    assert set(result["peak_rss_mib"]) == {"router", "smoke/0"}
    for server in result["peak_rss_mib"].values():
        assert server["pid"] and 20 < server["lifetime_peak"] < 4096, server
        assert server["sampled_peak"] <= server["lifetime_peak"], server
    json.dumps(result)  # what --json prints
    port = int(result["router_url"].rsplit(":", 1)[1])
    with socket.socket() as s:  # every process it started is gone
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_the_load_test_refuses_a_router_off_loopback() -> None:
    out = io.StringIO()
    with pytest.raises(LoadTestError, match="loopback"):
        load_test_command(clients=1, duration_s=1, router="http://example.com:8080", out=out)
    assert out.getvalue() == ""
