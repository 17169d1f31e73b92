"""The ports ``ddm up`` gives its servers never come from the kernel's ephemeral range, whose
ports outgoing connections take: one chosen there, free a moment ago, could be a probe's local
port by the time its server binds it (the router then failed with "Address already in use").
Nor can anything else take one between its draw and its server's start: ``ddm up`` holds it
bound meanwhile and hands the socket over (a router's port, held for the minutes its experts
took to load, was taken by another test's server and the router failed)."""

from __future__ import annotations

import errno
import io
import os
import re
import socket
import sys
from pathlib import Path

import httpx
import pytest

from ddm.checkpoints.shipped import DEFAULT_DDM
from ddm.cli import main
from ddm.deploy.spec import load_manifest
from ddm.runtime.local import (DEFAULT_MANIFEST, PORT_RANGE, HeldPorts, LocalRunError,
                               ProcessSpec, Supervisor, free_port, plan_local)
from ddm_devcluster.processes import free_ports
from ddm.serving.http.handoff import ENV, HandoffError, handed_socket


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


def _cannot_bind(port: int) -> bool:
    """Whether a server binding ``port`` as uvicorn does (``SO_REUSEADDR``) is refused."""
    with socket.socket() as rival:
        rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            rival.bind(("127.0.0.1", port))
        except OSError as error:
            return error.errno == errno.EADDRINUSE
        return False


#: A real server (``run_server``, as every ``ddm serve`` runs) answering ``/readyz``.
TINY_SERVER = """
import sys
from ddm.serving.http.server import run_server

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})

run_server(lambda control: app, "127.0.0.1", int(sys.argv[1]), "warning",
           metrics_port=int(sys.argv[2]))
"""


def test_a_held_port_is_nobody_else_s_until_its_server_listens_on_the_socket_handed_over(
        ) -> None:
    held = HeldPorts("127.0.0.1")
    try:
        port, metrics_port = held.draw(), held.draw()
        router_port = free_port()
        held.hold_router_port(router_port)
        assert all(_cannot_bind(p) for p in (port, metrics_port, router_port))
        supervisor = Supervisor(io.StringIO(), held=held)
        spec = ProcessSpec("tiny", (sys.executable, "-c", TINY_SERVER, str(port),
                                    str(metrics_port)), port,
                           (("PYTHONPATH", os.pathsep.join(sys.path)),), metrics_port)
        kept_alive = httpx.Client()
        try:
            # The server cannot bind its ports by number (it holds them itself, alone): ready
            # only on the sockets it was handed.
            supervisor.start_ready([spec], "127.0.0.1")
            assert held.hand_over(port, metrics_port) == []
            assert _cannot_bind(port) and _cannot_bind(router_port)
            assert kept_alive.get(f"http://127.0.0.1:{port}/").status_code == 200
        finally:
            supervisor.stop()  # it closes the kept-alive connection: TIME_WAIT on its side
            kept_alive.close()
        # The server's to the end, then free for the next process of that server, though its
        # connections linger in TIME_WAIT (a scaled-to-zero expert's restart failed on them).
        assert not _cannot_bind(port)
    finally:
        held.close()
    assert not _cannot_bind(router_port)


def test_a_handoff_names_each_wrong_descriptor() -> None:
    with socket.socket() as one, socket.socket() as other:
        one.bind(("127.0.0.1", 0))
        other.bind(("127.0.0.1", 0))
        wanted = other.getsockname()[1]
        found = handed_socket("127.0.0.1", wanted, {ENV: f"{one.fileno()}, {other.fileno()}"})
        assert found is not None and found.fileno() == other.fileno()
        assert not found.get_inheritable()
        found.detach()
        assert one.getsockname()  # another port's socket is left open
        assert handed_socket("127.0.0.1", wanted, {ENV: str(one.fileno())}) is None
        assert handed_socket("localhost", wanted, {}) is None
    unused = os.open(os.devnull, os.O_RDONLY)
    try:
        for value, problem in (("3x", "'3x' is not a file descriptor number"),
                               ("\u00b2", "'\u00b2' is not a file descriptor number"),  # a digit
                               # 2**32: an int wrapping to descriptor 0, standard input
                               ("4294967296", "'4294967296' is not a file descriptor number"),
                               (str(unused), f"descriptor {unused} is not a socket")):
            with pytest.raises(HandoffError, match=re.escape(problem)):
                handed_socket("127.0.0.1", 1, {ENV: value})
    finally:
        os.close(unused)


def test_a_socket_handed_for_another_address_is_refused_and_left_open() -> None:
    with socket.socket() as anywhere:
        anywhere.bind(("0.0.0.0", 0))
        port = anywhere.getsockname()[1]
        handed = {ENV: str(anywhere.fileno())}
        with pytest.raises(HandoffError, match=re.escape(
                f"descriptor {anywhere.fileno()} is bound to 0.0.0.0 port {port}, not to "
                "127.0.0.1")):
            handed_socket("127.0.0.1", port, handed)
        assert anywhere.getsockname()[1] == port  # still open
        found = handed_socket("0.0.0.0", port, handed)
        assert found is not None and found.fileno() == anywhere.fileno()
        found.detach()
    with socket.socket() as loopback:
        loopback.bind(("127.0.0.1", 0))
        port = loopback.getsockname()[1]
        found = handed_socket("localhost", port, {ENV: str(loopback.fileno())})  # its name
        assert found is not None
        found.detach()


def test_the_dev_cluster_draws_its_ports_apart_from_ddm_up_and_the_kernel() -> None:
    """The dev cluster's components bind their ports seconds after the draw (the scheduler
    once the API server is up), while tests beside it start servers of their own."""
    low, high = _ephemeral_range()
    ports = free_ports(40)
    assert len(set(ports)) == 40
    assert all(not low <= port <= high and port not in PORT_RANGE for port in ports), ports
