"""Pods of a test on a real node: a namespace ready for them, the container's processes and
log as it runs, and what the kubelet reports when a pod is deleted (exit code, when the
container exited, when the pod was gone).
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from waiting import wait_for

from ddm_devcluster import ClusterInfo
from ddm_devcluster.cluster import cluster_slot, node_layout
from ddm_devcluster.realnode import NodeNetwork


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


class ContainerLog:
    """A container's log as the node's containerd writes it (the CRI log file under the node's
    ``/var/log/pods``), held open from now on.

    Not read through the kubelet (``kubectl logs -f``): kubelet 1.20 ends a follow with
    "container not found" when it removes a deleted pod's exited container before reading the
    last lines, and a container's last words (``ddm: terminated (SIGTERM)``) were lost that
    way in CI. An open file outlives its removal, so :meth:`text` reads every line written.
    """

    def __init__(self, cluster: ClusterInfo, pod: client.V1Pod) -> None:
        meta = pod.metadata
        container = pod.spec.containers[0].name
        pods_dir = node_layout(cluster.state_dir).private_dir("/var/log") / "pods"
        path = pods_dir / f"{meta.namespace}_{meta.name}_{meta.uid}" / container / "0.log"
        self._file = wait_for(lambda: _open_or_none(path), 30, f"the container's log {path}")

    def text(self) -> str:
        """Every line the container wrote to stdout and stderr so far, in order."""
        self._file.seek(0)
        data = self._file.read()
        lines: list[str] = []
        partial = ""
        # up to the last newline: a record after it is still being written
        for record in data[:data.rfind(b"\n") + 1].decode(errors="replace").splitlines():
            # "<time> <stream> <P|F> <text>": P is part of a long line, F ends a line
            _, _, tag, *text = record.split(" ", 3)
            partial += text[0] if text else ""
            if tag == "F":
                lines.append(partial)
                partial = ""
        return "\n".join(lines)


def _open_or_none(path: Path) -> BinaryIO | None:
    try:
        return path.open("rb")
    except FileNotFoundError:
        return None


@dataclass(frozen=True)
class Ending:
    """How a deleted pod ended, in seconds after the deletion; None where not seen."""

    exit_code: int | None
    reason: str | None
    exited_after_s: float | None
    gone_after_s: float | None


class TaskExits:
    """containerd's task exits on the node (``ctr events``) from now on, by container id.

    The kubelet does not always report a deleted pod's exit: when it removes the container
    before its last status update, the pod goes with no terminated state (seen once in CI,
    kubelet 1.20). containerd's exit event always carries the status."""

    def __init__(self, ctr: Sequence[str]) -> None:
        self._exits: dict[str, tuple[int, float]] = {}
        self._seen = threading.Condition()
        self._process = subprocess.Popen([*ctr, "-n", "k8s.io", "events"],
                                         stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:  # "<time> k8s.io /tasks/exit {json}"
            if " /tasks/exit " not in line:
                continue
            event = json.loads(line.split(" /tasks/exit ", 1)[1])
            with self._seen:
                self._exits[event["container_id"]] = (int(event.get("exit_status", 0)),
                                                      time.monotonic())
                self._seen.notify_all()

    def wait(self, container_id: str, timeout_s: float) -> tuple[int, float] | None:
        """``(exit status, time.monotonic() when seen)`` of the container's task, or None."""
        with self._seen:
            self._seen.wait_for(lambda: container_id in self._exits, timeout_s)
            return self._exits.get(container_id)

    def close(self) -> None:
        self._process.kill()
        self._process.wait()


def delete_and_watch(core: client.CoreV1Api, pod: client.V1Pod, timeout_s: float,
                     exits: TaskExits | None = None) -> Ending:
    """Delete ``pod`` (its own grace period) and watch it from the version read in ``pod``:
    the kubelet's report of the first container's exit, then the pod's removal. ``exits``:
    where the kubelet reported no exit, containerd's (reason ``containerd``)."""
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
    if code is None and exits is not None:
        container_id = pod.status.container_statuses[0].container_id.split("://", 1)[1]
        seen = exits.wait(container_id, timeout_s=10)
        if seen is not None:
            code, reason, exited_s = seen[0], "containerd", round(seen[1] - started, 1)
    return Ending(code, reason, exited_s, gone_s)
