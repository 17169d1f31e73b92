"""The dev cluster is a working control plane: real scheduler, real controllers, real CRDs.

Every wait is a watch (or a poll) bounded by a deadline; nothing sleeps a fixed time. Tests
that use the cluster are marked ``cluster`` by conftest; the first two need none.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from ddm_devcluster import (ClusterInfo, StartupError, down, start_component, status,
                            stop_component, up)
from ddm_devcluster.cluster import cluster_slot
from ddm_devcluster.namespaces import host_footprint
from ddm_devcluster.node import dns_query
from ddm_devcluster.realnode import KERNEL_TUNABLES, NodeNetwork
from ddm_devcluster.api import ApiError
from ddm_devcluster.apt import deb_src_stanzas
from ddm_devcluster.components import USER_GROUPS, build_token_file

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
    tokens = {user: user[:3] for user in USER_GROUPS}
    lines = build_token_file(tokens).splitlines()
    assert 'ddm,ddm-admin,ddm-admin,"system:masters"' in lines
    assert 'sys,system:node:ddm-real-0,system:node:ddm-real-0,"system:nodes"' in lines
    assert sum("system:masters" in line for line in lines) == 1
    assert len(lines) == len(USER_GROUPS)


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
        assert node.status.allocatable["pods"] == "4096"  # a session's leftover pods never fill it
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


# -- the real node ------------------------------------------------------------------------------

#: Host paths the kubelet, containerd and the CNI plugins use by default: the node must never
#: create them on the host (it sees directories of its own state there).
NODE_DEFAULT_PATHS = ("/var/lib/kubelet", "/var/lib/cni", "/var/lib/containerd", "/var/log/pods",
                      "/var/log/containers", "/run/containerd", "/opt/containerd", "/etc/cni",
                      "/usr/libexec/kubernetes")
#: Host kernel settings the kubelet, kube-proxy or the CNI plugins would change.
HOST_SYSCTLS = (*KERNEL_TUNABLES, "net/ipv4/ip_forward", "net/ipv4/conf/all/route_localnet",
                "net/netfilter/nf_conntrack_max")


def host_state() -> dict[str, Any]:
    """What the real node must leave as it found it: sysctls, iptables rules, default paths."""
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    return {
        "sysctls": {k: Path("/proc/sys", k).read_text().strip() for k in HOST_SYSCTLS
                    if Path("/proc/sys", k).exists()},
        "iptables": [re.sub(r"\[\d+:\d+\]", "", line) for line in rules.splitlines()
                     if not line.startswith("#")],
        "paths": {p: Path(p).exists() for p in NODE_DEFAULT_PATHS},
    }


def host_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs between two `host_state` snapshots, one line per change."""
    changes = []
    for name in sorted(before["sysctls"].keys() | after["sysctls"].keys()):
        was, now = before["sysctls"].get(name), after["sysctls"].get(name)
        if was != now:
            changes.append(f"sysctl {name}: {was} -> {now}")
    changes += [f"iptables rule removed: {line}" for line in before["iptables"]
                if line not in after["iptables"]]
    changes += [f"iptables rule added: {line}" for line in after["iptables"]
                if line not in before["iptables"]]
    changes += [f"{path} {'appeared' if after['paths'][path] else 'vanished'}"
                for path in NODE_DEFAULT_PATHS if before["paths"][path] != after["paths"][path]]
    return changes


@pytest.fixture
def host_before() -> dict[str, Any]:
    """The host's state before the real node starts."""
    if os.geteuid() != 0 or shutil.which("iptables-save") is None:
        message = "the real node needs root and Debian's iptables, containerd, buildah"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return host_state()


#: A state directory deeper than any a test's temporary directory gets: the node keeps its unix
#: sockets out of it (a socket's path may not exceed 107 bytes; the kubelet died at start when
#: its pod-resources socket was under a pytest temporary directory).
DEEP = "a-state-directory-deeper-than-a-unix-socket-path-may-be/" * 2


@pytest.fixture
def real_node_cluster(tmp_path: Path, host_before: dict[str, Any]) -> Iterator[ClusterInfo]:
    """A second dev cluster, with a real node and no fake nodes (only the pause image)."""
    state_dir = tmp_path / DEEP / "cluster"
    info = up(state_dir, nodes=(), real_node=True,
              allow_build=os.environ.get("DDM_DEV_CLUSTER_BUILD") != "0")
    try:
        yield info
    finally:
        down(state_dir)


def test_the_real_node_is_ready_on_containerd_and_leaves_the_host_as_it_was(
        real_node_cluster: ClusterInfo, host_before: dict[str, Any]) -> None:
    info = real_node_cluster
    assert len(str(info.state_dir)) > 108
    node = info.api().request("GET", "/api/v1/nodes/ddm-real-0")
    assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "True"
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert not any(t["key"].startswith("node.kubernetes.io/") for t in node["spec"].get(
        "taints") or [])
    (address,) = [a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"]
    assert ipaddress.ip_address(address) in ipaddress.ip_network("198.18.0.0/15")
    network = NodeNetwork(cluster_slot(info.state_dir))
    assert dns_query(network.host_ip, "kubernetes.default.svc.cluster.local") == (
        0, [network.kubernetes_service_ip])
    assert dns_query(network.host_ip, "nothing.default.svc.cluster.local")[0] == 3  # NXDOMAIN
    assert dns_query(network.host_ip, "example.com")[0] == 5  # REFUSED: no upstream
    changes = host_changes(host_before, host_state())
    assert not changes, "changed on the host while the node runs:\n" + "\n".join(changes)
    down(info.state_dir)
    changes = host_changes(host_before, host_state())
    assert not changes, "changed on the host after down:\n" + "\n".join(changes)
    assert host_footprint(network) == []
    assert [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if str(info.state_dir) in line] == []
