"""`up`, `down` and `status` of the local cluster: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler on free ports, fake nodes, and one real node
(`ddm_devcluster.realnode`: kubelet, kube-proxy, containerd, cluster DNS) unless asked not to.

Everything one cluster needs lives in its state directory (default
``$DDM_DEV_CLUSTER_DIR`` or ``~/.cache/ddm/dev-cluster``): ``state.json`` (pids, ports,
server, admin token), ``kubeconfig`` (admin), ``pki/``, ``etcd/``, ``logs/`` and ``node/``.
The processes outlive `up`; `down` stops them and removes the node's namespaces. Each `up`
starts from an empty etcd.

With a real node, the fake nodes carry the taint ``ddm.dev/fake-node:NoSchedule``: pods that
do not tolerate it (every workload a user applies) run on the real node, and scheduling
experiments that tolerate it still reach the fake accelerators.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from ddm_devcluster import components as c
from ddm_devcluster import namespaces, node
from ddm_devcluster.api import Api, ApiError
from ddm_devcluster.build import Binaries, Log, cache_bin_dir, ensure_binaries, log_stderr
from ddm_devcluster.certs import create_pki
from ddm_devcluster.nodes import DEFAULT_NODES, FakeNode, register_nodes
from ddm_devcluster.realnode import FAKE_ONLY_SERVICE_RANGE, NodeLayout, NodeNetwork
from ddm_devcluster.processes import StartupError, free_ports, is_ours, spawn, stop, wait_until


@dataclass(frozen=True)
class ClusterInfo:
    """How to reach a running dev cluster as its admin (``system:masters``)."""

    state_dir: Path
    kubeconfig: Path
    server: str  # https://127.0.0.1:PORT
    token: str  # bearer token of the admin user
    ca_file: Path  # PEM CA that signed the API server's certificate
    kube_version: str  # e.g. "v1.20.2"

    def api(self) -> Api:
        return Api(self.server, self.token, self.ca_file)


@dataclass(frozen=True)
class ClusterStatus:
    """What `status` found: which components run, and whether the API server says ready."""

    state_dir: Path
    components: dict[str, bool]  # component name -> its process is alive
    ready: bool  # kube-apiserver answered /readyz with "ok"
    info: ClusterInfo | None  # None when there is no state file

    @property
    def running(self) -> bool:
        return bool(self.components) and all(self.components.values())


def default_state_dir() -> Path:
    """``$DDM_DEV_CLUSTER_DIR`` or ``~/.cache/ddm/dev-cluster``."""
    env = os.environ.get("DDM_DEV_CLUSTER_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ddm" / "dev-cluster"


def _layout(state_dir: Path | None) -> c.Layout:
    return c.Layout((state_dir or default_state_dir()).expanduser().resolve())


def _marker(layout: c.Layout) -> str:
    # Every component's command line names a file under the state directory; the trailing
    # slash keeps /tmp/a from matching a cluster in /tmp/ab.
    return f"{layout.root}/"


def _read_state(layout: c.Layout) -> dict[str, Any] | None:
    try:
        return json.loads(layout.state_file.read_text())
    except (OSError, ValueError):
        return None


def _write_state(layout: c.Layout, state: dict[str, Any]) -> None:
    partial = layout.state_file.with_suffix(".partial")
    partial.write_text(json.dumps(state, indent=2))
    partial.chmod(0o600)  # it holds the admin token
    partial.replace(layout.state_file)


def _info(layout: c.Layout, state: dict[str, Any]) -> ClusterInfo:
    return ClusterInfo(
        state_dir=layout.root,
        kubeconfig=Path(state["kubeconfig"]),
        server=state["server"],
        token=state["token"],
        ca_file=Path(state["ca_file"]),
        kube_version=state["kube_version"],
    )


def status(state_dir: Path | None = None) -> ClusterStatus:
    """The state of the dev cluster in ``state_dir`` (no side effects)."""
    layout = _layout(state_dir)
    state = _read_state(layout)
    if state is None:
        return ClusterStatus(layout.root, {}, False, None)
    alive = {name: is_ours(pid, _marker(layout)) for name, pid in state["pids"].items()}
    info = _info(layout, state)
    ready = False
    if alive.get("kube-apiserver"):
        try:
            ready = info.api().request("GET", "/readyz", timeout_s=2) == "ok"
        except ApiError:
            ready = False
    return ClusterStatus(layout.root, alive, ready, info)


def down(state_dir: Path | None = None, *, purge: bool = False, log: Log = log_stderr) -> None:
    """Stop every process of the cluster in ``state_dir``; with ``purge``, delete its files.

    Safe to call when nothing runs, and after an interrupted `up`.
    """
    layout = _layout(state_dir)
    state = _read_state(layout)
    if state is not None:
        def stop_components(names: list[str] | tuple[str, ...]) -> None:
            stop([state["pids"][n] for n in names if n in state["pids"]], _marker(layout))

        if state.get("real_node") is not None:
            node.stop(NodeLayout(layout.node_dir), NodeNetwork(state["real_node"]["slot"]),
                      stop_components, log)
        # Clients first, etcd last, so the API server does not log lost connections.
        for stage in c.STOP_ORDER:
            stop_components(stage)
        layout.state_file.unlink(missing_ok=True)
        log(f"stopped the dev cluster in {layout.root}")
    if purge:
        _clear(layout)


def cluster_slot(state_dir: Path | None = None) -> int:
    """The slot (`ddm_devcluster.realnode.NodeNetwork`) of the real node in ``state_dir``."""
    node_layout(state_dir)  # raises if there is none
    return _read_state(_layout(state_dir))["real_node"]["slot"]  # type: ignore[index]


def node_layout(state_dir: Path | None = None) -> NodeLayout:
    """The files of the real node of the running cluster in ``state_dir``."""
    layout = _layout(state_dir)
    state = _read_state(layout)
    if state is None or state.get("real_node") is None:
        raise StartupError(f"no dev cluster with a real node runs in {layout.root}: "
                           "run `ddm-dev-cluster up`")
    return NodeLayout(layout.node_dir)


def stop_component(state_dir: Path | None, name: str) -> None:
    """Stop one component of the running cluster in ``state_dir`` and leave the others running.

    For fault tests: stopping ``kube-apiserver`` makes the API unavailable while etcd keeps
    every object, so `start_component` brings the same cluster back.
    """
    layout, state = _running_state(state_dir, name)
    stop([state["pids"][name]], _marker(layout))


def start_component(state_dir: Path | None, name: str, *, timeout_s: float = 60.0) -> float:
    """Start a component that `stop_component` stopped, with the command line it had (same
    ports, certificates and flags); waits until it is healthy and returns the seconds that took.
    """
    layout, state = _running_state(state_dir, name)
    marker = _marker(layout)
    if is_ours(state["pids"][name], marker):
        raise StartupError(f"{name} of the dev cluster in {layout.root} is already running")
    command = state.get("commands", {}).get(name)
    if command is None:
        raise StartupError(f"the dev cluster in {layout.root} did not record how {name} was "
                           "started (it predates start_component); restart the whole cluster")
    pid = spawn(command, layout.log_file(name))
    state["pids"][name] = pid
    _write_state(layout, state)
    check = _health_check(name, c.Ports(**state["ports"]), _info(layout, state).api())
    return wait_until(check, what=f"{name} healthy", timeout_s=timeout_s,
                      watched=[(name, pid, layout.log_file(name))], marker=marker)


def _running_state(state_dir: Path | None, name: str) -> tuple[c.Layout, dict[str, Any]]:
    layout = _layout(state_dir)
    state = _read_state(layout)
    if state is None:
        raise StartupError(f"no dev cluster in {layout.root} (no {layout.state_file.name})")
    if name not in state["pids"]:
        raise ValueError(f"{name!r} is not a component of the dev cluster; "
                         f"one of {', '.join(state['pids'])}")
    return layout, state


def _health_check(name: str, ports: c.Ports, api: Api) -> Callable[[], bool]:
    """Whether component ``name`` serves: etcd's /health, the API server's /readyz, the
    controller-manager's and scheduler's /healthz."""
    checks: dict[str, Callable[[], bool]] = {
        "etcd": lambda: _http_ok(f"http://127.0.0.1:{ports.etcd_client}/health", '"true"'),
        "kube-apiserver": lambda: _api_ok(api, "/readyz"),
        "kube-controller-manager": lambda: _https_ok(ports.controller_manager),
        "kube-scheduler": lambda: _https_ok(ports.scheduler),
    }
    return checks[name]


def _clear(layout: c.Layout) -> None:
    for path in layout.owned_paths():
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def kube_version(apiserver: Path) -> tuple[str, int]:
    """("v1.20.2", 20) from ``kube-apiserver --version``."""
    out = subprocess.run([str(apiserver), "--version"], capture_output=True, text=True).stdout
    match = re.search(r"v(\d+)\.(\d+)\.\d+\S*", out)
    if match is None:
        raise StartupError(f"cannot read the version of {apiserver}: {out!r}")
    return match.group(0), int(match.group(2))


def up(
    state_dir: Path | None = None,
    *,
    binaries: Binaries | None = None,
    nodes: tuple[FakeNode, ...] = DEFAULT_NODES,
    real_node: bool = True,
    allow_build: bool = True,
    timeout_s: float = 180.0,
    log: Log = log_stderr,
) -> ClusterInfo:
    """Start a fresh dev cluster in ``state_dir`` (or return the one already running there).

    Finds or builds the binaries (see `ddm_devcluster.build`), starts the four components,
    registers the fake ``nodes``, starts the real node (unless ``real_node`` is False) and
    waits until controllers and scheduler are serving, the real node is Ready and the
    ``default`` service account can mount a token. Prints ``export KUBECONFIG=...`` on
    stdout. On any failure, or Ctrl-C, it stops what it started before raising.
    """
    layout = _layout(state_dir)
    current = status(layout.root)
    if current.running and current.ready and current.info is not None:
        log(f"the dev cluster in {layout.root} is already running")
        print(f"export KUBECONFIG={shlex.quote(str(current.info.kubeconfig))}", flush=True)
        return current.info
    down(layout.root, log=log)  # leftovers of a crashed or interrupted cluster
    binaries = binaries or ensure_binaries(allow_build=allow_build, log=log)
    if real_node:
        node.prepare(log)
    started = time.monotonic()
    try:
        _clear(layout)
        layout.root.mkdir(parents=True, exist_ok=True)
        info = _start(layout, binaries, nodes, real_node, timeout_s, log)
    except BaseException:
        down(layout.root, log=log)
        raise
    log(
        f"dev cluster {info.kube_version} up in {time.monotonic() - started:.1f} s at {info.server}"
    )
    print(f"export KUBECONFIG={shlex.quote(str(info.kubeconfig))}", flush=True)
    return info


def _start(
    layout: c.Layout, binaries: Binaries, nodes: tuple[FakeNode, ...], real_node: bool,
    timeout_s: float, log: Log,
) -> ClusterInfo:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    version, minor = kube_version(binaries.kube_apiserver)
    ports = c.Ports(*free_ports(5))
    node_layout = NodeLayout(layout.node_dir)
    network = None
    if real_node:
        network = namespaces.allocate()
        # Recorded before anything else, so that `down` removes the veth if `up` fails.
        _write_state(layout, {"pids": {}, "real_node": {"slot": network.slot}})
        namespaces.create(node_layout, network)
        log(f"node namespaces made: veth {network.host_link} {network.host_ip} <-> "
            f"{network.node_ip}, pods {network.pod_cidr}, services {network.service_cidr}")
        addresses = c.Addresses(network.host_ip, network.service_cidr, real_node=True)
        pki = create_pki(layout.pki_dir, (network.host_ip, network.kubernetes_service_ip))
    else:
        addresses = c.Addresses("127.0.0.1", FAKE_ONLY_SERVICE_RANGE, real_node=False)
        pki = create_pki(layout.pki_dir)
    server = f"https://{addresses.apiserver_ip}:{ports.apiserver}"
    tokens = _write_credentials(layout, server, pki.ca_cert.read_text())
    admin_token = tokens[c.ADMIN_USER]
    state: dict[str, Any] = {
        "kube_version": version,
        "server": server,
        "token": admin_token,
        "kubeconfig": str(layout.kubeconfig),
        "ca_file": str(pki.ca_cert),
        "ports": asdict(ports),
        "binaries": {k: str(v) for k, v in asdict(binaries).items()},
        "pids": {},
        "commands": {},
        "real_node": {"slot": network.slot} if network is not None else None,
    }
    info = _info(layout, state)
    api = info.api()
    marker = _marker(layout)
    watched: list[tuple[str, int, Path]] = []

    def launch(name: str, args: list[str]) -> None:
        pid = spawn(args, layout.log_file(name))
        state["pids"][name] = pid
        state["commands"][name] = args  # so `start_component` can restart it as it was
        _write_state(layout, state)  # written at once, so `down` can stop a half-started cluster
        watched.append((name, pid, layout.log_file(name)))

    def wait(what: str, check: Callable[[], bool]) -> None:
        took = wait_until(
            check, what=what, timeout_s=max(1.0, deadline - time.monotonic()),
            watched=watched, marker=marker,
        )  # fmt: skip
        log(f"{what}: {took:.1f} s")

    launch("etcd", c.etcd_args(binaries.etcd, layout, ports))
    wait("etcd healthy", _health_check("etcd", ports, api))
    launch(
        "kube-apiserver",
        c.apiserver_args(
            binaries.kube_apiserver, layout, ports, addresses, pki_ca=pki.ca_cert,
            pki_cert=pki.apiserver_cert, pki_key=pki.apiserver_key,
            sa_key=pki.service_account_key, sa_pub=pki.service_account_pub, minor=minor,
        ),
    )  # fmt: skip
    wait("kube-apiserver ready", _health_check("kube-apiserver", ports, api))
    launch(
        "kube-controller-manager",
        c.controller_manager_args(
            binaries.kube_controller_manager, layout, ports, pki_ca=pki.ca_cert,
            ca_key=pki.ca_key, sa_key=pki.service_account_key,
            service_range=addresses.service_range, minor=minor,
        ),
    )  # fmt: skip
    launch("kube-scheduler", c.scheduler_args(binaries.kube_scheduler, layout, ports, minor=minor))
    register_nodes(api, nodes, kubelet_version=version, schedulable=not real_node)
    log(f"registered fake nodes {', '.join(n.name for n in nodes)}")
    wait("kube-controller-manager healthy", _health_check("kube-controller-manager", ports, api))
    wait("kube-scheduler healthy", _health_check("kube-scheduler", ports, api))
    if network is not None:
        node_bin = cache_bin_dir()
        node.write_kubeconfigs(node_layout, server, pki.ca_cert.read_text(), tokens,
                               c.build_kubeconfig)
        node.start(node_layout, network, kubelet=_node_binary(binaries, "kubelet", node_bin),
                   kube_proxy=_node_binary(binaries, "kube-proxy", node_bin), api=api,
                   server=server, ca_file=pki.ca_cert, launch=launch, wait=wait, log=log)
    # Pods can be created only once the service-account controllers have made the default
    # service account (and, before 1.24, its token secret).
    wait("default service account", lambda: _default_service_account(api, minor))
    return info


def _node_binary(binaries: Binaries, name: str, cache_bin: Path) -> Path:
    """The kubelet or kube-proxy of the same release as the control plane (same directory)."""
    for directory in (binaries.kube_apiserver.parent, cache_bin):
        if (directory / name).is_file():
            return directory / name
    raise StartupError(f"no {name} beside {binaries.kube_apiserver} nor in {cache_bin}: run "
                       "`ddm-dev-cluster build`, or use --no-real-node")


def _write_credentials(layout: c.Layout, server: str, ca_pem: str) -> dict[str, str]:
    """Write the token file and the three kubeconfigs; returns every user's token."""
    tokens = {user: secrets.token_hex(16) for user in c.USER_GROUPS}
    layout.tokens_file.write_text(c.build_token_file(tokens))
    layout.tokens_file.chmod(0o600)
    layout.audit_policy_file.write_text(c.AUDIT_POLICY)
    for path, user in (
        (layout.kubeconfig, c.ADMIN_USER),
        (layout.component_kubeconfig("kube-controller-manager"), c.CONTROLLER_MANAGER_USER),
        (layout.component_kubeconfig("kube-scheduler"), c.SCHEDULER_USER),
    ):
        path.write_text(yaml.safe_dump(c.build_kubeconfig(server, ca_pem, user, tokens[user])))
        path.chmod(0o600)
    return tokens


def _http_ok(url: str, expect: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return expect in response.read().decode()
    except OSError:
        return False


def _https_ok(port: int) -> bool:
    """A component's own /healthz (self-signed certificate: not verified; it is on loopback)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(
            f"https://127.0.0.1:{port}/healthz", timeout=2, context=context
        ) as r:
            return r.read().decode().strip() == "ok"
    except OSError:
        return False


def _api_ok(api: Api, path: str) -> bool:
    try:
        return api.request("GET", path, timeout_s=2) == "ok"
    except ApiError:
        return False


def _default_service_account(api: Api, minor: int) -> bool:
    try:
        account = api.request(
            "GET", "/api/v1/namespaces/default/serviceaccounts/default", timeout_s=2
        )
    except ApiError:
        return False
    return minor >= 24 or bool(account.get("secrets"))
