"""The dev cluster's real node: its addresses, files and command lines (pure).

One node, ``ddm-real-0``, runs the real kubelet and kube-proxy (from the same build as the
control plane) with Debian's containerd, runc and CNI plugins. It lives in namespaces of its own
(see `ddm_devcluster.namespaces`), so nothing it does touches the host:

* a network namespace joined to the host by a veth pair. Every address is in 198.18.0.0/15 (the
  benchmarking range, never routed on the internet nor used by private networks): the veth,
  the pods' bridge and the Services' cluster IPs. The host routes the pod and Service ranges
  through the veth, so tests reach pods directly; the kubelet, kube-proxy and the CNI plugins
  write iptables rules and sysctls of that namespace only;
* a private mount namespace in which ``/run``, ``/var/lib`` and ``/var/log`` are directories
  of the node's state, and the six global kernel tunables the kubelet insists on writing
  (``kernel.panic`` and friends) are files of the node's state too;
* its containers' cgroups under ``/ddm-node-<slot>`` in each cgroup v1 hierarchy.

A *slot* (0..63) numbers the node, so that clusters started side by side do not collide:
veth ``198.19.<slot>.0/30``, pods ``198.18.<2 slot>.0/24``, Services ``198.18.<2 slot + 1>.0/24``.

Choices that matter:

* containerd may not set a negative ``oom_score_adj`` (``restrict_oom_score_adj``) and the
  kubelet runs with ``--oom-score-adj=0``: a sandbox without CAP_SYS_RESOURCE refuses both;
* the kubelet never garbage-collects images (``--image-gc-high-threshold=100``): they were
  imported, not pulled, and could not be pulled back;
* kube-proxy masquerades all Service traffic (``--masquerade-all``): a pod reaching a pod on
  the same bridge through a cluster IP then gets the reply back through the node, without the
  host's ``br_netfilter`` settings;
* the kubelet's API allows any caller (``--authorization-mode=AlwaysAllow``); it listens on the
  node's address, which only the host can reach;
* the kubelet's root directory is ``/var/lib/kubelet`` as the node sees it (the node's private
  ``/var/lib``, under its state directory on the host): the kubelet makes unix sockets in it
  (``pod-resources/kubelet.sock``), whose path may not exceed 107 bytes, and a root under a
  deep state directory (a test's temporary directory) passed that limit; the kubelet then dies
  at start (``Failed to create listener for podResources endpoint``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

NODE_NAME = "ddm-real-0"
REAL_NODE_LABEL = "ddm.dev/real-node"
CLUSTER_DOMAIN = "cluster.local"
MAX_SLOTS = 64
# The tunables the kubelet sets at start (pkg/kubelet/cm: setupKernelTunables) and the values
# it wants; inside the node's mount namespace they are files holding these values.
KERNEL_TUNABLES = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
# Host directories replaced, inside the node's mount namespace, by directories of its state.
PRIVATE_DIRS = ("/run", "/var/lib", "/var/log")
NODE_USER = f"system:node:{NODE_NAME}"
KUBE_PROXY_USER = "system:kube-proxy"
DNS_USER = "system:ddm-dev-dns"
# containerd's socket, inside the node's mount namespace (where /run is the node's own): a
# path under the state directory can exceed the 108 bytes a unix socket's path may have.
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
# The kubelet's root directory, inside the node's mount namespace (under its private /var/lib):
# it holds unix sockets, so it may not be a path under the state directory either.
KUBELET_ROOT = "/var/lib/kubelet"
# Service range of a cluster without a real node (nothing routes it; no slot needs it).
FAKE_ONLY_SERVICE_RANGE = "198.18.255.0/24"


@dataclass(frozen=True)
class NodeNetwork:
    """The addresses of the real node in ``slot``."""

    slot: int

    def __post_init__(self) -> None:
        if not 0 <= self.slot < MAX_SLOTS:
            raise ValueError(f"slot {self.slot} is outside 0..{MAX_SLOTS - 1}")

    @property
    def host_ip(self) -> str:
        """The host's end of the veth: the API server and the cluster DNS listen here."""
        return f"198.19.{self.slot}.1"

    @property
    def node_ip(self) -> str:
        return f"198.19.{self.slot}.2"

    @property
    def link_cidr(self) -> str:
        return f"198.19.{self.slot}.0/30"

    @property
    def pod_cidr(self) -> str:
        return f"198.18.{2 * self.slot}.0/24"

    @property
    def pod_gateway(self) -> str:
        return f"198.18.{2 * self.slot}.1"

    @property
    def service_cidr(self) -> str:
        return f"198.18.{2 * self.slot + 1}.0/24"

    @property
    def kubernetes_service_ip(self) -> str:
        """The first address of the Service range: the API server's ``kubernetes`` Service."""
        return f"198.18.{2 * self.slot + 1}.1"

    @property
    def host_link(self) -> str:
        return f"ddm{self.slot}h"

    @property
    def node_link(self) -> str:
        return f"ddm{self.slot}n"

    @property
    def cgroup_root(self) -> str:
        return f"/ddm-node-{self.slot}"


@dataclass(frozen=True)
class NodeLayout:
    """The real node's files, all under ``<state dir>/node``."""

    root: Path

    @property
    def netns(self) -> Path:
        return self.root / "netns"

    @property
    def ns_dir(self) -> Path:
        """A private bind mount of its own: a persistent mount namespace must live in one."""
        return self.root / "ns"

    @property
    def mntns(self) -> Path:
        return self.root / "ns" / "mnt"

    def private_dir(self, host_path: str) -> Path:
        return self.root / "private" / host_path.strip("/").replace("/", "-")

    @property
    def tunables_dir(self) -> Path:
        return self.root / "kernel-tunables"

    @property
    def containerd_config(self) -> Path:
        return self.root / "containerd.toml"

    def ctr(self) -> list[str]:
        """The ``ctr`` command line that talks to the node's containerd (from the host)."""
        return ["nsenter", f"--mount={self.mntns}", "--", "ctr", "-a", CONTAINERD_SOCKET]

    @property
    def cni_dir(self) -> Path:
        return self.root / "cni"

    @property
    def kubelet_dir(self) -> Path:
        return self.root / "kubelet"

    @property
    def kubeconfig_kubelet(self) -> Path:
        return self.root / "kubelet.kubeconfig"

    @property
    def kubeconfig_kube_proxy(self) -> Path:
        return self.root / "kube-proxy.kubeconfig"

    @property
    def resolv_conf(self) -> Path:
        return self.root / "resolv.conf"


def containerd_config(layout: NodeLayout, pause_image: str) -> str:
    """containerd's config.toml: state under the node's directory, CRI with the CNI bridge."""
    base = layout.root / "containerd"
    return f"""version = 2
root = "{base / 'root'}"
state = "{base / 'state'}"

[grpc]
  address = "{CONTAINERD_SOCKET}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{base / 'opt'}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause_image}"
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{layout.cni_dir / 'net.d'}"
    max_conf_num = 1
"""


def cni_config(layout: NodeLayout, network: NodeNetwork) -> str:
    """The pods' network: a bridge with host-local addresses, default route via the node."""
    return json.dumps({
        "cniVersion": "0.4.0",
        "name": "ddm-dev",
        "plugins": [
            {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
             "hairpinMode": True,
             "ipam": {"type": "host-local", "dataDir": str(layout.cni_dir / "ipam"),
                      "ranges": [[{"subnet": network.pod_cidr,
                                   "gateway": network.pod_gateway}]],
                      "routes": [{"dst": "0.0.0.0/0"}]}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }, indent=2)


def _in_node(layout: NodeLayout, binary: Path | str) -> list[str]:
    return ["nsenter", f"--net={layout.netns}", f"--mount={layout.mntns}", "--", str(binary)]


def containerd_args(layout: NodeLayout) -> list[str]:
    return [*_in_node(layout, "containerd"), "--config", str(layout.containerd_config)]


def kubelet_args(kubelet: Path, layout: NodeLayout, network: NodeNetwork, *,
                 pause_image: str) -> list[str]:
    return [
        *_in_node(layout, kubelet),
        f"--kubeconfig={layout.kubeconfig_kubelet}",
        "--container-runtime=remote",
        f"--container-runtime-endpoint=unix://{CONTAINERD_SOCKET}",
        "--runtime-request-timeout=5m",
        "--cgroup-driver=cgroupfs",
        f"--cgroup-root={network.cgroup_root}",
        "--fail-swap-on=false",
        f"--root-dir={KUBELET_ROOT}",
        f"--cert-dir={layout.kubelet_dir / 'pki'}",
        f"--volume-plugin-dir={layout.kubelet_dir / 'volume-plugins'}",
        f"--hostname-override={NODE_NAME}",
        f"--node-ip={network.node_ip}",
        f"--address={network.node_ip}",
        "--register-node=true",
        f"--node-labels={REAL_NODE_LABEL}=true",
        f"--pod-infra-container-image={pause_image}",
        f"--cluster-dns={network.host_ip}",
        f"--cluster-domain={CLUSTER_DOMAIN}",
        f"--resolv-conf={layout.resolv_conf}",
        "--anonymous-auth=true",
        "--authorization-mode=AlwaysAllow",
        "--read-only-port=0",
        "--healthz-bind-address=127.0.0.1",
        "--oom-score-adj=0",
        "--image-gc-high-threshold=100",
        "--image-gc-low-threshold=99",
        "--eviction-hard=memory.available<100Mi,nodefs.available<2%,imagefs.available<2%",
        "--v=1",
    ]


def kube_proxy_args(kube_proxy: Path, layout: NodeLayout, network: NodeNetwork) -> list[str]:
    return [
        *_in_node(layout, kube_proxy),
        f"--kubeconfig={layout.kubeconfig_kube_proxy}",
        f"--hostname-override={NODE_NAME}",
        "--proxy-mode=iptables",
        f"--cluster-cidr={network.pod_cidr}",
        "--masquerade-all=true",
        # 0: leave the (global) conntrack table size and timeouts as they are.
        "--conntrack-max-per-core=0",
        "--conntrack-tcp-timeout-established=0",
        "--conntrack-tcp-timeout-close-wait=0",
        "--metrics-bind-address=127.0.0.1:10249",
        "--healthz-bind-address=127.0.0.1:10256",
        "--v=1",
    ]
