"""The dev cluster's fake nodes: one CPU node and one per accelerator family.

No kubelet runs: nodes are API objects with a capacity and a Ready condition, so the real
scheduler binds pods to them (by extended resources, labels and taints) and nothing runs the
pods, which stay Pending with ``spec.nodeName`` set. Accelerator nodes carry the taints the
cloud providers' device plugins set, so workloads need the matching toleration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ddm_devcluster.api import Api

FAKE_NODE_LABEL = "ddm.dev/fake-node"
# With a real node in the cluster, the fake nodes carry this taint so that only pods that
# tolerate it are bound to them (and never run).
FAKE_NODE_TAINT = {"key": FAKE_NODE_LABEL, "value": "true", "effect": "NoSchedule"}
# Added by the API server's TaintNodesByCondition admission plugin on create; normally the
# node-lifecycle controller removes it once the kubelet reports Ready.
NOT_READY_TAINT = "node.kubernetes.io/not-ready"


@dataclass(frozen=True)
class FakeNode:
    """One node to register: capacity (= allocatable) in Kubernetes quantities, labels, taints."""

    name: str
    capacity: dict[str, str]
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[dict[str, str], ...] = ()


#: Pods a fake node takes. A test session's namespaces are never deleted (pods bound to a fake
#: node are never finalised), so bound pods only add up: with the kubelet's default of 110, the
#: CPU node was full two thirds into the integration tests and later routers stayed Pending
#: ("Too many pods"). Fake nodes run nothing, so the count costs nothing.
FAKE_NODE_PODS = 4096


def _capacity(cpu: str, memory: str, **extended: str) -> dict[str, str]:
    return {"cpu": cpu, "memory": memory, "pods": str(FAKE_NODE_PODS),
            "ephemeral-storage": "500Gi", **extended}


def _no_schedule(key: str) -> dict[str, str]:
    return {"key": key, "value": "present", "effect": "NoSchedule"}


DEFAULT_NODES: tuple[FakeNode, ...] = (
    FakeNode(
        name="ddm-cpu-0",
        # the largest of its family: the session's leftover pods hold their CPU requests
        capacity=_capacity("192", "768Gi"),
        labels={"node.kubernetes.io/instance-type": "m6i.48xlarge"},
    ),
    FakeNode(
        name="ddm-gpu-0",
        capacity=_capacity("192", "2048Gi", **{"nvidia.com/gpu": "8"}),
        labels={
            "node.kubernetes.io/instance-type": "p5.48xlarge",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            "nvidia.com/gpu.count": "8",
            "nvidia.com/gpu.memory": "81559",
        },
        taints=(_no_schedule("nvidia.com/gpu"),),
    ),
    FakeNode(
        name="ddm-neuron-0",
        capacity=_capacity(
            "128", "512Gi", **{"aws.amazon.com/neuron": "16", "aws.amazon.com/neuroncore": "32"}
        ),
        labels={"node.kubernetes.io/instance-type": "trn1.32xlarge"},
        taints=(_no_schedule("aws.amazon.com/neuron"),),
    ),
    FakeNode(
        name="ddm-tpu-0",
        capacity=_capacity("112", "192Gi", **{"google.com/tpu": "4"}),
        labels={
            "node.kubernetes.io/instance-type": "ct5lp-hightpu-4t",
            "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
            "cloud.google.com/gke-tpu-topology": "2x2",
        },
        taints=(_no_schedule("google.com/tpu"),),
    ),
)


def build_node(node: FakeNode, *, kubelet_version: str, now: datetime,
               schedulable: bool = True) -> dict[str, Any]:
    """The Node manifest (spec and status) for ``node``; ``now`` stamps its Ready condition;
    not ``schedulable``: tainted with FAKE_NODE_TAINT."""
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    labels = {
        "kubernetes.io/hostname": node.name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        FAKE_NODE_LABEL: "true",
        **node.labels,
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node.name, "labels": labels},
        "spec": {"taints": [dict(t) for t in node.taints]
                 + ([] if schedulable else [dict(FAKE_NODE_TAINT)])},
        "status": {
            "capacity": dict(node.capacity),
            "allocatable": dict(node.capacity),
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "fake node registered by ddm-dev-cluster (no kubelet)",
                    "lastHeartbeatTime": stamp,
                    "lastTransitionTime": stamp,
                }
            ],
            "addresses": [{"type": "Hostname", "address": node.name}],
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": kubelet_version,
                "kubeProxyVersion": kubelet_version,
                "containerRuntimeVersion": "fake://0",
                "osImage": "ddm fake node",
                "kernelVersion": "",
                "bootID": "",
                "machineID": "",
                "systemUUID": "",
            },
        },
    }


def register_nodes(api: Api, nodes: tuple[FakeNode, ...], *, kubelet_version: str,
                   schedulable: bool = True) -> None:
    """Create ``nodes`` (status included) and remove the not-ready taint admission adds.

    The node-lifecycle controller is disabled in this cluster, so nothing puts it back or
    marks the nodes unreachable once their (never refreshed) heartbeat goes stale.
    """
    now = datetime.now(UTC)
    for node in nodes:
        manifest = build_node(node, kubelet_version=kubelet_version, now=now,
                              schedulable=schedulable)
        created = api.request("POST", "/api/v1/nodes", manifest)  # status is kept on create
        remove_not_ready_taint(api, created)


def remove_not_ready_taint(api: Api, node: dict[str, Any]) -> None:
    """Drop NOT_READY_TAINT from ``node`` (a Node as read from the API), if it has it."""
    taints = node.get("spec", {}).get("taints") or []
    kept = [t for t in taints if t.get("key") != NOT_READY_TAINT]
    if kept != taints:
        api.merge_patch(f"/api/v1/nodes/{node['metadata']['name']}", {"spec": {"taints": kept}})
