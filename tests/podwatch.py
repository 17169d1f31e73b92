"""Pods of a test on a real node: a namespace ready for them, the container's processes and
log as it runs, and what the kubelet reports when a pod is deleted (exit code, when the
container exited, when the pod was gone).
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from waiting import wait_for

from ddm.devcluster import ClusterInfo
from ddm.devcluster.cluster import cluster_slot
from ddm.devcluster.realnode import NodeNetwork


def new_namespace(core: client.CoreV1Api, name: str) -> None:
    """Create namespace ``name`` and wait for its ``default`` ServiceAccount and that account's
    token: until the controllers made them, the API server refuses pods there (500, "No API
    token found for service account")."""
    core.create_namespace({"metadata": {"name": name}})

    def account_ready() -> bool:
        try:
            return bool(core.read_namespaced_service_account("default", name).secrets)
        except ApiException as error:
            if error.status == 404:
                return False
            raise

    wait_for(account_ready, 60, f"namespace {name}'s default ServiceAccount and its token")


def container_pids(cluster: ClusterInfo, pod: client.V1Pod) -> list[int]:
    """The host's pids of the processes of the pod's (first) container, from its cgroup on the
    node (the node shares the host's PID namespace tree)."""
    container_id = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    root = NodeNetwork(cluster_slot(cluster.state_dir)).cgroup_root.strip("/")
    (group,) = Path("/sys/fs/cgroup/pids", root).rglob(container_id)
    return [int(pid) for pid in (group / "cgroup.procs").read_text().split()]


def catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGTERM (``SigCgt`` in its status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


class LogFollower:
    """A container's log from now until the container exits (``kubectl logs -f``), in a thread."""

    def __init__(self, core: client.CoreV1Api, pod: client.V1Pod) -> None:
        self.lines: list[str] = []
        self._response = core.read_namespaced_pod_log(
            pod.metadata.name, pod.metadata.namespace, container=pod.spec.containers[0].name,
            follow=True, since_seconds=1, _preload_content=False)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for line in self._response.stream(decode_content=False):
            self.lines.extend(line.decode(errors="replace").splitlines())

    def text(self, timeout_s: float) -> str:
        """The log so far; waits up to ``timeout_s`` for its end (the container's exit)."""
        self._thread.join(timeout_s)
        return "\n".join(self.lines)


@dataclass(frozen=True)
class Ending:
    """How a deleted pod ended, in seconds after the deletion; None where not seen."""

    exit_code: int | None
    reason: str | None
    exited_after_s: float | None
    gone_after_s: float | None


def delete_and_watch(core: client.CoreV1Api, pod: client.V1Pod, timeout_s: float) -> Ending:
    """Delete ``pod`` (its own grace period) and watch it from the version read in ``pod``:
    the kubelet's report of the first container's exit, then the pod's removal."""
    name, namespace = pod.metadata.name, pod.metadata.namespace
    started = time.monotonic()
    core.delete_namespaced_pod(name, namespace)
    code: int | None = None
    reason: str | None = None
    exited_s: float | None = None
    gone_s: float | None = None
    stream = watch.Watch()
    for event in stream.stream(core.list_namespaced_pod, namespace,
                               field_selector=f"metadata.name={name}",
                               resource_version=pod.metadata.resource_version,
                               timeout_seconds=int(timeout_s)):
        seen = event["object"]
        statuses = seen.status.container_statuses or []
        terminated = statuses[0].state.terminated if statuses else None
        if terminated is not None and exited_s is None:
            code, reason = terminated.exit_code, terminated.reason
            exited_s = round(time.monotonic() - started, 1)
        if event["type"] == "DELETED":
            gone_s = round(time.monotonic() - started, 1)
            stream.stop()
    return Ending(code, reason, exited_s, gone_s)
