"""The operator under faults, on the dev cluster: killed in the middle of a reconcile, down while
DDMDeployments change or go, the API server gone for 10 s, and the API server stopped in the
middle of a reconcile.

The operator runs as its own process (``ddm operator``, as in its pod), so a SIGKILL leaves
exactly what a dead pod leaves. The API server is stopped alone (etcd keeps every object) and
restarted with the same address, certificates and flags. Every wait polls the API with a
deadline; the only sleep is the outage itself.
"""

from __future__ import annotations

import copy
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import watch
from test_operator import OWNER_LABEL, Cluster, _expected_children
from waiting import wait_for

from ddm_devcluster import ClusterInfo, start_component, stop_component
from ddm.operator.config import OperatorConfig
from ddm.operator.kube import Kube, KubeError
from ddm.operator.observed import Observed
from ddm.operator.reconcile import Outcome, Reconciler
from tests.support.operator_process import OperatorProcess, cpu_spec, install_crd

#: Seconds the API server stays down.
OUTAGE_S = 10
#: Seconds from the API server's return to a change being applied, at most.
RECOVERY_DEADLINE_S = 30


def _experts(spec: dict) -> list[str]:
    return [e["name"] for e in spec["experts"]]


@pytest.fixture(scope="module")
def cluster(kube_client: Any) -> Cluster:
    install_crd(kube_client)
    return Cluster(kube_client)


@pytest.fixture
def operator(dev_cluster: ClusterInfo, kube_namespace: str, tmp_path: Path
             ) -> Iterator[OperatorProcess]:
    """The operator as a process with the admin's kubeconfig, serving only the test's
    namespace (other modules' DDMs share the cluster); not started (tests do)."""
    process = OperatorProcess(dev_cluster.kubeconfig, tmp_path / "operator.log",
                              settings={"DDM_WATCH_NAMESPACES": kube_namespace})
    try:
        yield process
    finally:
        if process.alive:
            process.stop()


def _converged(cluster: Cluster, namespace: str, name: str, spec: dict) -> dict:
    """Wait (30 s) for exactly the expected children and a status of the current generation;
    returns the children."""
    expected = _expected_children(name, _experts(spec))

    def done() -> dict | None:
        children = cluster.children(namespace, name)
        ddm = cluster.ddm(namespace, name)
        current = (ddm.get("status") or {}).get("observedGeneration") == ddm["metadata"][
            "generation"]
        return children if current and set(children) == expected else None
    return wait_for(done, 30, f"{name}'s children and status")


def _assert_owned_by(cluster: Cluster, namespace: str, name: str) -> None:
    """Nothing orphaned: every object labelled as ``name``'s is controlled by it."""
    uid = cluster.ddm(namespace, name)["metadata"]["uid"]
    for kind in ("Deployment", "Service", "ConfigMap"):
        for item in cluster.list(kind, namespace, f"{OWNER_LABEL}={name}"):
            refs = [(r["kind"], r["name"], r["uid"], r.get("controller"))
                    for r in item["metadata"].get("ownerReferences") or []]
            assert refs == [("DDMDeployment", name, uid, True)], (kind, item["metadata"]["name"])


def _deploy(cluster: Cluster, namespace: str, name: str, spec: dict) -> dict:
    cluster.create_ddm(namespace, name, spec)
    return _converged(cluster, namespace, name, spec)


def test_killed_mid_reconcile_the_restarted_operator_converges_exactly(
        cluster: Cluster, kube_namespace: str, operator: OperatorProcess) -> None:
    ns, name, spec = kube_namespace, "killed", cpu_spec(8)  # 19 children, one at a time
    expected = _expected_children(name, _experts(spec))
    operator.start()
    since = cluster.core.list_namespaced_service(ns).metadata.resource_version
    cluster.create_ddm(ns, name, spec)
    stream = watch.Watch()
    for _ in stream.stream(cluster.core.list_namespaced_service, ns, resource_version=since,
                           label_selector=f"{OWNER_LABEL}={name}", timeout_seconds=30):
        operator.kill()  # at the first child
        stream.stop()
    assert not operator.alive, "no child appeared within 30 s"
    partial = cluster.children(ns, name)
    assert 0 < len(partial) < len(expected), "the kill was not in the middle of the reconcile"

    operator.start()
    children = _converged(cluster, ns, name, spec)
    assert set(children) == expected
    _assert_owned_by(cluster, ns, name)
    for key, before in partial.items():  # what existed at the kill was kept, not re-created
        assert children[key]["metadata"]["uid"] == before["metadata"]["uid"], key
    for (kind, child), obj in children.items():  # no Deployment was rewritten...
        if kind == "Deployment":
            assert obj["metadata"]["generation"] == 1, child
    rollouts = Counter(s["metadata"]["ownerReferences"][0]["name"]
                       for s in cluster.list("ReplicaSet", ns, f"{OWNER_LABEL}={name}"))
    assert max(rollouts.values(), default=1) == 1, rollouts  # ...nor rolled out twice
    status = cluster.ddm(ns, name)["status"]
    assert (status["phase"], status["expertsReady"]) == ("Pending", "0/8")
    assert {c["type"]: c["status"] for c in status["conditions"]}["SpecValid"] == "True"


#: Seconds from SIGTERM to the operator's exit, at most (Kubernetes' grace period is 30 s).
SIGTERM_EXIT_S = 10


def test_sigterm_in_the_middle_of_reconciles_exits_within_10_s_and_the_next_start_converges(
        cluster: Cluster, kube_namespace: str, operator: OperatorProcess) -> None:
    """Several DDMDeployments being created at once, as in a rollout of the operator under
    load: it stops within the limit, each run ended between two children, and the operator
    started again converges every one exactly."""
    ns, spec = kube_namespace, cpu_spec(8)  # 19 children each
    ddm_names = [f"term-{index}" for index in range(6)]
    operator.start()
    since = cluster.core.list_namespaced_service(ns).metadata.resource_version
    for name in ddm_names:
        cluster.create_ddm(ns, name, spec)
    stream = watch.Watch()
    for _ in stream.stream(cluster.core.list_namespaced_service, ns, resource_version=since,
                           timeout_seconds=30):
        stream.stop()  # at the first child: the runs are under way
    started = time.monotonic()
    status = operator.stop(timeout_s=30)
    exited_s = time.monotonic() - started
    assert status == 0, operator.log_tail()
    assert exited_s < SIGTERM_EXIT_S, f"{exited_s:.1f} s from SIGTERM to exit"
    partial = {name: cluster.children(ns, name) for name in ddm_names}
    assert sum(map(len, partial.values())) < 19 * len(ddm_names), "nothing was left to do"

    operator.start()
    for name in ddm_names:
        children = _converged(cluster, ns, name, spec)
        _assert_owned_by(cluster, ns, name)
        for key, before in partial[name].items():  # what the stopped runs wrote was kept
            assert children[key]["metadata"]["uid"] == before["metadata"]["uid"], key


def test_a_spec_changed_while_the_operator_is_down_is_applied_after_restart(
        cluster: Cluster, kube_namespace: str, operator: OperatorProcess) -> None:
    ns, spec = kube_namespace, cpu_spec(3)
    operator.start()
    _deploy(cluster, ns, "later", spec)
    operator.kill()
    spec = copy.deepcopy(spec)
    spec["experts"][1]["replicas"] = 2
    spec["experts"][1]["classes"] += spec["experts"].pop()["classes"]
    cluster.patch_ddm_spec(ns, "later", spec)

    operator.start()
    _converged(cluster, ns, "later", spec)
    assert cluster.get("Deployment", ns, "later-expert-e1")["spec"]["replicas"] == 2
    _assert_owned_by(cluster, ns, "later")
    assert cluster.ddm(ns, "later")["status"]["observedGeneration"] == 2


def test_a_ddm_deleted_while_the_operator_is_down_leaves_nothing_behind(
        cluster: Cluster, kube_namespace: str, operator: OperatorProcess) -> None:
    ns = kube_namespace
    operator.start()
    _deploy(cluster, ns, "gone", cpu_spec(3))
    operator.kill()
    finalizers = cluster.ddm(ns, "gone")["metadata"].get("finalizers")
    assert not finalizers, f"{finalizers} would hold the deletion until an operator runs again"
    cluster.custom.delete_namespaced_custom_object("ddm.dev", "v1alpha1", ns, "ddmdeployments",
                                                   "gone")
    wait_for(lambda: not cluster.children(ns, "gone"), 60,
             "the garbage collector to delete the children")

    restarted_at = len(operator.log_text())
    operator.start()
    _deploy(cluster, ns, "next", cpu_spec(2))  # it works
    assert not cluster.children(ns, "gone")
    log = operator.log_text()[restarted_at:]
    assert not re.search(r"\b(ERROR|Traceback)\b", log), log


def test_after_an_api_server_outage_the_operator_catches_up_and_acts_again(
        dev_cluster: ClusterInfo, cluster: Cluster, kube_namespace: str,
        operator: OperatorProcess) -> None:
    ns, spec = kube_namespace, cpu_spec(2)
    operator.start()
    _deploy(cluster, ns, "before", spec)
    _deploy(cluster, ns, "after", spec)
    missed = copy.deepcopy(spec)
    missed["experts"][0]["replicas"] = 2
    cluster.patch_ddm_spec(ns, "before", missed)  # the operator may or may not see this one
    stop_component(dev_cluster.state_dir, "kube-apiserver")
    stopped = time.monotonic()
    time.sleep(OUTAGE_S)  # the outage itself: nothing to wait for
    start_component(dev_cluster.state_dir, "kube-apiserver")
    back = time.monotonic()
    changed = copy.deepcopy(spec)
    changed["experts"][1]["replicas"] = 3
    cluster.patch_ddm_spec(ns, "after", changed)

    def replicas(name: str, expert: str) -> int:
        return cluster.get("Deployment", ns, f"{name}-expert-{expert}")["spec"]["replicas"]
    wait_for(lambda: replicas("after", "e1") == 3, RECOVERY_DEADLINE_S,
             f"the change made after the outage\n{operator.log_tail()}")
    acted = time.monotonic() - back
    wait_for(lambda: replicas("before", "e0") == 2, RECOVERY_DEADLINE_S,
             f"the change made before the outage\n{operator.log_tail()}")
    caught_up = time.monotonic() - back
    print(f"\nAPI server down {back - stopped:.1f} s (restart included); after it was back: "
          f"new change applied in {acted:.1f} s, the change made before the outage in "
          f"{caught_up:.1f} s")
    for name, current in (("before", missed), ("after", changed)):
        _converged(cluster, ns, name, current)
        assert cluster.ddm(ns, name)["status"]["observedGeneration"] == 2
    assert operator.alive


class _ServerStopsAfterWrites(Kube):
    """The operator's real API calls; once ``writes`` children are written, the API server is
    stopped (for real, as an outage would), so the rest of the run finds nobody answering."""

    def __init__(self, api_client: Any, state_dir: Path, writes: int) -> None:
        super().__init__(api_client)
        self._state_dir, self._writes_left = state_dir, writes

    def apply(self, manifest: Any, *, dry_run: bool = False) -> dict[str, Any]:
        applied = super().apply(manifest, dry_run=dry_run)
        if not dry_run:
            self._wrote()
        return applied

    def create(self, manifest: Any) -> dict[str, Any]:
        created = super().create(manifest)
        self._wrote()
        return created

    def _wrote(self) -> None:
        self._writes_left -= 1
        if self._writes_left == 0:
            stop_component(self._state_dir, "kube-apiserver")


def test_the_api_server_stopped_mid_reconcile_ends_the_run_in_kube_errors_then_it_converges(
        dev_cluster: ClusterInfo, kube_client: Any, cluster: Cluster,
        kube_namespace: str) -> None:
    """No operator process runs here: the reconciler itself, driven by the test, meets the
    outage after its third child, and every failure after it must be a KubeError (a
    connection refused is not allowed to escape as urllib3's own exception half way)."""
    ns, name, spec = kube_namespace, "blip", cpu_spec(4)
    expected = _expected_children(name, _experts(spec))
    cluster.create_ddm(ns, name, spec)
    config = OperatorConfig()
    events: list[str] = []

    def post_event(body: Any, *, reason: str, message: str) -> None:
        events.append(message)

    observed = Observed()  # what the watches would show: here only the DDM, then its writes
    observed.seen(cluster.ddm(ns, name))
    broken = Reconciler(_ServerStopsAfterWrites(kube_client, dev_cluster.state_dir, 3), config,
                        observed, post_event)
    try:
        with pytest.raises(KubeError) as caught:  # the status could not be written either
            broken.reconcile(ns, name)
    finally:
        start_component(dev_cluster.state_dir, "kube-apiserver")
    assert caught.value.status == 0, caught.value
    assert "did not answer" in str(caught.value), caught.value
    partial = cluster.children(ns, name)
    assert len(partial) == 3, sorted(partial)

    outcome = Reconciler(Kube(kube_client), config, observed, post_event).reconcile(ns, name)
    assert outcome == Outcome(), outcome
    children = cluster.children(ns, name)
    assert set(children) == expected
    for key, before in partial.items():  # what the first run wrote was kept
        assert children[key]["metadata"]["uid"] == before["metadata"]["uid"], key
    _assert_owned_by(cluster, ns, name)
    assert cluster.ddm(ns, name)["status"]["observedGeneration"] == 1
