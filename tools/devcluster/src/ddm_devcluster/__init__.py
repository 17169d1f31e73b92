"""A local Kubernetes control plane for tests and for trying the operator.

Real etcd, kube-apiserver, kube-controller-manager and kube-scheduler, started as local
processes, and fake nodes (CPU, NVIDIA GPU, AWS Neuron, Google TPU) that the real scheduler
binds pods to, and a real node (kubelet, kube-proxy, containerd) that runs them; the
project's images built with buildah. Imports no ML framework, and nothing of the product: a
tool of this repository (``ddm-dev-cluster``, the tests, the benchmarks), its own
distribution, never in the product's wheel or images.
"""

from ddm_devcluster.build import Binaries, BuildError, ensure_binaries, find_binaries
from ddm_devcluster.cluster import (ClusterInfo, ClusterStatus, down, start_component, status,
                                    stop_component, up)
from ddm_devcluster.command import main
from ddm_devcluster.processes import StartupError

__all__ = [
    "Binaries",
    "BuildError",
    "ClusterInfo",
    "ClusterStatus",
    "StartupError",
    "down",
    "ensure_binaries",
    "find_binaries",
    "main",
    "start_component",
    "status",
    "stop_component",
    "up",
]
