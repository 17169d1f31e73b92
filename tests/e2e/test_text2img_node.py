"""The shipped text-to-image DDM on the dev cluster's real node, as a user applies it:
``examples/text2img.yaml`` (checkpoints baked into our CPU image, the text encoder and decoder
in Deployments of their own, two PyTorch and two JAX experts), reconciled by the operator
(in this process, against the real API server) and run by the kubelet. Asked over the router's
``/v1/images/generations`` what issue 23 promises at the shipped defaults: the digit and colour
a prompt names at least 95% of the time, and more ink for "thick" than for "thin".

Only the pods' resource requests are made small (seven server pods share a two-core node);
everything else is the example as shipped. Every wait polls with a deadline.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from kubernetes import client
from podwatch import new_namespace
from waiting import wait_for

from ddm.operator.config import Images, OperatorConfig
from ddm_devcluster import ClusterInfo
from ddm_devcluster import images as dev_images
from tests.support.operator_process import install_crd, operator_in_thread
from tests.support.text2img_served import Ask, judge, png_rgb

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "text2img.yaml"
NAMESPACE = "text2img-demo"
GROUP, VERSION_API, PLURAL = "ddm.dev", "v1alpha1", "ddmdeployments"
READY_TIMEOUT_S = 600
GENERATION_S = 300
RESOURCES = {"requests": {"cpu": "50m", "memory": "256Mi"}, "limits": {"memory": "1536Mi"}}


def _manifest() -> dict[str, Any]:
    document = yaml.safe_load(EXAMPLE.read_text())
    document["metadata"]["namespace"] = NAMESPACE
    spec = document["spec"]
    for part in (spec["textEncoder"], spec["decoder"], spec["router"], *spec["experts"]):
        part["resources"] = RESOURCES
    return document


@pytest.fixture(scope="module")
def router_url(dev_cluster: ClusterInfo, kube_client: Any) -> Iterator[str]:
    """The example applied in its namespace and Ready; the router pod's address."""
    install_crd(kube_client)
    core = client.CoreV1Api(kube_client)
    custom = client.CustomObjectsApi(kube_client)
    new_namespace(core, NAMESPACE)
    document = _manifest()
    name = document["metadata"]["name"]
    config = OperatorConfig(images=Images.defaults(dev_images.VERSION),
                            image_pull_policy="Never")

    def status() -> dict[str, Any]:
        return custom.get_namespaced_custom_object(GROUP, VERSION_API, NAMESPACE, PLURAL,
                                                   name).get("status") or {}

    def explain() -> str:
        pods = core.list_namespaced_pod(NAMESPACE).items
        return f"status: {status()}\n" + "\n".join(
            f"{p.metadata.name}: {p.status.phase} {p.status.container_statuses}" for p in pods)

    try:
        with operator_in_thread(dev_cluster.kubeconfig, config, (NAMESPACE,)):
            custom.create_namespaced_custom_object(GROUP, VERSION_API, NAMESPACE, PLURAL,
                                                   document)
            wait_for(lambda: status().get("phase") == "Ready", READY_TIMEOUT_S,
                     f"{name} to be Ready", explain)
            (router,) = [p for p in core.list_namespaced_pod(
                NAMESPACE, label_selector=f"ddm.dev/deployment={name},"
                                          "app.kubernetes.io/component=router").items
                         if p.metadata.deletion_timestamp is None]
            yield f"http://{router.status.pod_ip}:8080"
    finally:
        core.delete_namespace(NAMESPACE, grace_period_seconds=0)


def test_prompts_get_their_digit_colour_and_stroke_on_the_real_node(router_url: str) -> None:
    def draw(ask: Ask) -> np.ndarray:
        answer = httpx.post(f"{router_url}/v1/images/generations", timeout=GENERATION_S,
                            json={"prompt": ask.prompt, "n": 1, "seed": ask.seed})
        assert answer.status_code == 200, answer.text
        return png_rgb(answer.json()["data"][0]["b64_json"])

    verdict = judge(draw)
    verdict.assert_meets_the_bar("real node")
