"""The operator against a real control plane (the dev cluster), running in this process.

``run_operator`` runs in a thread for the module (cluster-wide, its own event loop, stopped by
a flag; a test that needs other operator settings restarts it, as a Helm upgrade would). The
dev cluster has no kubelet: the real scheduler binds pods to the fake accelerator
nodes and they stay Pending, so where a test needs ready pods it plays the kubelet and writes
the pods' status itself (the ReplicaSet and Deployment controllers and the endpoints
controller then do the rest, as they would). Every wait polls the API with a deadline.
"""

from __future__ import annotations

import base64
import copy
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from podsecurity import violations
from waiting import wait_for

from ddm.checkpoints.uri import REMOTE_SCHEMES
from ddm.operator import names
from ddm.operator.config import OperatorConfig
from ddm.operator.runner import run_operator
from ddm.deploy.router_config import RouterConfigFile
from tests.support.operator_process import CRD_FILE, install_crd

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "ddm.dev", "v1alpha1", "ddmdeployments"
OWNER_LABEL = "ddm.dev/deployment"
HASH = "ddm.dev/spec-hash"




class Cluster:
    """Plain-dict reads and writes through the typed clients (independent of the operator)."""

    def __init__(self, api_client: Any) -> None:
        self.custom = client.CustomObjectsApi(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.networking = client.NetworkingV1Api(api_client)

    @staticmethod
    def _json(response: Any) -> Any:
        return json.loads(response.data)

    def _api(self, kind: str) -> tuple[Any, str]:
        return {"Deployment": (self.apps, "deployment"), "ReplicaSet": (self.apps, "replica_set"),
                "Service": (self.core, "service"), "ConfigMap": (self.core, "config_map"),
                "Pod": (self.core, "pod"), "Endpoints": (self.core, "endpoints"),
                "Secret": (self.core, "secret"),
                "NetworkPolicy": (self.networking, "network_policy")}[kind]

    def get(self, kind: str, namespace: str, name: str) -> dict | None:
        api, suffix = self._api(kind)
        try:
            return self._json(getattr(api, f"read_namespaced_{suffix}")(
                name, namespace, _preload_content=False))
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, selector: str) -> list[dict]:
        api, suffix = self._api(kind)
        return self._json(getattr(api, f"list_namespaced_{suffix}")(
            namespace, label_selector=selector, _preload_content=False))["items"]

    def create_ddm(self, namespace: str, name: str, spec: dict) -> dict:
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DDMDeployment",
                "metadata": {"name": name}, "spec": spec}
        return self.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL,
                                                           body)

    def ddm(self, namespace: str, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)

    def patch_ddm_spec(self, namespace: str, name: str, spec: dict) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                   {"spec": spec})

    def events(self, namespace: str, name: str | None = None) -> list[dict]:
        """The events about ``name`` (None: about anything in the namespace)."""
        selector = f"involvedObject.name={name}" if name else None
        return self._json(self.core.list_namespaced_event(
            namespace, field_selector=selector, _preload_content=False))["items"]

    def children(self, namespace: str, owner: str) -> dict[tuple[str, str], dict]:
        return {(kind, item["metadata"]["name"]): item
                for kind in ("Deployment", "Service", "ConfigMap")
                for item in self.list(kind, namespace, f"{OWNER_LABEL}={owner}")}


@pytest.fixture(scope="module")
def cluster(kube_client: Any) -> Cluster:
    return Cluster(kube_client)


@pytest.fixture(scope="module")
def crd(kube_client: Any) -> dict:
    """The CRD from crds/, installed and served."""
    install_crd(kube_client)
    return yaml.safe_load(CRD_FILE.read_text())


class OperatorThread:
    """The operator, cluster-wide, in a thread of this process; restartable with other
    settings (``OperatorConfig``), as a Helm upgrade restarts its pod with a new environment."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.config: OperatorConfig | None = None

    def start(self, config: OperatorConfig) -> None:
        assert self._thread is None, "already running"
        self._stop, ready = threading.Event(), threading.Event()
        self._thread = threading.Thread(
            target=run_operator, name="ddm-operator", daemon=True,
            kwargs={"kubeconfig": self.kubeconfig, "liveness_port": None,
                    "operator_config": config, "configure_logging": False,
                    "stop_flag": self._stop, "ready_flag": ready})
        self._thread.start()
        assert ready.wait(60), "the operator did not start"
        self.config = config

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the operator did not stop"
        self._thread = None

    def restart(self, config: OperatorConfig) -> None:
        """Run with ``config`` (nothing to do when it already does)."""
        if self._thread is not None and config == self.config:
            return
        self.stop()
        self.start(config)


#: The operator's settings when the environment sets none (the chart's are tested apart).
DEFAULT_CONFIG = OperatorConfig.from_env({})
#: How long a test waits for the operator, or the cluster's controllers, to act: a bound on a
#: hang, not a speed target (on a loaded 2-core CI machine one reconcile took over 15 s).
OPERATOR_DEADLINE_S = 60


@pytest.fixture(scope="module")
def operator(dev_cluster: Any, crd: dict) -> Iterator[OperatorThread]:
    """The operator with default settings; stopped (and checked stopped) at the end."""
    running = OperatorThread(dev_cluster.kubeconfig)
    running.start(DEFAULT_CONFIG)
    try:
        yield running
    finally:
        running.stop()


def _expert(name: str, classes: list[int], **fields: Any) -> dict:
    return {"name": name, "checkpoint": {"uri": f"image:///models/{name}"}, "classes": classes,
            **fields}


CPU_SPEC = {"sampling": {"strategy": "oracle"},
            "experts": [_expert("a", [0, 1, 2]), _expert("b", [3, 4, 5, 6]),
                        _expert("c", [7, 8, 9])]}
MIXED_SPEC = {"sampling": {"strategy": "oracle", "steps": 30}, "experts": [
    _expert("low", [0, 1, 2, 3], accelerator={"type": "neuron", "count": 1}),
    {**_expert("mid", [4, 5, 6], framework="jax",
               accelerator={"type": "nvidia", "count": 1, "product": "NVIDIA-H100-80GB-HBM3"}),
     "checkpoint": {"uri": "s3://ddm-models/mid"}},
    _expert("high", [7, 8, 9]),
]}
#: expert -> (extended resource it must get, or None for cpu)
MIXED_RESOURCES = {"low": "aws.amazon.com/neuron", "mid": "nvidia.com/gpu", "high": None}


def _expected_children(owner: str, experts: list[str], *, stager: bool = False
                       ) -> set[tuple[str, str]]:
    """``stager``: the DDM fetches a checkpoint, so it has a checkpoint stager too."""
    out = {("ConfigMap", f"{owner}-router-config"), ("Deployment", f"{owner}-router"),
           ("Service", f"{owner}-router")}
    if stager:
        out |= {("Deployment", f"{owner}-stager"), ("Service", f"{owner}-stager")}
    for expert in experts:
        out |= {("Deployment", f"{owner}-expert-{expert}"), ("Service", f"{owner}-expert-{expert}")}
    return out


def _fetches(spec: dict) -> bool:
    """Whether a spec names a checkpoint to fetch (from a URI or the user's Secret)."""
    checkpoints = [e["checkpoint"] for e in spec["experts"]]
    checkpoints += [spec.get("router", {}).get("checkpoint") or {}]
    return any("uriFrom" in c or c.get("uri", "").split("://")[0] in REMOTE_SCHEMES
               for c in checkpoints)


def _deploy(cluster: Cluster, namespace: str, name: str, spec: dict) -> dict:
    """Create a DDMDeployment and wait for all its children; returns them."""
    cluster.create_ddm(namespace, name, spec)
    expected = _expected_children(name, [e["name"] for e in spec["experts"]],
                                  stager=_fetches(spec))

    def complete() -> dict | None:
        children = cluster.children(namespace, name)
        return children if set(children) == expected else None

    def explain() -> str:
        return (f"children: {sorted(cluster.children(namespace, name))}; "
                f"status: {cluster.ddm(namespace, name).get('status')}")
    return wait_for(complete, OPERATOR_DEADLINE_S, f"the children of {name}", explain)


def _bound_pods(cluster: Cluster, namespace: str, selector: str, count: int) -> list[dict]:
    def bound() -> list[dict] | None:
        pods = [p for p in cluster.list("Pod", namespace, selector)
                if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")]
        return pods if len(pods) == count else None
    return wait_for(bound, OPERATOR_DEADLINE_S, f"{count} pods ({selector}) bound to nodes")


@pytest.mark.usefixtures("operator")
def test_a_mixed_ddm_gets_its_children_scheduled_and_a_status(cluster: Cluster,
                                                               kube_namespace: str) -> None:
    ns = kube_namespace
    children = _deploy(cluster, ns, "mixed", MIXED_SPEC)
    owner = cluster.ddm(ns, "mixed")
    for child in children.values():
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "DDMDeployment", "mixed", owner["metadata"]["uid"], True)
        assert HASH in child["metadata"]["annotations"]
    for expert, resource in MIXED_RESOURCES.items():
        pod = children[("Deployment", f"mixed-expert-{expert}")]["spec"]["template"]["spec"]
        limits = pod["containers"][0].get("resources", {}).get("limits", {})
        assert limits == ({resource: "1"} if resource else {})
        service = children[("Service", f"mixed-expert-{expert}")]["spec"]
        assert service["clusterIP"] == "None"
        (pod_on_node,) = _bound_pods(cluster, ns, f"ddm.dev/expert={expert}", 1)
        node = cluster.core.read_node(pod_on_node["spec"]["nodeName"])
        if resource:
            assert int(node.status.allocatable.get(resource, "0")) >= 1, node.metadata.name
        else:
            assert not node.spec.taints, node.metadata.name  # the CPU node
    mid = children[("Deployment", "mixed-expert-mid")]["spec"]["template"]["spec"]
    assert mid["initContainers"][0]["command"][:2] == ["ddm", "fetch-checkpoint"]
    (stager,) = _bound_pods(cluster, ns, f"{OWNER_LABEL}=mixed,{names.COMPONENT_LABEL}=stager",
                            1)
    assert not violations(stager["spec"])
    config = RouterConfigFile.from_yaml(
        children[("ConfigMap", "mixed-router-config")]["data"]["router.yaml"])
    assert [e.discovery.dns for e in config.experts] == [
        f"mixed-expert-{e}.{ns}.svc.cluster.local" for e in ("low", "mid", "high")]

    def reported() -> dict | None:
        status = cluster.ddm(ns, "mixed").get("status") or {}
        return status if status.get("observedGeneration") == 1 else None
    status = wait_for(reported, OPERATOR_DEADLINE_S, "the status")
    assert status["phase"] == "Pending" and status["expertsReady"] == "0/3"
    assert status["routerURL"] == f"http://mixed-router.{ns}.svc:8080"
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "False", "SpecValid": "True", "ExpertsReady": "False", "RouterReady": "False"}
    assert all(c["reason"] and c["message"] and c["lastTransitionTime"]
               for c in status["conditions"])
    assert {e["name"]: e["accelerator"] for e in status["experts"]} == {
        "low": "neuron x1", "mid": "nvidia x1 (NVIDIA-H100-80GB-HBM3)", "high": "cpu"}
    wait_for(lambda: "Created" in {e["reason"] for e in cluster.events(ns, "mixed")},
             OPERATOR_DEADLINE_S, "Created events")


#: A text DDM: the decoder and router network in pods of their own on accelerators, the text
#: encoder in the router's pod.
TEXT_SPEC = {
    "conditioning": "text",
    "sampling": {"strategy": "top2", "steps": 50, "guidanceScale": 7.5},
    "textEncoder": {"checkpoint": {"uri": "image:///opt/paris/text_encoder"}},
    "decoder": {"checkpoint": {"uri": "image:///opt/paris/decoder"}, "placement": "separate",
                "accelerator": {"type": "nvidia"}, "precision": "bfloat16"},
    "router": {"checkpoint": {"uri": "image:///opt/paris/router"},
               "network": {"placement": "separate", "accelerator": {"type": "neuron"}}},
    "experts": [{"name": "e0", "accelerator": {"type": "nvidia"}, "precision": "bfloat16",
                 "checkpoint": {"uri": "image:///opt/paris/expert_0"}},
                {"name": "e1", "checkpoint": {"uri": "image:///opt/paris/expert_1"}}],
}


@pytest.mark.usefixtures("operator")
def test_a_text_ddm_gets_a_deployment_per_separate_stage(cluster: Cluster,
                                                         kube_namespace: str) -> None:
    ns = kube_namespace
    cluster.create_ddm(ns, "text", TEXT_SPEC)
    stages = {("Deployment", "text-stage-decoder"), ("Service", "text-stage-decoder"),
              ("Deployment", "text-stage-router-network"),
              ("Service", "text-stage-router-network")}
    expected = _expected_children("text", ["e0", "e1"]) | stages
    children = wait_for(lambda: (c if set(c := cluster.children(ns, "text")) == expected
                                 else None), OPERATOR_DEADLINE_S, "the children of text")
    # The API server kept every new field and defaulted no numClasses onto the text DDM.
    stored = cluster.ddm(ns, "text")["spec"]
    assert "numClasses" not in stored and stored["decoder"]["placement"] == "separate"
    for role, resource in (("decoder", "nvidia.com/gpu"),
                           ("router-network", "aws.amazon.com/neuron")):
        pod = children[("Deployment", f"text-stage-{role}")]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["command"][:3] == ["ddm", "serve", "stage"]
        assert container["resources"]["limits"] == {resource: "1"}
        (bound,) = _bound_pods(cluster, ns, f"{names.STAGE_LABEL}={role}", 1)
        node = cluster.core.read_node(bound["spec"]["nodeName"])
        assert int(node.status.allocatable.get(resource, "0")) >= 1, node.metadata.name
    config = RouterConfigFile.from_yaml(
        children[("ConfigMap", "text-router-config")]["data"]["router.yaml"])
    assert config.conditioning == "text" and config.sampling.guidance_scale == 7.5
    assert config.text_encoder.checkpoint == "/opt/paris/text_encoder"
    assert config.decoder.discovery.dns == f"text-stage-decoder.{ns}.svc.cluster.local"

    def reported() -> dict | None:
        status = cluster.ddm(ns, "text").get("status") or {}
        return status if status.get("stages") else None
    status = wait_for(reported, OPERATOR_DEADLINE_S, "the stages in the status")
    assert [(s["name"], s["accelerator"], s["readyReplicas"]) for s in status["stages"]] == [
        ("decoder", "nvidia x1", 0), ("router-network", "neuron x1", 0)]
    assert {c["type"]: c["status"] for c in status["conditions"]}["StagesReady"] == "False"


@pytest.mark.usefixtures("operator")
def test_kubectl_get_ddm_shows_the_printer_columns(cluster: Cluster, kube_namespace: str
                                                   ) -> None:
    _deploy(cluster, kube_namespace, "columns", CPU_SPEC)
    wait_for(lambda: cluster.ddm(kube_namespace, "columns").get("status"),
             OPERATOR_DEADLINE_S, "a status")
    # What kubectl asks for: the server renders the CRD's printer columns as a Table.
    response = cluster.custom.list_namespaced_custom_object(
        GROUP, VERSION, kube_namespace, PLURAL, _preload_content=False,
        _headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"})
    table = json.loads(response.data)
    assert [c["name"] for c in table["columnDefinitions"]] == [
        "Name", "Ready", "Experts", "Replicas", "Strategy", "Phase", "Age"]
    assert table["rows"][0]["cells"][:6] == ["columns", "False", "0/3", "a 0/1, b 0/1, c 0/1",
                                             "oracle", "Pending"]


def _mark_ready(cluster: Cluster, pod: dict, ip: str) -> None:
    """Write what a kubelet would for a started, ready container (there is no kubelet)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status = {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
        "conditions": [{"type": kind, "status": "True", "lastTransitionTime": now}
                       for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
        "containerStatuses": [{"name": c["name"], "ready": True, "started": True,
                               "restartCount": 0, "image": c["image"], "imageID": "",
                               "state": {"running": {"startedAt": now}}}
                              for c in pod["spec"]["containers"]],
    }
    cluster.core.patch_namespaced_pod_status(pod["metadata"]["name"],
                                             pod["metadata"]["namespace"], {"status": status})


@pytest.mark.usefixtures("operator")
def test_the_status_follows_the_pods_readiness(cluster: Cluster, kube_namespace: str) -> None:
    ns = kube_namespace
    spec = copy.deepcopy(CPU_SPEC)
    spec["experts"][1]["replicas"] = 2
    _deploy(cluster, ns, "ready", spec)
    pods = _bound_pods(cluster, ns, f"{OWNER_LABEL}=ready", 5)  # 4 expert pods, 1 router pod
    for index, pod in enumerate(pods):
        _mark_ready(cluster, pod, f"198.18.1.{index + 10}")

    def ready() -> dict | None:
        status = cluster.ddm(ns, "ready").get("status") or {}
        return status if status.get("phase") == "Ready" else None
    status = wait_for(ready, OPERATOR_DEADLINE_S, "phase Ready")
    assert status["expertsReady"] == "3/3"
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "True", "SpecValid": "True", "ExpertsReady": "True", "RouterReady": "True"}
    assert {e["name"]: e["readyReplicas"] for e in status["experts"]} == {"a": 1, "b": 2, "c": 1}
    # The router's DNS name for expert b resolves to both of its ready replicas.
    b_ips = {p["status"]["podIP"] for p in cluster.list("Pod", ns, "ddm.dev/expert=b")
             if "status" in p and p["status"].get("podIP")}
    endpoints = wait_for(lambda: (cluster.get("Endpoints", ns, "ready-expert-b") or {}).get(
        "subsets"), OPERATOR_DEADLINE_S, "endpoints of expert b")
    assert {a["ip"] for s in endpoints for a in s.get("addresses", [])} == b_ips


def _one_gpu_node(cluster: Cluster, name: str) -> dict[str, str]:
    """A node of one GPU for one test: tainted so that only the pods that tolerate its own
    taint go there, and labelled for them to pick it. Returns the toleration and selector
    such a pod needs."""
    from ddm_devcluster.nodes import FakeNode, build_node

    mark = {"key": "ddm.dev/test-node", "value": name, "effect": "NoSchedule"}
    node = build_node(FakeNode(name=name, capacity={
        "cpu": "16", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": "1"},
        labels={"ddm.dev/test-node": name},
        taints=({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}, mark)),
        kubelet_version="v1.20.0", now=datetime.now(timezone.utc))
    created = cluster._json(cluster.core.create_node(node, _preload_content=False))
    # The API server's admission taints a new node not-ready; no kubelet is here to lift it.
    taints = [t for t in created["spec"]["taints"]
              if t["key"] != "node.kubernetes.io/not-ready"]
    cluster.core.patch_node(name, {"spec": {"taints": taints}})
    return mark


def _statuses_since(cluster: Cluster, namespace: str, name: str, resource_version: str
                    ) -> list[dict]:
    """Every status DDMDeployment ``name`` was written with after ``resource_version``, in
    order (a watch from there, ended by its timeout)."""
    response = cluster.custom.list_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, watch=True, resource_version=resource_version,
        field_selector=f"metadata.name={name}", timeout_seconds=2, _preload_content=False)
    events = [json.loads(line) for line in response.read().decode().splitlines() if line]
    return [e["object"].get("status") or {} for e in events if e["type"] == "MODIFIED"]


@pytest.mark.usefixtures("operator")
def test_a_pool_on_its_nodes_only_gpu_is_updated_without_a_second_gpu(
        cluster: Cluster, kube_namespace: str) -> None:
    """The cluster has no GPU to spare (a DDM on as few GPUs as its weights need): an update
    of the pool must not wait for one, as a new pod made beside the old one would. The old
    pod is asked to go first; once it is gone the new one takes the GPU; the DDM is not Ready
    between the two, and Ready again on its new spec."""
    ns, node = kube_namespace, f"gpu-{kube_namespace}"
    mark = _one_gpu_node(cluster, node)
    try:
        spec = {"sampling": {"strategy": "oracle"}, "pools": [{
            "name": "gpu", "accelerator": {"type": "nvidia"}, "maxBatch": 8,
            "nodeSelector": {"ddm.dev/test-node": node},
            "tolerations": [{**mark, "operator": "Equal"}]}],
            "experts": [_expert("a", [0, 1, 2, 3, 4], pool="gpu"),
                        _expert("b", [5, 6, 7, 8, 9], pool="gpu")]}
        cluster.create_ddm(ns, "one", spec)
        (old,) = _bound_pods(cluster, ns, "ddm.dev/pool=gpu", 1)
        assert old["spec"]["nodeName"] == node
        (router,) = _bound_pods(cluster, ns, "app.kubernetes.io/component=router", 1)
        _mark_ready(cluster, old, "198.18.3.10")
        _mark_ready(cluster, router, "198.18.3.11")

        def phase() -> str | None:
            return (cluster.ddm(ns, "one").get("status") or {}).get("phase")
        wait_for(lambda: phase() == "Ready", OPERATOR_DEADLINE_S, "phase Ready")

        before = cluster.ddm(ns, "one")["metadata"]["resourceVersion"]
        spec["pools"][0]["maxBatch"] = 16
        cluster.patch_ddm_spec(ns, "one", spec)

        def old_pod_going() -> dict | None:
            pod = cluster.get("Pod", ns, old["metadata"]["name"])
            return pod if pod and pod["metadata"].get("deletionTimestamp") else None
        wait_for(old_pod_going, OPERATOR_DEADLINE_S, "the old pool pod asked to go first",
                 lambda: str([(p["metadata"]["name"], p["status"].get("conditions"))
                              for p in cluster.list("Pod", ns, "ddm.dev/pool=gpu")]))

        def pools_condition() -> dict:
            status = cluster.ddm(ns, "one").get("status") or {}
            return next((c for c in status.get("conditions", []) if c["type"] == "PoolsReady"),
                        {})
        # The new pod waits for the GPU the old one holds until it has gone.
        wait_for(lambda: (c := pools_condition()).get("status") == "False" and c[
            "message"].startswith("pool gpu: 0/1 ready"), OPERATOR_DEADLINE_S,
            "PoolsReady False while the old pod goes", pools_condition)
        assert phase() != "Ready"
        # No status written since the change said the new spec was ready while it was not
        # (the run that applied it once reported the Deployment as it was before).
        written = _statuses_since(cluster, ns, "one", before)
        assert any(s.get("observedGeneration") == 2 for s in written), written
        assert not [s for s in written if s.get("observedGeneration") == 2
                    and s.get("phase") == "Ready"], written

        # What the kubelet does once the old container has stopped: the pod object goes.
        cluster.core.delete_namespaced_pod(old["metadata"]["name"], ns, grace_period_seconds=0)
        new = wait_for(lambda: [p for p in _bound_pods(cluster, ns, "ddm.dev/pool=gpu", 1)
                                if p["metadata"]["name"] != old["metadata"]["name"]],
                       OPERATOR_DEADLINE_S, "the new pool pod on the GPU")[0]
        assert new["spec"]["nodeName"] == node
        command = new["spec"]["containers"][0]["command"]
        assert command[command.index("--max-batch") + 1] == "16"
        _mark_ready(cluster, new, "198.18.3.12")
        wait_for(lambda: phase() == "Ready" and pools_condition().get("status") == "True",
                 OPERATOR_DEADLINE_S, "Ready on the new spec")
        assert cluster.ddm(ns, "one")["status"]["observedGeneration"] == 2
    finally:
        cluster.core.delete_node(node, _preload_content=False)


SHA_MISMATCH = ("checkpoint /models/expert-a: weights.safetensors has sha256 9f2c..., "
                "config.json records 41d0...: sha256 mismatch")


def _crash_loop(cluster: Cluster, pod: dict, message: str, restarts: int) -> None:
    """Write what a kubelet would for a container that exits 1 after writing ``message`` to
    its termination-message file, and is being restarted with a back-off."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status = {
        "phase": "Running", "podIP": "198.18.2.10", "podIPs": [{"ip": "198.18.2.10"}],
        "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                       {"type": "Ready", "status": "False", "lastTransitionTime": now,
                        "reason": "ContainersNotReady"}],
        "containerStatuses": [{
            "name": c["name"], "ready": False, "started": False, "restartCount": restarts,
            "image": c["image"], "imageID": "",
            "state": {"waiting": {"reason": "CrashLoopBackOff",
                                  "message": "back-off 40s restarting failed container"}},
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message,
                                         "startedAt": now, "finishedAt": now}},
        } for c in pod["spec"]["containers"]],
    }
    cluster.core.patch_namespaced_pod_status(pod["metadata"]["name"],
                                             pod["metadata"]["namespace"], {"status": status})


@pytest.mark.usefixtures("operator")
def test_the_status_says_why_an_expert_is_not_ready(cluster: Cluster,
                                                    kube_namespace: str) -> None:
    """A checkpoint that fails to load (a crash loop) and a pod no node can take (the real
    scheduler: no node has 16 GPUs), each reported with the reason the pod gives."""
    ns = kube_namespace
    spec = copy.deepcopy(CPU_SPEC)
    spec["experts"][2].update(accelerator={"type": "nvidia", "count": 8}, replicas=2)
    _deploy(cluster, ns, "why", spec)
    (pod,) = _bound_pods(cluster, ns, "ddm.dev/expert=a", 1)
    template = cluster.get("Deployment", ns, "why-expert-a")["spec"]["template"]["spec"]
    assert template["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"
    _crash_loop(cluster, pod, SHA_MISMATCH, restarts=3)

    def explained() -> dict | None:
        status = cluster.ddm(ns, "why").get("status") or {}
        experts = {e["name"]: e for e in status.get("experts", [])}
        return experts if {"a", "c"} <= {n for n, e in experts.items() if "reason" in e} \
            else None
    experts = wait_for(explained, OPERATOR_DEADLINE_S, "reasons for experts a and c")
    assert experts["a"]["reason"] == "CrashLoopBackOff"
    assert experts["a"]["message"] == (
        f"container expert restarted 3 times; last exit 1: {SHA_MISMATCH}")
    assert experts["c"]["reason"] == "Unschedulable"
    assert "Insufficient nvidia.com/gpu" in experts["c"]["message"]
    assert "reason" not in experts["b"]
    condition = next(c for c in cluster.ddm(ns, "why")["status"]["conditions"]
                     if c["type"] == "ExpertsReady")
    assert condition["status"] == "False"
    assert condition["message"].startswith(
        f"expert a: 0/1 ready: container expert restarted 3 times; last exit 1: {SHA_MISMATCH}; "
        "expert c: ")


@pytest.mark.usefixtures("operator")
def test_fields_the_schema_does_not_know_never_reach_a_pod(cluster: Cluster,
                                                           kube_namespace: str) -> None:
    """The API server prunes unknown fields (the spec has no env, command or host settings),
    so an injected env, command or hostNetwork is dropped before the operator sees it."""
    ns = kube_namespace
    spec = copy.deepcopy(CPU_SPEC)
    spec["experts"][0].update(env=[{"name": "LD_PRELOAD", "value": "/tmp/evil.so"}],
                              command=["sh", "-c", "id"], hostNetwork=True,
                              securityContext={"privileged": True})
    spec["router"] = {"hostPID": True, "volumes": [{"name": "root", "hostPath": {"path": "/"}}]}
    _deploy(cluster, ns, "pruned", spec)
    stored = cluster.ddm(ns, "pruned")["spec"]
    # Only the fields given: an expert's replicas and accelerator default in the spec's reader,
    # not the schema, since a pooled expert must carry none (issue 37).
    assert set(stored["experts"][0]) == {"name", "checkpoint", "classes", "framework"}
    assert set(stored["router"]) == {"replicas", "contextCacheBytes"}  # the schema's defaults
    for name in ("pruned-expert-a", "pruned-router"):
        pod = cluster.get("Deployment", ns, name)["spec"]["template"]["spec"]
        text = json.dumps(pod)
        assert "LD_PRELOAD" not in text and "hostNetwork" not in text and "hostPID" not in text
        assert pod["containers"][0]["command"][:2] == ["ddm", "serve"]
        assert violations(pod) == []


@pytest.mark.usefixtures("operator")
def test_router_authentication_creates_its_two_immutable_secrets_once(
        cluster: Cluster, kube_namespace: str) -> None:
    """The public token (mounted into the router alone) and the experts' token (the router
    and the experts): immutable, named after the DDM's uid, created once, kept across
    reconciles, and garbage-collected with the DDM."""
    ns = kube_namespace
    spec = {**copy.deepcopy(CPU_SPEC), "router": {"auth": {}}}
    _deploy(cluster, ns, "auth", spec)
    owner = cluster.ddm(ns, "auth")
    uid = owner["metadata"]["uid"]
    public, private = names.router_token_name("auth", uid), names.expert_token_name("auth", uid)
    secrets, tokens = {}, {}
    for name in (public, private):
        secret = secrets[name] = wait_for(lambda: cluster.get("Secret", ns, name),
                                            OPERATOR_DEADLINE_S, name)
        (ref,) = secret["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("DDMDeployment", uid, True)
        assert secret["type"] == "Opaque" and set(secret["data"]) == {"token"}
        assert secret["immutable"] is True
        tokens[name] = base64.b64decode(secret["data"]["token"]).decode()
        assert len(tokens[name]) == 43  # 32 random bytes, URL-safe base64 without padding
    assert tokens[public] != tokens[private]

    pod = cluster.get("Deployment", ns, "auth-router")["spec"]["template"]["spec"]
    for volume, secret in (("router-token", public), ("expert-token", private)):
        assert {"name": volume, "secret": {
            "secretName": secret, "defaultMode": 0o440,
            "items": [{"key": "token", "path": "token"}]}} in pod["volumes"]
    for expert in ("a", "b", "c"):
        text = json.dumps(cluster.get("Deployment", ns, f"auth-expert-{expert}"))
        assert private in text and public not in text
    config = RouterConfigFile.from_yaml(
        cluster.get("ConfigMap", ns, "auth-router-config")["data"]["router.yaml"])
    assert config.auth.token_file == "/var/run/secrets/ddm/router-token/token"
    assert config.auth.expert_token_file == "/var/run/secrets/ddm/expert-token/token"
    status = wait_for(lambda: cluster.ddm(ns, "auth").get("status"),
                      OPERATOR_DEADLINE_S, "a status")
    assert status["routerTokenSecret"] == public
    assert sorted(status["tokenSecrets"]) == sorted([public, private])
    assert status["routerURL"] == f"http://auth-router.{ns}.svc:8080"
    assert not any(token in json.dumps(status) for token in tokens.values())

    spec["router"]["replicas"] = 2  # a change, so the operator reconciles again
    cluster.patch_ddm_spec(ns, "auth", spec)
    wait_for(lambda: (cluster.ddm(ns, "auth").get("status") or {}).get(
        "observedGeneration") == 2, OPERATOR_DEADLINE_S, "observedGeneration 2")
    assert cluster.ddm(ns, "auth")["status"]["phase"] != "Failed"  # its own: not "planted"
    for name, secret in secrets.items():
        again = cluster.get("Secret", ns, name)
        assert (again["metadata"]["uid"], again["metadata"]["resourceVersion"],
                again["data"]) == (secret["metadata"]["uid"],
                                   secret["metadata"]["resourceVersion"], secret["data"])
    assert [e for e in cluster.events(ns, "auth") if "Secret" in e["message"]
            and e["reason"] == "Created"] != []

    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "auth")
    for name in (public, private):
        wait_for(lambda: cluster.get("Secret", ns, name) is None, 60,
                 "the garbage collector to delete the Secrets")


def test_network_policies_follow_the_operators_setting(operator: OperatorThread,
                                                       cluster: Cluster,
                                                       kube_namespace: str) -> None:
    ns = kube_namespace
    try:
        scrapers = ({"namespaceSelector": {"matchLabels": {"team": "monitoring"}},
                     "podSelector": {"matchLabels": {"app": "prometheus"}}},
                    {"ipBlock": {"cidr": "10.9.0.0/16", "except": ["10.9.1.0/24"]}})
        operator.restart(OperatorConfig(images=DEFAULT_CONFIG.images, network_policy=True,
                                        metrics_from=scrapers))
        _deploy(cluster, ns, "np", CPU_SPEC)
        policies = wait_for(lambda: {p["metadata"]["name"]: p for p in cluster.list(
            "NetworkPolicy", ns, f"{OWNER_LABEL}=np")} or None,
            OPERATOR_DEADLINE_S, "NetworkPolicies")
        assert set(policies) == {"np-experts", "np-router"}  # image:// only: no stager
        pods = _bound_pods(cluster, ns, f"{OWNER_LABEL}=np", 4)

        def selected(selector: dict) -> set[str]:
            return {p["metadata"]["name"] for p in pods
                    if selector["matchLabels"].items() <= p["metadata"]["labels"].items()}
        experts = {p["metadata"]["name"] for p in pods if "-expert-" in p["metadata"]["name"]}
        routers = {p["metadata"]["name"] for p in pods} - experts
        expert_policy = policies["np-experts"]["spec"]
        assert selected(expert_policy["podSelector"]) == experts and len(experts) == 3
        assert selected(expert_policy["ingress"][0]["from"][0]["podSelector"]) == routers
        assert selected(policies["np-router"]["spec"]["podSelector"]) == routers
        for name in ("np-experts", "np-router"):  # the API server kept the scrapers' rule
            (scrape,) = [rule for rule in policies[name]["spec"]["ingress"]
                         if rule["ports"] == [{"protocol": "TCP", "port": names.METRICS_PORT}]]
            assert scrape["from"] == list(scrapers)

        operator.restart(DEFAULT_CONFIG)
        wait_for(lambda: not cluster.list("NetworkPolicy", ns, f"{OWNER_LABEL}=np"),
                 OPERATOR_DEADLINE_S, "the NetworkPolicies removed")
        assert set(cluster.children(ns, "np")) == _expected_children("np", ["a", "b", "c"])
    finally:
        operator.restart(DEFAULT_CONFIG)


def _versions(children: dict) -> dict[tuple[str, str], tuple[Any, ...]]:
    """What changes when a child is rewritten: generation (Deployments), version, hash."""
    return {key: (c["metadata"].get("generation"),
                  c["metadata"]["resourceVersion"] if key[0] != "Deployment" else None,
                  c["metadata"]["annotations"][HASH])
            for key, c in children.items()}


@pytest.mark.usefixtures("operator")
def test_updates_touch_only_what_changed_and_removed_experts_go(cluster: Cluster,
                                                                kube_namespace: str) -> None:
    ns = kube_namespace
    before = _versions(_deploy(cluster, ns, "upd", CPU_SPEC))
    spec = copy.deepcopy(CPU_SPEC)
    spec["experts"][1]["replicas"] = 2
    cluster.patch_ddm_spec(ns, "upd", spec)
    wait_for(lambda: cluster.get("Deployment", ns, "upd-expert-b")["spec"]["replicas"] == 2,
             OPERATOR_DEADLINE_S, "expert b scaled to 2")
    after = _versions(cluster.children(ns, "upd"))
    assert [key for key in before if before[key] != after[key]] == [
        ("Deployment", "upd-expert-b")]
    wait_for(lambda: (cluster.ddm(ns, "upd").get("status") or {}).get(
        "observedGeneration") == 2, OPERATOR_DEADLINE_S, "observedGeneration 2")

    router_hash = cluster.get("Deployment", ns, "upd-router")["spec"]["template"]["metadata"][
        "annotations"]["ddm.dev/config-hash"]
    spec["experts"] = spec["experts"][:2]
    spec["experts"][1]["classes"] = list(range(3, 10))
    cluster.patch_ddm_spec(ns, "upd", spec)
    wait_for(lambda: set(cluster.children(ns, "upd")) == _expected_children("upd", ["a", "b"]),
             OPERATOR_DEADLINE_S, "the children of expert c deleted")
    config = RouterConfigFile.from_yaml(
        cluster.get("ConfigMap", ns, "upd-router-config")["data"]["router.yaml"])
    assert [e.name for e in config.experts] == ["a", "b"]
    template = cluster.get("Deployment", ns, "upd-router")["spec"]["template"]
    assert template["metadata"]["annotations"]["ddm.dev/config-hash"] != router_hash
    wait_for(lambda: "Deleted" in {e["reason"] for e in cluster.events(ns, "upd")},
             OPERATOR_DEADLINE_S, "a Deleted event")


@pytest.mark.usefixtures("operator")
def test_children_changed_by_hand_are_restored(cluster: Cluster, kube_namespace: str) -> None:
    ns = kube_namespace
    children = _deploy(cluster, ns, "drift", CPU_SPEC)
    image = children[("Deployment", "drift-expert-a")]["spec"]["template"]["spec"][
        "containers"][0]["image"]
    # Not deserialised: the client expects a Service back, Kubernetes 1.20 answers a Status.
    cluster.core.delete_namespaced_service("drift-expert-c", ns, _preload_content=False)
    cluster.apps.patch_namespaced_deployment("drift-expert-a", ns, {"spec": {
        "replicas": 4, "template": {"spec": {"containers": [{"name": "expert",
                                                            "image": "nginx"}]}}}})

    def restored() -> bool:
        deployment = cluster.get("Deployment", ns, "drift-expert-a")
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        return (cluster.get("Service", ns, "drift-expert-c") is not None
                and deployment["spec"]["replicas"] == 1 and container["image"] == image)
    wait_for(restored, OPERATOR_DEADLINE_S, "the Service re-created and the Deployment restored")
    wait_for(lambda: "Restored" in {e["reason"] for e in cluster.events(ns, "drift")},
             OPERATOR_DEADLINE_S, "a Restored event")


# (a change to a valid spec, a fragment of the API server's message). Kubernetes 1.20 names
# fields inside list items without their index (spec.experts.replicas), later versions with it.
SCHEMA_REJECTS = {
    "duplicate expert names": (
        lambda s: s["experts"].append(copy.deepcopy(s["experts"][0])),
        'spec.experts[3]: Duplicate value: map[string]interface {}{"name":"a"}'),
    "unknown accelerator": (
        lambda s: s["experts"][0].update(accelerator={"type": "amd"}),
        'spec.experts.accelerator.type: Unsupported value: "amd"'),
    "negative replicas": (
        lambda s: s["experts"][0].update(replicas=-1),
        "spec.experts.replicas: Invalid value: -1"),
    "expert name not a DNS label": (
        lambda s: s["experts"][0].update(name="Expert_A"),
        "should match '^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'"),
    "unknown strategy": (
        lambda s: s["sampling"].update(strategy="random"),
        'spec.sampling.strategy: Invalid value: "random"'),
    "too many steps": (
        lambda s: s["sampling"].update(steps=5000),
        "spec.sampling.steps: Invalid value: 5000"),
    "unknown solver": (
        lambda s: s["sampling"].update(solver="rk4"),
        'spec.sampling.solver: Unsupported value: "rk4"'),
    "bad checkpoint URI": (
        lambda s: s["experts"][0].update(checkpoint={"uri": "ftp://host/model"}),
        'Invalid value: "ftp://host/model"'),
    "repeated class": (
        lambda s: s["experts"][0].update(classes=[0, 0]),
        "spec.experts[0].classes[1]: Duplicate value: 0"),
    "no experts": (
        lambda s: s.update(experts=[]),
        "spec.experts: Invalid value: 0: spec.experts in body should have at least 1 items"),
    "too many GPUs for any node": (
        lambda s: s["experts"][0].update(accelerator={"type": "nvidia", "count": 64}),
        "spec.experts.accelerator.count: Invalid value: 64"),
}


@pytest.mark.parametrize("case", list(SCHEMA_REJECTS))
def test_the_api_server_rejects_invalid_specs(cluster: Cluster, crd: dict, kube_namespace: str,
                                              case: str) -> None:
    change, message = SCHEMA_REJECTS[case]
    spec = copy.deepcopy(CPU_SPEC)
    change(spec)
    with pytest.raises(ApiException) as caught:
        cluster.create_ddm(kube_namespace, "bad", spec)
    assert caught.value.status == 422
    assert message in json.loads(caught.value.body)["message"]


def test_the_api_server_rejects_a_name_too_long_for_children(cluster: Cluster, crd: dict,
                                                             kube_namespace: str) -> None:
    with pytest.raises(ApiException) as caught:
        cluster.create_ddm(kube_namespace, "a-name-that-is-much-too-long", CPU_SPEC)
    assert "metadata.name in body should be at most 24 chars long" in caught.value.body


# (a change the schema allows but the operator refuses, a fragment of its message)
SEMANTIC_ERRORS = {
    "oracle with overlapping classes": (
        lambda s: s["experts"][1].update(classes=[2, 3, 4, 5, 6]),
        "spec.experts[1].classes: label 2 is also claimed by expert a"),
    "more GPUs than a node has": (
        lambda s: s["experts"][0].update(accelerator={"type": "nvidia", "count": 9}),
        "spec.experts[0].accelerator.count: 9 is not a size nvidia offers per pod"),
    "JAX on Neuron": (
        lambda s: s["experts"][0].update(framework="jax", accelerator={"type": "neuron"}),
        "spec.experts[0].accelerator.type: neuron cannot run framework jax"),
    "host path": (
        lambda s: s["experts"][0].update(checkpoint={"uri": "file:///srv/models/a"}),
        "spec.experts[0].checkpoint.uri: 'file:///srv/models/a' mounts a directory of the node"),
}


def _invalid_status(cluster: Cluster, namespace: str, name: str, generation: int) -> dict:
    def reported() -> dict | None:
        status = cluster.ddm(namespace, name).get("status") or {}
        return status if (status.get("phase"), status.get("observedGeneration")) == (
            "Invalid", generation) else None
    return wait_for(reported, OPERATOR_DEADLINE_S, f"{name} reported Invalid")


@pytest.mark.usefixtures("operator")
@pytest.mark.parametrize("case", list(SEMANTIC_ERRORS))
def test_semantic_errors_are_reported_and_create_nothing(cluster: Cluster, kube_namespace: str,
                                                         case: str) -> None:
    change, message = SEMANTIC_ERRORS[case]
    spec = copy.deepcopy(CPU_SPEC)
    change(spec)
    cluster.create_ddm(kube_namespace, "semantic", spec)
    status = _invalid_status(cluster, kube_namespace, "semantic", 1)
    condition = next(c for c in status["conditions"] if c["type"] == "SpecValid")
    assert condition["status"] == "False" and message in condition["message"]
    warnings = wait_for(lambda: [e for e in cluster.events(kube_namespace, "semantic")
                                 if e["type"] == "Warning" and e["reason"] == "InvalidSpec"],
                        OPERATOR_DEADLINE_S, "a Warning event")
    assert message in warnings[0]["message"]
    assert cluster.children(kube_namespace, "semantic") == {}


@pytest.mark.usefixtures("operator")
def test_an_invalid_update_changes_no_child(cluster: Cluster, kube_namespace: str) -> None:
    ns = kube_namespace
    before = _versions(_deploy(cluster, ns, "keep", CPU_SPEC))
    spec = copy.deepcopy(CPU_SPEC)
    spec["experts"][2]["classes"] = [6, 7, 8, 9]
    cluster.patch_ddm_spec(ns, "keep", spec)
    status = _invalid_status(cluster, ns, "keep", 2)
    assert "label 6 is also claimed by expert b" in status["conditions"][0]["message"]
    assert _versions(cluster.children(ns, "keep")) == before


@pytest.mark.usefixtures("operator")
def test_an_object_in_the_way_is_reported_not_overwritten(cluster: Cluster,
                                                          kube_namespace: str) -> None:
    ns = kube_namespace
    cluster.core.create_namespaced_config_map(ns, {"metadata": {"name": "clash-router-config"},
                                                   "data": {"router.yaml": "mine"}})
    cluster.create_ddm(ns, "clash", CPU_SPEC)

    def failed() -> dict | None:
        status = cluster.ddm(ns, "clash").get("status") or {}
        return status if status.get("phase") == "Failed" else None
    ready = next(c for c in wait_for(failed, OPERATOR_DEADLINE_S, "phase Failed")["conditions"]
                 if c["type"] == "Ready")
    assert ready["reason"] == "ApplyFailed"
    assert "ConfigMap clash-router-config already exists and belongs to something else" in \
        ready["message"]
    assert cluster.get("ConfigMap", ns, "clash-router-config")["data"] == {"router.yaml": "mine"}
    assert cluster.get("Deployment", ns, "clash-expert-a") is not None  # the rest goes on
    wait_for(lambda: [e for e in cluster.events(ns, "clash") if e["reason"] == "ApplyFailed"],
             OPERATOR_DEADLINE_S, "an ApplyFailed warning")


@pytest.mark.usefixtures("operator")
def test_deleting_a_ddm_removes_every_child(cluster: Cluster, kube_namespace: str) -> None:
    ns = kube_namespace
    _deploy(cluster, ns, "gone", CPU_SPEC)
    selector = f"{OWNER_LABEL}=gone"
    wait_for(lambda: len(cluster.list("ReplicaSet", ns, selector)) == 4,
             OPERATOR_DEADLINE_S, "4 ReplicaSets")
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "gone")

    def remaining() -> list[str]:
        return [f"{kind} {item['metadata']['name']}"
                for kind in ("Deployment", "ReplicaSet", "Service", "ConfigMap")
                for item in cluster.list(kind, ns, selector)]
    wait_for(lambda: "all gone" if not remaining() else None, 60,
             "garbage collection of the children")
    # Pods stay Terminating: without a kubelet nothing confirms that they stopped.


def test_the_users_path_with_kubectl(dev_cluster: Any, operator: None, cluster: Cluster,
                                     kube_namespace: str) -> None:
    """kubectl apply -f the mixed-accelerator example, kubectl get ddm, kubectl delete."""
    kubectl = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or "kubectl"

    def run(*args: str) -> str:
        done = subprocess.run([kubectl, "--kubeconfig", str(dev_cluster.kubeconfig),
                               "-n", kube_namespace, *args], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    example = ROOT / "examples" / "mixed-accelerators.yaml"
    assert "created" in run("apply", "-f", str(example))
    name = yaml.safe_load(example.read_text())["metadata"]["name"]
    wait_for(lambda: cluster.ddm(kube_namespace, name).get("status"),
             OPERATOR_DEADLINE_S, "a status")
    header, row = run("get", "ddm", name).splitlines()[:2]
    assert header.split() == ["NAME", "READY", "EXPERTS", "REPLICAS", "STRATEGY", "PHASE",
                              "AGE"]
    assert row.split()[:3] == [name, "False", "0/3"]
    assert "deleted" in run("delete", "-f", str(example))
