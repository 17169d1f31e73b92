"""``ddm`` as PID 1 of a PID namespace, as in a container: SIGTERM ends it however early it comes.

The kernel gives a PID namespace's init no default action for a signal it has no handler for:
without ``ddm``'s own handler a server still importing ignores SIGTERM, and a deleted pod waits
for the SIGKILL at the end of its grace period. Once the server answers probes, an expert still
loading its model was never ready: it stops at once, without draining and without waiting for
the loading. The real-node version, through the kubelet: tests/e2e/test_sigterm.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from podwatch import catches_sigterm
from waiting import wait_for

from ddm.cli import EXIT_TERMINATED
from ddm.runtime.local import free_port

EXPERT = str(Path(__file__).resolve().parents[2] / "checkpoints" / "digits" / "expert-0-4")

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="a PID namespace needs root and unshare(1)")


def as_pid_1(*argv: str) -> subprocess.Popen[str]:
    """``ddm argv...`` as PID 1 of a new PID namespace (unshare is its parent outside)."""
    return subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m",
                             "ddm.cli", *argv], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_server_still_importing_ends_on_sigterm_as_pid_1() -> None:
    outer = as_pid_1("serve", "expert", "--checkpoint", EXPERT, "--port", "0")
    try:
        (ddm,) = wait_for(lambda: children(outer.pid), 30, "unshare to start ddm")
        # ddm's handler is in place a few tens of milliseconds in; PyTorch takes seconds
        wait_for(lambda: catches_sigterm(ddm), 30, "ddm to handle SIGTERM")
        os.kill(ddm, signal.SIGTERM)
        try:
            outer.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail("ddm as PID 1 ignored SIGTERM during its start-up", pytrace=False)
        stderr = outer.stderr.read() if outer.stderr else ""
        assert "Started server process" not in stderr, f"already serving:\n{stderr}"
        assert outer.returncode == EXIT_TERMINATED, stderr
        assert "ddm: terminated (SIGTERM)" in stderr, stderr
    finally:
        outer.kill()
        outer.wait()


def loading(base: str) -> bool:
    try:
        answer = httpx.get(f"{base}/readyz", timeout=2)
    except httpx.HTTPError:
        return False  # not listening yet
    return answer.status_code == 503 and answer.json().get("status") == "loading"


def test_an_expert_still_loading_stops_at_once_without_draining() -> None:
    """JAX: seconds of importing, checking and compiling in the start-up thread."""
    port = free_port()
    outer = as_pid_1("serve", "expert", "--checkpoint", EXPERT, "--port", str(port),
                     "--backend", "jax", "--drain-s", "30")
    try:
        (ddm,) = wait_for(lambda: children(outer.pid), 30, "unshare to start ddm")
        wait_for(lambda: loading(f"http://127.0.0.1:{port}"), 60,
                 "the expert to answer that it is loading")
        os.kill(ddm, signal.SIGTERM)
        try:
            outer.wait(timeout=10)  # not the 30 s drain, nor the rest of the loading
        except subprocess.TimeoutExpired:
            pytest.fail("the expert did not stop within 10 s of SIGTERM", pytrace=False)
        stderr = outer.stderr.read() if outer.stderr else ""
        assert outer.returncode == 0, stderr
        assert "stopped while still starting" in stderr and "draining" not in stderr, stderr
    finally:
        outer.kill()
        outer.wait()
