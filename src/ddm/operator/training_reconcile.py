"""Level-triggered reconciliation of one DDMTraining: a thin driver of its pure plan.

Every trigger (the DDMTraining created, updated or resumed, one of its Jobs changed, the
progress ticker) runs the same ``reconcile(namespace, name)``: read the DDMTraining and its
jobs, create the jobs whose predecessors have succeeded (``training_status.to_create``: the
partition first, then every expert and the router network's job), read the steps each running
job's rank-0 process last logged (and what a failed job's pod said as it ended), create the
DDMDeployment once every job has succeeded, and write the status
(``training_status.training_status``) when it changed.

With the ``network_policy`` setting each job's NetworkPolicy
(``training_manifests.build_network_policy``) is created just before it, and a job whose policy
cannot be created (or whose name another's policy holds) is not run: its pods would not be
confined. A policy, like its job, is made once and never changed; one made before the setting
was turned off stays until the DDMTraining goes.

The jobs and policies are owned by the DDMTraining (controller ownerReferences): deleting it
deletes them.
The checkpoints stay on the output volume, and the DDMDeployment, created without an owner
reference (``training_manifests.build_deployment``), outlives it: it serves what was trained.
Its readiness is its own (``kubectl get ddmdeployment``); the training names it in
``status.deployment``; once it is there the training is over, and later runs change nothing
(jobs deleted afterwards are not run again). A job is created, never changed: a spec changed
while it runs applies to jobs not yet created.

Steps are read from the logs because that works on every cluster (1.20 included) without
giving the training pods any API access: the ticker (``TrainingTicker``) re-runs every active
training every ``PROGRESS_POLL_S``, so the status follows within a minute.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import kopf

from ddm.deploy.spec import SpecError
from ddm.deploy.training_plan import JobPlan, TrainingPlan, plan_training
from ddm.deploy.training_spec import PLURAL, TrainingSpec, parse_training_spec
from ddm.operator import names
from ddm.operator.children import with_owner
from ddm.operator.config import OperatorConfig
from ddm.operator.kube import Kube, KubeError
from ddm.operator.policy import host_path_allowed, name_allowed
from ddm.operator.status import now_rfc3339
from ddm.operator.training_manifests import (
    JOB_LABEL,
    TRAINING_LABEL,
    build_deployment,
    build_training_objects,
)
from ddm.operator.training_status import (
    FAILED,
    FAILED_PHASE,
    RUNNING,
    failure_said,
    finished,
    job_state,
    to_create,
    training_status,
)
from ddm.progress import last_progress

log = logging.getLogger("ddm.operator")
#: Seconds between two progress reads of an active training (the status is at most this old).
PROGRESS_POLL_S = 30.0
#: Log lines read from a job's rank-0 process per progress read (torchrun adds a few of its own).
LOG_LINES = 200
#: The pod label the JobSet of a multi-node TrainJob gives each node's index.
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"


@dataclass(frozen=True)
class TrainingOutcome:
    """How a run ended: the spec's problems, or the first API call that failed; ``active``:
    whether the training still has work (the ticker keeps reading its progress)."""

    spec_error: SpecError | None = None
    failure: str | None = None
    active: bool = False


class TrainingReconciler:
    """Converges DDMTrainings; safe to call from many threads (runs are serialised)."""

    def __init__(self, kube: Kube, config: OperatorConfig,
                 post_event: Callable[..., None] = kopf.info,
                 post_warning: Callable[..., None] = kopf.warn) -> None:
        self._kube, self._config = kube, config
        self._post_event, self._post_warning = post_event, post_warning
        self._lock = threading.Lock()

    def reconcile(self, namespace: str, name: str) -> TrainingOutcome | None:
        """One run for ``namespace/name``; None when it is gone or being deleted."""
        with self._lock:
            return self._run(namespace, name)

    def _run(self, namespace: str, name: str) -> TrainingOutcome | None:
        body = self._kube.get_owner(namespace, name, PLURAL)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return None
        meta, previous = body["metadata"], body.get("status") or {}
        if previous.get("deployment"):  # done: its jobs are never run again, its status stays
            return TrainingOutcome()
        try:
            spec = self._checked_spec(body.get("spec"), name)
        except SpecError as error:
            self._write(namespace, name, previous, {
                "phase": FAILED_PHASE, "observedGeneration": meta.get("generation"),
                "message": "invalid spec: " + "; ".join(error.problems)})
            return TrainingOutcome(spec_error=error)
        plan = plan_training(spec)
        jobs = self._jobs(spec, namespace, meta)
        errors: list[str] = []
        objects = build_training_objects(spec, plan, meta, self._config)
        for job in to_create(plan, jobs):
            *policies, manifest = (with_owner(made, body) for made in objects[job.name])
            try:
                for policy in policies:
                    self._create_policy(policy, meta["uid"])
                jobs[job.name] = self._kube.create_object(manifest)
            except KubeError as error:
                errors.append(error.args[0])
                continue
            self._event(body, "Created", f"created {manifest['kind']} "
                                         f"{manifest['metadata']['name']}")
        deployment = (self._create_deployment(spec, body, errors) if finished(plan, jobs)
                      else None)
        status = training_status(plan, jobs, self._logged(namespace, name, plan, jobs), meta,
                                 previous=previous, now=now_rfc3339(), deployment=deployment,
                                 said=self._said(namespace, name, plan, jobs))
        if status["phase"] == FAILED_PHASE and previous.get("phase") != FAILED_PHASE:
            self._event(body, "Failed", status["message"])
        elif deployment is not None:
            self._event(body, "Succeeded", f"every job succeeded; DDMDeployment {deployment} "
                                           "created from the outputs")
        self._write(namespace, name, previous, status)
        for error in errors:
            log.warning("%s/%s: %s", namespace, name, error)
        return TrainingOutcome(failure=errors[0] if errors else None,
                               active=status["phase"] != FAILED_PHASE and deployment is None)

    def _checked_spec(self, raw: Any, name: str) -> TrainingSpec:
        """The spec, with file:// volumes only where the operator's settings allow them, and
        store credentials only in the training's own Secrets (``<name>-*``) or allowed ones,
        as for a DDMDeployment (``ddm.operator.policy``)."""
        allowed = self._config.allowed.host_paths
        spec = parse_training_spec(raw, allow_host_paths=bool(allowed))
        outside = [f"{field}: {source.uri!r} is outside the host paths this operator allows"
                   for field, source in (("spec.output.uri", spec.output),
                                         ("spec.output.volume", spec.state),
                                         ("spec.data.uri", spec.data.volume))
                   if source is not None and source.scheme == "file"
                   and not host_path_allowed(source.path, allowed)]
        outside += [f"{field}.name: {secret.name!r} is not this training's Secret ({name}-*) "
                    "nor one this operator allows (DDM_ALLOWED_SECRETS)"
                    for field, secret in (
                        ("spec.data.storeCredentialsSecret", spec.data.store_credentials),
                        ("spec.output.storeCredentialsSecret", spec.output_credentials))
                    if secret is not None
                    and not name_allowed(secret.name, self._config.allowed.secrets, name)]
        if outside:
            raise SpecError(outside)
        return spec

    def _jobs(self, spec: TrainingSpec, namespace: str, meta: Mapping[str, Any]
              ) -> dict[str, dict[str, Any]]:
        """This training's jobs (controlled by it) by plan job name."""
        selector = (f"{TRAINING_LABEL}={meta['name']},"
                    f"{names.MANAGED_BY_LABEL}={names.MANAGED_BY}")
        kinds = ("Job", "TrainJob") if spec.engine == "kubeflow-trainer" else ("Job",)
        return {obj["metadata"]["labels"][JOB_LABEL]: obj
                for kind in kinds for obj in self._kube.list_labelled(kind, namespace, selector)
                if _controlled_by(obj, meta["uid"])
                and JOB_LABEL in (obj["metadata"].get("labels") or {})}

    def _logged(self, namespace: str, name: str, plan: TrainingPlan,
                jobs: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
        """Job name -> the steps its rank-0 process last logged (running jobs that did)."""
        logged = {}
        for job in plan.jobs:
            if job.steps is None or job_state(jobs.get(job.name)) != RUNNING:
                continue
            done = self._job_progress(namespace, name, job)
            if done is not None:
                logged[job.name] = done
        return logged

    def _said(self, namespace: str, name: str, plan: TrainingPlan,
              jobs: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
        """Failed job name -> what its newest failed pod said (its termination message)."""
        said = {}
        for job in plan.jobs:
            if job_state(jobs.get(job.name)) == FAILED:
                text = failure_said(self._pods(namespace, name, job))
                if text is not None:
                    said[job.name] = text
        return said

    def _pods(self, namespace: str, name: str, job: JobPlan) -> list[dict[str, Any]]:
        return self._kube.list_labelled(
            "Pod", namespace, f"{TRAINING_LABEL}={name},{JOB_LABEL}={job.name}")

    def _job_progress(self, namespace: str, name: str, job: JobPlan) -> int | None:
        pod = rank_zero_pod(self._pods(namespace, name, job))
        if pod is None:
            return None
        container = pod["spec"]["containers"][0]["name"]
        try:
            text = self._kube.log_tail(namespace, pod["metadata"]["name"], container,
                                       LOG_LINES)
        except KubeError as error:  # its node cannot serve logs now: the count stays
            log.warning("%s/%s: %s", namespace, name, error)
            return None
        found = last_progress(text)
        return found[0] if found else None

    def _create_policy(self, policy: dict[str, Any], uid: str) -> None:
        """Create a job's NetworkPolicy unless an earlier run did (its job's create failed);
        a ``KubeError`` when it could not be, or its name is another's."""
        meta = policy["metadata"]
        try:
            self._kube.create(policy)
        except KubeError as error:
            if error.status != 409:
                raise
            there = self._kube.get("NetworkPolicy", meta["namespace"], meta["name"])
            if there is None:
                raise KubeError(409, f"NetworkPolicy {meta['name']} was deleted while it was "
                                     "being created; it is created on the next run") from None
            if not _controlled_by(there, uid):
                raise KubeError(409, f"NetworkPolicy {meta['name']} exists and was not made "
                                     "by this training, so its job is not run (its pods would "
                                     "not be confined); delete or rename it") from None
            return
        log.info("%s/%s: created NetworkPolicy %s", meta["namespace"],
                 meta["labels"][TRAINING_LABEL], meta["name"])

    def _create_deployment(self, spec: TrainingSpec, body: Mapping[str, Any],
                           errors: list[str]) -> str | None:
        """Create the DDMDeployment of the outputs; its name, or None (the error noted)."""
        document = build_deployment(spec, body["metadata"])
        deployment = document["metadata"]["name"]
        namespace = body["metadata"]["namespace"]
        try:
            self._kube.create_object(document)
        except KubeError as error:
            if error.status != 409:
                errors.append(error.args[0])
                return None
            there = self._kube.get_owner(namespace, deployment) or {}
            labels = (there.get("metadata") or {}).get("labels") or {}
            if labels.get(TRAINING_LABEL) != body["metadata"]["name"]:
                errors.append(f"DDMDeployment {deployment} exists and was not made by this "
                              "training: left as it is")
                return None
            return deployment  # made by an earlier run whose status write failed
        return deployment

    def _write(self, namespace: str, name: str, previous: Mapping[str, Any],
               status: Mapping[str, Any]) -> None:
        if any(previous.get(key) != value for key, value in status.items()):
            self._kube.write_status(namespace, name, status, PLURAL)

    def _event(self, body: Mapping[str, Any], reason: str, message: str) -> None:
        """An event on the DDMTraining: a Warning for a failure, else Normal."""
        log.info("%s/%s: %s", body["metadata"]["namespace"], body["metadata"]["name"], message)
        post = self._post_warning if reason == "Failed" else self._post_event
        post(body, reason=reason, message=message)


def rank_zero_pod(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest started pod running a job's rank 0 (a TrainJob's node 0), or None."""
    started = [p for p in pods if (p.get("status") or {}).get("phase") not in (None, "Pending")
               and (p["metadata"].get("labels") or {}).get(JOB_INDEX_LABEL, "0") == "0"]
    return max(started, key=lambda p: (p["metadata"].get("creationTimestamp") or "",
                                       p["metadata"]["name"]), default=None)


def _controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid and ref.get("controller")
               for ref in obj["metadata"].get("ownerReferences") or [])


class TrainingTicker:
    """Re-runs every active training every ``interval`` seconds (their progress lives in logs,
    which raise no event). A thread of its own; kopf timers would put a finalizer on every
    DDMTraining, so that deleting one would hang whenever no operator runs."""

    def __init__(self, reconciler: TrainingReconciler, interval: float = PROGRESS_POLL_S
                 ) -> None:
        self._reconciler, self._interval = reconciler, interval
        self._active: set[tuple[str, str]] = set()
        self._guard = threading.Lock()
        self._stop = threading.Event()

    def start(self) -> None:
        """Start the thread in a copy of the caller's context: kopf's start-up handler holds
        the event queue that ``kopf.info`` posts to."""
        context = contextvars.copy_context()
        threading.Thread(name="training-ticker", target=context.run, args=(self._loop,),
                         daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def track(self, namespace: str, name: str, active: bool) -> None:
        """Keep (or stop) re-running ``namespace/name``."""
        with self._guard:
            (self._active.add if active else self._active.discard)((namespace, name))

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            with self._guard:
                keys = sorted(self._active)
            for namespace, name in keys:
                try:
                    outcome = self._reconciler.reconcile(namespace, name)
                except KubeError as error:
                    log.warning("%s/%s: %s (read again in %.0f s)", namespace, name, error,
                                self._interval)
                    continue
                self.track(namespace, name, outcome is not None and outcome.active)
