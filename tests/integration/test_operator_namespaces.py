"""Watched namespaces: ``DDM_WATCH_NAMESPACES`` limits the operator to a list of namespaces, and
with a list it needs only the Helm chart's per-namespace Role.

The cluster test installs what the chart renders for ``watchNamespaces`` (its ServiceAccount,
Role and RoleBinding: it renders nothing cluster-scoped then), runs ``ddm operator`` as a process
under that ServiceAccount with the environment the chart gives it, and shows that a DDMDeployment
in a watched namespace is reconciled while one elsewhere is left untouched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_tool import ensure_helm
from kubernetes import client, utils
from test_operator import OWNER_LABEL, Cluster
from waiting import wait_for

from ddm_devcluster import ClusterInfo
from ddm.operator.runner import watched_namespaces
from tests.support.operator_process import (OperatorProcess, cpu_spec,
                                            install_crd, service_account_kubeconfig)

ROOT = Path(__file__).resolve().parents[2]
#: The most an operator process may take to start and answer a DDM: seconds alone, over 30
#: beside the rest of the suite on two busy cores (a CI run, 2026-12-01).
REPORT_S = 180.0


@pytest.mark.parametrize(("value", "namespaces"), [
    ("", ()),
    ("  ", ()),
    ("team-a", ("team-a",)),
    ("team-a, team-b ,c", ("team-a", "team-b", "c")),
])
def test_the_watched_namespaces_are_a_comma_separated_list(value: str,
                                                           namespaces: tuple[str, ...]) -> None:
    assert watched_namespaces({"DDM_WATCH_NAMESPACES": value}) == namespaces
    assert watched_namespaces({}) == ()


@pytest.mark.parametrize(("value", "problem"), [
    ("team-a,,team-b", "entry 2 is empty"),
    ("team-a,", "entry 2 is empty"),
    ("team-*", "entry 1 'team-*' is not a namespace name"),
    ("Team-A", "entry 1 'Team-A' is not a namespace name"),
    ("team-a;team-b", "entry 1 'team-a;team-b' is not a namespace name"),
    ("-team", "entry 1 '-team' is not a namespace name"),
    ("a" * 64, f"entry 1 '{'a' * 64}' is not a namespace name"),
    ("team-a,team-a", "namespace 'team-a' is listed twice"),
])
def test_a_malformed_namespace_list_is_refused_naming_the_entry(value: str, problem: str) -> None:
    with pytest.raises(ValueError) as refused:
        watched_namespaces({"DDM_WATCH_NAMESPACES": value})
    assert str(refused.value).startswith(f"DDM_WATCH_NAMESPACES={value!r}: {problem}")


def test_ddm_operator_refuses_to_start_on_a_malformed_list(tmp_path: Path) -> None:
    env = {**os.environ, "DDM_WATCH_NAMESPACES": "team-a,Team-B"}
    done = subprocess.run([sys.executable, "-m", "ddm", "operator",
                           "--kubeconfig", str(tmp_path / "absent")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "ddm: error: DDM_WATCH_NAMESPACES='team-a,Team-B': entry 2 'Team-B' is not a namespace "
        "name (at most 63 lowercase letters, digits and '-', starting and ending with a letter "
        "or digit)")


def _install_chart_rbac(kube_client: Any, release: str, home: str, kinds: set[str],
                        *values: str) -> str:
    """Create the objects of ``kinds`` that the chart renders (release ``release`` in namespace
    ``home``, ``--set`` ``values``); returns the operator's ServiceAccount."""
    command = [str(ensure_helm()), "template", release, str(ROOT / "charts" / "ddm-operator"),
               "--namespace", home]
    for value in values:
        command += ["--set", value]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rendered = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    chosen = [doc for doc in rendered if doc["kind"] in kinds]
    assert {doc["kind"] for doc in chosen} == kinds
    for doc in chosen:
        utils.create_from_dict(kube_client, doc, namespace=doc["metadata"].get("namespace", home))
    (account,) = [doc["metadata"]["name"] for doc in chosen if doc["kind"] == "ServiceAccount"]
    return account


def _operator_as(kube_client: Any, home: str, account: str, directory: Path,
                 watch_namespaces: str) -> OperatorProcess:
    """The operator under ``account``'s token, with the environment the chart gives it."""
    identity = service_account_kubeconfig(kube_client, home, account, directory / "kubeconfig")
    return OperatorProcess(identity, directory / "operator.log", settings={
        "DDM_WATCH_NAMESPACES": watch_namespaces, "DDM_ROUTER_AUTH": "true",
        "DDM_NETWORK_POLICY": "true"})


def _reported(cluster: Cluster, namespace: str, name: str, operator: OperatorProcess) -> dict:
    def current() -> dict | None:
        status = cluster.ddm(namespace, name).get("status") or {}
        return status if status.get("observedGeneration") == 1 else None
    return wait_for(current, REPORT_S,
                    f"the status of {namespace}/{name}\n{operator.log_tail()}")


def _assert_no_permission_problem(operator: OperatorProcess) -> None:
    log = operator.log_text()
    assert "Forbidden" not in log and "Not enough permissions" not in log, log


def test_only_the_watched_namespace_is_served_with_the_charts_namespaced_rbac(
        dev_cluster: ClusterInfo, kube_client: Any, tmp_path: Path) -> None:
    install_crd(kube_client)
    cluster, suffix = Cluster(kube_client), uuid.uuid4().hex[:6]
    home, watched, other = f"ops-{suffix}", f"watched-{suffix}", f"other-{suffix}"
    for namespace in (home, watched, other):
        cluster.core.create_namespace({"metadata": {"name": namespace}})
    account = _install_chart_rbac(kube_client, f"ddm-{suffix}", home,
                                  {"ServiceAccount", "Role", "RoleBinding"},
                                  f"watchNamespaces={{{watched}}}")
    operator = _operator_as(kube_client, home, account, tmp_path, watched)
    operator.start()
    try:
        cluster.create_ddm(other, "left", cpu_spec(2))  # first, so it had every chance
        cluster.create_ddm(watched, "served", cpu_spec(2))
        assert _reported(cluster, watched, "served", operator)["phase"] == "Pending"
        assert cluster.children(watched, "served")
        wait_for(lambda: "Created" in {e["reason"] for e in cluster.events(watched, "served")},
                 REPORT_S, "Created events (the Role lets the operator post them)")
        left = cluster.ddm(other, "left")
        assert "status" not in left
        assert not left["metadata"].get("finalizers")
        assert not [key for key in left["metadata"].get("annotations") or {}
                    if key.startswith("ddm.dev/")]
        for kind in ("Deployment", "Service", "ConfigMap"):
            assert cluster.list(kind, other, f"{OWNER_LABEL}=left") == []
        _assert_no_permission_problem(operator)
    finally:
        operator.stop()
    rights = client.AuthorizationV1Api(kube_client).create_subject_access_review({"spec": {
        "user": f"system:serviceaccount:{home}:{account}", "resourceAttributes": {
            "group": "ddm.dev", "resource": "ddmdeployments", "verb": "list"}}})
    assert not rights.status.allowed, "the test's operator could list DDMDeployments everywhere"


def test_cluster_wide_the_charts_cluster_role_is_enough(
        dev_cluster: ClusterInfo, kube_client: Any, tmp_path: Path) -> None:
    install_crd(kube_client)
    cluster, suffix = Cluster(kube_client), uuid.uuid4().hex[:6]
    home, anywhere = f"ops-{suffix}", f"any-{suffix}"
    for namespace in (home, anywhere):
        cluster.core.create_namespace({"metadata": {"name": namespace}})
    account = _install_chart_rbac(kube_client, f"ddm-{suffix}", home,
                                  {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"})
    operator = _operator_as(kube_client, home, account, tmp_path, "")
    operator.start()
    try:
        cluster.create_ddm(anywhere, "served", cpu_spec(2))
        assert _reported(cluster, anywhere, "served", operator)["phase"] == "Pending"
        _assert_no_permission_problem(operator)
    finally:
        operator.stop()
