"""Scale to zero by the operator, on the dev cluster's real node (issue 24).

The operator runs in this process (cluster-wide, its own thread) against the real API server;
the kubelet and containerd run the MNIST DDM's router and experts from the CPU image. Expert
``mnist-cluster-2`` has ``autoscaling: {minReplicas: 0}``; the operator's scaler reads the
router's ``/metrics`` (from this host, which reaches pod addresses as the operator's pod
would) and sets that expert's replicas:

* idle, the expert has no pod;
* policy ``wait``: a generation that needs it is held until the scaler started a pod (a cold
  start: image present, weights in the image), succeeds, says how long it waited, and leaves
  one ready pod;
* after the scale-down delay with no traffic the expert is back at zero;
* policy ``reroute``: the same generation is answered without waiting, naming the rerouted
  steps.

Every wait polls the API or the router with a deadline; nothing sleeps a fixed time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubernetes import client
from podwatch import new_namespace
from waiting import wait_for

from ddm.operator.config import Images, OperatorConfig
from ddm_devcluster import ClusterInfo
from ddm_devcluster.images import VERSION
from tests.support.operator_process import install_crd, operator_in_thread

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE, NAME, SCALED = "autoscaling", "mnist", "mnist-cluster-2"
GROUP, VERSION_API, PLURAL = "ddm.dev", "v1alpha1", "ddmdeployments"
DELAY_S = 10
READY_TIMEOUT_S = 600
LABELS, STEPS = list(range(10)), 10


def _ddm() -> dict[str, Any]:
    """examples/mnist.yaml with small CPU requests (five pods on a two-core node), policy
    wait, and ``SCALED`` at zero while idle, back at zero ``DELAY_S`` after its last use."""
    document = yaml.safe_load((ROOT / "examples" / "mnist.yaml").read_text())
    document["metadata"] = {"name": NAME, "namespace": NAMESPACE}
    spec = document["spec"]
    spec["router"]["missingExpert"] = {"policy": "wait", "waitSeconds": READY_TIMEOUT_S}
    spec["router"]["resources"] = {"requests": {"cpu": "50m", "memory": "256Mi"},
                                   "limits": {"memory": "1Gi"}}
    for expert in spec["experts"]:
        expert["resources"] = {"requests": {"cpu": "50m", "memory": "256Mi"},
                               "limits": {"memory": "1Gi"}}
        if expert["name"] == SCALED:
            expert["autoscaling"] = {
                "minReplicas": 0, "maxReplicas": 1, "scaleDownDelaySeconds": DELAY_S,
                "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}}}
    return document


@pytest.fixture(scope="module")
def api(dev_cluster: ClusterInfo, kube_client: Any) -> Iterator[dict[str, Any]]:
    """The typed clients, the CRD installed, the operator running, the namespace made."""
    install_crd(kube_client)
    core = client.CoreV1Api(kube_client)
    new_namespace(core, NAMESPACE)
    config = OperatorConfig(images=Images.defaults(VERSION), image_pull_policy="Never")
    try:
        with operator_in_thread(dev_cluster.kubeconfig, config, (NAMESPACE,)):
            yield {"core": core, "apps": client.AppsV1Api(kube_client),
                   "custom": client.CustomObjectsApi(kube_client)}
    finally:
        core.delete_namespace(NAMESPACE, grace_period_seconds=0)


def _pods(api: dict[str, Any], selector: str) -> list[client.V1Pod]:
    """The pods ``selector`` picks that are not being deleted."""
    return [p for p in api["core"].list_namespaced_pod(NAMESPACE, label_selector=selector).items
            if p.metadata.deletion_timestamp is None]


def _all_pods(api: dict[str, Any], selector: str) -> list[client.V1Pod]:
    return api["core"].list_namespaced_pod(NAMESPACE, label_selector=selector).items


def _ready(pod: client.V1Pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


SCALED_PODS = f"ddm.dev/deployment={NAME},ddm.dev/expert={SCALED}"
ROUTER_PODS = f"ddm.dev/deployment={NAME},app.kubernetes.io/component=router"


def _router_url(api: dict[str, Any]) -> str | None:
    ready = [p for p in _pods(api, ROUTER_PODS) if _ready(p)]
    return f"http://{ready[0].status.pod_ip}:8080" if len(ready) == 1 else None


def _status(api: dict[str, Any]) -> dict[str, Any]:
    return api["custom"].get_namespaced_custom_object(
        GROUP, VERSION_API, NAMESPACE, PLURAL, NAME).get("status") or {}


def _explain(api: dict[str, Any]) -> str:
    lines = [f"status: {_status(api)}"]
    for pod in _all_pods(api, f"ddm.dev/deployment={NAME}"):
        lines.append(f"{pod.metadata.name}: {pod.status.phase}, ready {_ready(pod)}"
                     + (", deleting" if pod.metadata.deletion_timestamp else ""))
    return "\n".join(lines)


def _generate(url: str) -> dict[str, Any]:
    answer = httpx.post(f"{url}/v1/generate", timeout=READY_TIMEOUT_S,
                        json={"labels": LABELS, "steps": STEPS, "seed": 0})
    assert answer.status_code == 200, answer.text
    return answer.json()


def _uses(answer: dict[str, Any], expert: str) -> int:
    """Image-steps of ``answer`` that ran on ``expert``."""
    k = answer["expert_names"].index(expert)
    return sum(bool(mask >> k & 1) for image in answer["routing"] for mask in image)


def _policy(url: str) -> str | None:
    try:
        return httpx.get(f"{url}/v1/demand", timeout=10).json()["missing_expert"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def test_an_expert_at_min_replicas_0_runs_only_while_needed(api: dict[str, Any]) -> None:
    api["custom"].create_namespaced_custom_object(GROUP, VERSION_API, NAMESPACE, PLURAL, _ddm())
    explain = lambda: _explain(api)  # noqa: E731
    wait_for(lambda: _status(api).get("phase") == "Ready", READY_TIMEOUT_S,
             "the DDM to be Ready with its scaled expert at zero", explain, interval_s=1)
    # idle: the scaler set zero replicas (the Deployment's default one never got to serve)
    wait_for(lambda: not _all_pods(api, SCALED_PODS), 120, f"no pod of {SCALED}", explain)
    deployment = api["apps"].read_namespaced_deployment(f"{NAME}-expert-{SCALED}", NAMESPACE)
    assert deployment.spec.replicas == 0
    assert f"{SCALED} 0/0" in _status(api)["expertReplicas"]
    url = wait_for(lambda: _router_url(api), 60, "one ready router pod", explain)

    started = time.monotonic()
    answer = _generate(url)  # policy wait: held until the scaler's pod is ready
    cold_s = time.monotonic() - started
    print(f"\nwait: {SCALED} started from zero; the generation waited {answer['waited_s']:.1f} "
          f"s, answered after {cold_s:.1f} s")
    assert answer["waited_s"] > 0 and _uses(answer, SCALED) > 0, answer["waited_s"]
    assert not any(answer["rerouted"]), answer["rerouted"]
    assert [p for p in _pods(api, SCALED_PODS) if _ready(p)], explain()
    wait_for(lambda: f"{SCALED} 1/1" in _status(api).get("expertReplicas", ""), 60,
             "the status to show the scaled expert's ready pod", explain)
    demand = {e["name"]: e for e in _status(api)["demand"]["experts"]}
    assert demand[SCALED]["desiredReplicas"] == 1, demand

    idle_from = time.monotonic()
    wait_for(lambda: not _all_pods(api, SCALED_PODS), 120,
             f"{SCALED} back at zero after {DELAY_S} s without demand", explain)
    print(f"scale to zero: no pod of {SCALED} {time.monotonic() - idle_from:.1f} s after the "
          f"answer (delay {DELAY_S} s, drain and exit included)")

    api["custom"].patch_namespaced_custom_object(
        GROUP, VERSION_API, NAMESPACE, PLURAL, NAME,
        {"spec": {"router": {"missingExpert": {"policy": "reroute"}}}})
    url = wait_for(lambda: (u := _router_url(api)) and _policy(u) == "reroute" and u,
                   READY_TIMEOUT_S, "a ready router with policy reroute", explain, interval_s=1)
    assert not _all_pods(api, SCALED_PODS)
    started = time.monotonic()
    answer = _generate(url)  # reroute: answered at once, without the expert at zero
    print(f"reroute: answered in {time.monotonic() - started:.1f} s, "
          f"{sum(map(len, answer['rerouted']))} image-steps rerouted")
    # (its rows still count as demand on it: the scaler starts it, for the steps to come)
    assert answer["waited_s"] == 0 and any(answer["rerouted"]), answer
