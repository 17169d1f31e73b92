"""What a converged DDM costs the operator: no request but those a change calls for.

``ddm operator`` runs as a process under a ServiceAccount of its own; the dev cluster's API
server audits every request of a ServiceAccount (``ddm_devcluster.components.AUDIT_POLICY``),
so the audit log lists, in order, each request the operator sent. Its runs read their
DDMDeployment, children and pods from its watches (``ddm.operator.observed``), so once a DDM
is converged, a change that needs nothing costs nothing but the check it calls for, and a
child deleted costs its create (and the Event that says so) alone.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from test_operator import Cluster
from waiting import wait_for

from ddm_devcluster import ClusterInfo
from ddm_devcluster.components import Layout
from ddm.operator.kube import Kube, KubeError
from tests.support.operator_process import (OperatorProcess, cpu_spec, install_crd,
                                            service_account_kubeconfig)

ACCOUNT = "operator"
#: Requests that hold a connection open (kopf's watches): not a request per change.
LONG_RUNNING = {"watch"}


def _requests(audit_log: Path, user: str) -> list[tuple[str, str, str, bool]]:
    """The (verb, resource, name, dry run) of each request ``user`` made, in the order the
    API server answered them (no name for a create: its URL has none)."""
    found = []
    for line in audit_log.read_text().splitlines():
        event = json.loads(line)
        if (event["user"]["username"] != user or event["stage"] != "ResponseComplete"
                or "objectRef" not in event or event["verb"] in LONG_RUNNING):
            continue
        ref = event["objectRef"]
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        name = "" if event["verb"] == "create" else ref.get("name", "")
        found.append((event["verb"], resource, name, "dryRun=" in event["requestURI"]))
    return found


def _since_last(requests: list[tuple[str, str, str, bool]], first: tuple[str, str, str, bool]
                ) -> list[tuple[str, str, str, bool]]:
    """``requests`` from the last ``first`` on (none if there is none)."""
    return requests[len(requests) - 1 - requests[::-1].index(first):] if first in requests \
        else []


def _settled_spec() -> dict[str, Any]:
    """Two experts and a router, none with a replica: no pod comes and goes to change the
    status, so after the Deployments' controller has written their status once, nothing
    about the DDM changes unless the test changes it."""
    spec = cpu_spec(2)
    for expert in spec["experts"]:
        expert["replicas"] = 0
    spec["router"] = {"replicas": 0}
    return spec


def test_a_converged_ddm_costs_only_the_requests_a_change_calls_for(
        dev_cluster: ClusterInfo, kube_client: Any, tmp_path: Path) -> None:
    install_crd(kube_client)
    cluster, ns = Cluster(kube_client), f"quiet-{uuid.uuid4().hex[:6]}"
    cluster.core.create_namespace({"metadata": {"name": ns}})
    client.RbacAuthorizationV1Api(kube_client).create_namespaced_role_binding(ns, {
        "metadata": {"name": "operator-admin"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "cluster-admin"},
        "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": ns}]})
    identity = service_account_kubeconfig(kube_client, ns, ACCOUNT, tmp_path / "kubeconfig")
    operator = OperatorProcess(identity, tmp_path / "operator.log",
                               settings={"DDM_WATCH_NAMESPACES": ns})
    audit_log = Layout(dev_cluster.state_dir).audit_log
    user = f"system:serviceaccount:{ns}:{ACCOUNT}"
    config_map, service = "quiet-router-config", "quiet-expert-e0"
    operator.start()
    try:
        cluster.create_ddm(ns, "quiet", _settled_spec())

        def converged() -> bool:
            status = cluster.ddm(ns, "quiet").get("status") or {}
            deployments = [c for (kind, _), c in cluster.children(ns, "quiet").items()
                           if kind == "Deployment"]
            return status.get("observedGeneration") == 1 and len(deployments) == 3 and all(
                (d.get("status") or {}).get("observedGeneration") == d["metadata"]["generation"]
                for d in deployments)
        wait_for(converged, 60, f"the DDM converged\n{operator.log_tail()}")

        def recreated() -> None:
            cluster.core.delete_namespaced_config_map(config_map, ns)
            wait_for(lambda: cluster.get("ConfigMap", ns, config_map), 60,
                     f"the ConfigMap made again\n{operator.log_tail()}")
        # A run after the controllers' last word: the status then has nothing new to say.
        recreated()
        # Someone else's annotation on a Service: nothing for the operator to do but check it
        # (a Service has no generation, so its resourceVersion alone says it changed).
        cluster.core.patch_namespaced_service(service, ns, {
            "metadata": {"annotations": {"example.com/note": "not the operator's"}}})
        check = ("patch", "services", service, True)
        wait_for(lambda: check in _requests(audit_log, user), 60,
                 f"the operator's dry run of the annotated Service\n{operator.log_tail()}")
        recreated()
        event = ("create", "events", "", False)
        wait_for(lambda: event in _since_last(_requests(audit_log, user), check), 60,
                 f"the Event of the new ConfigMap\n{operator.log_tail()}")
    finally:
        operator.stop()
    since_check = _since_last(_requests(audit_log, user), check)
    assert since_check == [check, ("create", "configmaps", "", False), event], since_check
    assert cluster.get("Service", ns, service)["metadata"]["annotations"][
        "example.com/note"] == "not the operator's"


def test_a_created_child_is_taken_as_applied_so_a_later_apply_removes_what_it_drops(
        kube_client: Any, kube_namespace: str) -> None:
    """``Kube.create`` records the fields as its creator's ``Update``; ``own_as_applied``
    makes them the operator's applied ones, so an apply that no longer sets one removes it
    (left as created, the creator's entry would keep it for good). A copy that is behind is
    refused (HTTP 409), never written over."""
    kube = Kube(kube_client)

    def config_map(data: dict[str, str], **meta: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "ConfigMap", "data": data,
                "metadata": {"name": "made", "namespace": kube_namespace, **meta}}
    created = kube.create(config_map({"kept": "1", "dropped": "2"}))
    with pytest.raises(KubeError) as taken:
        kube.create(config_map({"other": "3"}))
    assert taken.value.status == 409
    owned = kube.own_as_applied(created)
    assert kube.own_as_applied(owned) == owned  # nothing left to take: no request
    version = owned["metadata"]["resourceVersion"]
    assert kube.apply(config_map({"kept": "1"}, resourceVersion=version))["data"] == {"kept": "1"}
    with pytest.raises(KubeError) as stale:
        kube.apply(config_map({"kept": "stale"}, resourceVersion=version))
    assert stale.value.status == 409
    assert kube.get("ConfigMap", kube_namespace, "made")["data"] == {"kept": "1"}
