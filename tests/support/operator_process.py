"""The operator as the cluster tests and ``python -m benchmarks operator`` run it: ``ddm operator``
as its own process (as in its pod) under its own identity, a ServiceAccount with a TokenRequest
token, on a real API server; the CRD from ``crds/`` installed; a DDMDeployment spec of N CPU
experts.

A SIGKILL of :class:`OperatorProcess` leaves exactly what a dead pod leaves, and the API server
tells its requests apart from the test's or the benchmark's (its own user). Waits poll with a
deadline and fail with ``RuntimeError`` naming what was awaited (the benchmark runs outside
pytest).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ddm_devcluster.components import build_kubeconfig
from ddm_devcluster.processes import free_ports, log_tail
from ddm.operator import names
from ddm.operator.config import OperatorConfig
from ddm.operator.runner import run_operator

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "ddmdeployments.ddm.dev.yaml"
TRAINING_CRD_FILE = CRD_FILE.with_name("ddmtrainings.ddm.dev.yaml")
_POLL_S = 0.5
T = TypeVar("T")


class OperatorProcess:
    """``ddm operator`` as a separate process, logging to ``log_file``.

    ``settings``: its ``DDM_*`` environment (what the Helm chart would set, such as
    ``DDM_WATCH_NAMESPACES``); none is inherited from this process.
    """

    def __init__(self, kubeconfig: Path, log_file: Path, *,
                 settings: Mapping[str, str] | None = None) -> None:
        self.kubeconfig, self.log_file = kubeconfig, log_file
        self._env = {k: v for k, v in os.environ.items() if not k.startswith("DDM_")}
        self._env.update(settings or {})
        self._process: subprocess.Popen[bytes] | None = None
        self._liveness_port = 0

    def start(self, ready_timeout_s: float = 60.0) -> None:
        """Start it and wait until kopf's liveness endpoint answers (its watches are starting)."""
        if self.alive:
            raise RuntimeError(f"the operator (pid {self.pid}) is already running")
        (self._liveness_port,) = free_ports(1)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "ddm", "operator", "--kubeconfig", str(self.kubeconfig),
                 "--liveness-port", str(self._liveness_port)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self._env)
        deadline = time.monotonic() + ready_timeout_s
        while not self._live():
            if not self.alive:
                raise RuntimeError(f"the operator exited at start-up:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the operator did not start in {ready_timeout_s:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.1)

    def _live(self) -> bool:
        try:
            with urllib.request.urlopen(
                    f"http://127.0.0.1:{self._liveness_port}/healthz", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("the operator was never started")
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind, as when its node dies."""
        if self.alive:
            assert self._process is not None
            self._process.send_signal(signal.SIGKILL)
            self._process.wait(10)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (as Kubernetes stops a pod) and wait; returns the exit status."""
        if self._process is None:
            raise RuntimeError("the operator was never started")
        if self.alive:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                raise RuntimeError(f"the operator did not exit within {timeout_s:.0f} s of "
                                   f"SIGTERM (killed):\n{self.log_tail()}") from None
        return int(self._process.returncode)

    def peak_rss_bytes(self) -> int:
        """The process's peak resident memory so far (``VmHWM``)."""
        status = Path(f"/proc/{self.pid}/status").read_text()
        match = re.search(r"^VmHWM:\s+(\d+) kB$", status, re.MULTILINE)
        if match is None:
            raise RuntimeError(f"no VmHWM in /proc/{self.pid}/status")
        return int(match.group(1)) * 1024

    def log_text(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file.exists() else ""

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_file, lines)


def service_account_kubeconfig(api_client: client.ApiClient, namespace: str, name: str,
                               path: Path, *, hours: int = 12) -> Path:
    """Create ServiceAccount ``namespace/name`` (if absent) and write a kubeconfig at ``path``
    that authenticates as it (a TokenRequest token valid ``hours``), on ``api_client``'s server.
    """
    core = client.CoreV1Api(api_client)
    try:
        core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
    except ApiException as error:
        if error.status != 409:
            raise
    token = core.create_namespaced_service_account_token(
        name, namespace, {"spec": {"expirationSeconds": hours * 3600}}).status.token
    configuration = api_client.configuration
    ca_pem = Path(configuration.ssl_ca_cert).read_text()
    path.write_text(yaml.safe_dump(build_kubeconfig(
        configuration.host, ca_pem, f"system:serviceaccount:{namespace}:{name}", token)))
    path.chmod(0o600)
    return path


@contextlib.contextmanager
def operator_in_thread(kubeconfig: Path, config: OperatorConfig,
                       namespaces: tuple[str, ...]) -> Iterator[None]:
    """The operator in a thread of this process, serving ``namespaces`` only: a test's operator
    that served the whole session's cluster would also work through the DDMs earlier tests
    left there (failing ones, retried), and reach the test's own late on a loaded machine."""
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=run_operator, name="ddm-operator", daemon=True, kwargs={
        "namespaces": namespaces, "kubeconfig": kubeconfig, "liveness_port": None,
        "operator_config": config, "configure_logging": False,
        "stop_flag": stop, "ready_flag": ready})
    thread.start()
    if not ready.wait(60):
        raise RuntimeError("the operator did not start in 60 s")
    try:
        yield
    finally:
        stop.set()
        thread.join(30)


def install_crd(api_client: client.ApiClient, timeout_s: float = 30.0,
                crd_file: Path = CRD_FILE) -> None:
    """Create the DDMDeployment CRD (or ``crd_file``'s) from ``crds/`` (kept if there) and wait
    until it serves."""
    if not crd_file.is_file():
        raise FileNotFoundError(f"{crd_file} not found: run from a checkout of the repository")
    body = yaml.safe_load(crd_file.read_text())
    plural = body["spec"]["names"]["plural"]
    api = client.ApiextensionsV1Api(api_client)
    try:
        api.create_custom_resource_definition(body)
    except ApiException as error:
        if error.status != 409:
            raise

    def served() -> bool:
        try:
            client.CustomObjectsApi(api_client).list_cluster_custom_object(
                names.GROUP, names.VERSION, plural, limit=1)
        except ApiException as error:
            if error.status == 404:
                return False
            raise
        return True
    _poll(served, timeout_s, f"the {body['spec']['names']['kind']} CRD to be served")


def _poll(check: Callable[[], T], timeout_s: float, what: str, interval_s: float = _POLL_S) -> T:
    """``check()`` once it is truthy; a RuntimeError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)
    return result


def cpu_spec(experts: int) -> dict[str, Any]:
    """The spec of a CPU DDMDeployment of ``experts`` (2 to 10) experts, one label each, the
    last the rest; its checkpoints are ``image://`` URIs, so nothing is fetched."""
    if not 2 <= experts <= 10:
        raise ValueError(f"experts must be 2 to 10 (the digits have 10 labels), got {experts}")
    groups = [[label] for label in range(experts - 1)] + [list(range(experts - 1, 10))]
    return {"sampling": {"strategy": "oracle"},
            "experts": [{"name": f"e{i}", "checkpoint": {"uri": f"image:///models/e{i}"},
                         "classes": classes} for i, classes in enumerate(groups)]}
