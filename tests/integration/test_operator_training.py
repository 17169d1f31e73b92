"""The operator reconciles a DDMTraining against a real control plane (the dev cluster).

The operator runs in a thread of this process, serving the test's namespace. The dev cluster's
nodes are fake (no kubelet): the real scheduler binds the jobs' pods and they stay Pending, so
the test plays the kubelet and writes the pods' phase (Running, Failed, Succeeded) as a kubelet
would after the container ran; the real Job controller then counts them, retries a failed
pod, and marks the Job Complete, and the operator follows from there. The steps read from the
pods' logs need a real node (tests/e2e/test_training.py); here no pod has a log.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from test_operator import Cluster
from waiting import wait_for

from ddm.operator.config import OperatorConfig
from tests.support.operator_process import TRAINING_CRD_FILE, install_crd, operator_in_thread

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "ddm.dev", "v1alpha1", "ddmtrainings"
TRAINING_LABEL, JOB_LABEL = "ddm.dev/training", "ddm.dev/job"
#: A bound on a hang, not a speed target (the Job controller retries a failed pod after ~10 s).
DEADLINE_S = 90
HOST_ROOT = "/srv/ddm/"
TRAINING_JOBS = {"expert-digits-0-4", "expert-digits-5-9", "router"}


def _example(output: str) -> dict[str, Any]:
    """examples/training.yaml writing under the host path ``output`` (pods on any node)."""
    document = yaml.safe_load((ROOT / "examples" / "training.yaml").read_text())
    document["spec"]["output"]["uri"] = f"file://{output}"
    return document


class Trainings:
    def __init__(self, cluster: Cluster, namespace: str) -> None:
        self.cluster, self.ns = cluster, namespace
        self.batch = client.BatchV1Api(cluster.core.api_client)

    def create(self, document: dict[str, Any]) -> dict[str, Any]:
        return self.cluster.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.ns, PLURAL, document)

    def get(self, name: str) -> dict[str, Any]:
        return self.cluster.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL,
                                                                name)

    def status(self, name: str) -> dict[str, Any]:
        return self.get(name).get("status") or {}

    def jobs(self, name: str) -> dict[str, dict[str, Any]]:
        items = self.cluster._json(self.batch.list_namespaced_job(
            self.ns, label_selector=f"{TRAINING_LABEL}={name}", _preload_content=False))
        return {job["metadata"]["labels"][JOB_LABEL]: job for job in items["items"]}

    def pods(self, name: str, job: str) -> list[dict[str, Any]]:
        return [p for p in self.cluster.list("Pod", self.ns,
                                             f"{TRAINING_LABEL}={name},{JOB_LABEL}={job}")
                if not p["metadata"].get("deletionTimestamp")]

    def policies(self, name: str) -> dict[str, dict[str, Any]]:
        """The training's NetworkPolicies by name."""
        return {p["metadata"]["name"]: p for p in self.cluster.list(
            "NetworkPolicy", self.ns, f"{TRAINING_LABEL}={name}")}

    def deployment(self, name: str) -> dict[str, Any] | None:
        try:
            return self.cluster.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.ns, "ddmdeployments", name)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def wait(self, name: str, check: Any, what: str) -> dict[str, Any]:
        """The status of ``name`` once ``check(status)`` holds."""
        return wait_for(lambda: s if check(s := self.status(name)) else None, DEADLINE_S, what,
                        lambda: f"status: {self.status(name)}; jobs: {sorted(self.jobs(name))}")


def _kubelet_ran(cluster: Cluster, pod: dict[str, Any], phase: str, exit_code: int = 0) -> None:
    """Write what a kubelet writes once the pod's containers ran (or run, for Running)."""
    containers = pod["spec"]["containers"]
    state = ({"running": {"startedAt": "2026-01-01T00:00:00Z"}} if phase == "Running" else
             {"terminated": {"exitCode": exit_code, "reason": "Completed" if not exit_code
                             else "Error", "startedAt": "2026-01-01T00:00:00Z",
                             "finishedAt": "2026-01-01T00:01:00Z"}})
    status = {"phase": phase, "containerStatuses": [
        {"name": c["name"], "image": c["image"], "imageID": "", "ready": phase == "Running",
         "restartCount": 0, "state": state} for c in containers]}
    cluster.core.patch_namespaced_pod_status(pod["metadata"]["name"], pod["metadata"]["namespace"],
                                             {"status": status})


def _one_bound_pod(t: Trainings, name: str, job: str, but: set[str] = frozenset()
                   ) -> dict[str, Any]:
    def bound() -> dict[str, Any] | None:
        pods = [p for p in t.pods(name, job) if p["spec"].get("nodeName")
                and p["metadata"]["name"] not in but]
        return pods[0] if len(pods) == 1 else None
    return wait_for(bound, DEADLINE_S, f"one new pod of {job} bound to a node")


@pytest.fixture
def trainings(kube_client: Any, dev_cluster: Any, kube_namespace: str) -> Any:
    install_crd(kube_client)  # the DDMDeployment the outputs make
    install_crd(kube_client, crd_file=TRAINING_CRD_FILE)
    config = OperatorConfig.from_env({"DDM_ALLOW_HOST_PATHS": HOST_ROOT,
                                      "DDM_NETWORK_POLICY": "true"})
    with operator_in_thread(dev_cluster.kubeconfig, config, (kube_namespace,)):
        yield Trainings(Cluster(kube_client), kube_namespace)


def test_a_training_runs_its_jobs_in_order_retries_one_and_makes_its_deployment(
        trainings: Trainings) -> None:
    t, cluster = trainings, trainings.cluster
    uid = t.create(_example(HOST_ROOT + "digits"))["metadata"]["uid"]
    # the experts' jobs and the router's start together (the router network reads the data and
    # the partition, not the experts)
    t.wait("digits", lambda s: s.get("phase") == "Training", "phase Training")
    jobs = wait_for(lambda: (j := t.jobs("digits")) and set(j) == TRAINING_JOBS and j,
                    DEADLINE_S, "the experts' and the router's Jobs")
    # each job's pods confined by a NetworkPolicy of its name, made before it
    policies = t.policies("digits")
    assert set(policies) == {job["metadata"]["name"] for job in jobs.values()}
    for job in [*jobs.values(), *policies.values()]:
        (ref,) = job["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("DDMTraining", uid, True)
    status = t.status("digits")
    assert status["expertsDone"] == "0/2"
    assert status["steps"] == {"done": 0, "asked": 4500}
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Expert-digits-0-4": "False", "Expert-digits-5-9": "False", "Router": "False"}
    # expert 0-4's pod fails: the Job controller runs a new one (it resumes the saved state);
    # the other jobs and their pods are left alone
    others = {job: _one_bound_pod(t, "digits", job) for job in ("expert-digits-5-9", "router")}
    for pod in others.values():
        _kubelet_ran(cluster, pod, "Running")
    failed = _one_bound_pod(t, "digits", "expert-digits-0-4")
    _kubelet_ran(cluster, failed, "Failed", exit_code=137)
    t.wait("digits", lambda s: s["jobs"]["expert-digits-0-4"]["retries"] == 1,
           "one failed pod counted")
    retry = _one_bound_pod(t, "digits", "expert-digits-0-4", but={failed["metadata"]["name"]})
    assert "--resume" in " ".join(retry["spec"]["containers"][0]["command"])
    for job, pod in others.items():
        assert t.jobs("digits")[job]["metadata"]["uid"] == jobs[job]["metadata"]["uid"]
        assert [p["metadata"]["uid"] for p in t.pods("digits", job)] == [pod["metadata"]["uid"]]
    assert t.status("digits")["phase"] == "Training"
    # the router finishes first: the training waits for its experts
    _kubelet_ran(cluster, others["router"], "Succeeded")
    t.wait("digits", lambda s: s["jobs"]["router"]["state"] == "Succeeded", "router done")
    assert t.status("digits")["phase"] == "Training"
    assert t.deployment("digits-trained") is None
    # both experts finish: the DDMDeployment is made
    for pod in (retry, others["expert-digits-5-9"]):
        _kubelet_ran(cluster, pod, "Succeeded")
    t.wait("digits", lambda s: s.get("expertsDone") == "2/2", "both experts done")
    status = t.wait("digits", lambda s: s.get("phase") == "Succeeded", "phase Succeeded")
    assert status["deployment"] == "digits-trained"
    assert status["steps"] == {"done": 4500, "asked": 4500}
    made = t.deployment("digits-trained")
    assert "ownerReferences" not in made["metadata"]  # it outlives the training
    assert {e["name"]: e["checkpoint"]["uri"] for e in made["spec"]["experts"]} == {
        name: f"file://{HOST_ROOT}digits/experts/{name}" for name in ("digits-0-4",
                                                                      "digits-5-9")}
    assert made["spec"]["router"]["checkpoint"]["uri"] == f"file://{HOST_ROOT}digits/router"
    reasons = {e["reason"] for e in cluster.events(t.ns, "digits")}
    assert {"Created", "Succeeded"} <= reasons, reasons
    # deleting the training deletes its jobs (the garbage collector), not the DDMDeployment
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, t.ns, PLURAL, "digits")
    wait_for(lambda: not t.jobs("digits") and not t.policies("digits"), DEADLINE_S,
             "the jobs and their NetworkPolicies to go with the training")
    assert t.deployment("digits-trained") is not None


def test_an_invalid_training_fails_naming_the_field_and_creates_nothing(
        trainings: Trainings) -> None:
    document = _example("/elsewhere/digits")  # outside the host paths the operator allows
    document["metadata"]["name"] = "outside"
    t = trainings
    t.create(document)
    status = t.wait("outside", lambda s: s.get("phase") == "Failed", "phase Failed")
    assert "spec.output.uri" in status["message"], status
    assert not t.jobs("outside") and not t.policies("outside")
    bad = copy.deepcopy(_example(HOST_ROOT + "b"))
    bad["metadata"]["name"] = "uneven"
    bad["spec"]["experts"][0]["batchSize"] = 127  # not shared evenly by its 2 processes
    t.create(bad)
    status = t.wait("uneven", lambda s: s.get("phase") == "Failed", "phase Failed")
    assert "spec.experts[0].batchSize" in status["message"], status
