"""The CUDA image (Dockerfile.cuda) built for real and one expert of it served on the real node.

Several GB of wheels: not part of `make test` (CI builds and uses the CPU image); run with
`make test-images`, which sets ``DDM_TEST_CUDA_IMAGE=1``. There is no GPU on the real node, so
the expert runs on the CPU; the test checks that the image carries torch's CUDA build and
JAX's CUDA plugin, and that the expert loads its checkpoint and serves from the image as the
operator's pods run it (uid 10001, read-only root file system).
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from typing import Any

import pytest
from kubernetes import client
from kubernetes.stream import stream
from podwatch import new_namespace
from waiting import wait_for

from ddm_devcluster import ClusterInfo
from ddm_devcluster import images as dev_images
from ddm_devcluster.build import log_stderr
from ddm_devcluster.cluster import node_layout

pytestmark = pytest.mark.skipif(os.environ.get("DDM_TEST_CUDA_IMAGE") != "1",
                                reason="builds the multi-GB CUDA image: `make test-images`")
NAMESPACE = "cuda-image"


def expert_pod() -> dict[str, Any]:
    """The digits 0-4 expert as the operator runs experts (restricted, read-only root)."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "expert", "labels": {"app": "cuda-expert"}},
        "spec": {
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "automountServiceAccountToken": False,  # as the operator's server pods
            "terminationGracePeriodSeconds": 10,
            "containers": [{
                "name": "expert", "image": dev_images.CUDA.name,
                "imagePullPolicy": "Never",
                "command": ["ddm", "serve", "expert", "--checkpoint",
                            "/opt/ddm/checkpoints/digits/expert-0-4", "--host", "0.0.0.0",
                            "--port", "8000", "--backend", "torch"],
                "ports": [{"containerPort": 8000}],
                "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8000},
                                   "periodSeconds": 2},
                "securityContext": {"readOnlyRootFilesystem": True,
                                    "allowPrivilegeEscalation": False,
                                    "capabilities": {"drop": ["ALL"]}},
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                                 {"name": "cache", "mountPath": "/var/cache/ddm"}],
            }],
            "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}],
        },
    }


def test_an_expert_from_the_cuda_image_serves_on_the_real_node(
        dev_cluster: ClusterInfo, kube_client: Any) -> None:
    started = time.monotonic()
    built = dev_images.build_project_image(dev_images.CUDA, log=log_stderr)
    built_s = time.monotonic() - started
    started = time.monotonic()
    dev_images.import_into_containerd([dev_images.CUDA.name],
                                      node_layout(dev_cluster.state_dir).ctr(),
                                      ids={dev_images.CUDA.name: built}, log=log_stderr)
    imported_s = time.monotonic() - started
    core = client.CoreV1Api(kube_client)
    new_namespace(core, NAMESPACE)
    core.create_namespaced_pod(NAMESPACE, expert_pod())
    started = time.monotonic()

    def ready() -> client.V1Pod | None:
        pod = core.read_namespaced_pod("expert", NAMESPACE)
        statuses = pod.status.container_statuses or []
        return pod if statuses and statuses[0].ready else None

    pod = wait_for(ready, 600, "the CUDA image's expert to be ready",
                   lambda: core.read_namespaced_pod_log("expert", NAMESPACE))
    ready_s = time.monotonic() - started
    assert pod.spec.node_name == "ddm-real-0"
    with urllib.request.urlopen(f"http://{pod.status.pod_ip}:8000/healthz", timeout=10) as answer:
        assert answer.status == 200
    # no GPU on the node: the server says it runs on the CPU
    log = core.read_namespaced_pod_log("expert", NAMESPACE)
    assert re.search(r"expert expert-0-4 ready on torch \(torch [^,]+, cpu\)", log), log
    versions = stream(core.connect_get_namespaced_pod_exec, "expert", NAMESPACE,
                      command=["python", "-c", "import torch, jax, jax_plugins.xla_cuda13; "
                               "print(torch.version.cuda, torch.cuda.is_available(), "
                               "jax.__version__)"],
                      stderr=False, stdout=True)
    cuda, available, jax_version = versions.split()[-3:]
    assert cuda.startswith("13.") and available == "False", versions
    print(f"\nCUDA image: built in {built_s:.0f} s, imported in {imported_s:.0f} s, expert "
          f"ready {ready_s:.0f} s after creation; torch's CUDA {cuda} (GPU seen: {available}), "
          f"JAX {jax_version} with its CUDA 13 plugin")
