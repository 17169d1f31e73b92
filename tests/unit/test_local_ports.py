"""The ports ``ddm up`` gives its servers never come from the kernel's ephemeral range, whose
ports outgoing connections take: one chosen there, free a moment ago, could be a probe's local
port by the time its server binds it (the router then failed with "Address already in use")."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from ddm.checkpoints.shipped import DEFAULT_DDM
from ddm.cli import main
from ddm.deploy.spec import load_manifest
from ddm.runtime.local import DEFAULT_MANIFEST, LocalRunError, free_port, plan_local


def _ephemeral_range() -> tuple[int, int]:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return int(low), int(high)


def test_free_ports_are_bindable_and_outside_the_ephemeral_range() -> None:
    low, high = _ephemeral_range()
    ports = {free_port() for _ in range(50)}
    assert all(not low <= port <= high for port in ports), (sorted(ports), (low, high))
    assert len(ports) > 40  # spread out: two servers of one `ddm up` rarely draw the same
    for port in list(ports)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_not_handed_out() -> None:
    taken = []
    try:
        for _ in range(200):  # hold many ports; none of them is handed out again
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            taken.append(s)
        held = {s.getsockname()[1] for s in taken}
        assert len(held) == len(taken)
        assert all(free_port() not in held for _ in range(50))
    finally:
        for s in taken:
            s.close()


def test_a_plan_hands_no_port_out_twice_nor_the_routers() -> None:
    """Ports are drawn long before their servers bind them (the router's after every expert is
    ready), so a source may repeat itself: the router's port and repeats are drawn again."""
    router_port = 20000
    draws = iter([router_port, 20001, 20001, router_port, *range(20002, 20100)])
    plan = plan_local(load_manifest(DEFAULT_MANIFEST), draws.__next__, router_port,
                      locate=lambda source: Path("/fetched"))
    servers = [*plan.experts, *plan.stages, plan.router]
    ports = [port for server in servers for port in (server.port, server.metrics_port)]
    assert len(ports) == len(set(ports)) and ports.count(router_port) == 1
    assert plan.router.port == router_port


def test_a_router_port_it_cannot_listen_on_fails_before_any_server_starts(capsys) -> None:
    """The router starts last, once every expert has loaded (minutes for a large DDM): a
    taken ``--port`` failed only then, and ``--port 0`` (a port the kernel picks) was never
    seen ready, failing after the 300 s readiness timeout. Both are refused at once."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", free_port()))
        holder.listen()
        taken = holder.getsockname()[1]
        for port, problem in (
                (taken, f"cannot listen on 127.0.0.1:{taken} (Address already in use)"),
                (0, "--port must be in 1..65535, got 0"),
                (65536, "--port must be in 1..65535, got 65536")):
            assert main(["up", "--port", str(port)]) in (1, 2)
            out, err = capsys.readouterr()
            assert "started" not in out, out  # no server was started
            assert err.startswith("ddm: error: ") and problem in err, err


@pytest.mark.parametrize("host, reason", [
    ("300.1.1.1", "Name or service not known"),  # not an address: looked up as a name
    ("192.0.2.1", "Cannot assign requested address"),  # TEST-NET-1: nobody's address
    ("::1", "Address family for hostname not supported"),  # servers' addresses are IPv4
])
def test_a_host_it_cannot_listen_on_is_named_as_such_before_any_server_starts(
        capsys, tmp_path: Path, host: str, reason: str) -> None:
    """An unusable ``--host`` was blamed on the port ("cannot listen on 300.1.1.1:8080 ...:
    choose another --port"), or reported as "no free port ... after 100 tries"."""
    assert main(["up", "--host", host, "--port", str(free_port()),
                 "--auth-token-file", str(tmp_path / "token")]) in (1, 2)
    out, err = capsys.readouterr()
    assert "started" not in out, out
    assert err.startswith(f"ddm: error: --host {host}: ") and reason in err, err
    assert "--port" not in err, err
    with pytest.raises(LocalRunError, match=f"--host {re.escape(host)}: "):
        free_port(host)


def test_a_host_beyond_this_machine_needs_a_token_before_anything_starts(capsys) -> None:
    """The shipped manifest asks for no token: served on every interface, anyone who reaches
    the machine would use it. ``ddm up`` refuses, saying how to turn authentication on."""
    assert main(["up", "--host", "0.0.0.0", "--port", str(free_port())]) == 1
    out, err = capsys.readouterr()
    assert "started" not in out, out
    assert err.startswith(f"ddm: error: --host 0.0.0.0 exposes {DEFAULT_DDM}'s API beyond this "
                          "machine, and its spec asks for no token: turn authentication on "
                          "(add auth: {} under spec.router in the manifest"), err
