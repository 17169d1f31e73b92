"""Where the dev cluster keeps its files, and the command line of each component (pure).

Choices that matter:

* authentication is by static bearer tokens (``--token-auth-file``): an admin in
  ``system:masters``, and the controller-manager and scheduler as their usual users, whose
  permissions come from the API server's bootstrap RBAC policy; the controller-manager runs
  each controller under its own service account (``--use-service-account-credentials``);
* the controller-manager runs every default controller except ``nodelifecycle``: with no
  kubelet the nodes' heartbeats go stale, and that controller would mark them unreachable,
  taint them and evict their pods;
* no leader election (one instance each), secure ports only, on 127.0.0.1; with a real node
  (`ddm_devcluster.realnode`) the API server listens on the host's end of the node's veth
  instead, so that the kubelet, kube-proxy and pods reach it, and it authorizes the kubelet
  with the Node authorizer.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

from ddm_devcluster.realnode import DNS_USER, KUBE_PROXY_USER, NODE_USER

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
ADMIN_USER = "ddm-admin"
CONTROLLER_MANAGER_USER = "system:kube-controller-manager"
SCHEDULER_USER = "system:kube-scheduler"
# The users of the token file and their groups.
USER_GROUPS = {ADMIN_USER: ("system:masters",), CONTROLLER_MANAGER_USER: (), SCHEDULER_USER: (),
               NODE_USER: ("system:nodes",), KUBE_PROXY_USER: (), DNS_USER: ()}
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
NODE_COMPONENTS = ("containerd", "kubelet", "kube-proxy", "cluster-dns")
# The API server's audit policy: the requests of service accounts outside kube-system (an
# operator under test), metadata only, so a test can list the verbs it used.
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: None
  userGroups: ["system:serviceaccounts:kube-system"]
- level: Metadata
  userGroups: ["system:serviceaccounts"]
- level: None
"""
# `down` stops the components stage by stage: the node's (containerd last: its containers are
# killed first), the API server's other clients, then it, then etcd.
STOP_ORDER = (("kubelet", "kube-proxy", "cluster-dns"), ("containerd",),
              ("kube-controller-manager", "kube-scheduler"), ("kube-apiserver",), ("etcd",))


@dataclass(frozen=True)
class Layout:
    """The files of one dev cluster under its state directory."""

    root: Path

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def pki_dir(self) -> Path:
        return self.root / "pki"

    @property
    def tokens_file(self) -> Path:
        return self.root / "tokens.csv"

    @property
    def audit_policy_file(self) -> Path:
        return self.root / "audit-policy.yaml"

    @property
    def audit_log(self) -> Path:
        """One JSON event per line (``AUDIT_POLICY``)."""
        return self.root / "logs" / "audit.log"

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig users point KUBECONFIG at."""
        return self.root / "kubeconfig"

    def component_kubeconfig(self, component: str) -> Path:
        return self.root / f"{component}.kubeconfig"

    @property
    def etcd_dir(self) -> Path:
        return self.root / "etcd"

    def log_file(self, component: str) -> Path:
        return self.root / "logs" / f"{component}.log"

    @property
    def node_dir(self) -> Path:
        """The real node's files (`ddm_devcluster.realnode.NodeLayout`)."""
        return self.root / "node"

    def cert_dir(self, component: str) -> Path:
        """Where a component keeps the self-signed certificate of its own secure port."""
        return self.root / "serving-certs" / component

    def owned_paths(self) -> list[Path]:
        """Everything `up` creates, so a new `up` can clear the last cluster's leftovers."""
        return [
            self.state_file,
            self.pki_dir,
            self.tokens_file,
            self.audit_policy_file,
            self.kubeconfig,
            *(self.component_kubeconfig(c) for c in COMPONENTS),
            self.etcd_dir,
            self.root / "logs",
            self.root / "serving-certs",
            self.node_dir,
        ]


@dataclass(frozen=True)
class Addresses:
    """Where the API server listens and which range its Services' cluster IPs come from."""

    apiserver_ip: str  # 127.0.0.1, or the host's end of the real node's veth
    service_range: str
    real_node: bool


@dataclass(frozen=True)
class Ports:
    """The TCP ports (all on 127.0.0.1) one cluster uses."""

    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int


def etcd_args(etcd: Path, layout: Layout, ports: Ports) -> list[str]:
    client = f"http://127.0.0.1:{ports.etcd_client}"
    peer = f"http://127.0.0.1:{ports.etcd_peer}"
    return [
        str(etcd),
        "--name=ddm",
        f"--data-dir={layout.etcd_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=ddm={peer}",
        "--logger=zap",
        "--log-level=warn",
    ]


def apiserver_args(
    binary: Path, layout: Layout, ports: Ports, addresses: Addresses, *, pki_ca: Path,
    pki_cert: Path, pki_key: Path, sa_key: Path, sa_pub: Path, minor: int,
) -> list[str]:  # fmt: skip
    args = [
        str(binary),
        f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
        f"--bind-address={addresses.apiserver_ip}",
        f"--advertise-address={addresses.apiserver_ip}",
        f"--secure-port={ports.apiserver}",
        f"--cert-dir={layout.cert_dir('kube-apiserver')}",
        f"--tls-cert-file={pki_cert}",
        f"--tls-private-key-file={pki_key}",
        f"--client-ca-file={pki_ca}",
        # Lets the controller-manager's and scheduler's delegated authentication read a
        # complete kube-system/extension-apiserver-authentication (else they log errors).
        f"--requestheader-client-ca-file={pki_ca}",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--token-auth-file={layout.tokens_file}",
        f"--audit-policy-file={layout.audit_policy_file}",
        f"--audit-log-path={layout.audit_log}",
        "--authorization-mode=Node,RBAC",
        f"--service-cluster-ip-range={addresses.service_range}",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-key-file={sa_pub}",
        f"--service-account-signing-key-file={sa_key}",
        "--allow-privileged=true",
        # The kubelet's name is not in any DNS the API server reads (logs, exec, port-forward).
        "--kubelet-preferred-address-types=InternalIP,Hostname",
        # The `kubernetes` Endpoints may not point at a loopback address: without a real node
        # no pod runs to use it, so it is not maintained.
        f"--endpoint-reconciler-type={'lease' if addresses.real_node else 'none'}",
        "--profiling=false",
    ]
    if minor < 24:  # the insecure port (default 8080) exists until 1.24: close it
        args.append("--insecure-port=0")
    return args


def controller_manager_args(
    binary: Path, layout: Layout, ports: Ports, *, pki_ca: Path, ca_key: Path, sa_key: Path,
    service_range: str, minor: int,
) -> list[str]:  # fmt: skip
    kubeconfig = layout.component_kubeconfig("kube-controller-manager")
    args = [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports.controller_manager}",
        f"--cert-dir={layout.cert_dir('kube-controller-manager')}",
        "--leader-elect=false",
        "--controllers=*,-nodelifecycle",
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={sa_key}",
        f"--root-ca-file={pki_ca}",
        f"--cluster-signing-cert-file={pki_ca}",
        f"--cluster-signing-key-file={ca_key}",
        f"--service-cluster-ip-range={service_range}",
        "--profiling=false",
    ]
    if minor < 24:
        args.append("--port=0")
    return args


def scheduler_args(binary: Path, layout: Layout, ports: Ports, *, minor: int) -> list[str]:
    kubeconfig = layout.component_kubeconfig("kube-scheduler")
    args = [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports.scheduler}",
        f"--cert-dir={layout.cert_dir('kube-scheduler')}",
        "--leader-elect=false",
        "--profiling=false",
    ]
    if minor < 23:
        args.append("--port=0")
    return args


def build_token_file(tokens: dict[str, str]) -> str:
    """The ``--token-auth-file`` CSV: ``token,user,uid[,"group,..."]`` per user of USER_GROUPS."""
    lines = []
    for user, groups in USER_GROUPS.items():
        group_field = f',"{",".join(groups)}"' if groups else ""
        lines.append(f"{tokens[user]},{user},{user}{group_field}\n")
    return "".join(lines)


def build_kubeconfig(server: str, ca_pem: str, user: str, token: str) -> dict:
    """A one-context kubeconfig (CA embedded, bearer token) named ``ddm-dev``."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "ddm-dev",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_pem.encode()).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "ddm-dev", "context": {"cluster": "ddm-dev", "user": user}}],
        "current-context": "ddm-dev",
    }
