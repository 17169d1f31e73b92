"""The real node's namespaces, veth and cgroups: made by `create`, removed by `remove`.

What the host sees while a node runs: a veth end ``ddm<slot>h`` (198.19.<slot>.1/30) with
routes to the node's pod and Service ranges through it, and cgroups ``/ddm-node-<slot>``.
Everything else (the node's network namespace, mount namespace, the directories it sees as
``/run``, ``/var/lib``, ``/var/log``, its kernel tunables) is under the node's state directory
and goes away with it. Uses ``ip`` (iproute2), ``unshare``, ``nsenter`` and ``mount``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from ddm_devcluster.realnode import (KERNEL_TUNABLES, MAX_SLOTS, PRIVATE_DIRS, NodeLayout,
                                     NodeNetwork)

CGROUP_V1 = Path("/sys/fs/cgroup")


class NamespaceError(RuntimeError):
    """The node's namespaces could not be made; the message names the command and its error."""


def _run(*cmd: str) -> str:
    result = subprocess.run(list(cmd), capture_output=True, text=True)
    if result.returncode != 0:
        raise NamespaceError(f"{' '.join(cmd)}: {result.stderr.strip() or result.returncode}")
    return result.stdout


def _is_mountpoint(path: Path) -> bool:
    target = f" {path} "
    return any(target in line for line in Path("/proc/self/mountinfo").read_text().splitlines())


def cgroup_hierarchies() -> list[Path]:
    """The mounted cgroup v1 hierarchies (the kubelet 1.20 needs them: no cgroup v2 only)."""
    found = [p for p in sorted(CGROUP_V1.iterdir()) if (p / "cgroup.procs").is_file()
             and not p.is_symlink()] if CGROUP_V1.is_dir() else []
    if not any(p.name == "memory" for p in found):
        raise NamespaceError("the real node needs cgroup v1 controllers mounted under "
                             f"{CGROUP_V1} (kubelet 1.20); this machine has none: use "
                             "--no-real-node")
    return found


def allocate() -> NodeNetwork:
    """Claim the first free slot by creating its veth pair (creation fails if it exists)."""
    for slot in range(MAX_SLOTS):
        network = NodeNetwork(slot)
        result = subprocess.run(["ip", "link", "add", network.host_link, "type", "veth",
                                 "peer", "name", network.node_link], capture_output=True)
        if result.returncode == 0:
            return network
    raise NamespaceError(f"all {MAX_SLOTS} real-node slots are taken (ip link shows ddm*h)")


def create(layout: NodeLayout, network: NodeNetwork) -> None:
    """The node's network and mount namespaces, with the veth of ``allocate`` between them."""
    cgroups = cgroup_hierarchies()
    layout.ns_dir.mkdir(parents=True, exist_ok=True)
    layout.netns.touch()
    _run("unshare", f"--net={layout.netns}", "true")
    _run("ip", "link", "set", network.node_link, "netns", str(layout.netns))
    _run("ip", "addr", "add", f"{network.host_ip}/30", "dev", network.host_link)
    _run("ip", "link", "set", network.host_link, "up")
    inside = ["nsenter", f"--net={layout.netns}"]
    _run(*inside, "ip", "link", "set", "lo", "up")
    _run(*inside, "ip", "addr", "add", f"{network.node_ip}/30", "dev", network.node_link)
    _run(*inside, "ip", "link", "set", network.node_link, "up")
    _run(*inside, "ip", "route", "add", "default", "via", network.host_ip)
    _run(*inside, "sysctl", "-qw", "net.ipv4.ip_forward=1")  # this namespace's own
    for cidr in (network.pod_cidr, network.service_cidr):
        _run("ip", "route", "add", cidr, "via", network.node_ip, "dev", network.host_link)
    _create_mount_namespace(layout)
    for hierarchy in cgroups:
        _make_cgroup(hierarchy, network.cgroup_root)


def _create_mount_namespace(layout: NodeLayout) -> None:
    # unshare can keep a mount namespace only in a file on a private mount.
    _run("mount", "--bind", str(layout.ns_dir), str(layout.ns_dir))
    _run("mount", "--make-private", str(layout.ns_dir))
    layout.mntns.touch()
    layout.tunables_dir.mkdir(parents=True, exist_ok=True)
    script = []
    for tunable, value in KERNEL_TUNABLES.items():
        shown = layout.tunables_dir / tunable.replace("/", ".")
        shown.write_text(f"{value}\n")
        script.append(f"mount --bind {shown} /proc/sys/{tunable}")
    for host_path in PRIVATE_DIRS:
        private = layout.private_dir(host_path)
        private.mkdir(parents=True, exist_ok=True)
        script.append(f"mount --bind {private} {host_path}")
    _run("unshare", f"--mount={layout.mntns}", "--propagation", "private", "sh", "-ec",
         "\n".join(script))


def _make_cgroup(hierarchy: Path, name: str) -> None:
    group = hierarchy / name.strip("/")
    group.mkdir(exist_ok=True)
    if hierarchy.name == "cpuset":  # a cpuset cgroup takes no task until it has cpus and mems
        for knob in ("cpuset.cpus", "cpuset.mems"):
            (group / knob).write_text((hierarchy / knob).read_text())


def _cgroup_dirs(name: str) -> list[Path]:
    """Every cgroup under ``name`` in every hierarchy, deepest first."""
    found: list[Path] = []
    if not CGROUP_V1.is_dir():
        return found
    for hierarchy in CGROUP_V1.iterdir():
        group = hierarchy / name.strip("/")
        if group.is_dir() and not group.is_symlink():
            found.extend(sorted((p for p in group.rglob("*") if p.is_dir()),
                                key=lambda p: -len(p.parts)))
            found.append(group)
    return found


def kill_containers(network: NodeNetwork) -> None:
    """SIGKILL every process in the node's cgroups (its pods' containers)."""
    for group in _cgroup_dirs(network.cgroup_root):
        for pid in _procs(group):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wait_for_empty_cgroups(name: str, *, timeout_s: float) -> None:
    """Killed processes leave their cgroups only once reaped: a cgroup is removable then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_procs(group) for group in _cgroup_dirs(name)):
            return
        time.sleep(0.1)  # polling the kernel's view: no event tells when a zombie is reaped


def _procs(group: Path) -> list[str]:
    try:
        return (group / "cgroup.procs").read_text().split()
    except OSError:
        return []


def processes_in(namespace_file: Path) -> list[int]:
    """Pids of the processes in the namespace kept at ``namespace_file`` (a bind mount)."""
    try:
        inode = namespace_file.stat().st_ino
    except OSError:
        return []
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "mnt") == f"mnt:[{inode}]":
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def remove(layout: NodeLayout, network: NodeNetwork | None) -> list[str]:
    """Undo `create` (and `allocate`); returns what could not be removed (empty when clean).

    Call after the node's processes are stopped. Safe to call twice, and after a failed
    `create`.
    """
    problems: list[str] = []
    for path in (layout.mntns, layout.ns_dir, layout.netns):
        if path.exists() and _is_mountpoint(path):
            result = subprocess.run(["umount", str(path)], capture_output=True, text=True)
            if result.returncode != 0:
                problems.append(f"umount {path}: {result.stderr.strip()}")
    if network is not None:
        # Deleting one end deletes the pair and the routes through it; the pair is usually
        # already gone with the network namespace.
        subprocess.run(["ip", "link", "del", network.host_link], capture_output=True)
        _wait_for_empty_cgroups(network.cgroup_root, timeout_s=20.0)
        for group in _cgroup_dirs(network.cgroup_root):
            try:
                group.rmdir()
            except OSError as error:
                problems.append(f"rmdir {group}: {error}")
    return problems


def host_footprint(network: NodeNetwork) -> Sequence[str]:
    """What of the node the host still shows: its veth and its cgroups (for `status`, tests)."""
    left = []
    if subprocess.run(["ip", "link", "show", network.host_link],
                      capture_output=True).returncode == 0:
        left.append(f"link {network.host_link}")
    left.extend(f"cgroup {g}" for g in _cgroup_dirs(network.cgroup_root))
    return left
