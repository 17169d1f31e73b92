"""The operator's autoscaler against a real API server (the dev cluster, fake nodes).

The operator runs in this process. There is no kubelet, so the test plays it for the router's
pod: ready, at a loopback address (127.0.0.7) where a real metrics endpoint listens on the
metrics port, serving the router's own ``DemandMeter`` series, which the test drives as a
router would (rows routed, generations waiting). The scaler reads them there and sets the
autoscaled expert's replicas; a reconcile that rewrites the Deployment keeps them. The test
marks the expert's pod ready too, once it has seen that a replica still starting is kept.
A pool (issue 37) is scaled the same way from the sum of its experts' demand: a generation
waiting for one member starts it from zero.
"""

from __future__ import annotations

import calendar
import http.server
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from kubernetes import client
from prometheus_client import CollectorRegistry, generate_latest
from waiting import wait_for

from ddm.operator import names
from ddm.operator.config import OperatorConfig
from ddm.operator.scaler import FIELD_MANAGER
from ddm.serving.router.fleet.demand import DemandMeter
from tests.support.operator_process import install_crd, operator_in_thread

GROUP, VERSION, PLURAL = "ddm.dev", "v1alpha1", "ddmdeployments"
ROUTER_IP = "127.0.0.7"  # a loopback address of its own: the "pod" the scaler scrapes
EXPERT_IP = "127.0.0.8"  # the expert's "pod" (the scaler never calls it)
NAME, SCALED = "scaled", "a"
DELAY_S = 3


class _Metrics(http.server.BaseHTTPRequestHandler):
    registry = CollectorRegistry()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = generate_latest(type(self).registry)
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture(scope="module")
def meter() -> Iterator[DemandMeter]:
    """The router's demand series, served at ROUTER_IP on the metrics port."""
    registry = CollectorRegistry()
    _Metrics.registry = registry
    server = http.server.ThreadingHTTPServer((ROUTER_IP, names.METRICS_PORT), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield DemandMeter((SCALED, "b", "c"), registry)
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def operator(dev_cluster: Any, kube_client: Any, kube_namespace: str) -> Iterator[None]:
    install_crd(kube_client)
    with operator_in_thread(dev_cluster.kubeconfig, OperatorConfig(), (kube_namespace,)):
        yield


def _spec(max_batch: int | None = None) -> dict[str, Any]:
    scaled = {"name": SCALED, "checkpoint": {"uri": "image:///models/a"}, "classes": [0, 1, 2],
              "autoscaling": {"minReplicas": 0, "maxReplicas": 3, "target": {"rowsPerSecond": 10},
                              "scaleDownDelaySeconds": DELAY_S,
                              "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}}}}
    if max_batch is not None:
        scaled["maxBatch"] = max_batch
    return {"sampling": {"strategy": "oracle"}, "router": {"missingExpert": {"policy": "wait"}},
            "experts": [scaled, {"name": "b", "checkpoint": {"uri": "image:///models/b"},
                                 "classes": list(range(3, 10))}]}


def _observed_at(status: dict[str, Any]) -> float:
    """``status.demand.observedAt`` in seconds since the epoch (0 before the first)."""
    text = status.get("demand", {}).get("observedAt")
    return calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ")) if text else 0.0


def _mark_ready(core: client.CoreV1Api, pod: client.V1Pod, ip: str) -> None:
    """Write what a kubelet would for a started, ready container."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, {"status": {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
        "conditions": [{"type": kind, "status": "True", "lastTransitionTime": now}
                       for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")],
        "containerStatuses": [{"name": c.name, "ready": True, "started": True,
                               "restartCount": 0, "image": c.image, "imageID": "",
                               "state": {"running": {"startedAt": now}}}
                              for c in pod.spec.containers]}})


def _applied(kube_client: Any, ns: str, name: str, spec: dict[str, Any], deployment: str
             ) -> tuple[Callable[[], int | None], client.V1Pod]:
    """``spec`` applied as DDMDeployment ``name``: a reader of the replicas of its Deployment
    ``deployment`` (None while absent), and its router's pod once bound."""
    core, apps = client.CoreV1Api(kube_client), client.AppsV1Api(kube_client)
    client.CustomObjectsApi(kube_client).create_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, {"apiVersion": f"{GROUP}/{VERSION}",
                                     "kind": "DDMDeployment", "metadata": {"name": name},
                                     "spec": spec})

    def replicas() -> int | None:
        try:
            return apps.read_namespaced_deployment(deployment, ns).spec.replicas
        except client.ApiException:
            return None

    router = wait_for(lambda: [p for p in core.list_namespaced_pod(
        ns, label_selector=f"ddm.dev/deployment={name},app.kubernetes.io/component=router"
    ).items if p.spec.node_name], 60, "the router's pod to be bound")[0]
    return replicas, router


@pytest.mark.usefixtures("operator")
def test_the_scaler_follows_the_routers_demand_and_a_reconcile_keeps_its_replicas(
        kube_client: Any, kube_namespace: str, meter: DemandMeter) -> None:
    ns = kube_namespace
    core, apps = client.CoreV1Api(kube_client), client.AppsV1Api(kube_client)
    custom = client.CustomObjectsApi(kube_client)
    deployment = f"{NAME}-expert-{SCALED}"
    replicas, router = _applied(kube_client, ns, NAME, _spec(), deployment)

    def status() -> dict[str, Any]:
        return custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, NAME).get(
            "status") or {}

    assert replicas() == 1  # Kubernetes' default: no router read yet, nothing decided
    _mark_ready(core, router, ROUTER_IP)

    # idle: the scaler reads the router and takes the expert to zero
    wait_for(lambda: replicas() == 0, 60, "the idle expert at zero")
    owners = {f.manager for f in apps.read_namespaced_deployment(deployment, ns).metadata
              .managed_fields if "f:replicas" in (f.fields_v1 or {}).get("f:spec", {})}
    assert owners == {FIELD_MANAGER}, owners

    meter.wait_started(SCALED)  # a generation waits for it: started from zero
    wait_for(lambda: replicas() == 1, 30, "one replica for the waiting generation")
    meter.wait_ended(SCALED, 1.0)

    # no demand since, but its replica still starting (not ready): kept past the delay, which
    # counts from when it can serve; status.demand, rewritten at least every 15 s, times a
    # scaler pass well past the delay
    ended = time.time()
    wait_for(lambda: _observed_at(status()) > ended + DELAY_S + 2, 60,
             "a scaler pass past the scale-down delay")
    assert replicas() == 1, "a replica still starting was scaled away"
    selector = (f"ddm.dev/deployment={NAME},app.kubernetes.io/component=expert,"
                f"ddm.dev/expert={SCALED}")
    expert_pod = wait_for(lambda: [p for p in core.list_namespaced_pod(
        ns, label_selector=selector).items if p.spec.node_name
        and p.metadata.deletion_timestamp is None], 60, "the expert's pod")[0]
    _mark_ready(core, expert_pod, EXPERT_IP)
    wait_for(lambda: apps.read_namespaced_deployment(deployment, ns).status.ready_replicas
             == 1, 60, "the expert's replica ready")

    meter.routed(np.array([10_000, 0, 0]), np.array([10_000.0, 0, 0]))  # far above 3 x 10/s
    wait_for(lambda: replicas() == 3, 30, "maxReplicas under heavy demand")
    demand = wait_for(lambda: {e["name"]: e for e in status().get("demand", {}).get(
        "experts", [])}.get(SCALED, {}).get("desiredReplicas") == 3 and status()["demand"],
        30, "status.demand to show the decision")
    assert demand["routers"] == "1/1" and demand["experts"][0]["rowsPerSecond"] > 30
    wait_for(lambda: f"{SCALED} 1/3" in status().get("expertReplicas", ""), 30,  # 1 marked ready
             "the Replicas column to show the scaler's count")

    # a spec change rewrites the Deployment; the replicas stay the scaler's
    custom.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, NAME,
                                          {"spec": _spec(max_batch=8)})
    wait_for(lambda: "--max-batch" in apps.read_namespaced_deployment(deployment, ns)
             .spec.template.spec.containers[0].command, 30, "the reconcile's update")
    assert replicas() == 3

    # no new rows: back at zero once the delay has passed (the 30 s rate window notwithstanding)
    wait_for(lambda: replicas() == 0, 30, "zero replicas after the scale-down delay")


def _pooled_spec() -> dict[str, Any]:
    """A text DDM: experts a and b in pool ``p`` (scaled to zero), c alone."""
    def checkpoint(name: str) -> dict[str, str]:
        return {"uri": f"image:///models/{name}"}

    return {"conditioning": "text", "sampling": {"strategy": "top1"},
            "router": {"checkpoint": checkpoint("router"), "missingExpert": {"policy": "wait"}},
            "textEncoder": {"checkpoint": checkpoint("text-encoder")},
            "pools": [{"name": "p", "autoscaling": {
                "minReplicas": 0, "maxReplicas": 2, "target": {"rowsPerSecond": 10},
                "scaleDownDelaySeconds": DELAY_S,
                "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}}}}],
            "experts": [{"name": name, "checkpoint": checkpoint(name),
                         **({"pool": "p"} if name != "c" else {})} for name in ("a", "b", "c")]}


@pytest.mark.usefixtures("operator")
def test_a_pool_scales_from_its_experts_demand_and_wakes_for_any_member(
        kube_client: Any, kube_namespace: str, meter: DemandMeter) -> None:
    ns, name = kube_namespace, "pooled"
    core, custom = client.CoreV1Api(kube_client), client.CustomObjectsApi(kube_client)
    replicas, router = _applied(kube_client, ns, name, _pooled_spec(), f"{name}-pool-p")

    def demand() -> dict[str, Any]:
        status = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name).get(
            "status") or {}
        return {p["name"]: p for p in status.get("demand", {}).get("pools", [])}.get("p", {})

    _mark_ready(core, router, ROUTER_IP)
    wait_for(lambda: replicas() == 0, 60, "the idle pool at zero")
    assert demand()["experts"] == ["a", "b"]

    meter.wait_started("b")  # a generation waits for one member: the pool starts
    wait_for(lambda: replicas() == 1, 30, "one pool replica for the waiting generation")
    meter.wait_ended("b", 1.0)
    pool_pod = wait_for(lambda: [p for p in core.list_namespaced_pod(
        ns, label_selector=f"ddm.dev/deployment={name},ddm.dev/pool=p").items
        if p.spec.node_name and p.metadata.deletion_timestamp is None], 60, "the pool's pod")[0]
    _mark_ready(core, pool_pod, EXPERT_IP)

    meter.routed(np.array([5_000, 5_000, 0]), np.array([5_000.0, 5_000.0, 0]))  # both members
    wait_for(lambda: replicas() == 2, 30, "maxReplicas under the members' demand")
    wait_for(lambda: demand().get("desiredReplicas") == 2, 30, "status.demand.pools")
    assert demand()["rowsPerSecond"] > 20

    wait_for(lambda: replicas() == 0, 60, "the pool back at zero after the delay")
