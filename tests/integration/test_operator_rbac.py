"""The chart's RBAC is exactly what the operator uses, proven with the API server's audit log.

``ddm operator`` runs as a process under the ServiceAccount and Role the chart renders (router
authentication and NetworkPolicies on), and is taken through a DDM's whole life and everything
it does: create a DDM (a fetched checkpoint included, so all three kinds of its Secrets),
change it (a new URI: a new Secret), remove an expert, restore a child edited by hand, refuse
a planted token Secret and an invalid spec, (restarted with NetworkPolicies off) remove the
NetworkPolicies, and delete the DDM. The dev cluster's API server audits every request of a
service account outside kube-system (``AUDIT_POLICY``); from the audit log come the (API
group, resource, verb) the operator used, and they must equal the Role's rules, but for the
permissions the API server checks without a request of their own (``IMPLIED``), and lie
within the ClusterRole the chart renders for a cluster-wide install. On Secrets it used, and
has, ``create`` alone.
"""

from __future__ import annotations

import copy
import json
import subprocess
import uuid
from pathlib import Path
from typing import Any, Callable

import yaml
from helm_tool import ensure_helm
from kubernetes import client
from test_operator import ROOT, Cluster
from test_operator_namespaces import _install_chart_rbac
from waiting import wait_for

from ddm_devcluster import ClusterInfo
from ddm.operator import names
from ddm_devcluster.components import Layout
from tests.support.operator_process import (TRAINING_CRD_FILE, OperatorProcess, cpu_spec,
                                            install_crd, service_account_kubeconfig)

#: Granted but never a request of its own: the API server checks them inside another one.
#: - ``create`` on a kind the operator applies (server-side apply creates with a PATCH; the
#:   audit shows ``patch`` with status 201, counted as ``create`` below);
#: - ``update`` on ``ddmdeployments/finalizers``: the OwnerReferencesPermissionEnforcement
#:   admission plugin (on in OpenShift and some distributions) requires it to set
#:   ``blockOwnerDeletion`` in a child's ownerReference.
IMPLIED = {("ddm.dev", "ddmdeployments/finalizers", "update"),
           ("ddm.dev", "ddmtrainings/finalizers", "update")}
#: Reads of one child by name: the reconcile makes them only when a child's dry run says its
#: name is taken by an object outside the DDM's labelled children (reconcile.py's clash
#: check), which this scenario does not stage; every other read is a list.
CLASH_READS = {(group, resource, "get") for group, resource in (
    ("", "configmaps"), ("", "services"), ("apps", "deployments"),
    ("networking.k8s.io", "networkpolicies"))}
#: The autoscaler reads a DDMDeployment by name each pass (``scaler.Scaler.scale``), and only
#: for one with experts it scales, which this scenario does not stage; the reconcile reads its
#: DDMDeployments from kopf's watch (``observed``).
SCALER_READS = {("ddm.dev", "ddmdeployments", "get")}
Use = tuple[str, str, str]  # (API group, resource[/subresource], verb)


def _granted(role: dict[str, Any]) -> set[Use]:
    return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def _used(audit_log: Path, user: str) -> tuple[set[Use], list[dict[str, Any]]]:
    """What ``user`` did (applies that created counted as ``create`` too), and its refusals."""
    used: set[Use] = set()
    refused = []
    for line in audit_log.read_text().splitlines():
        event = json.loads(line)
        if event["user"]["username"] != user or "objectRef" not in event:
            continue
        ref, code = event["objectRef"], (event.get("responseStatus") or {}).get("code", 0)
        if code == 403:
            refused.append(event)
            continue
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        used.add((ref.get("apiGroup", ""), resource, event["verb"]))
        if event["verb"] == "patch" and code == 201:
            used.add((ref.get("apiGroup", ""), resource, "create"))
    return used, refused


def test_the_operator_uses_exactly_the_verbs_the_chart_grants(
        dev_cluster: ClusterInfo, kube_client: Any, tmp_path: Path) -> None:
    install_crd(kube_client)
    install_crd(kube_client, crd_file=TRAINING_CRD_FILE)
    cluster, suffix = Cluster(kube_client), uuid.uuid4().hex[:6]
    home, ns = f"ops-{suffix}", f"audited-{suffix}"
    for namespace in (home, ns):
        cluster.core.create_namespace({"metadata": {"name": namespace}})
    account = _install_chart_rbac(kube_client, f"ddm-{suffix}", home,
                                  {"ServiceAccount", "Role", "RoleBinding"},
                                  f"watchNamespaces={{{ns}}}")
    (role,) = json.loads(client.RbacAuthorizationV1Api(kube_client).list_namespaced_role(
        ns, _preload_content=False).data)["items"]
    identity = service_account_kubeconfig(kube_client, home, account, tmp_path / "kubeconfig")
    operator = OperatorProcess(identity, tmp_path / "operator.log", settings={
        "DDM_WATCH_NAMESPACES": ns, "DDM_ROUTER_AUTH": "true", "DDM_NETWORK_POLICY": "true"})
    operator.start()
    try:
        _exercise(cluster, ns, operator)
        _train(cluster, ns, operator, lambda: _used(
            Layout(dev_cluster.state_dir).audit_log,
            f"system:serviceaccount:{home}:{account}")[0])
    finally:
        operator.stop()
    # NetworkPolicies turned off: the operator deletes them
    operator = OperatorProcess(identity, tmp_path / "operator.log", settings={
        "DDM_WATCH_NAMESPACES": ns, "DDM_ROUTER_AUTH": "true", "DDM_NETWORK_POLICY": "false"})
    operator.start()
    try:
        wait_for(lambda: cluster.get("NetworkPolicy", ns, "audited-experts") is None, 60,
                 f"the NetworkPolicies to go\n{operator.log_tail()}")
    finally:
        operator.stop()
    # the DDM deleted: the garbage collector, not the operator, removes its Secrets
    uid = cluster.ddm(ns, "audited")["metadata"]["uid"]
    cluster.custom.delete_namespaced_custom_object("ddm.dev", "v1alpha1", ns, "ddmdeployments",
                                                   "audited")
    wait_for(lambda: cluster.get("Secret", ns, names.expert_token_name("audited", uid)) is None,
             60, "the garbage collector to delete the Secrets")
    used, refused = _used(Layout(dev_cluster.state_dir).audit_log,
                          f"system:serviceaccount:{home}:{account}")
    assert refused == [], refused
    granted = _granted(role)
    assert not used - granted, f"used but not granted: {sorted(used - granted)}"
    unused = sorted(granted - IMPLIED - CLASH_READS - SCALER_READS - used)
    assert not unused, f"granted but never used: {unused}"
    assert {verb for group, resource, verb in used if (group, resource) == ("", "secrets")} \
        == {verb for group, resource, verb in granted if (group, resource) == ("", "secrets")} \
        == {"create"}
    cluster_wide = _granted(_cluster_role())
    assert not used - cluster_wide, f"not in the ClusterRole: {sorted(used - cluster_wide)}"


def _cluster_role() -> dict[str, Any]:
    """The ClusterRole the chart renders when it serves the whole cluster."""
    done = subprocess.run([str(ensure_helm()), "template", "ddm",
                           str(ROOT / "charts" / "ddm-operator")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (role,) = [doc for doc in yaml.safe_load_all(done.stdout)
               if doc and doc["kind"] == "ClusterRole"]
    return role


def _status(cluster: Cluster, ns: str, name: str, generation: int, operator: OperatorProcess
            ) -> dict:
    def current() -> dict | None:
        status = cluster.ddm(ns, name).get("status") or {}
        return status if status.get("observedGeneration") == generation else None
    return wait_for(current, 60, f"the status of generation {generation}\n{operator.log_tail()}")


def _exercise(cluster: Cluster, ns: str, operator: OperatorProcess) -> None:
    """Every kind of call the operator makes."""
    spec = cpu_spec(3)
    spec["experts"][0]["checkpoint"] = {"uri": "s3://models/e0?X-Amz-Signature=s"}
    uid = cluster.create_ddm(ns, "audited", spec)["metadata"]["uid"]
    _status(cluster, ns, "audited", 1, operator)
    wait_for(lambda: cluster.get("Secret", ns, names.router_token_name("audited", uid)), 60,
             "the token")
    # a new URI (a new Secret) and an expert fewer (its children deleted)
    changed = copy.deepcopy(spec)
    changed["experts"][0]["checkpoint"]["uri"] = "s3://models/e0-v2"
    changed["experts"][1]["classes"] += changed["experts"].pop(2)["classes"]
    cluster.patch_ddm_spec(ns, "audited", changed)
    wait_for(lambda: cluster.get("Deployment", ns, "audited-expert-e2") is None, 60,
             f"the removed expert's Deployment to go\n{operator.log_tail()}")
    # a child edited by hand is restored
    cluster.core.patch_namespaced_config_map("audited-router-config", ns,
                                             {"data": {"router.yaml": "edited: true\n"}})
    wait_for(lambda: "edited" not in cluster.get("ConfigMap", ns, "audited-router-config")[
        "data"]["router.yaml"], 60, "the ConfigMap to be restored")
    # a planted token Secret (before the operator's first run), and an invalid spec
    operator.stop()
    uid = cluster.create_ddm(ns, "planted", cpu_spec(2))["metadata"]["uid"]
    cluster.core.create_namespaced_secret(ns, {
        "metadata": {"name": names.router_token_name("planted", uid)},
        "stringData": {"token": "known"}})
    operator.start()
    assert _status(cluster, ns, "planted", 1, operator)["phase"] == "Failed"
    invalid = cpu_spec(2)
    invalid["experts"][0]["checkpoint"] = {"uri": "http://unpinned.example/m"}
    cluster.create_ddm(ns, "invalid", invalid)
    assert _status(cluster, ns, "invalid", 1, operator)["phase"] == "Invalid"
    wait_for(lambda: {"Created", "Deleted", "Restored"} <= {
        e["reason"] for e in cluster.events(ns, "audited")}, 60, "the events")


def _train(cluster: Cluster, ns: str, operator: OperatorProcess,
           used: Callable[[], set[Use]]) -> None:
    """A DDMTraining taken to its DDMDeployment, playing the kubelet for its jobs' pods (no
    node takes them: the claim does not exist): its Jobs created, a running pod's log read
    for its progress, the DDMDeployment of its outputs created."""
    document = yaml.safe_load((ROOT / "examples" / "training.yaml").read_text())
    cluster.custom.create_namespaced_custom_object("ddm.dev", "v1alpha1", ns, "ddmtrainings",
                                                   document)
    batch = client.BatchV1Api(cluster.core.api_client)

    def pods(job: str) -> list[dict[str, Any]]:
        return cluster.list("Pod", ns, f"ddm.dev/training=digits,ddm.dev/job={job}")

    def kubelet(job: str, phase: str) -> None:
        (pod,) = wait_for(lambda: pods(job), 60, f"the pod of {job}\n{operator.log_tail()}")
        cluster.core.patch_namespaced_pod_status(pod["metadata"]["name"], ns,
                                                 {"status": {"phase": phase}})

    def complete(job: str) -> None:
        kubelet(job, "Succeeded")
        wait_for(lambda: (batch.read_namespaced_job_status(f"digits-{job}", ns).status
                          .succeeded), 60, f"{job} to succeed")

    # one expert running, the other finishing: the run that sees it reads the first's log
    kubelet("expert-digits-0-4", "Running")
    complete("expert-digits-5-9")
    # the run that saw it (or the progress ticker, within 30 s) read the running pod's log
    wait_for(lambda: ("", "pods/log", "get") in used(), 60,
             f"a read of the running pod's log\n{operator.log_tail()}")
    complete("expert-digits-0-4")
    complete("router")
    wait_for(lambda: cluster.custom.list_namespaced_custom_object(
        "ddm.dev", "v1alpha1", ns, "ddmdeployments", label_selector="ddm.dev/training=digits"
    )["items"], 60, f"the DDMDeployment of the outputs\n{operator.log_tail()}")
