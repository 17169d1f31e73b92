"""A user's first ten minutes, on the dev cluster's real node: the README's "Try it on a local
cluster", command by command.

The real helm installs the chart; the real kubelet and containerd run the operator in its pod
from the image built from images/operator/Dockerfile (no ML framework), under the chart's
ServiceAccount, then the expert and router pods the operator creates, from
images/cpu/Dockerfile. The router finds its experts through the cluster DNS; `kubectl
port-forward service/digits-router` reaches the router as a user would, and the digits it
draws must be read as the asked ones by the shipped classifier.

The module runs in order: dry-run, install, example, generate, security checks, upgrade,
uninstall. Every wait polls the API with a deadline.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from helm_tool import ensure_helm
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from PIL import Image
from podsecurity import violations
from podwatch import ContainerLog, TaskExits, container_pids, delete_and_watch
from waiting import wait_for

from ddm_devcluster import ClusterInfo
from ddm_devcluster import images as dev_images
from ddm_devcluster.cluster import node_layout
from ddm.operator.manifests import DRAIN_S
from ddm.evaluation.commands import evaluate_images

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ddm-operator"
EXAMPLE = ROOT / "examples" / "digits.yaml"
HETEROGENEOUS = ROOT / "examples" / "heterogeneous.yaml"
RELEASE, SYSTEM, USERS = "ddm", "ddm-system", "digits-demo"
OPERATOR_ACCOUNT = f"system:serviceaccount:{SYSTEM}:{RELEASE}-ddm-operator"
RELEASE_SELECTOR = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/managed-by=Helm"
READY_TIMEOUT_S = 420
# The images are in the node's containerd only (imported, never pushed): pods must not pull.
DEV_VALUES = ("--set", "images.pullPolicy=Never")


def pod_logs(core: client.CoreV1Api, namespace: str, tail_chars: int = 4000) -> str:
    """The end of every container log of the pods in ``namespace`` (for failure messages)."""
    parts = []
    for pod in core.list_namespaced_pod(namespace).items:
        for container in pod.spec.containers:
            try:
                text = core.read_namespaced_pod_log(pod.metadata.name, namespace,
                                                    container=container.name)
            except ApiException as error:
                text = f"(no log: {error.reason})"
            parts.append(f"--- {pod.metadata.name}/{container.name}\n{text[-tail_chars:]}")
    return "\n".join(parts)


def pod_states(core: client.CoreV1Api, namespace: str) -> str:
    """One line per pod: phase, readiness and why it is not scheduled (for failure messages)."""
    lines = []
    for pod in core.list_namespaced_pod(namespace).items:
        unscheduled = [c.message for c in pod.status.conditions or []
                       if c.type == "PodScheduled" and c.status != "True"]
        ready = [c.ready for c in pod.status.container_statuses or []]
        lines.append(f"{pod.metadata.name}: {pod.status.phase}, ready {ready}"
                     + (", deleting" if pod.metadata.deletion_timestamp else "")
                     + (f", unscheduled: {unscheduled[0]}" if unscheduled else ""))
    return "\n".join(lines)


class PortForward:
    """``kubectl port-forward service/NAME :PORT`` in the background; ``url`` is its local end."""

    def __init__(self, tools: Tools, namespace: str, target: str, port: int) -> None:
        self._process = subprocess.Popen(
            ["kubectl", "port-forward", "-n", namespace, target, f":{port}"], env=tools.env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert self._process.stdout is not None
        first = self._process.stdout.readline()  # "Forwarding from 127.0.0.1:PORT -> PORT"
        match = re.search(r"127\.0\.0\.1:(\d+)", first)
        if match is None:
            self.close()
            pytest.fail(f"kubectl port-forward {target}: {first}", pytrace=False)
        self.url = f"http://127.0.0.1:{match.group(1)}"

    def close(self) -> None:
        self._process.terminate()
        self._process.wait(10)


class Tools:
    """helm and kubectl as a user runs them, logged in as the dev cluster's admin."""

    def __init__(self, cluster: ClusterInfo) -> None:
        self.helm = ensure_helm()
        self.env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig),
                    "HELM_CACHE_HOME": str(cluster.state_dir / "helm-cache"),
                    "HELM_CONFIG_HOME": str(cluster.state_dir / "helm-config"),
                    "HELM_DATA_HOME": str(cluster.state_dir / "helm-data")}

    def run(self, *command: str, stdin: str | None = None, ok: bool = True,
            timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        executable = str(self.helm) if command[0] == "helm" else command[0]
        result = subprocess.run([executable, *command[1:]], input=stdin, capture_output=True,
                                text=True, env=self.env, timeout=timeout_s)
        if ok:
            assert result.returncode == 0, f"{' '.join(command)}:\n{result.stdout}{result.stderr}"
        return result

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run("kubectl", *args, **kwargs)

    def can_i(self, verb: str, resource: str, namespace: str) -> bool:
        result = self.kubectl("auth", "can-i", verb, resource, "-n", namespace,
                              f"--as={OPERATOR_ACCOUNT}", ok=False)
        return result.stdout.strip() == "yes"


@pytest.fixture(scope="module")
def tools(dev_cluster: ClusterInfo) -> Tools:
    return Tools(dev_cluster)


@pytest.fixture(scope="module")
def core(kube_client: Any) -> client.CoreV1Api:
    return client.CoreV1Api(kube_client)


@pytest.fixture(scope="module")
def custom(kube_client: Any) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(kube_client)


def ddm_status(custom: client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any]:
    try:
        return custom.get_namespaced_custom_object(
            "ddm.dev", "v1alpha1", namespace, "ddmdeployments", name).get("status") or {}
    except ApiException as error:
        if error.status == 404:
            return {}
        raise


def test_rendered_chart_passes_server_side_dry_run(tools: Tools, core: client.CoreV1Api
                                                   ) -> None:
    """`helm template` output is accepted by the API server as it stands (CRD applied first)."""
    tools.kubectl("apply", "--server-side", "-f", str(CHART / "crds"))
    core.create_namespace({"metadata": {"name": SYSTEM}})
    for values in ([], ["--set", "watchNamespaces={default}", "--set", "example.enabled=true"]):
        rendered = tools.run("helm", "template", RELEASE, str(CHART), "-n", SYSTEM,
                             *values).stdout
        tools.kubectl("apply", "--dry-run=server", "-f", "-", stdin=rendered)


def test_helm_install_runs_the_operator_under_its_own_account(
        tools: Tools, core: client.CoreV1Api) -> None:
    tools.run("helm", "install", RELEASE, str(CHART), "-n", SYSTEM, *DEV_VALUES, "--wait",
              "--timeout", "5m")
    (pod,) = core.list_namespaced_pod(SYSTEM, label_selector="app.kubernetes.io/component="
                                                            "operator").items
    assert pod.spec.service_account_name == OPERATOR_ACCOUNT.rsplit(":", 1)[1]
    assert all(c.ready for c in pod.status.container_statuses)
    # In a container of the slim operator image (images/operator/Dockerfile: no ML framework),
    # on the real node (the fake nodes run nothing).
    (container,) = pod.spec.containers
    assert container.image == dev_images.OPERATOR.name
    assert pod.spec.node_name == "ddm-real-0"


def test_the_operator_may_do_exactly_what_it_needs(tools: Tools) -> None:
    for verb, resource in [("watch", "ddmdeployments.ddm.dev"),
                           ("patch", "ddmdeployments.ddm.dev/status"),
                           ("create", "deployments.apps"), ("delete", "services"),
                           ("list", "pods"), ("create", "secrets"), ("create", "events")]:
        assert tools.can_i(verb, resource, USERS), f"operator cannot {verb} {resource}"
    for verb, resource in [("get", "secrets"), ("list", "secrets"), ("watch", "secrets"),
                           ("delete", "pods"), ("create", "pods"),
                           ("delete", "ddmdeployments.ddm.dev"),
                           ("create", "roles.rbac.authorization.k8s.io"), ("get", "nodes")]:
        assert not tools.can_i(verb, resource, USERS), f"operator may {verb} {resource}"


@pytest.fixture(scope="module")
def digits(tools: Tools, core: client.CoreV1Api,
           custom: client.CustomObjectsApi) -> Iterator[dict[str, Any]]:
    """The shipped example, applied with kubectl and Ready; what a user needs to call it."""
    core.create_namespace({"metadata": {"name": USERS}})
    tools.kubectl("apply", "-n", USERS, "-f", str(EXAMPLE))

    def ready() -> dict[str, Any] | None:
        status = ddm_status(custom, USERS, "digits")
        return status if status.get("phase") == "Ready" else None

    status = wait_for(ready, READY_TIMEOUT_S, "the digits DDMDeployment to be Ready",
                      lambda: pod_logs(core, SYSTEM) + pod_logs(core, USERS))

    def router_listed() -> bool:
        """Whether the endpoints controller lists the router pod (port-forward to a Service
        picks one of its ready pods)."""
        subsets = core.read_namespaced_endpoints("digits-router", USERS).subsets or []
        return any(s.addresses for s in subsets)

    wait_for(router_listed, 60, "the router's Service to list its pod")
    secret = core.read_namespaced_secret(status["routerTokenSecret"], USERS)
    token = base64.b64decode(secret.data["token"]).decode()
    forward = PortForward(tools, USERS, "service/digits-router", 8080)
    try:
        yield {"status": status, "url": forward.url, "token": token}
    finally:
        forward.close()


def test_kubectl_get_ddm_shows_it_ready(tools: Tools, digits: dict[str, Any]) -> None:
    """What `kubectl get ddm` prints (polled: on a loaded 2-core machine a readiness probe can
    time out while the JAX expert compiles, and the columns follow the probes)."""
    def table() -> str | None:
        text = tools.kubectl("get", "ddm", "-n", USERS).stdout
        header, row = text.splitlines()
        assert header.split()[:3] == ["NAME", "READY", "EXPERTS"], text
        return text if row.split()[:3] == ["digits", "True", "2/2"] else None

    wait_for(table, 120, "kubectl get ddm to show digits True 2/2")


def _decode(images_b64: list[str]) -> np.ndarray:
    return np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(b)))) for b in images_b64])


def test_the_router_draws_the_asked_digits(digits: dict[str, Any]) -> None:
    headers = {"Authorization": f"Bearer {digits['token']}"}
    assert httpx.post(f"{digits['url']}/v1/generate", json={"labels": [1]},
                      timeout=60).status_code == 401
    metrics = _hundred_digits(digits["url"], headers)
    assert metrics["accuracy"] >= 0.95, metrics


def _hundred_digits(url: str, headers: dict[str, str]) -> dict[str, Any]:
    """Ten of each digit from the router at ``url`` (two requests of 50), as the classifier
    reads them."""
    labels = np.repeat(np.arange(10), 10)
    images = []
    for half in (labels[:50], labels[50:]):
        answer = httpx.post(f"{url}/v1/generate", headers=headers, timeout=300,
                            json={"labels": half.tolist(), "steps": 40, "seed": 0})
        assert answer.status_code == 200, answer.text
        images.append(_decode(answer.json()["images"]))
    return evaluate_images(np.concatenate(images), labels)


def test_the_heterogeneous_example_serves_an_epsilon_expert_beside_a_velocity_one(
        tools: Tools, core: client.CoreV1Api, custom: client.CustomObjectsApi,
        digits: dict[str, Any]) -> None:
    """examples/heterogeneous.yaml from the image (a DDPM epsilon expert for 0-4, our velocity
    expert for 5-9): the router converts and mixes them, and the classifier reads its digits
    as it reads the all-velocity DDM's."""
    manifest = yaml.safe_load(HETEROGENEOUS.read_text())
    for expert in manifest["spec"]["experts"]:  # the real node has 2 CPUs; digits holds 1.25
        expert["resources"]["requests"]["cpu"] = "100m"
    name = manifest["metadata"]["name"]
    tools.kubectl("apply", "-n", USERS, "-f", "-", stdin=yaml.safe_dump(manifest))
    try:
        wait_for(lambda: ddm_status(custom, USERS, name).get("phase") == "Ready",
                 READY_TIMEOUT_S, f"the {name} DDMDeployment to be Ready",
                 lambda: pod_logs(core, USERS))
        wait_for(lambda: any(s.addresses for s in core.read_namespaced_endpoints(
            f"{name}-router", USERS).subsets or []), 60, "its router's Service to list its pod")
        secret = core.read_namespaced_secret(
            ddm_status(custom, USERS, name)["routerTokenSecret"], USERS)
        headers = {"Authorization": f"Bearer {base64.b64decode(secret.data['token']).decode()}"}
        forward = PortForward(tools, USERS, f"service/{name}-router", 8080)
        try:
            metrics = _hundred_digits(forward.url, headers)
        finally:
            forward.close()
        assert metrics["accuracy"] >= 0.95, metrics
    finally:  # its pods gone before the next tests ask the node for CPU
        tools.kubectl("delete", "ddm", name, "-n", USERS, "--wait=true")
        wait_for(lambda: not core.list_namespaced_pod(
            USERS, label_selector=f"app.kubernetes.io/instance={name}").items, 120,
            f"the {name} pods to be gone")


def test_every_pod_meets_the_restricted_profile(core: client.CoreV1Api, kube_client: Any,
                                               digits: dict[str, Any]) -> None:
    pods = [*core.list_namespaced_pod(SYSTEM).items, *core.list_namespaced_pod(USERS).items]
    assert len(pods) >= 4  # operator, two experts, router
    for pod in pods:
        spec = kube_client.sanitize_for_serialization(pod.spec)
        assert violations(spec) == [], pod.metadata.name


def test_every_pod_runs_on_the_real_node_from_our_images(core: client.CoreV1Api,
                                                         digits: dict[str, Any]) -> None:
    """The operator from the slim operator image, everything it creates from the CPU image."""
    image = {SYSTEM: dev_images.OPERATOR.name, USERS: dev_images.CPU.name}
    pods = [*core.list_namespaced_pod(SYSTEM).items, *core.list_namespaced_pod(USERS).items]
    for pod in pods:
        assert pod.spec.node_name == "ddm-real-0", pod.metadata.name
        (container,) = pod.spec.containers
        assert container.image == image[pod.metadata.namespace], (pod.metadata.name,
                                                                  container.image)
        assert all(s.ready for s in pod.status.container_statuses), pod.metadata.name


def test_no_token_reaches_any_log(dev_cluster: ClusterInfo, digits: dict[str, Any],
                                  core: client.CoreV1Api) -> None:
    """Neither the router's token nor any ServiceAccount token is ever logged: not in the
    containers' logs the kubelet keeps, nor in the cluster's own components' logs."""
    secrets = [digits["token"]]
    for namespace in (SYSTEM, USERS):
        for secret in core.list_namespaced_secret(namespace).items:
            if secret.type == "kubernetes.io/service-account-token":
                secrets.append(base64.b64decode(secret.data["token"]).decode())
    container_logs = node_layout(dev_cluster.state_dir).private_dir("/var/log") / "pods"
    logs = [*container_logs.rglob("*.log"), *(dev_cluster.state_dir / "logs").glob("*.log")]
    assert any(log.is_relative_to(container_logs) for log in logs)
    for log in logs:
        text = log.read_text(errors="replace")
        for secret in secrets:
            assert secret not in text, f"a token appears in {log.name}"


# -- faults on the real node ---------------------------------------------------------------------

class Load:
    """Generations sent one after another from a thread until `stop`; every answer recorded."""

    def __init__(self, url: str, token: str, labels: list[int]) -> None:
        self.statuses: list[int | str] = []
        self.seconds: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, token, labels), daemon=True)
        self._thread.start()

    def _run(self, url: str, token: str, labels: list[int]) -> None:
        headers = {"Authorization": f"Bearer {token}"}
        with httpx.Client(timeout=120) as http:
            seed = 0
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    answer = http.post(f"{url}/v1/generate", headers=headers,
                                       json={"labels": labels, "steps": 8, "seed": seed})
                    self.statuses.append(answer.status_code)
                except httpx.HTTPError as error:
                    self.statuses.append(f"{type(error).__name__}: {error}")
                self.seconds.append(time.monotonic() - started)
                seed += 1

    def stop(self) -> list[int | str]:
        self._stop.set()
        self._thread.join(180)
        return self.statuses


def expert_pods(core: client.CoreV1Api, expert: str) -> list[client.V1Pod]:
    return core.list_namespaced_pod(
        USERS, label_selector=f"ddm.dev/deployment=digits,ddm.dev/expert={expert}").items


def set_expert(custom: client.CustomObjectsApi, index: int, **fields: Any) -> None:
    """Patch one expert of the digits DDMDeployment (a JSON patch: the list is replaced)."""
    ddm = custom.get_namespaced_custom_object("ddm.dev", "v1alpha1", USERS, "ddmdeployments",
                                              "digits")
    experts = ddm["spec"]["experts"]
    experts[index].update(fields)
    custom.patch_namespaced_custom_object("ddm.dev", "v1alpha1", USERS, "ddmdeployments",
                                          "digits", {"spec": {"experts": experts}})


def ready_pods(core: client.CoreV1Api, expert: str, count: int) -> list[client.V1Pod] | None:
    pods = [p for p in expert_pods(core, expert) if p.metadata.deletion_timestamp is None
            and p.status.container_statuses and all(c.ready for c in p.status.container_statuses)]
    everyone = expert_pods(core, expert)
    return pods if len(pods) == count and len(everyone) == count else None


def kill_container(dev_cluster: ClusterInfo, pod: client.V1Pod) -> int:
    """SIGKILL every process of the pod's container, found in its cgroup on the node; returns
    how many were killed."""
    pids = container_pids(dev_cluster, pod)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    return len(pids)


def test_a_killed_expert_is_restarted_by_the_kubelet_and_no_generation_fails(
        dev_cluster: ClusterInfo, core: client.CoreV1Api, custom: client.CustomObjectsApi,
        digits: dict[str, Any]) -> None:
    """Two replicas of the 0-4 expert; one's process is SIGKILLed under load: the kubelet
    restarts the container and the router sends every generation to a live replica."""
    set_expert(custom, 0, replicas=2)
    first, _ = wait_for(lambda: ready_pods(core, "digits-0-4", 2), 300,
                        "two ready replicas of expert digits-0-4", lambda: pod_logs(core, USERS))
    wait_for(lambda: ddm_status(custom, USERS, "digits").get("phase") == "Ready", 120,
             "digits Ready with two replicas of digits-0-4")
    load = Load(digits["url"], digits["token"], [0, 1, 2, 3, 4])
    wait_for(lambda: len(load.statuses) >= 2, 120, "load to flow")
    restarts = first.status.container_statuses[0].restart_count
    started = time.monotonic()
    assert kill_container(dev_cluster, first) >= 1

    def restarted() -> bool:
        pod = core.read_namespaced_pod(first.metadata.name, USERS)
        (status,) = pod.status.container_statuses
        return status.restart_count > restarts and status.ready

    wait_for(restarted, 300, "the kubelet to restart the killed expert and find it ready",
             lambda: pod_logs(core, USERS))
    back_s = time.monotonic() - started
    statuses = load.stop()
    print(f"\nkilled expert: back and ready in {back_s:.1f} s; {len(statuses)} generations "
          f"during the fault, {sum(s != 200 for s in statuses)} failed; slowest "
          f"{max(load.seconds):.1f} s")
    assert statuses and all(s == 200 for s in statuses), statuses


def test_a_rolling_update_of_an_expert_under_load_drops_no_request(
        core: client.CoreV1Api, custom: client.CustomObjectsApi,
        digits: dict[str, Any]) -> None:
    """A spec change of the 0-4 expert rolls its pods one by one (surge first, readiness
    gated, old pods drain on SIGTERM) while generations keep coming."""
    before = {p.metadata.name for p in expert_pods(core, "digits-0-4")}
    load = Load(digits["url"], digits["token"], [0, 4, 5, 9])
    wait_for(lambda: len(load.statuses) >= 2, 120, "load to flow")
    started = time.monotonic()
    # Surge first: the new pod must fit beside the old ones. On a 2-CPU node the operator, two
    # 0-4 replicas and one 5-9 expert (500m each) and the router (250m) leave 150m.
    set_expert(custom, 0, resources={"requests": {"cpu": "100m", "memory": "512Mi"},
                                     "limits": {"memory": "1Gi"}})

    def rolled() -> bool:
        pods = ready_pods(core, "digits-0-4", len(before))
        return bool(pods) and not before & {p.metadata.name for p in pods or []}

    wait_for(rolled, 600, "the 0-4 expert's pods to be replaced",
             lambda: f"{pod_states(core, USERS)}\n{pod_logs(core, USERS)}")
    rolled_s = time.monotonic() - started
    wait_for(lambda: len(load.statuses) >= 2 + 2, 120, "load to flow after the rollout")
    statuses = load.stop()
    print(f"\nrolling update: {len(before)} pods replaced in {rolled_s:.1f} s; "
          f"{len(statuses)} generations, {sum(s != 200 for s in statuses)} failed")
    assert all(s == 200 for s in statuses), statuses


def test_servers_exit_promptly_on_sigterm_as_pid_1(dev_cluster: ClusterInfo,
                                                   core: client.CoreV1Api,
                                                   digits: dict[str, Any]) -> None:
    """Deleting a pod sends SIGTERM to the server, PID 1 of its container: it drains for the
    operator's DRAIN_S and exits 0, before the grace period would SIGKILL it (137). A
    watch on the pod sees the kubelet report the container's exit (code and when), then the
    pod's removal (containerd's exit event where the kubelet lost track of the exit:
    podwatch.TaskExits); the server's own log of its shutdown is kept for the failure
    message."""
    (deployment,) = client.AppsV1Api(core.api_client).list_namespaced_deployment(
        USERS, label_selector="ddm.dev/deployment=digits,ddm.dev/expert=digits-0-4").items
    replicas = deployment.spec.replicas
    victim = wait_for(lambda: (ready_pods(core, "digits-0-4", replicas) or [None])[0], 300,
                      "a ready, settled replica of expert digits-0-4")
    name, grace = victim.metadata.name, victim.spec.termination_grace_period_seconds
    server_log = ContainerLog(dev_cluster, victim)
    exits = TaskExits(node_layout(dev_cluster.state_dir).ctr())
    try:
        ending = delete_and_watch(core, victim, timeout_s=grace + 60, exits=exits)
    finally:
        exits.close()
    shutdown = server_log.text()
    print(f"\nSIGTERM to PID 1: container exited {ending.exit_code} after "
          f"{ending.exited_after_s} s (drain {DRAIN_S} s, grace {grace} s); pod gone "
          f"{ending.gone_after_s} s after deletion")
    explain = f"pod {name}: {ending}; its log:\n{shutdown}"
    assert ending.gone_after_s is not None, f"not deleted within {grace + 60} s; {explain}"
    assert ending.exited_after_s is not None, \
        f"neither the kubelet nor containerd reported the exit; {explain}"
    # 137 would be the SIGKILL at the end of the grace period; exiting before DRAIN_S would
    # mean it did not drain. How long after the drain it took is a figure (docs/reliability.md).
    assert ending.exit_code == 0, explain
    assert DRAIN_S <= ending.exited_after_s < grace, explain
    wait_for(lambda: ready_pods(core, "digits-0-4", replicas), 300,
             "the expert's Deployment to replace the deleted pod")


def test_an_expert_whose_checkpoint_cannot_load_is_reported_in_status(
        tools: Tools, core: client.CoreV1Api,
        custom: client.CustomObjectsApi, digits: dict[str, Any]) -> None:
    """The whole chain: the expert exits with the reason in its termination message, the
    kubelet reports the crash loop, and the operator puts the reason in the status."""
    broken = yaml.safe_load(EXAMPLE.read_text())
    broken["metadata"]["name"] = "broken"
    broken["spec"]["experts"][0]["checkpoint"]["uri"] = "image:///opt/ddm/checkpoints/missing"
    for expert in broken["spec"]["experts"]:  # the real node has 2 CPUs; digits holds 1
        expert["resources"]["requests"]["cpu"] = "100m"
    tools.kubectl("apply", "-n", USERS, "-f", "-", stdin=yaml.safe_dump(broken))

    def explained() -> str | None:
        status = ddm_status(custom, USERS, "broken")
        conditions = {c["type"]: c for c in status.get("conditions") or []}
        message = conditions.get("ExpertsReady", {}).get("message", "")
        return message if "/opt/ddm/checkpoints/missing" in message else None

    message = wait_for(explained, 240, "the status to say why expert digits-0-4 is not ready",
                       lambda: pod_logs(core, USERS))
    assert "expert digits-0-4: 0/1 ready" in message and "restarted" in message, message
    assert ddm_status(custom, USERS, "broken")["phase"] != "Ready"
    tools.kubectl("delete", "ddm", "broken", "-n", USERS, "--wait=false")


#: The namespace of the DDM whose expert is fetched, and of the store that serves it.
FETCHING = "fetch-demo"
#: The admin's cap on each fetched checkpoint (the shipped ones are under 1 MiB): the size of
#: the stager's and the expert's volumes and of their fetch steps' ephemeral-storage requests.
FETCH_CAP = 64 << 20


def _store(image: str) -> list[dict[str, Any]]:
    """An allowed checkpoint store inside the cluster: Python's own HTTP server, in our image,
    serving the shipped checkpoints read-only (a pod of the restricted profile)."""
    labels = {"app": "checkpoint-store"}
    context = {"runAsNonRoot": True, "runAsUser": 10001, "allowPrivilegeEscalation": False,
               "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
               "seccompProfile": {"type": "RuntimeDefault"}}
    pod = {"metadata": {"labels": labels}, "spec": {
        "automountServiceAccountToken": False,
        "containers": [{"name": "store", "image": image, "imagePullPolicy": "Never",
                        "command": ["python", "-m", "http.server", "8000", "--directory",
                                    "/opt/ddm/checkpoints/digits"],
                        "ports": [{"containerPort": 8000}],
                        "readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 2},
                        "resources": {"requests": {"cpu": "20m", "memory": "32Mi"}},
                        "securityContext": context}]}}
    return [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "store"},
             "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": pod}},
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "store"},
             "spec": {"selector": labels, "ports": [{"port": 8000, "targetPort": 8000}]}}]


def test_an_expert_fetched_over_http_from_an_allowed_store_serves_generations(
        tools: Tools, core: client.CoreV1Api, custom: client.CustomObjectsApi) -> None:
    """The digits DDM with its PyTorch expert fetched over plain http (pinned) from a store
    the admin allowed: the operator's stager fetches and verifies it, the expert's pod copies
    it from the stager (its own pod never reaches the store), and generations come back."""
    apps = client.AppsV1Api(core.api_client)
    (operator,) = apps.list_namespaced_deployment(
        SYSTEM, label_selector="app.kubernetes.io/component=operator").items
    image = {e.name: e.value for e in operator.spec.template.spec.containers[0].env}[
        "DDM_IMAGE_CPU"]
    core.create_namespace({"metadata": {"name": FETCHING}})
    tools.kubectl("apply", "-n", FETCHING, "-f", "-",
                  stdin=yaml.safe_dump_all(_store(image)))
    tools.kubectl("rollout", "status", "deployment/store", "-n", FETCHING, "--timeout=180s")
    store_ip = core.read_namespaced_service("store", FETCHING).spec.cluster_ip
    tools.run("helm", "upgrade", RELEASE, str(CHART), "-n", SYSTEM, *DEV_VALUES,
              "--reuse-values", "--wait", "--timeout", "5m",
              "--set", f"checkpointFetch.allowNetworks={{{store_ip}/32}}",
              "--set", f"checkpointFetch.maxBytes={FETCH_CAP}")

    fetched = yaml.safe_load(EXAMPLE.read_text())
    fetched["metadata"]["name"] = "fetched"
    config = (ROOT / "checkpoints" / "digits" / "expert-0-4" / "config.json").read_bytes()
    fetched["spec"]["experts"][0]["checkpoint"] = {
        "uri": f"http://store.{FETCHING}.svc.cluster.local:8000/expert-0-4",
        "sha256": hashlib.sha256(config).hexdigest()}
    for expert in fetched["spec"]["experts"]:  # the real node has 2 CPUs; digits holds 1
        expert["resources"]["requests"]["cpu"] = "50m"
    fetched["spec"]["router"]["resources"] = {"requests": {"cpu": "50m", "memory": "256Mi"},
                                              "limits": {"memory": "1Gi"}}
    tools.kubectl("apply", "-n", FETCHING, "-f", "-", stdin=yaml.safe_dump(fetched))
    try:
        wait_for(lambda: ddm_status(custom, FETCHING, "fetched").get("phase") == "Ready",
                 READY_TIMEOUT_S, "the DDM with a fetched expert to be Ready",
                 lambda: pod_states(core, FETCHING) + pod_logs(core, SYSTEM)
                 + pod_logs(core, FETCHING))
        pods = {p.metadata.labels.get("app.kubernetes.io/component"): p
                for p in core.list_namespaced_pod(
                    FETCHING, label_selector="ddm.dev/deployment=fetched").items}
        (fetch,) = pods["stager"].status.init_container_statuses
        assert fetch.state.terminated.exit_code == 0
        expert = core.list_namespaced_pod(
            FETCHING, label_selector="ddm.dev/expert=digits-0-4").items[0]
        (copied,) = expert.status.init_container_statuses
        assert copied.name == "copy-checkpoint" and copied.state.terminated.exit_code == 0
        assert "store." not in " ".join(expert.spec.init_containers[0].command)
        assert expert.spec.node_name == "ddm-real-0"

        token = base64.b64decode(core.read_namespaced_secret(ddm_status(
            custom, FETCHING, "fetched")["routerTokenSecret"], FETCHING).data["token"]).decode()
        forward = PortForward(tools, FETCHING, "service/fetched-router", 8080)
        try:
            answer = httpx.post(f"{forward.url}/v1/generate", timeout=300,
                                headers={"Authorization": f"Bearer {token}"},
                                json={"labels": [0, 1, 2, 3, 4], "steps": 40, "seed": 0})
        finally:
            forward.close()
        assert answer.status_code == 200, answer.text
        drawn = evaluate_images(_decode(answer.json()["images"]), np.arange(5))
        assert drawn["accuracy"] >= 0.8, drawn
    finally:
        tools.kubectl("delete", "namespace", FETCHING, "--wait=false")


def release_objects(kube_client: Any) -> list[str]:
    """Every object the release labelled that still exists (kind/namespace/name)."""
    rbac = client.RbacAuthorizationV1Api(kube_client)
    core = client.CoreV1Api(kube_client)
    apps = client.AppsV1Api(kube_client)
    found = []
    for kind, lister in [
            ("ClusterRole", rbac.list_cluster_role),
            ("ClusterRoleBinding", rbac.list_cluster_role_binding),
            ("Role", rbac.list_role_for_all_namespaces),
            ("RoleBinding", rbac.list_role_binding_for_all_namespaces),
            ("ServiceAccount", core.list_service_account_for_all_namespaces),
            ("Deployment", apps.list_deployment_for_all_namespaces),
            ("Pod", core.list_pod_for_all_namespaces)]:
        for item in lister(label_selector=f"app.kubernetes.io/instance={RELEASE}").items:
            name = item.metadata.labels.get("app.kubernetes.io/name")
            if kind != "Pod" or name == "ddm-operator":
                found.append(f"{kind}/{item.metadata.namespace or ''}/{item.metadata.name}")
    return sorted(found)


def test_helm_upgrade_to_watched_namespaces_swaps_the_rbac(
        tools: Tools, kube_client: Any, digits: dict[str, Any],
        core: client.CoreV1Api) -> None:
    tools.run("helm", "upgrade", RELEASE, str(CHART), "-n", SYSTEM, *DEV_VALUES, "--wait",
              "--timeout", "5m",
              "--set", f"watchNamespaces={{{USERS}}}", "--set", "networkPolicy.enabled=true")
    after = release_objects(kube_client)
    assert f"Role/{USERS}/{RELEASE}-ddm-operator" in after
    assert f"RoleBinding/{USERS}/{RELEASE}-ddm-operator" in after
    assert tools.can_i("watch", "ddmdeployments.ddm.dev", USERS)
    assert not tools.can_i("watch", "ddmdeployments.ddm.dev", "default")
    # The new operator (Recreate: the old one is gone first) serves the DDM under the Role:
    # it adds the NetworkPolicies the new values ask for.
    networking = client.NetworkingV1Api(kube_client)
    wait_for(lambda: networking.list_namespaced_network_policy(
        USERS, label_selector="ddm.dev/deployment=digits").items,
        120, "the upgraded operator to add the digits NetworkPolicies",
        lambda: pod_logs(core, SYSTEM))
    operators = [o for o in after if o.startswith("Pod/")]
    assert len(operators) == 1, after


def test_helm_uninstall_leaves_nothing_of_the_release(
        tools: Tools, kube_client: Any, custom: client.CustomObjectsApi) -> None:
    tools.run("helm", "uninstall", RELEASE, "-n", SYSTEM, "--wait", "--timeout", "3m")
    wait_for(lambda: release_objects(kube_client) == [], 120,
             "every object of the release to be deleted")
    # The documented CRD policy: the CRD and the user's DDMDeployments stay.
    extensions = client.ApiextensionsV1Api(kube_client)
    assert extensions.read_custom_resource_definition("ddmdeployments.ddm.dev")
    assert ddm_status(custom, USERS, "digits")
