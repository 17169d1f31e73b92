"""The dev cluster is a working control plane: real scheduler, real controllers, real CRDs.

Every wait is a watch (or a poll) bounded by a deadline; nothing sleeps a fixed time. Tests
that use the cluster are marked ``cluster`` by conftest; the first two need none.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from ddm.devcluster import ClusterInfo, StartupError, start_component, status, stop_component
from ddm.devcluster.api import ApiError
from ddm.devcluster.apt import deb_src_stanzas
from ddm.devcluster.components import build_token_file

DEADLINE_S = 60


def _watch_until(
    list_call: Callable[..., Any],
    predicate: Callable[[dict[str, Any]], Any],
    *,
    timeout_s: float = DEADLINE_S,
    **kwargs: Any,
) -> Any:
    """Stream ``list_call`` events until ``predicate(event)`` returns an object; return it."""
    deadline = time.monotonic() + timeout_s
    while (remaining := deadline - time.monotonic()) > 0:
        stream = watch.Watch()
        for event in stream.stream(list_call, timeout_seconds=max(1, int(remaining)), **kwargs):
            found = predicate(event)
            if found is not None:
                stream.stop()
                return found
    pytest.fail(f"nothing matched within {timeout_s} s ({list_call.__name__} {kwargs})")


def test_deb_src_entries_mirror_only_debian_archives(tmp_path: Path) -> None:
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(
        "deb [arch=amd64] http://deb.debian.org/debian bookworm main contrib\n"
        "deb https://packages.example.com/apt stable main\n"
    )
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://deb.debian.org/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n\n"
        "Types: deb\nURIs: https://deb.nodesource.com/node_20.x\nSuites: nodistro\n"
    )
    assert deb_src_stanzas(tmp_path) == (
        "Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: bookworm\n"
        "Components: main contrib\n\n"
        "Types: deb-src\nURIs: http://deb.debian.org/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n"
    )


def test_token_file_puts_only_the_admin_in_system_masters() -> None:
    lines = build_token_file(
        {"ddm-admin": "a", "system:kube-controller-manager": "c", "system:kube-scheduler": "s"}
    ).splitlines()
    assert lines == [
        'a,ddm-admin,ddm-admin,"system:masters"',
        "c,system:kube-controller-manager,system:kube-controller-manager",
        "s,system:kube-scheduler,system:kube-scheduler",
    ]


def test_fake_nodes_are_registered_ready_and_schedulable(kube_client: Any) -> None:
    nodes = {
        n.metadata.name: n
        for n in client.CoreV1Api(kube_client)
        .list_node(label_selector="ddm.dev/fake-node=true")
        .items
    }
    assert set(nodes) == {"ddm-cpu-0", "ddm-gpu-0", "ddm-neuron-0", "ddm-tpu-0"}
    for node in nodes.values():
        ready = [c for c in node.status.conditions if c.type == "Ready"]
        assert [c.status for c in ready] == ["True"]
        assert not node.spec.unschedulable
        assert all(t.key != "node.kubernetes.io/not-ready" for t in node.spec.taints or [])
        assert node.status.allocatable["pods"] == "110"
    assert nodes["ddm-gpu-0"].status.capacity["nvidia.com/gpu"] == "8"
    assert nodes["ddm-gpu-0"].metadata.labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert nodes["ddm-neuron-0"].status.capacity["aws.amazon.com/neuron"] == "16"
    assert nodes["ddm-neuron-0"].status.capacity["aws.amazon.com/neuroncore"] == "32"
    assert (
        nodes["ddm-neuron-0"].metadata.labels["node.kubernetes.io/instance-type"] == "trn1.32xlarge"
    )
    assert nodes["ddm-tpu-0"].status.capacity["google.com/tpu"] == "4"
    assert nodes["ddm-tpu-0"].metadata.labels["cloud.google.com/gke-tpu-topology"] == "2x2"
    assert {t.key for t in nodes["ddm-tpu-0"].spec.taints} == {"google.com/tpu"}


def _deployment(name: str, resource: str | None, toleration: str | None) -> dict[str, Any]:
    limits = {resource: "1"} if resource else {}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": "registry.invalid/never-pulled:0",
                            "resources": {"requests": {"cpu": "100m", **limits}, "limits": limits},
                        }
                    ],
                    "tolerations": (
                        [{"key": toleration, "operator": "Exists", "effect": "NoSchedule"}]
                        if toleration
                        else []
                    ),
                },
            },
        },
    }


@pytest.mark.parametrize(
    ("resource", "toleration", "node"),
    [
        ("nvidia.com/gpu", "nvidia.com/gpu", "ddm-gpu-0"),
        ("aws.amazon.com/neuron", "aws.amazon.com/neuron", "ddm-neuron-0"),
        ("google.com/tpu", "google.com/tpu", "ddm-tpu-0"),
        (None, None, "ddm-cpu-0"),  # untolerated taints keep plain pods off accelerator nodes
    ],
    ids=["nvidia", "neuron", "tpu", "cpu"],
)
def test_scheduler_binds_deployment_pod_to_the_matching_node(
    kube_client: Any, kube_namespace: str, resource: str | None, toleration: str | None, node: str
) -> None:
    name = f"d-{uuid.uuid4().hex[:6]}"
    client.AppsV1Api(kube_client).create_namespaced_deployment(
        kube_namespace, _deployment(name, resource, toleration)
    )

    def bound(event: dict[str, Any]) -> Any:
        pod = event["object"]
        return pod if pod.spec.node_name else None

    pod = _watch_until(
        client.CoreV1Api(kube_client).list_namespaced_pod,
        bound,
        namespace=kube_namespace,
        label_selector=f"app={name}",
    )
    assert pod.spec.node_name == node
    assert pod.metadata.owner_references[0].kind == "ReplicaSet"  # made by the controllers


def test_custom_resource_definition_serves_objects(kube_client: Any) -> None:
    # A map-valued field: encoding it crashed the API server before the reflect2 update.
    group, plural = "test.ddm.dev", f"widgets{uuid.uuid4().hex[:6]}"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": plural[:-1], "kind": f"W{plural}"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {
                                        "replicas": {"type": "integer", "minimum": 0},
                                        "resources": {
                                            "type": "object",
                                            "additionalProperties": {"type": "string"},
                                        },
                                    },
                                }
                            },
                        }
                    },
                    "subresources": {"status": {}},
                }
            ],
        },
    }
    extensions = client.ApiextensionsV1Api(kube_client)
    extensions.create_custom_resource_definition(crd)

    def established(event: dict[str, Any]) -> Any:
        conditions = event["object"].status.conditions or []
        return (
            event["object"]
            if any(c.type == "Established" and c.status == "True" for c in conditions)
            else None
        )

    _watch_until(
        extensions.list_custom_resource_definition,
        established,
        field_selector=f"metadata.name={plural}.{group}",
    )
    custom = client.CustomObjectsApi(kube_client)
    body = {
        "apiVersion": f"{group}/v1",
        "kind": f"W{plural}",
        "metadata": {"name": "one"},
        "spec": {"replicas": 2, "resources": {"nvidia.com/gpu": "1", "cpu": "2"}},
    }
    deadline = time.monotonic() + DEADLINE_S
    while True:  # Established can precede the new endpoint's readiness by a moment
        try:
            custom.create_namespaced_custom_object(group, "v1", "default", plural, body)
            break
        except ApiException as error:
            if error.status != 404 or time.monotonic() > deadline:
                raise
    got = custom.get_namespaced_custom_object(group, "v1", "default", plural, "one")
    assert got["spec"]["resources"] == {"nvidia.com/gpu": "1", "cpu": "2"}
    with pytest.raises(ApiException) as invalid:
        body["metadata"]["name"] = "bad"
        body["spec"]["replicas"] = -1
        custom.create_namespaced_custom_object(group, "v1", "default", plural, body)
    assert invalid.value.status == 422  # the schema is enforced


def test_garbage_collector_deletes_dependents_of_a_deleted_owner(
    kube_client: Any, kube_namespace: str
) -> None:
    core = client.CoreV1Api(kube_client)
    owner = core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "owner"}})
    reference = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": "owner",
        "uid": owner.metadata.uid,
    }
    dependent = core.create_namespaced_config_map(
        kube_namespace, {"metadata": {"name": "dependent", "ownerReferences": [reference]}}
    )
    core.delete_namespaced_config_map("owner", kube_namespace, propagation_policy="Background")

    def deleted(event: dict[str, Any]) -> Any:
        return event["object"] if event["type"] == "DELETED" else None

    _watch_until(
        core.list_namespaced_config_map,
        deleted,
        namespace=kube_namespace,
        field_selector="metadata.name=dependent",
        resource_version=dependent.metadata.resource_version,  # events after its creation
    )
    with pytest.raises(ApiException) as gone:
        core.read_namespaced_config_map("dependent", kube_namespace)
    assert gone.value.status == 404


def test_the_api_server_restarts_on_the_same_port_with_its_data(
    dev_cluster: ClusterInfo, kube_client: Any, kube_namespace: str
) -> None:
    core = client.CoreV1Api(kube_client)
    kept = core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "kept"}})
    stop_component(dev_cluster.state_dir, "kube-apiserver")
    stopped = status(dev_cluster.state_dir)
    assert stopped.components == {
        "etcd": True, "kube-apiserver": False,
        "kube-controller-manager": True, "kube-scheduler": True,
    }  # fmt: skip
    assert not stopped.ready
    with pytest.raises(ApiError) as unreachable:
        dev_cluster.api().request("GET", "/readyz", timeout_s=2)
    assert unreachable.value.status == 0
    with pytest.raises(StartupError, match="is already running"):
        start_component(dev_cluster.state_dir, "etcd")

    took = start_component(dev_cluster.state_dir, "kube-apiserver")
    assert took < 60
    assert status(dev_cluster.state_dir).running
    # Same address, certificate and tokens: the clients made before the stop work unchanged.
    again = core.read_namespaced_config_map("kept", kube_namespace)
    assert again.metadata.uid == kept.metadata.uid


def test_only_components_of_the_cluster_can_be_stopped(dev_cluster: ClusterInfo) -> None:
    with pytest.raises(ValueError, match="'kubelet' is not a component of the dev cluster"):
        stop_component(dev_cluster.state_dir, "kubelet")
    assert status(dev_cluster.state_dir).running
