"""A stand-in kubelet for the dev cluster's fake nodes (TEST SCAFFOLDING, not the product).

The dev cluster has no kubelet: the real scheduler binds pods to the fake nodes
(``ddm.devcluster.nodes``) and they stay Pending. ``NodeAgent`` plays the kubelet for them in
end-to-end tests: it runs each pod's containers as local processes from the pod spec and
reports the pod's IP, phase, readiness and container states through the ``pods/status``
subresource, so the real ReplicaSet, Deployment and endpoints controllers, a router's DNS
discovery and an operator's status all work as on a real cluster::

    from node_agent import NodeAgent          # tests/e2e is on sys.path for its tests

    with NodeAgent(dev_cluster, work_dir=tmp_path, namespaces=[namespace]) as agent:
        ...                                   # create Deployments; pods become Running/Ready
        agent.logs(namespace, pod_name, "expert")   # a container's stdout and stderr
        agent.log_files()                     # every log it wrote (grep them for secrets)

``dev_cluster`` is the ``ClusterInfo`` of ``ddm.devcluster`` (admin credentials); pass
``namespaces`` so the agent leaves other tests' pods alone (default: every namespace). Leaving
the block kills every process the agent started, always. It needs root (mount namespaces).

How a pod is run, and where that differs from a kubelet:

* Network: one local address per pod, ``198.18.N.3``, ``.4``, ... (freed ones are reused;
  ``198.18.N.2`` is the cluster DNS, see `cluster_dns.py`). Loopback addresses cannot be
  used: the API server rejects Endpoints in 127.0.0.0/8, so the endpoints controller could
  never list the pods. The agent takes a free ``198.18.N.0/24`` (RFC 2544's benchmarking
  range, routed nowhere) by adding ``ip route add local 198.18.N.0/24 dev lo``, which makes
  every address in it a loopback-like local address (an existing route means another agent
  holds that block), and deletes the route when it stops. There is no network namespace,
  so a ``0.0.0.0`` in a container's ``command`` or ``args`` is replaced by the pod's
  address, which is what binding every interface of a pod's own network namespace amounts
  to. A server that binds every interface without saying so on its command line binds the
  host's, and two such replicas collide on their port. ``/etc/hosts`` names the pod's
  address.
* Files: each container runs in its own mount and UTS namespace (``unshare``; hostname = pod
  name) and ``chroot``, on a copy-on-write overlay of the host's ``/`` (the "image" is the
  host's file system: the repository's ``.venv`` provides ``ddm``, so a volume mounted over
  the venv's directory, e.g. at ``/work`` here, hides it). Nothing a container writes
  reaches the host except through its volumes. The repository is mounted at
  ``/opt/ddm`` (WORKDIR of the project's images, with ``checkpoints/`` and ``examples/``)
  over a fresh tmpfs on ``/opt``. ``readOnlyRootFilesystem`` makes that root read-only.
  Volumes: ``emptyDir`` (a directory per pod), ``configMap``, ``secret``, ``downwardAPI``
  and ``projected`` (ConfigMaps, Secrets, downward API, a TokenRequest token) written once
  when the pod starts (not refreshed); ``subPath`` and ``readOnly`` are honoured. Other
  volume kinds (``persistentVolumeClaim``, ``hostPath``, ...) fail the pod with a reason.
  The ServiceAccount token comes as the volume the ServiceAccount admission plugin adds
  (absent when ``automountServiceAccountToken`` is false), so in-cluster configuration
  (``kubernetes.config.load_incluster_config``, kopf's logins) works as in a real pod:
  ``KUBERNETES_SERVICE_HOST``/``PORT`` are the API server's 127.0.0.1 and port, and the
  cluster DNS names ``kubernetes.default.svc`` after the agent's own port 443, which the
  agent forwards to the API server (the one job of kube-proxy done here).
* Processes run as root: ``runAsUser`` and capabilities are not applied, nor are resource
  limits; without a limit, the thread pools of OpenMP, MKL, OpenBLAS and XLA get one
  thread each (what a 1-CPU cgroup limit would impose) unless the pod's env sets them.
  Service-link variables (``<SVC>_SERVICE_HOST``) are not set (no cluster IPs here).
  A container with no ``command`` runs ``entrypoint`` (the images' ENTRYPOINT) with its args.
* Timings shortened for tests: probe periods and initial delays capped at
  ``max_probe_period_s``, crash-loop back-off 1 s doubling up to ``max_backoff_s`` (the
  kubelet's is 10 s up to 5 min), grace periods capped at ``max_grace_s``. Probes:
  ``httpGet``, ``tcpSocket`` and ``exec``; no gRPC probes, lifecycle hooks nor events.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import math
import os
import re
import select
import shlex
import shutil
import signal
import socket
import socketserver
import ssl
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Collection, Sequence
from datetime import UTC, datetime
from fractions import Fraction
from pathlib import Path
from typing import Any, Self
from urllib.parse import urlsplit

from cluster_dns import ClusterDns
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from ddm.devcluster.cluster import ClusterInfo
from ddm.devcluster.nodes import FAKE_NODE_LABEL

ROOT = Path(__file__).resolve().parents[2]
IMAGE_WORKDIR = "/opt/ddm"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
CLUSTER_DOMAIN = "cluster.local"
POD_NETWORK = "198.18"  # pods get 198.18.N.x: see the module docstring
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Set unless the pod's env does: one thread per pool, as a 1-CPU limit would impose.
THREAD_DEFAULTS = {
    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
}
MESSAGE_LIMIT = 4096  # bytes of a termination message, as the kubelet keeps
FALLBACK_LOG_LINES = 80  # lines of log a FallbackToLogsOnError message takes
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


class PodFailure(Exception):
    """The pod can never run as specified (e.g. an unsupported volume): it goes Failed."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class NotYet(Exception):
    """Something the pod needs does not exist yet (a ConfigMap, a Secret): retried."""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _json(response: Any) -> Any:
    return json.loads(response.data)


def _quantity(text: str) -> Fraction:
    """A Kubernetes quantity ("500m", "2Gi", "1e3") as an exact number."""
    match = re.fullmatch(r"([0-9.]+(?:[eE][-+]?[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?", text)
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    number, suffix = match.groups()
    scale = {None: 1, "m": Fraction(1, 1000), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "P": 10**15, "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
             "Pi": 2**50, "Ei": 2**60}[suffix]
    return Fraction(number) * scale


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` references (``$$`` escapes; unknown ones stay as written)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def _field(pod: dict[str, Any], path: str) -> str:
    """A downward-API ``fieldRef`` of ``pod``."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    if match := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path):
        return (meta.get(match.group(1)) or {}).get(match.group(2), "")
    if path in ("metadata.labels", "metadata.annotations"):
        items = sorted((meta.get(path.split(".")[1]) or {}).items())
        return "\n".join(f'{k}="{v}"' for k, v in items)
    values = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
              "metadata.uid": meta["uid"], "spec.nodeName": spec.get("nodeName", ""),
              "spec.serviceAccountName": spec.get("serviceAccountName", ""),
              "status.podIP": status.get("podIP", ""), "status.hostIP": "127.0.0.1",
              "status.podIPs": status.get("podIP", ""), "status.hostIPs": "127.0.0.1"}
    if path not in values:
        raise PodFailure("UnsupportedFieldRef", f"fieldRef {path!r} is not supported")
    return values[path]


def _resource(container: dict[str, Any], ref: dict[str, Any], node: dict[str, Any]) -> str:
    """A ``resourceFieldRef`` (a missing limit reads the node's allocatable, as the kubelet's)."""
    kind, _, name = ref["resource"].partition(".")
    resources = container.get("resources") or {}
    amount = (resources.get(kind) or {}).get(name) or (resources.get("limits") or {}).get(name)
    value = _quantity(str(amount or node["status"]["allocatable"][name]))
    divisor = _quantity(str(ref.get("divisor") or "1")) or 1  # the API defaults it to "0"
    return str(math.ceil(value / divisor))


# -------------------------------------------------------------------------------- files


def _write_files(directory: Path, files: dict[str, bytes], items: list[dict[str, Any]] | None,
                 mode: int, what: str) -> None:
    """Write a ConfigMap's or Secret's keys (or only ``items``, at their paths) as files."""
    chosen = {key: (key, mode) for key in files} if not items else {
        item["key"]: (item["path"], item.get("mode", mode)) for item in items}
    for key, (path, file_mode) in chosen.items():
        if key not in files:
            raise NotYet(f"{what} has no key {key!r}")
        target = directory / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(files[key])
        target.chmod(file_mode)


class _Api:
    """The few reads and writes the agent needs, as plain dicts."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api_client)

    def object_data(self, kind: str, namespace: str, name: str, optional: bool
                    ) -> dict[str, bytes] | None:
        """A ConfigMap's or Secret's data as bytes (None: absent and optional)."""
        read = (self.core.read_namespaced_config_map if kind == "ConfigMap"
                else self.core.read_namespaced_secret)
        try:
            body = _json(read(name, namespace, _preload_content=False))
        except ApiException as error:
            if error.status == 404 and optional:
                return None
            if error.status == 404:
                raise NotYet(f"{kind} {namespace}/{name} not found") from None
            raise
        if kind == "Secret":
            return {k: base64.b64decode(v) for k, v in (body.get("data") or {}).items()}
        return {**{k: v.encode() for k, v in (body.get("data") or {}).items()},
                **{k: base64.b64decode(v) for k, v in (body.get("binaryData") or {}).items()}}

    def token(self, pod: dict[str, Any], source: dict[str, Any]) -> bytes:
        """A TokenRequest token bound to ``pod`` (a projected ``serviceAccountToken``)."""
        request = {"spec": {"audiences": [source["audience"]] if source.get("audience") else None,
                            "expirationSeconds": source.get("expirationSeconds", 3600),
                            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1",
                                               "name": pod["metadata"]["name"],
                                               "uid": pod["metadata"]["uid"]}}}
        answer = _json(self.core.create_namespaced_service_account_token(
            pod["spec"].get("serviceAccountName", "default"), pod["metadata"]["namespace"],
            request, _preload_content=False))
        return answer["status"]["token"].encode()


def prepare_volumes(api: _Api, pod: dict[str, Any], directory: Path) -> dict[str, Path]:
    """Each volume's contents under ``directory``; returns volume name -> host directory.

    Raises PodFailure for a volume kind a process cannot have, NotYet while a ConfigMap or
    Secret it needs is missing.
    """
    namespace = pod["metadata"]["namespace"]
    out: dict[str, Path] = {}
    for volume in pod["spec"].get("volumes") or []:
        name = volume["name"]
        target = directory / name
        target.mkdir(parents=True, exist_ok=True)
        sources = (volume["projected"]["sources"] if "projected" in volume else [volume])
        mode = (volume.get("projected") or {}).get("defaultMode", 0o644)
        for source in sources:
            _fill(api, pod, namespace, name, source, target, mode)
        out[name] = target
    return out


def _fill(api: _Api, pod: dict[str, Any], namespace: str, volume: str, source: dict[str, Any],
          target: Path, projected_mode: int) -> None:
    if "emptyDir" in source:
        return
    for kind, key, name_key in (("ConfigMap", "configMap", "name"),
                                ("Secret", "secret", "secretName")):
        if key in source:
            ref = source[key]
            name = ref.get(name_key) or ref.get("name")
            data = api.object_data(kind, namespace, name, bool(ref.get("optional")))
            if data is not None:
                _write_files(target, data, ref.get("items"), ref.get("defaultMode", projected_mode),
                             f"{kind} {namespace}/{name}")
            return
    if "downwardAPI" in source:
        for item in source["downwardAPI"].get("items") or []:
            if "fieldRef" not in item:
                raise PodFailure("UnsupportedVolume", f"volume {volume}: only fieldRef items")
            path = target / item["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(_field(pod, item["fieldRef"]["fieldPath"]))
        return
    if "serviceAccountToken" in source:
        path = target / source["serviceAccountToken"]["path"]
        path.write_bytes(api.token(pod, source["serviceAccountToken"]))
        path.chmod(projected_mode)
        return
    kinds = ", ".join(sorted(set(source) - {"name"}))
    raise PodFailure("UnsupportedVolume",
                     f"volume {volume!r} is of kind {kinds}, which a node agent running local "
                     "processes cannot provide (use emptyDir, configMap, secret, downwardAPI or "
                     "projected)")


# ------------------------------------------------------------------ the container's root


def _covers(mount_point: str, path: str) -> bool:
    """Whether a mount at ``mount_point`` hides ``path`` (both absolute, resolved)."""
    return path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


def setup_script(root_dir: Path, repository: Path, mounts: Sequence[tuple[Path, str, bool]],
                 hostname: str, read_only_root: bool, chroot: str) -> str:
    """The shell that builds a container's file system in its new mount namespace and
    ``exec``s the container's command (given as arguments, then the working directory).

    ``mounts``: (host source, path in the container, read-only). The host's symlinks in a
    target are resolved first (the root is an overlay of the host's): ``/var/run/...`` must
    become ``<root>/run/...``, never the host's ``/run`` through an absolute link.
    """
    q = shlex.quote
    r = q(str(root_dir))
    lines = [
        "set -eu",
        f'container_path="$PATH"; PATH={SYSTEM_PATH}',
        f"mount -t tmpfs -o mode=0755 ddm-node-agent {r}",
        f"mkdir {r}/upper {r}/work {r}/root {r}/image-upper {r}/image-work",
        f"mount -t overlay overlay -o lowerdir=/,upperdir={r}/upper,workdir={r}/work {r}/root",
        f"mount --rbind /proc {r}/root/proc",
        f"mount --rbind /sys {r}/root/sys",
        f"mount -t tmpfs -o mode=0755,nosuid tmpfs {r}/root/dev",
        *(f"touch {r}/root/dev/{d} && mount --bind /dev/{d} {r}/root/dev/{d}" for d in DEVICES),
        f"mkdir {r}/root/dev/pts {r}/root/dev/shm",
        f"mount --rbind /dev/pts {r}/root/dev/pts",
        f"mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs {r}/root/dev/shm",
        f"ln -s /proc/self/fd {r}/root/dev/fd && ln -s pts/ptmx {r}/root/dev/ptmx",
        *(f"ln -s /proc/self/fd/{i} {r}/root/dev/{n}"
          for i, n in enumerate(("stdin", "stdout", "stderr"))),
        f"mount -t tmpfs -o mode=0755 tmpfs {r}/root/opt && mkdir {r}/root{IMAGE_WORKDIR}",
        (f"mount -t overlay overlay -o lowerdir={q(str(repository))},upperdir={r}/image-upper,"
         f"workdir={r}/image-work {r}/root{IMAGE_WORKDIR}"),
    ]
    for source, target, read_only in sorted(mounts, key=lambda m: m[1].count("/")):
        inside = f"{r}/root{q(os.path.realpath(target))}"
        if source.is_dir():
            lines.append(f"mkdir -p {inside}")
        else:
            lines.append(f'mkdir -p "$(dirname {inside})" && touch {inside}')
        lines.append(f"mount --bind {q(str(source))} {inside}")
        if read_only:
            lines.append(f"mount -o remount,bind,ro {inside}")
    # The "image" is the host's file system: where a volume (say an emptyDir at /tmp) covers
    # the checkout or the virtualenv that provides `ddm`, show them again at their own paths,
    # as an image's files would be there whatever the pod mounts elsewhere.
    for host_path in sorted({os.path.realpath(repository), os.path.realpath(sys.prefix)}):
        if any(_covers(os.path.realpath(target), host_path) for _, target, _ in mounts):
            inside = f"{r}/root{q(host_path)}"
            lines += [f"mkdir -p {inside}", f"mount --bind {q(host_path)} {inside}",
                      f"mount -o remount,bind,ro {inside}"]
    if read_only_root:
        lines += [f"mount -o remount,bind,ro {r}/root{part}"
                  for part in ("", "/opt", IMAGE_WORKDIR)]
    lines += [
        f"hostname {q(hostname)}",
        'PATH="$container_path"',
        # The container's command with its working directory, inside the new root.
        (f'workdir="$1"; shift; exec {q(chroot)} {r}/root '
         "/bin/sh -c 'cd \"$0\" && exec \"$@\"' \"$workdir\" \"$@\""),
    ]
    return "\n".join(lines)


def _check_tools(work_dir: Path) -> dict[str, str]:
    """The util-linux tools the agent runs, after checking that mount namespaces work here."""
    tools = {name: shutil.which(name, path=SYSTEM_PATH)
             for name in ("setpriv", "unshare", "nsenter", "chroot", "ip")}
    missing = [name for name, path in tools.items() if path is None]
    if missing:
        raise RuntimeError(f"NodeAgent needs {', '.join(missing)} (util-linux, iproute2)")
    probe = work_dir / "namespace-check"
    probe.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [tools["unshare"], "--mount", "--uts", "--propagation", "private",
         "mount", "-t", "tmpfs", "tmpfs", str(probe)], capture_output=True, text=True,
        check=False)
    probe.rmdir()
    if result.returncode != 0:
        raise RuntimeError(
            "NodeAgent runs each container in its own mount namespace, which needs root and a "
            f"kernel that permits unshare(2) here; `unshare --mount` failed: "
            f"{result.stderr.strip() or result.returncode}")
    return {name: str(path) for name, path in tools.items()}


# ------------------------------------------------------------------------ a container


class _Probe:
    """The schedule and counts of one probe of one container run."""

    def __init__(self, spec: dict[str, Any], started: float, cap_s: float) -> None:
        self.spec = spec
        self.period_s = min(spec.get("periodSeconds", 10), cap_s)
        self.due = started + min(spec.get("initialDelaySeconds", 0), cap_s)
        self.successes = self.failures = 0

    def record(self, ok: bool, now: float) -> bool | None:
        """Count one result; True or False once a threshold is reached, else None."""
        self.due = now + self.period_s
        self.successes, self.failures = (self.successes + 1, 0) if ok else (0, self.failures + 1)
        if ok and self.successes >= self.spec.get("successThreshold", 1):
            return True
        if not ok and self.failures >= self.spec.get("failureThreshold", 3):
            return False
        return None


class _Container:
    """One container of a pod: its process, restarts, probes and reported state."""

    def __init__(self, pod: _Pod, spec: dict[str, Any], *, init: bool) -> None:
        self.pod, self.spec, self.init, self.name = pod, spec, init, spec["name"]
        self.restarts = 0
        waiting = "PodInitializing" if init or pod.has_init else "ContainerCreating"
        self.state: dict[str, Any] = {"waiting": {"reason": waiting}}
        self.last_state: dict[str, Any] = {}
        self.ready = self.started = False
        self.succeeded: bool | None = None  # set once it has finished for good
        self.process: subprocess.Popen[bytes] | None = None
        self.container_id = ""
        self.env: dict[str, str] = {}
        self.log_path = pod.agent.log_path(pod.namespace, pod.name, self.name)
        self.message_path = pod.dir / "termination" / self.name
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"{pod.namespace}/{pod.name}/{self.name}")

    def status(self) -> dict[str, Any]:
        out = {"name": self.name, "image": self.spec.get("image", ""),
               "imageID": f"ddm-node-agent://{self.spec.get('image', '')}"
               if self.container_id else "",
               "ready": self.ready, "restartCount": self.restarts,
               "state": self.state, "lastState": self.last_state}
        if not self.init:
            out["started"] = self.started
        if self.container_id:
            out["containerID"] = self.container_id
        return out

    def _set(self, **fields: Any) -> None:
        with self.pod.lock:
            for key, value in fields.items():
                setattr(self, key, value)
        self.pod.changed.set()

    def _run(self) -> None:
        delay = 0.0
        try:
            while not self.pod.stopping.is_set():
                try:
                    argv, self.env = self.pod.command(self.spec)
                except (NotYet, PodFailure) as error:
                    self._set(state={"waiting": {"reason": "CreateContainerConfigError",
                                                 "message": str(error)}})
                    self.pod.stopping.wait(1.0)
                    continue
                began = time.monotonic()
                terminated = self._run_once(argv)
                if self.pod.stopping.is_set():
                    self._set(state={"terminated": terminated})
                    break
                code, policy = terminated["exitCode"], self.pod.restart_policy
                if self.init:
                    again = code != 0 and policy != "Never"
                else:
                    again = policy == "Always" or (policy == "OnFailure" and code != 0)
                if not again:  # a completed init container counts as ready
                    self._set(state={"terminated": terminated}, succeeded=code == 0,
                              ready=self.init and code == 0)
                    break
                # The kubelet's back-off, shortened: it doubles per crash, and starts over
                # once a run has lasted twice its cap.
                ran_long = time.monotonic() - began > 2 * self.pod.agent.max_backoff_s
                delay = 1.0 if not delay or ran_long else min(2 * delay,
                                                              self.pod.agent.max_backoff_s)
                self._set(last_state={"terminated": terminated}, restarts=self.restarts + 1,
                          state={"waiting": {"reason": "CrashLoopBackOff", "message": (
                              f"back-off {delay:g}s restarting failed container={self.name} "
                              f"pod={self.pod.name}")}})
                if self.pod.stopping.wait(delay):
                    break
        except Exception:  # noqa: BLE001 - any agent bug is logged, not lost in a thread
            self.pod.agent.log(f"container {self.thread.name} failed:\n{traceback.format_exc()}")
            self._set(state={"waiting": {"reason": "AgentError", "message": "see agent.log"}})

    def _run_once(self, argv: list[str]) -> dict[str, Any]:
        """Run the process once, probing it; returns its ``terminated`` state."""
        agent, pod = self.pod.agent, self.pod
        self.message_path.parent.mkdir(parents=True, exist_ok=True)
        self.message_path.write_bytes(b"")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            offset = log.tell()
            process = subprocess.Popen(
                [agent.tools["setpriv"], "--pdeathsig", "KILL",  # dies if the agent dies
                 agent.tools["unshare"], "--mount", "--uts", "--propagation", "private",
                 "/bin/sh", "-c", pod.setup(self), "sh",
                 self.spec.get("workingDir") or IMAGE_WORKDIR, *argv],
                env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        self._set(process=process)
        _wait_entered(process)
        started_at = _now()
        has = {kind: kind in self.spec and not self.init
               for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
        self._set(process=process, container_id=f"ddm-node-agent://{process.pid}",
                  state={"running": {"startedAt": started_at}},
                  started=not has["startupProbe"],
                  ready=not has["startupProbe"] and not has["readinessProbe"] and not self.init)
        agent.log(f"started {self.thread.name} (pid {process.pid})")
        code = self._supervise(process)
        kill_group(process.pid)  # what the main process left behind dies with the container
        self._set(process=None, ready=False, started=False)
        message = self.message_path.read_bytes()[:MESSAGE_LIMIT].decode(errors="replace")
        policy = self.spec.get("terminationMessagePolicy", "File")
        if not message and code != 0 and policy == "FallbackToLogsOnError":
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                tail = log.read().decode(errors="replace").splitlines()[-FALLBACK_LOG_LINES:]
            message = "\n".join(tail)[-MESSAGE_LIMIT:]
        agent.log(f"{self.thread.name} exited with {code}")
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                      "startedAt": started_at, "finishedAt": _now(),
                      "containerID": self.container_id}
        if message:
            terminated["message"] = message
        return terminated

    def _supervise(self, process: subprocess.Popen[bytes]) -> int:
        """Wait for the process, running its probes; kills it on deletion or failed liveness."""
        cap = self.pod.agent.max_probe_period_s
        now = time.monotonic()
        probes = {kind: _Probe(self.spec[kind], now, cap) for kind in
                  ("startupProbe", "readinessProbe", "livenessProbe")
                  if kind in self.spec and not self.init}
        def active(kind: str) -> bool:  # the startup probe until it passes, then the others
            return (kind == "startupProbe") != self.started

        while True:
            due = [p.due for kind, p in probes.items() if active(kind)]
            wait = min([0.5, *(max(0.0, d - time.monotonic()) for d in due)])
            try:
                return _exit_code(process.wait(timeout=wait))
            except subprocess.TimeoutExpired:
                pass
            if self.pod.stopping.is_set():
                return self._kill(process, self.pod.grace_s)
            now = time.monotonic()
            for kind, probe in probes.items():
                if probe.due > now or not active(kind):
                    continue
                verdict = probe.record(self._check(probe.spec), now)
                if verdict is None:
                    continue
                if kind == "readinessProbe":
                    if verdict != self.ready:
                        self._set(ready=verdict)
                elif verdict:  # the startup probe succeeded: readiness and liveness begin
                    self._set(started=True, ready="readinessProbe" not in probes)
                    for other in probes.values():
                        other.due = min(other.due, now)
                else:
                    self.pod.agent.log(f"{self.thread.name} failed its {kind}: restarting it")
                    return self._kill(process, self.pod.grace_s)

    def _check(self, probe: dict[str, Any]) -> bool:
        """One probe (httpGet, tcpSocket or exec) of the running container."""
        timeout = probe.get("timeoutSeconds", 1)
        try:
            if "exec" in probe:
                pid = str(self.process.pid) if self.process else "0"
                return subprocess.run(
                    [self.pod.agent.tools["nsenter"], "--target", pid, "--mount", "--uts",
                     "--root", "--wd", "--", *probe["exec"]["command"]], env=self.env,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout,
                    check=False).returncode == 0
            action = probe.get("httpGet") or probe.get("tcpSocket")
            if action is None:
                return False  # gRPC probes are not supported: never passes
            host, port = action.get("host") or self.pod.ip, self._port(action["port"])
            if "tcpSocket" in probe:
                socket.create_connection((host, port), timeout=timeout).close()
                return True
            if action.get("scheme", "HTTP").upper() == "HTTPS":
                connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                    host, port, timeout=timeout, context=ssl._create_unverified_context())
            else:
                connection = http.client.HTTPConnection(host, port, timeout=timeout)
            headers = {h["name"]: h["value"] for h in action.get("httpHeaders") or []}
            try:
                connection.request("GET", action.get("path", "/"), headers=headers)
                return 200 <= connection.getresponse().status < 400
            finally:
                connection.close()
        except (OSError, http.client.HTTPException, subprocess.TimeoutExpired, LookupError):
            return False

    def _port(self, port: int | str) -> int:
        if isinstance(port, int) or port.isdigit():
            return int(port)
        for declared in self.spec.get("ports") or []:
            if declared.get("name") == port:
                return int(declared["containerPort"])
        raise LookupError(f"container {self.name} declares no port named {port!r}")

    @staticmethod
    def _kill(process: subprocess.Popen[bytes], grace_s: float) -> int:
        """SIGTERM, then SIGKILL for the whole process group after ``grace_s``."""
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        kill_group(process.pid)
        return _exit_code(process.wait())


def _wait_entered(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Wait until the setup script has entered the container's root (or ended): the
    container starts then, and its probes may run."""
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{process.pid}/root") != "/":
                return
        time.sleep(0.01)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def kill_group(pid: int) -> None:
    """SIGKILL every process left in a container's process group (its main process's pid)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------ a pod


class _Pod:
    """One pod bound to a fake node: its address, files, containers and status writes."""

    def __init__(self, agent: NodeAgent, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        self.agent, self.object = agent, pod
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.dir = agent.work_dir / "pods" / f"{self.namespace}_{self.name}_{self.uid[:8]}"
        self.lock = threading.Lock()
        self.changed, self.stopping = threading.Event(), threading.Event()
        self.grace_s = agent.max_grace_s
        self.deleted = False  # the object is gone: nothing to delete
        self.restart_policy = spec.get("restartPolicy", "Always")
        self.has_init = bool(spec.get("initContainers"))
        self.ip = ""
        self.volumes: dict[str, Path] = {}
        self.waiting_for = ""  # why volumes are not ready yet
        self.failure: PodFailure | None = None
        self.start_time = _now()
        self.init = [_Container(self, c, init=True) for c in spec.get("initContainers") or []]
        self.containers = [_Container(self, c, init=False) for c in spec["containers"]]
        self._written: dict[str, Any] | None = None
        self._transitions: dict[str, tuple[str, str]] = {}
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"pod {self.namespace}/{self.name}")

    # -- events from the watch

    def update(self, pod: dict[str, Any]) -> None:
        with self.lock:
            self.object = pod
        meta = pod["metadata"]
        if meta.get("deletionTimestamp") and not self.stopping.is_set():
            grace = meta.get("deletionGracePeriodSeconds",
                             pod["spec"].get("terminationGracePeriodSeconds", 30))
            self.halt(min(float(grace), self.agent.max_grace_s))
        self.changed.set()

    def halt(self, grace_s: float, *, deleted: bool = False) -> None:
        """Stop every container (SIGTERM, SIGKILL after ``grace_s``)."""
        self.grace_s = min(self.grace_s, grace_s)
        self.deleted = self.deleted or deleted
        self.stopping.set()
        self.changed.set()

    # -- the pod's life

    def _run(self) -> None:
        try:
            self._prepare()
            if self.failure is None:
                self._run_containers()
            else:
                self._sync()
                self.stopping.wait()
        except Exception:  # noqa: BLE001 - any agent bug is logged, not lost in a thread
            self.agent.log(f"{self.thread.name} failed:\n{traceback.format_exc()}")
        finally:
            self.stopping.set()
            for container in self.init + self.containers:
                if container.thread.is_alive():
                    container.thread.join(self.grace_s + 10)
            if self._deleting() and not self.deleted and not self.agent.stopping.is_set():
                self._delete()
            self.agent.forget(self)

    def _prepare(self) -> None:
        self.ip = self.agent.addresses.take()
        etc = self.dir / "etc"
        etc.mkdir(parents=True, exist_ok=True)
        search = f"{self.namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}"
        (etc / "resolv.conf").write_text(
            f"nameserver {self.agent.dns_address}\nsearch {search}\noptions ndots:5\n")
        (etc / "hosts").write_text(
            f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"{self.ip}\t{self.name}\n")
        (etc / "hostname").write_text(self.name[:63] + "\n")
        self._sync()
        while not self.stopping.is_set():
            try:
                self.volumes = prepare_volumes(self.agent.api, self.object, self.dir / "volumes")
                return
            except NotYet as error:
                self.waiting_for = str(error)
                self._sync()
                self.stopping.wait(1.0)
            except PodFailure as failure:
                self.agent.log(f"{self.thread.name} cannot run: {failure}")
                self.failure = failure
                return

    def _run_containers(self) -> None:
        self.waiting_for = ""
        pending = list(self.init)
        launched = False
        while not self.stopping.is_set():
            self.changed.clear()
            while pending and pending[0].succeeded:
                pending.pop(0)
            if pending and not pending[0].thread.is_alive() and pending[0].succeeded is None:
                pending[0].thread.start()
            if not pending and not launched:
                for container in self.containers:
                    container.thread.start()
                launched = True
            self._sync()
            self.changed.wait(1.0)

    def _deleting(self) -> bool:
        with self.lock:
            return bool(self.object["metadata"].get("deletionTimestamp"))

    def _delete(self) -> None:
        """Remove the object once its processes are gone, as the kubelet does."""
        try:
            self.agent.api.core.delete_namespaced_pod(
                self.name, self.namespace, _preload_content=False,
                body={"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}})
        except ApiException as error:
            if error.status not in (404, 409):
                raise

    # -- what a container runs

    def command(self, spec: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        """The argv and environment of one container (raises NotYet while a ConfigMap or
        Secret its env needs is missing)."""
        with self.lock:
            pod = self.object
        server = urlsplit(self.agent.cluster.server)
        env = {"PATH": f"{self.agent.venv_bin}:{SYSTEM_PATH}", "HOSTNAME": self.name[:63],
               "KUBERNETES_SERVICE_HOST": str(server.hostname),
               "KUBERNETES_SERVICE_PORT": str(server.port),
               "KUBERNETES_SERVICE_PORT_HTTPS": str(server.port),
               "KUBERNETES_PORT": f"tcp://{server.hostname}:{server.port}"}
        api = self.agent.api
        for source in spec.get("envFrom") or []:
            kind, ref = (("ConfigMap", source["configMapRef"]) if "configMapRef" in source
                         else ("Secret", source["secretRef"]))
            data = api.object_data(kind, self.namespace, ref["name"], bool(ref.get("optional")))
            for key, value in (data or {}).items():
                env[source.get("prefix", "") + key] = value.decode(errors="replace")
        for variable in spec.get("env") or []:
            value = self._env_value(pod, spec, variable, env)
            if value is not None:
                env[variable["name"]] = value
        for key, value in {**THREAD_DEFAULTS, "HOME": "/root"}.items():
            env.setdefault(key, value)
        argv = [*(spec.get("command") or self.agent.entrypoint), *(spec.get("args") or [])]
        argv = [_expand(arg, env).replace("0.0.0.0", self.ip) for arg in argv]
        return argv, env

    def _env_value(self, pod: dict[str, Any], spec: dict[str, Any], variable: dict[str, Any],
                   env: dict[str, str]) -> str | None:
        if "valueFrom" not in variable:
            return _expand(variable.get("value", ""), env)
        source = variable["valueFrom"]
        if "fieldRef" in source:
            return _field(pod, source["fieldRef"]["fieldPath"])
        if "resourceFieldRef" in source:
            return _resource(spec, source["resourceFieldRef"], self.agent.node(pod))
        kind, ref = (("ConfigMap", source["configMapKeyRef"]) if "configMapKeyRef" in source
                     else ("Secret", source["secretKeyRef"]))
        data = self.agent.api.object_data(kind, self.namespace, ref["name"],
                                          bool(ref.get("optional")))
        if data is None or (ref["key"] not in data and ref.get("optional")):
            return None
        if ref["key"] not in data:
            raise NotYet(f"{kind} {self.namespace}/{ref['name']} has no key {ref['key']!r}")
        return data[ref["key"]].decode(errors="replace")

    def setup(self, container: _Container) -> str:
        """The setup script of one container run (see `setup_script`)."""
        etc = self.dir / "etc"
        mounts = [(etc / name, f"/etc/{name}", False) for name in ("hosts", "hostname",
                                                                     "resolv.conf")]
        for mount in container.spec.get("volumeMounts") or []:
            source = self.volumes[mount["name"]]
            if mount.get("subPath"):
                source = source / mount["subPath"]
                if not source.exists():
                    source.mkdir(parents=True)
            mounts.append((source, mount["mountPath"], bool(mount.get("readOnly"))))
        mounts.append((container.message_path,
                       container.spec.get("terminationMessagePath", "/dev/termination-log"),
                       False))
        security = container.spec.get("securityContext") or {}
        return setup_script(self.agent.work_dir / "rootfs", self.agent.repository, mounts,
                            self.name[:63], bool(security.get("readOnlyRootFilesystem")),
                            self.agent.tools["chroot"])

    # -- status

    def _phase(self) -> str:
        if self.failure is not None or any(c.succeeded is False for c in self.init):
            return "Failed"
        if not all(c.succeeded for c in self.init):
            return "Pending"
        if any("waiting" in c.state and not c.last_state for c in self.containers):
            return "Pending"
        if any("running" in c.state or c.succeeded is None for c in self.containers):
            return "Running"
        return "Succeeded" if all(c.succeeded for c in self.containers) else "Failed"

    def _condition(self, kind: str, true: bool, reason: str = "", message: str = ""
                   ) -> dict[str, Any]:
        status = "True" if true else "False"
        previous = self._transitions.get(kind)
        if previous is None or previous[0] != status:
            self._transitions[kind] = (status, _now())
        out = {"type": kind, "status": status, "lastProbeTime": None,
               "lastTransitionTime": self._transitions[kind][1]}
        if not true and reason:
            out.update(reason=reason, message=message)
        return out

    def status(self) -> dict[str, Any]:
        """The pod's status as the kubelet would report it now."""
        with self.lock:
            current = dict(self.object.get("status") or {})
            phase = self._phase()
            init = [c.status() for c in self.init]
            containers = [c.status() for c in self.containers]
        if self.waiting_for:
            for entry in init[:1] or containers:
                entry["state"] = {"waiting": {"reason": "ContainerCreating",
                                              "message": self.waiting_for}}
        unready = [c["name"] for c in containers if not c["ready"]]
        uninitialized = [c["name"] for c in init if "terminated" not in c["state"]
                         or c["state"]["terminated"]["exitCode"] != 0]
        not_ready = f"containers with unready status: [{' '.join(unready)}]"
        scheduled = [c for c in current.get("conditions") or [] if c["type"] == "PodScheduled"]
        status = {
            **{k: v for k, v in current.items() if k in ("qosClass", "nominatedNodeName")},
            "phase": phase, "hostIP": "127.0.0.1", "startTime": self.start_time,
            "conditions": [
                self._condition("Initialized", not uninitialized, "ContainersNotInitialized",
                                f"containers with incomplete status: [{' '.join(uninitialized)}]"),
                self._condition("Ready", phase == "Running" and not unready,
                                "ContainersNotReady", not_ready),
                self._condition("ContainersReady", not unready, "ContainersNotReady", not_ready),
                *scheduled,
            ],
            "containerStatuses": containers,
        }
        if self.ip:
            status.update(podIP=self.ip, podIPs=[{"ip": self.ip}])
        if init:
            status["initContainerStatuses"] = init
        if self.failure is not None:
            status.update(reason=self.failure.reason, message=str(self.failure))
        return status

    def _sync(self) -> None:
        """Write the status through pods/status if it changed since the last write."""
        status = self.status()
        if status == self._written:
            return
        for _ in range(5):
            with self.lock:
                body = {**self.object, "status": status}
            try:
                answer = self.agent.api.core.replace_namespaced_pod_status(
                    self.name, self.namespace, body, _preload_content=False)
            except ApiException as error:
                if error.status == 404:
                    self.halt(0, deleted=True)
                    return
                if error.status != 409:
                    raise
                fresh = _json(self.agent.api.core.read_namespaced_pod(
                    self.name, self.namespace, _preload_content=False))
                if fresh["metadata"]["uid"] != self.uid:
                    self.halt(0, deleted=True)
                    return
                self.update(fresh)
                continue
            self.update(_json(answer))
            self._written = status
            return


# ---------------------------------------------------------------------------- the agent


class _Addresses:
    """Pod addresses ``<prefix>3`` to ``<prefix>254``, lowest free first."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def take(self) -> str:
        with self._lock:
            free = next((n for n in range(3, 255) if n not in self._used), None)
            if free is None:
                raise RuntimeError(f"all pod addresses {self.prefix}3-254 are in use")
            self._used.add(free)
            return f"{self.prefix}{free}"

    def give_back(self, address: str) -> None:
        with self._lock:
            self._used.discard(int(address.rsplit(".", 1)[1]))


class _Pump(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        with socket.create_connection(self.server.upstream, timeout=10) as upstream:  # type: ignore[attr-defined]
            upstream.settimeout(None)
            peers = {self.request: upstream, upstream: self.request}
            while True:
                readable, _, _ = select.select(list(peers), [], [])
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    peers[sock].sendall(data)


class _Forwarder(socketserver.ThreadingTCPServer):
    """TCP from ``address`` to ``upstream``: kube-proxy's job for the ``kubernetes`` Service."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        super().__init__(address, _Pump)


class NodeAgent:
    """Runs the pods bound to the fake nodes as local processes; see the module docstring.

    ``work_dir`` receives ``logs/`` (one file per container, ``<ns>_<pod>_<container>.log``),
    ``agent.log`` (what the agent did: starts, exits, probe failures, its own errors) and
    ``pods/`` (volumes, termination messages). ``repository`` is mounted at /opt/ddm and its
    interpreter's directory (this one's, ``sys.executable``) leads every container's PATH.
    """

    def __init__(self, cluster: ClusterInfo, work_dir: Path, *,
                 namespaces: Collection[str] | None = None, repository: Path = ROOT,
                 entrypoint: Sequence[str] = ("ddm",), max_backoff_s: float = 10.0,
                 max_probe_period_s: float = 2.0, max_grace_s: float = 5.0) -> None:
        self.cluster, self.work_dir = cluster, Path(work_dir).resolve()
        self.namespaces = None if namespaces is None else frozenset(namespaces)
        self.repository = Path(repository).resolve()
        self.entrypoint = tuple(entrypoint)
        self.max_backoff_s, self.max_probe_period_s = max_backoff_s, max_probe_period_s
        self.max_grace_s = max_grace_s
        self.venv_bin = str(Path(sys.executable).parent)
        self.stopping = threading.Event()
        self.tools: dict[str, str] = {}
        self.api: _Api  # set by start(), with the address pool
        self.addresses: _Addresses
        self._pods: dict[str, _Pod] = {}
        self._finished: set[str] = set()
        self._nodes: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._log_lock = threading.Lock()
        self._api_client: client.ApiClient | None = None
        self._dns: ClusterDns | None = None
        self._forwarder: _Forwarder | None = None
        self._watch_thread: threading.Thread | None = None
        self._watch_response: Any = None
        self._route: str | None = None  # the local route of this agent's pod addresses

    # -- life

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> Self:
        """Check the machine, serve DNS, and start running the fake nodes' pods."""
        try:
            self.work_dir.mkdir(parents=True, exist_ok=True)
            (self.work_dir / "rootfs").mkdir(exist_ok=True)
            self.tools = _check_tools(self.work_dir)
            configuration = client.Configuration()
            config.load_kube_config(config_file=str(self.cluster.kubeconfig),
                                    client_configuration=configuration)
            configuration.connection_pool_maxsize = 64  # one status writer per pod thread
            self._api_client = client.ApiClient(configuration)
            self.api = _Api(self._api_client)
            nodes = _json(self.api.core.list_node(label_selector=f"{FAKE_NODE_LABEL}=true",
                                                  _preload_content=False))["items"]
            self._nodes = {n["metadata"]["name"]: n for n in nodes}
            self._take_block()
            self._watch_thread = threading.Thread(target=self._watch, daemon=True,
                                                  name="node-agent-watch")
            self._watch_thread.start()
        except BaseException:
            self.stop()
            raise
        return self

    def _take_block(self) -> None:
        """Make the first free ``198.18.N.0/24`` local; its ``.2`` serves DNS (and the
        ``kubernetes`` Service's port 443)."""
        server = urlsplit(self.cluster.server)
        for block in range(256):
            network = f"{POD_NETWORK}.{block}.0/24"
            added = subprocess.run(
                [self.tools["ip"], "route", "add", "local", network, "dev", "lo"],
                capture_output=True, text=True, check=False)
            if "File exists" in added.stderr:
                continue  # another agent's block
            if added.returncode != 0:
                raise RuntimeError(f"NodeAgent cannot give pods addresses: `ip route add local "
                                   f"{network} dev lo` failed: {added.stderr.strip()}")
            self._route = network
            address = f"{POD_NETWORK}.{block}.2"
            self.addresses = _Addresses(f"{POD_NETWORK}.{block}.")
            self._dns = ClusterDns(self._api_client, address, domain=CLUSTER_DOMAIN, static={
                f"kubernetes.default.svc.{CLUSTER_DOMAIN}": address}).__enter__()
            self._forwarder = _Forwarder((address, 443), (str(server.hostname), server.port or 443))
            threading.Thread(target=self._forwarder.serve_forever, daemon=True,
                             name="node-agent-kubernetes-service").start()
            return
        raise RuntimeError(f"every block {POD_NETWORK}.N.0/24 is taken (routes left by agents "
                           "that crashed? see `ip route show table local`)")

    def stop(self) -> None:
        """Kill every process the agent started (SIGTERM, then SIGKILL after 1 s) and stop."""
        self.stopping.set()
        with self._lock:
            pods = list(self._pods.values())
        for pod in pods:
            pod.halt(1.0)
        if self._watch_response is not None:
            self._watch_response.shutdown()
        for pod in pods:
            pod.thread.join(15)
            for container in pod.init + pod.containers:
                process = container.process
                if process is not None:  # a thread that did not finish: kill its processes
                    kill_group(process.pid)
        if self._watch_thread is not None:
            self._watch_thread.join(10)
        if self._forwarder is not None:
            self._forwarder.shutdown()
            self._forwarder.server_close()
        if self._dns is not None:
            self._dns.__exit__(None, None, None)
        if self._route is not None:
            subprocess.run([self.tools["ip"], "route", "del", "local", self._route, "dev", "lo"],
                           capture_output=True, check=False)
        if self._api_client is not None:
            self._api_client.close()

    # -- what tests read

    @property
    def dns_address(self) -> str:
        """The cluster DNS's address (port 53), as pods' resolv.conf names it."""
        assert self._dns is not None, "the agent is not started"
        return self._dns.address

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        return self.work_dir / "logs" / f"{namespace}_{pod}_{container}.log"

    def logs(self, namespace: str, pod: str, container: str) -> str:
        """Everything a container wrote to stdout and stderr, over all its restarts."""
        path = self.log_path(namespace, pod, container)
        return path.read_text(errors="replace") if path.exists() else ""

    def log_files(self) -> list[Path]:
        """Every log the agent wrote: the containers' and its own ``agent.log``."""
        return sorted((self.work_dir / "logs").glob("*.log")) + [self.work_dir / "agent.log"]

    def pids(self, namespace: str, pod: str) -> dict[str, int]:
        """The running processes of a pod's containers (container name -> pid)."""
        with self._lock:
            pods = [p for p in self._pods.values() if (p.namespace, p.name) == (namespace, pod)]
        return {c.name: c.process.pid for p in pods for c in p.init + p.containers
                if c.process is not None}

    # -- for pods

    def log(self, line: str) -> None:
        """One line in ``agent.log`` (never a secret: no env, no file contents)."""
        with self._log_lock, open(self.work_dir / "agent.log", "a") as out:
            out.write(f"{_now()} {line}\n")

    def node(self, pod: dict[str, Any]) -> dict[str, Any]:
        return self._nodes[pod["spec"]["nodeName"]]

    def forget(self, pod: _Pod) -> None:
        """A pod's thread ended: free its address; its uid is never run again."""
        if pod.ip:
            self.addresses.give_back(pod.ip)
        with self._lock:
            self._pods.pop(pod.uid, None)
            self._finished.add(pod.uid)

    # -- the watch

    def _watch(self) -> None:
        while not self.stopping.is_set():
            try:
                listing = _json(self.api.core.list_pod_for_all_namespaces(
                    field_selector="spec.nodeName!=", _preload_content=False))
                uids = set()
                for pod in listing["items"]:
                    uids.add(pod["metadata"]["uid"])
                    self._on_event("ADDED", pod)
                with self._lock:
                    vanished = [p for uid, p in self._pods.items() if uid not in uids]
                for pod in vanished:  # deleted while the watch was down
                    pod.halt(0, deleted=True)
                self._stream(listing["metadata"]["resourceVersion"])
            except Exception as error:  # noqa: BLE001 - a broken watch is listed again
                if self.stopping.is_set():
                    return
                self.log(f"pod watch failed, listing again: {error!r}")
                self.stopping.wait(0.5)

    def _stream(self, resource_version: str) -> None:
        from kubernetes.watch.watch import iter_resp_lines

        self._watch_response = self.api.core.list_pod_for_all_namespaces(
            field_selector="spec.nodeName!=", watch=True, resource_version=resource_version,
            timeout_seconds=300, _preload_content=False)
        if self.stopping.is_set():
            return
        for line in iter_resp_lines(self._watch_response):
            event = json.loads(line)
            if event["type"] == "ERROR":  # e.g. 410 Gone: list again
                self.log(f"pod watch ended: {event['object'].get('message')}")
                return
            if event["type"] != "BOOKMARK":
                self._on_event(event["type"], event["object"])

    def _on_event(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        if self.namespaces is not None and meta["namespace"] not in self.namespaces:
            return
        if pod["spec"].get("nodeName") not in self._nodes:
            return
        with self._lock:
            worker = self._pods.get(meta["uid"])
            if kind == "DELETED":
                if worker is not None:
                    worker.halt(0, deleted=True)
                return
            if worker is not None:
                worker.update(pod)
                return
            if meta["uid"] in self._finished or self.stopping.is_set() or (
                    (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")):
                return
            worker = _Pod(self, pod)
            self._pods[meta["uid"]] = worker
            worker.thread.start()  # under the lock: `stop` joins only started threads
        self.log(f"running pod {meta['namespace']}/{meta['name']} ({meta['uid']})")
