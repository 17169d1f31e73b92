"""A pooled DDM on the dev cluster's real node (issue 37): ``examples/text2img-pooled.yaml``
(the shipped text-to-image DDM, its four experts, text encoder, decoder and router network in
one pool, the checkpoints baked into our CPU image), reconciled by the operator (in this
process, against the real API server) and run by the kubelet.

* It becomes Ready with one Deployment for its pool (``ddm serve pool``) beside the router's
  and nothing else, and answers ``/v1/images/generations`` with a PNG.
* The memory refusal: the same DDM with a pool memory limit (1 GiB) below what its members
  need at ``maxBatch`` rows (about 1.8 GB): the pool's pod exits 1 before loading anything, and
  the DDM's status says so, naming the pool and the pod's reason (the sum and the limit) in
  ``status.pools`` and the ``PoolsReady`` condition.

Both DDMs share one namespace and one operator; the pods' requests are made small (a two-core
node). Every wait polls with a deadline.
"""

from __future__ import annotations

import copy
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
from ddm_devcluster import images as dev_images
from tests.support.operator_process import install_crd, operator_in_thread
from tests.support.text2img_served import png_rgb

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "text2img-pooled.yaml"
NAMESPACE = "pooled-demo"
GROUP, VERSION_API, PLURAL = "ddm.dev", "v1alpha1", "ddmdeployments"
READY_TIMEOUT_S = 600
GENERATION_S = 300
ROUTER_RESOURCES = {"requests": {"cpu": "50m", "memory": "256Mi"},
                    "limits": {"memory": "1536Mi"}}
#: The example's own limit (2 GiB: its members need about 1.8 GB at 64 rows each), and one
#: they exceed but in which the server's runtime still starts and refuses.
FITS, TOO_SMALL = "2Gi", "1Gi"
MEMBERS = ["expert-0", "expert-1", "expert-2", "expert-3", "text-encoder", "decoder",
           "router-network"]


def _manifest(name: str, memory: str) -> dict[str, Any]:
    document = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    document["metadata"] = {"name": name, "namespace": NAMESPACE}
    spec = document["spec"]
    spec["router"]["resources"] = ROUTER_RESOURCES
    spec["pools"][0]["resources"] = {"requests": {"cpu": "50m", "memory": "256Mi"},
                                     "limits": {"memory": memory}}
    return document


@pytest.fixture(scope="module")
def api(dev_cluster: ClusterInfo, kube_client: Any) -> Iterator[dict[str, Any]]:
    """The CRD installed, the operator running for the namespace, both DDMs applied."""
    install_crd(kube_client)
    core = client.CoreV1Api(kube_client)
    custom = client.CustomObjectsApi(kube_client)
    new_namespace(core, NAMESPACE)
    config = OperatorConfig(images=Images.defaults(dev_images.VERSION),
                            image_pull_policy="Never")
    try:
        with operator_in_thread(dev_cluster.kubeconfig, config, (NAMESPACE,)):
            for name, memory in (("pooled", FITS), ("pooled-small", TOO_SMALL)):
                custom.create_namespaced_custom_object(GROUP, VERSION_API, NAMESPACE, PLURAL,
                                                       _manifest(name, memory))
            yield {"core": core, "apps": client.AppsV1Api(kube_client), "custom": custom}
    finally:
        core.delete_namespace(NAMESPACE, grace_period_seconds=0)


def _status(api: dict[str, Any], name: str) -> dict[str, Any]:
    return api["custom"].get_namespaced_custom_object(
        GROUP, VERSION_API, NAMESPACE, PLURAL, name).get("status") or {}


def _explain(api: dict[str, Any], name: str) -> str:
    pods = api["core"].list_namespaced_pod(
        NAMESPACE, label_selector=f"ddm.dev/deployment={name}").items
    return f"status: {_status(api, name)}\n" + "\n".join(
        f"{p.metadata.name}: {p.status.phase} {p.status.container_statuses}" for p in pods)


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.get("conditions", [])}


def test_a_pooled_ddm_is_ready_with_one_deployment_for_its_pool_and_draws(
        api: dict[str, Any]) -> None:
    status = wait_for(lambda: (s if (s := _status(api, "pooled")).get("phase") == "Ready"
                               else None), READY_TIMEOUT_S, "the pooled DDM to be Ready",
                      lambda: _explain(api, "pooled"))
    assert status["pools"] == [{"name": "models", "accelerator": "cpu", "members": MEMBERS,
                                "replicas": 1, "readyReplicas": 1}]
    assert _conditions(status)["PoolsReady"]["status"] == "True"
    deployments = {d.metadata.name: d for d in api["apps"].list_namespaced_deployment(
        NAMESPACE, label_selector="ddm.dev/deployment=pooled").items}
    assert sorted(deployments) == ["pooled-pool-models", "pooled-router"]
    (container,) = deployments["pooled-pool-models"].spec.template.spec.containers
    assert container.command[:3] == ["ddm", "serve", "pool"], container.command
    (router,) = [p for p in api["core"].list_namespaced_pod(
        NAMESPACE, label_selector="ddm.dev/deployment=pooled,"
                                  "app.kubernetes.io/component=router").items
                 if p.metadata.deletion_timestamp is None]
    answer = httpx.post(f"http://{router.status.pod_ip}:8080/v1/images/generations",
                        timeout=GENERATION_S,
                        json={"prompt": "a thick red seven", "n": 1, "seed": 0, "steps": 10})
    assert answer.status_code == 200, answer.text
    image = png_rgb(answer.json()["data"][0]["b64_json"])
    assert image.ndim == 3 and image.shape[2] == 3 and image.std() > 0


def test_a_pool_over_its_memory_limit_says_why_in_the_ddms_status(api: dict[str, Any]) -> None:
    def refused() -> dict[str, Any] | None:
        status = _status(api, "pooled-small")
        pools = status.get("pools") or [{}]
        return status if "do not fit" in pools[0].get("message", "") else None

    status = wait_for(refused, READY_TIMEOUT_S, "the pool's refusal in the status",
                      lambda: _explain(api, "pooled-small"))
    (pool,) = status["pools"]
    assert pool["readyReplicas"] == 0 and pool["reason"] in ("CrashLoopBackOff", "Error")
    assert "last exit 1: pool of expert-0, " in pool["message"], pool
    assert ("the pool's members do not fit: sum " in pool["message"]
            and " bytes > limit 1,073,741,824 bytes (--memory-limit-bytes: the pool's "
                "resources.limits.memory)" in pool["message"])
    conditions = _conditions(status)
    assert conditions["PoolsReady"]["status"] == "False"
    assert conditions["PoolsReady"]["message"].startswith("pool models: 0/1 ready: ")
    assert "do not fit" in conditions["PoolsReady"]["message"]
    assert status["phase"] != "Ready"
