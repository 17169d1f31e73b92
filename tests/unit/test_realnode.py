"""The real node's plan (addresses, configs, command lines), checked without running it."""

from __future__ import annotations

import ipaddress
import json
import tomllib
from pathlib import Path

import pytest

from ddm_devcluster.realnode import (CONTAINERD_SOCKET, KUBELET_ROOT, MAX_SLOTS, PRIVATE_DIRS,
                                     NodeLayout, NodeNetwork, cni_config, containerd_config,
                                     kube_proxy_args, kubelet_args)

BENCHMARKING = ipaddress.ip_network("198.18.0.0/15")
LAYOUT = NodeLayout(Path("/state/node"))


def networks_of(network: NodeNetwork) -> list[ipaddress.IPv4Network]:
    return [ipaddress.ip_network(c) for c in (network.link_cidr, network.pod_cidr,
                                              network.service_cidr)]


def test_every_address_of_every_slot_is_in_the_benchmarking_range_and_none_overlap() -> None:
    seen: list[ipaddress.IPv4Network] = []
    for slot in range(MAX_SLOTS):
        network = NodeNetwork(slot)
        for cidr in networks_of(network):
            assert cidr.subnet_of(BENCHMARKING), cidr
            assert not any(cidr.overlaps(other) for other in seen), (slot, cidr)
            seen.append(cidr)
        link = ipaddress.ip_network(network.link_cidr)
        assert {ipaddress.ip_address(network.host_ip),
                ipaddress.ip_address(network.node_ip)} <= set(link.hosts())
        assert ipaddress.ip_address(network.kubernetes_service_ip) in networks_of(network)[2]
    with pytest.raises(ValueError, match="outside"):
        NodeNetwork(MAX_SLOTS)


def test_containerd_keeps_its_state_under_the_node_and_never_asks_for_a_negative_oom_score(
        ) -> None:
    config = tomllib.loads(containerd_config(LAYOUT, "localhost/ddm-dev/pause:1"))
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["restrict_oom_score_adj"] is True
    assert cri["sandbox_image"] == "localhost/ddm-dev/pause:1"
    paths = [config["root"], config["state"], cri["cni"]["conf_dir"],
             config["plugins"]["io.containerd.internal.v1.opt"]["path"]]
    assert all(p.startswith("/state/node/") for p in paths), paths
    # Its socket is under /run inside the node's mount namespace: the node's own directory.
    assert config["grpc"]["address"] == CONTAINERD_SOCKET
    assert CONTAINERD_SOCKET.startswith("/run/") and "/run" in PRIVATE_DIRS


def test_the_pods_network_is_the_slots_bridge() -> None:
    network = NodeNetwork(3)
    (bridge, _portmap) = json.loads(cni_config(LAYOUT, network))["plugins"]
    (subnet,) = bridge["ipam"]["ranges"][0]
    assert subnet == {"subnet": "198.18.6.0/24", "gateway": "198.18.6.1"}
    assert bridge["ipam"]["dataDir"].startswith("/state/node/")


def test_the_kubelet_and_kube_proxy_run_inside_the_nodes_namespaces_and_leave_host_settings(
        ) -> None:
    network = NodeNetwork(0)
    kubelet = kubelet_args(Path("/bin/kubelet"), LAYOUT, network, pause_image="p")
    proxy = kube_proxy_args(Path("/bin/kube-proxy"), LAYOUT, network)
    for args in (kubelet, proxy):
        assert args[:4] == ["nsenter", "--net=/state/node/netns", "--mount=/state/node/ns/mnt",
                            "--"]
    assert "--oom-score-adj=0" in kubelet  # no CAP_SYS_RESOURCE: no negative score
    assert "--image-gc-high-threshold=100" in kubelet  # imported images cannot be pulled back
    assert f"--cgroup-root={network.cgroup_root}" in kubelet
    assert f"--cluster-dns={network.host_ip}" in kubelet
    # the kubelet's own root is the node's private /var/lib: short socket paths (unix sockets
    # allow 107 bytes), still under the state directory on the host
    assert f"--root-dir={KUBELET_ROOT}" in kubelet and "/var/lib" in PRIVATE_DIRS
    for flag in ("--cert-dir", "--volume-plugin-dir", "--resolv-conf"):
        (value,) = [a.split("=", 1)[1] for a in kubelet if a.startswith(flag + "=")]
        assert value.startswith("/state/node/"), (flag, value)
    # 0 leaves the host-wide conntrack table size and timeouts alone.
    assert {"--conntrack-max-per-core=0", "--conntrack-tcp-timeout-established=0"} <= set(proxy)
