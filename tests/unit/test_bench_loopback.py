"""A benchmark's second router over the same servers (benchmarks/loopback.py): the router's
own command on other ports, with its environment added."""

from __future__ import annotations

import pytest

from benchmarks.loopback import another_router
from ddm.runtime.local import ProcessSpec

ROUTER = ProcessSpec("router", ("python", "-m", "ddm", "serve", "router", "--config",
                                "router.yaml", "--port", "8000", "--metrics-port", "9000",
                                "--max-concurrent", "32"), 8000, (("A", "1"),), 9000, 60.0)


def test_another_router_runs_the_same_command_on_its_own_ports_with_its_environment() -> None:
    other = another_router(ROUTER, "calls_ahead_off", 8100, 9100, (("DDM_CALLS_AHEAD", "off"),))
    assert other.name == "calls_ahead_off"
    assert other.argv == ("python", "-m", "ddm", "serve", "router", "--config", "router.yaml",
                          "--port", "8100", "--metrics-port", "9100", "--max-concurrent", "32")
    assert (other.port, other.metrics_port, other.ready_s) == (8100, 9100, 60.0)
    assert other.env == (("A", "1"), ("DDM_CALLS_AHEAD", "off"))
    assert ROUTER.argv[ROUTER.argv.index("--port") + 1] == "8000"  # the first is unchanged


def test_a_router_command_without_a_port_flag_is_refused_by_name() -> None:
    bare = ProcessSpec("router", ("ddm", "serve", "router", "--port", "8000"), 8000)
    with pytest.raises(ValueError, match="the router's command has no --metrics-port"):
        another_router(bare, "other", 8100, 9100, ())
