"""The Kubernetes Pod Security Standards "restricted" profile as a checker over pod specs.

Kubernetes 1.20 (the dev cluster) predates the PodSecurity admission plugin, so tests hold
every pod spec we render or create to the profile with this function instead. It follows the
published standard (https://kubernetes.io/docs/concepts/security/pod-security-standards/):
the baseline controls plus the restricted ones, for containers, init containers and
ephemeral containers.
"""

from __future__ import annotations

from typing import Any

#: Volume types the restricted profile allows.
ALLOWED_VOLUMES = frozenset({"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                             "persistentVolumeClaim", "projected", "secret"})
SAFE_SYSCTLS = frozenset({"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                          "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                          "net.ipv4.ping_group_range"})
ALLOWED_SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t"})
ALLOWED_SECCOMP = frozenset({"RuntimeDefault", "Localhost"})


def _containers(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{field}[{c.get('name', i)}]", c)
            for field in ("initContainers", "containers", "ephemeralContainers")
            for i, c in enumerate(spec.get(field) or [])]


def violations(spec: dict[str, Any]) -> list[str]:
    """What in the pod ``spec`` breaks the restricted profile (empty when it complies)."""
    found: list[str] = []
    pod_context = spec.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(flag):
            found.append(f"{flag} is true")
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            found.append(f"volume {volume.get('name')!r} has type "
                         f"{sorted(kinds - ALLOWED_VOLUMES)}")
    for sysctl in pod_context.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            found.append(f"sysctl {sysctl.get('name')!r} is not in the safe set")
    found += _selinux("pod", pod_context)
    if pod_context.get("runAsUser") == 0:
        found.append("pod securityContext.runAsUser is 0")
    pod_seccomp = (pod_context.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in ALLOWED_SECCOMP:
        found.append(f"pod seccompProfile.type is {pod_seccomp}")
    for where, container in _containers(spec):
        context = container.get("securityContext") or {}
        if context.get("privileged"):
            found.append(f"{where}: privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{where}: allowPrivilegeEscalation is not false")
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"{where}: capabilities.drop does not include ALL")
        added = set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}
        if added:
            found.append(f"{where}: capabilities.add {sorted(added)}")
        run_as_non_root = context.get("runAsNonRoot", pod_context.get("runAsNonRoot"))
        if run_as_non_root is not True:
            found.append(f"{where}: runAsNonRoot is not true (container or pod)")
        if context.get("runAsUser") == 0:
            found.append(f"{where}: runAsUser is 0")
        seccomp = (context.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ALLOWED_SECCOMP:
            found.append(f"{where}: seccompProfile.type is {seccomp} (RuntimeDefault or "
                         "Localhost required, on the container or the pod)")
        if context.get("procMount", "Default") != "Default":
            found.append(f"{where}: procMount is {context['procMount']}")
        found += _selinux(where, context)
        for port in container.get("ports") or []:
            if port.get("hostPort"):
                found.append(f"{where}: hostPort {port['hostPort']}")
    return found


def _selinux(where: str, context: dict[str, Any]) -> list[str]:
    options = context.get("seLinuxOptions") or {}
    found = []
    if options.get("type", "") not in ALLOWED_SELINUX_TYPES:
        found.append(f"{where}: seLinuxOptions.type {options['type']!r}")
    for field in ("user", "role"):
        if options.get(field):
            found.append(f"{where}: seLinuxOptions.{field} is set")
    return found
