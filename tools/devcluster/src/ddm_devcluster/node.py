"""Start and stop the real node's processes: containerd, the kubelet, kube-proxy, cluster DNS.

`ddm_devcluster.cluster` calls `start` once the control plane serves, with its own ``launch``
(which records each process in the cluster's state) and ``wait``; `stop` undoes everything,
also after a half-finished `start`.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from ddm_devcluster import images, namespaces
from ddm_devcluster.api import Api, ApiError
from ddm_devcluster.apt import Log, ensure_apt_packages
from ddm_devcluster.dns import TYPE_A
from ddm_devcluster.nodes import remove_not_ready_taint
from ddm_devcluster.realnode import (CLUSTER_DOMAIN, DNS_USER, KUBE_PROXY_USER, NODE_NAME,
                                     NODE_USER, NodeLayout, NodeNetwork, cni_config,
                                     containerd_args, containerd_config, kube_proxy_args,
                                     kubelet_args)

# What the node needs from Debian, besides what the image build needs.
APT_PACKAGES = ("containerd", "runc", "containernetworking-plugins", "iptables", "iproute2",
                "util-linux", "buildah", "gcc", "libc6-dev")

Launch = Callable[[str, list[str]], None]
Wait = Callable[[str, Callable[[], bool]], None]


def prepare(log: Log) -> None:
    """Install what the node needs (as root, once) and fail early without cgroup v1."""
    ensure_apt_packages(APT_PACKAGES, log=log)
    namespaces.cgroup_hierarchies()


def write_kubeconfigs(layout: NodeLayout, server: str, ca_pem: str, tokens: dict[str, str],
                      build_kubeconfig: Callable[[str, str, str, str], dict]) -> None:
    """The kubelet's and kube-proxy's kubeconfigs, and the DNS server's token file."""
    layout.root.mkdir(parents=True, exist_ok=True)
    for path, user in ((layout.kubeconfig_kubelet, NODE_USER),
                       (layout.kubeconfig_kube_proxy, KUBE_PROXY_USER)):
        path.write_text(yaml.safe_dump(build_kubeconfig(server, ca_pem, user, tokens[user])))
        path.chmod(0o600)
    dns_token(layout).write_text(tokens[DNS_USER])
    dns_token(layout).chmod(0o600)


def dns_token(layout: NodeLayout) -> Path:
    return layout.root / "dns.token"


def start(layout: NodeLayout, network: NodeNetwork, *, kubelet: Path, kube_proxy: Path,
          api: Api, server: str, ca_file: Path, launch: Launch, wait: Wait, log: Log) -> None:
    """containerd (with the pause image), the kubelet, kube-proxy and the DNS server; returns
    once the node is Ready, schedulable and DNS answers."""
    layout.containerd_config.write_text(containerd_config(layout, images.PAUSE_IMAGE))
    (layout.cni_dir / "net.d").mkdir(parents=True, exist_ok=True)
    (layout.cni_dir / "net.d" / "10-ddm-dev.conflist").write_text(cni_config(layout, network))
    layout.resolv_conf.write_text("# cluster DNS only: the dev cluster has no upstream resolver\n")
    _grant_dns_reads(api)
    launch("containerd", containerd_args(layout))
    wait("containerd serving", lambda: _containerd_ok(layout))
    images.ensure_pause(images.cache_dir(), log)
    images.import_into_containerd([images.PAUSE_IMAGE], layout.ctr(), log=log)
    launch("cluster-dns", [sys.executable, "-m", "ddm_devcluster.dns", "--listen",
                           network.host_ip, "--server", server, "--token-file",
                           str(dns_token(layout)), "--ca-file", str(ca_file),
                           "--domain", CLUSTER_DOMAIN])
    launch("kubelet", kubelet_args(kubelet, layout, network, pause_image=images.PAUSE_IMAGE))
    launch("kube-proxy", kube_proxy_args(kube_proxy, layout, network))
    wait(f"node {NODE_NAME} Ready", lambda: _ready(api))
    _untaint(api)
    wait("cluster DNS answering", lambda: _dns_answers(
        network.host_ip, f"kubernetes.default.svc.{CLUSTER_DOMAIN}",
        network.kubernetes_service_ip))


def stop(layout: NodeLayout, network: NodeNetwork | None, stop_pids: Callable[[Sequence[str]],
         None], log: Log) -> None:
    """Stop the node: its agents, its containers, containerd and the shims, its namespaces."""
    stop_pids(["kubelet", "kube-proxy", "cluster-dns"])  # nothing restarts containers now
    if network is not None:
        namespaces.kill_containers(network)
    stop_pids(["containerd"])
    # containerd's shims (and anything else left) share the node's mount namespace.
    leftovers = namespaces.processes_in(layout.mntns)
    if leftovers:
        subprocess.run(["kill", "-KILL", *map(str, leftovers)], capture_output=True)
    problems = namespaces.remove(layout, network)
    for problem in problems:
        log(f"could not clean up: {problem}")


def _grant_dns_reads(api: Api) -> None:
    """The DNS server reads Services and Endpoints (the bootstrap role CoreDNS uses)."""
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "ddm-dev:cluster-dns"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "system:kube-dns"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                      "name": DNS_USER}],
    }
    api.request("POST", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", binding)


def _containerd_ok(layout: NodeLayout) -> bool:
    try:
        return subprocess.run([*layout.ctr(), "version"], capture_output=True,
                              timeout=10).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _ready(api: Api) -> bool:
    try:
        node = api.request("GET", f"/api/v1/nodes/{NODE_NAME}", timeout_s=5)
    except ApiError:
        return False
    conditions = node.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _untaint(api: Api) -> None:
    """The node-lifecycle controller (disabled here) would remove the not-ready taint."""
    remove_not_ready_taint(api, api.request("GET", f"/api/v1/nodes/{NODE_NAME}"))


def dns_query(server: str, name: str, *, timeout_s: float = 2.0) -> tuple[int, list[str]]:
    """One A query over UDP: (rcode, addresses). For health checks and tests."""
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    query = struct.pack("!HHHHHH", 0x4444, 0x0100, 1, 0, 0, 0) + question + struct.pack(
        "!HH", TYPE_A, 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout_s)
        sock.sendto(query, (server, 53))
        reply = sock.recv(4096)
    rcode = reply[3] & 0x0F
    count = struct.unpack("!H", reply[6:8])[0]
    offset = 12 + len(question) + 4
    addresses = []
    for _ in range(count):
        length = struct.unpack("!H", reply[offset + 10:offset + 12])[0]
        addresses.append(".".join(map(str, reply[offset + 12:offset + 12 + length])))
        offset += 12 + length
    return rcode, addresses


def _dns_answers(server: str, name: str, expected: str) -> bool:
    try:
        return dns_query(server, name)[1] == [expected]
    except OSError:
        return False
