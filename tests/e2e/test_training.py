"""A DDM trained on the dev cluster's real node by the operator, then served (issue 38).

examples/training.yaml (engine: job) is applied with its output on a node directory the
operator may mount (``file://``) and small CPU requests (the node has two cores). The operator
(in this process, against the real API server) creates the two experts' Jobs (torchrun with 2
processes; JAX with 2 processes as 2 containers) and the router network's beside them; the kubelet
runs them from the CPU image. The status reports the steps the jobs log. The PyTorch expert's pod
is deleted once it has saved its state: the Job controller runs a new pod, which resumes from
that state (its first progress line is past the saved step, never back at 0). When every job
has succeeded the operator creates the DDMDeployment of the outputs, which becomes Ready, and
the digits its router draws are read as the asked ones by the shipped classifier.

Every wait polls the API or the router with a deadline; nothing sleeps a fixed time.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from kubernetes import client
from PIL import Image
from podwatch import new_namespace
from waiting import wait_for

from ddm.evaluation.commands import evaluate_images
from ddm.operator.config import Images, OperatorConfig
from ddm.operator.policy import AllowLists
from ddm.progress import PROGRESS_PREFIX, last_progress
from ddm_devcluster import ClusterInfo
from ddm_devcluster import images as dev_images
from tests.support.operator_process import TRAINING_CRD_FILE, install_crd, operator_in_thread

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE, NAME, DEPLOYMENT = "training-demo", "digits", "digits-trained"
GROUP, VERSION = "ddm.dev", "v1alpha1"
TORCH_JOB = "expert-digits-0-4"
#: Bounds on a hang, not speed targets: the whole training on two shared cores, a Ready DDM.
TRAINING_TIMEOUT_S = 3600
READY_TIMEOUT_S = 600
RESOURCES = {"requests": {"cpu": "100m", "memory": "512Mi"}}
#: The whole training takes 20-30 minutes on CI's two cores, more than CI's budget leaves:
#: the test runs where this variable is set (docs/development.md), and is skipped elsewhere.
OPT_IN = "DDM_E2E_TRAINING"

pytestmark = pytest.mark.skipif(not os.environ.get(OPT_IN),
                                reason=f"trains a DDM for 20-30 min: set {OPT_IN}=1 to run it")


@pytest.fixture(scope="module")
def output() -> Iterator[Path]:
    """A node directory the jobs' pods (uid 10001) can write (a pytest one is mode 0700)."""
    base = Path(tempfile.mkdtemp(prefix="ddm-e2e-train-", dir="/tmp"))
    os.chmod(base, 0o777)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def api(dev_cluster: ClusterInfo, kube_client: Any, output: Path) -> Iterator[dict[str, Any]]:
    """Both CRDs installed, the operator running (allowed to mount ``output``)."""
    install_crd(kube_client)
    install_crd(kube_client, crd_file=TRAINING_CRD_FILE)
    core = client.CoreV1Api(kube_client)
    new_namespace(core, NAMESPACE)
    config = OperatorConfig(images=Images.defaults(dev_images.VERSION),
                            image_pull_policy="Never",
                            allowed=AllowLists(host_paths=(f"{output}/",)))
    try:
        with operator_in_thread(dev_cluster.kubeconfig, config, (NAMESPACE,)):
            yield {"core": core, "custom": client.CustomObjectsApi(kube_client)}
    finally:
        core.delete_namespace(NAMESPACE, grace_period_seconds=0)


def _status(api: dict[str, Any], plural: str = "ddmtrainings", name: str = NAME
            ) -> dict[str, Any]:
    return api["custom"].get_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, plural, name).get("status") or {}


def _pods(api: dict[str, Any], job: str) -> list[Any]:
    return [p for p in api["core"].list_namespaced_pod(
        NAMESPACE, label_selector=f"ddm.dev/training={NAME},ddm.dev/job={job}").items
            if p.metadata.deletion_timestamp is None]


def _log(api: dict[str, Any], pod: Any) -> str:
    try:
        return api["core"].read_namespaced_pod_log(pod.metadata.name, NAMESPACE,
                                                   container=pod.spec.containers[0].name)
    except client.ApiException:
        return ""  # not started yet


def _explain(api: dict[str, Any]) -> str:
    lines = [f"status: {_status(api)}"]
    for pod in api["core"].list_namespaced_pod(NAMESPACE).items:
        lines.append(f"--- {pod.metadata.name}: {pod.status.phase}\n{_log(api, pod)[-2000:]}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def trained(api: dict[str, Any], output: Path) -> dict[str, Any]:
    """The training applied, its PyTorch expert's pod killed after its first save, run to
    Succeeded; what the test saw on the way and how long it took."""
    document = yaml.safe_load((ROOT / "examples" / "training.yaml").read_text())
    spec = document["spec"]
    root = output / NAME  # made here: a hostPath the kubelet makes is root's, mode 0755
    root.mkdir()
    os.chmod(root, 0o777)
    spec["output"]["uri"] = f"file://{root}"
    for job in (*spec["experts"], spec["router"]):
        job["resources"] = RESOURCES
    save_every = spec["experts"][0].get("saveEvery", 500)
    started = time.monotonic()
    api["custom"].create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "ddmtrainings",
                                                  document)
    # the status follows the steps the jobs log
    wait_for(lambda: (_status(api).get("jobs") or {}).get(TORCH_JOB, {}).get("stepsDone", 0)
             > 0, TRAINING_TIMEOUT_S, "steps in the status", lambda: _explain(api))
    print(f"\n{NAME}: steps in the status after {time.monotonic() - started:.0f} s: "
          f"{_status(api).get('steps')}")
    # the PyTorch expert's pod deleted once it has saved its state
    (first,) = _pods(api, TORCH_JOB)
    wait_for(lambda: (p := last_progress(_log(api, first))) and p[0] > save_every,
             TRAINING_TIMEOUT_S, f"{TORCH_JOB} past step {save_every}", lambda: _explain(api))
    api["core"].delete_namespaced_pod(first.metadata.name, NAMESPACE, grace_period_seconds=0)
    print(f"{NAME}: {TORCH_JOB}'s pod deleted after {time.monotonic() - started:.0f} s: "
          f"{_status(api).get('steps')}")
    second = wait_for(lambda: [p for p in _pods(api, TORCH_JOB)
                               if p.metadata.uid != first.metadata.uid], TRAINING_TIMEOUT_S,
                      "the Job's new pod")[0]
    resumed = wait_for(lambda: next((line for line in _log(api, second).splitlines()
                                     if line.startswith(PROGRESS_PREFIX)), None),
                       TRAINING_TIMEOUT_S, "the new pod's first progress line",
                       lambda: _explain(api))
    print(f"{NAME}: the new pod resumed at {resumed}")
    status = wait_for(lambda: (s if (s := _status(api)).get("phase") in ("Succeeded", "Failed")
                               else None), TRAINING_TIMEOUT_S, "the training to finish",
                      lambda: _explain(api))
    trained_s = time.monotonic() - started
    print(f"\n{NAME}: trained in {trained_s:.0f} s (the PyTorch expert's pod killed once)")
    return {"status": status, "resumed": last_progress(resumed), "save_every": save_every}


def test_the_jobs_run_and_report_their_steps(trained: dict[str, Any]) -> None:
    status = trained["status"]
    assert status["phase"] == "Succeeded", status
    assert status["expertsDone"] == "2/2"
    assert status["steps"] == {"done": 4500, "asked": 4500}
    assert status["deployment"] == DEPLOYMENT


def test_a_killed_expert_resumes_from_its_saved_state(trained: dict[str, Any]) -> None:
    done, total = trained["resumed"]
    assert trained["save_every"] <= done < total, trained["resumed"]


def test_the_trained_ddm_serves_digits_the_classifier_reads(
        api: dict[str, Any], trained: dict[str, Any]) -> None:
    started = time.monotonic()
    wait_for(lambda: _status(api, "ddmdeployments", DEPLOYMENT).get("phase") == "Ready",
             READY_TIMEOUT_S, f"{DEPLOYMENT} to be Ready", lambda: _explain(api))
    print(f"\n{DEPLOYMENT}: Ready {time.monotonic() - started:.0f} s after it was created")
    (router,) = [p for p in api["core"].list_namespaced_pod(
        NAMESPACE, label_selector=f"ddm.dev/deployment={DEPLOYMENT},"
                                  "app.kubernetes.io/component=router").items
                 if p.metadata.deletion_timestamp is None]
    url = f"http://{router.status.pod_ip}:8080"
    labels = np.repeat(np.arange(10), 10)
    images = []
    for half in (labels[:50], labels[50:]):
        answer = httpx.post(f"{url}/v1/generate", timeout=300,
                            json={"labels": half.tolist(), "steps": 40, "seed": 0})
        assert answer.status_code == 200, answer.text
        images.extend(np.asarray(Image.open(io.BytesIO(base64.b64decode(b))))
                      for b in answer.json()["images"])
    metrics = evaluate_images(np.stack(images), labels)
    print(f"{DEPLOYMENT}: classifier accuracy {metrics['accuracy']:.3f}")
    assert metrics["accuracy"] >= 0.9, metrics
