"""A DDMTraining's status and next steps, computed (purely) from its plan, its jobs and what
their logs last said.

- Each job's state comes from its Job's (or TrainJob's) conditions (:func:`job_state`):
  absent, running, succeeded or failed. A failed pod is retried by the Job controller up to
  ``backoffLimit`` times (``training_manifests.BACKOFF_LIMIT``); the new pod passes
  ``--resume`` and continues the state the failed one saved, and no other job is touched. A
  job that has used every retry is failed, and so is the training, naming the job.
- Steps: a running job's steps come from its rank-0 process's last progress line
  (``ddm train --progress-log``, ``ddm.progress.last_progress``), read from its pod's log by
  the reconcile; a finished job has done every step asked; a job whose pod has printed
  nothing yet keeps the count the status had (a resumed pod continues from its saved step).
- A failed job's reason: what its newest failed pod said as it ended (its termination
  message, :func:`failure_said`), read by the reconcile, in the job's condition and the
  status' message.
- The phase: Failed (a job failed), Succeeded (every job did), Fetching (the data job copies
  MNIST from its store), Partitioning (the partition job runs), Training (an expert or the
  router job runs), else Pending.

Conditions keep their ``lastTransitionTime`` while their status is unchanged (``status``), so an
unchanged state gives an equal status and the operator writes nothing.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ddm.deploy.training_plan import (
    DATA_JOB,
    EXPERT_KIND,
    PARTITION_JOB,
    TRAINED_KINDS,
    JobPlan,
    TrainingPlan,
)
from ddm.deploy.training_crd import TRAINING_PHASES
from ddm.operator.status import build_condition, capped_last_line, conditions_by_type

#: The training's phases by name (the CRD's ``status.phase`` allows only these).
(PENDING_PHASE, FETCHING_PHASE, PARTITIONING_PHASE, TRAINING_PHASE, SUCCEEDED_PHASE,
 FAILED_PHASE) = TRAINING_PHASES
ABSENT, RUNNING, SUCCEEDED, FAILED = "Absent", "Running", "Succeeded", "Failed"
#: The job conditions Job and TrainJob share (a JobSet's too): ``Complete`` and ``Failed``.
_FINISHED = {"Complete": SUCCEEDED, "Failed": FAILED}


def job_state(job: Mapping[str, Any] | None) -> str:
    """ABSENT (no such job), SUCCEEDED, FAILED (out of retries) or RUNNING."""
    if job is None:
        return ABSENT
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("status") == "True" and condition.get("type") in _FINISHED:
            return _FINISHED[condition["type"]]
    return RUNNING


def job_retries(job: Mapping[str, Any] | None) -> int:
    """The pods of ``job`` that failed so far (each retried from its saved state)."""
    return int(((job or {}).get("status") or {}).get("failed") or 0)


def failure_said(pods: Sequence[Mapping[str, Any]]) -> str | None:
    """What the newest failed pod of a job said as it ended: the termination message of its
    container that failed (``ddm train`` writes its error there; without one, Kubernetes
    keeps the log's tail), else the pod's own reason (an eviction); its last line, capped as
    a DDMDeployment's status caps what its pods say (``status.capped_last_line``). None: none
    said."""
    failed = [pod for pod in pods if (pod.get("status") or {}).get("phase") == "Failed"]
    for pod in sorted(failed, reverse=True, key=lambda p: (
            p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"])):
        status = pod.get("status") or {}
        for container in status.get("containerStatuses") or []:
            for state in (container.get("state"), container.get("lastState")):
                ended = (state or {}).get("terminated") or {}
                if ended.get("exitCode", 0) != 0:
                    return capped_last_line(ended.get("message") or ended.get("reason")
                                            or f"exit status {ended['exitCode']}")
        if status.get("message") or status.get("reason"):
            return capped_last_line(status.get("message") or status["reason"])
    return None


def to_create(plan: TrainingPlan, jobs: Mapping[str, Mapping[str, Any] | None]
              ) -> tuple[JobPlan, ...]:
    """The jobs to create now: those absent whose every predecessor has succeeded; none once
    a job has failed (the training has failed)."""
    states = {job.name: job_state(jobs.get(job.name)) for job in plan.jobs}
    if FAILED in states.values():
        return ()
    done = {name for name, state in states.items() if state == SUCCEEDED}
    return tuple(job for job in plan.ready(done) if states[job.name] == ABSENT)


def finished(plan: TrainingPlan, jobs: Mapping[str, Mapping[str, Any] | None]) -> bool:
    """Whether every job has succeeded (the DDMDeployment is then created)."""
    return all(job_state(jobs.get(job.name)) == SUCCEEDED for job in plan.jobs)


def training_status(plan: TrainingPlan, jobs: Mapping[str, Mapping[str, Any] | None],
                    logged: Mapping[str, int], meta: Mapping[str, Any], *,
                    previous: Mapping[str, Any], now: str, deployment: str | None,
                    said: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The status: ``phase``, ``expertsDone`` (``k/n``), ``steps`` (done and asked in all),
    ``jobs`` (per job: state, steps done and asked, retries), a condition per expert
    (``Expert-NAME``) and for the router (``Router``), ``message`` (why it failed), and
    ``deployment`` (the DDMDeployment created, once it is). ``logged``: job name -> the steps
    its last progress line reported; ``said``: failed job name -> what its failed pod said
    (:func:`failure_said`), repeated in its condition and in ``message``."""
    said = said or {}
    before = conditions_by_type(previous)
    earlier = previous.get("jobs") or {}
    generation = meta.get("generation")
    states = {job.name: job_state(jobs.get(job.name)) for job in plan.jobs}
    report: dict[str, dict[str, Any]] = {}
    conditions = []
    for job in plan.jobs:
        state = states[job.name]
        entry: dict[str, Any] = {"state": state, "retries": job_retries(jobs.get(job.name))}
        if job.steps is not None:
            done = (job.steps if state == SUCCEEDED else
                    logged.get(job.name, (earlier.get(job.name) or {}).get("stepsDone", 0)))
            entry.update(stepsDone=min(int(done), job.steps), stepsAsked=job.steps)
        report[job.name] = entry
        if job.kind in TRAINED_KINDS:
            kind = f"Expert-{job.expert}" if job.kind == EXPERT_KIND else "Router"
            message = _progress_message(entry)
            if state == FAILED and job.name in said:
                message += f"; it said: {said[job.name]}"
            conditions.append(build_condition(before, kind, state == SUCCEEDED, generation, now,
                                              (state, message)))
    failed = [name for name in states if states[name] == FAILED]
    experts = [job for job in plan.jobs if job.kind == EXPERT_KIND]
    trained = [job for job in plan.jobs if job.steps is not None]
    status: dict[str, Any] = {
        "phase": _phase(plan, states),
        "observedGeneration": generation,
        "expertsDone": f"{sum(states[j.name] == SUCCEEDED for j in experts)}/{len(experts)}",
        "steps": {"done": sum(report[j.name]["stepsDone"] for j in trained),
                  "asked": sum(j.steps or 0 for j in trained)},
        "jobs": report,
        "conditions": conditions,
        "message": (f"job {failed[0]} failed after {report[failed[0]]['retries']} failed pods "
                    f"(each retried from its saved state)"
                    + (f"; it said: {said[failed[0]]}" if failed[0] in said else "")
                    if failed else None),
    }
    if deployment is not None:
        status["deployment"] = deployment
    return status


def _progress_message(entry: Mapping[str, Any]) -> str:
    return (f"{entry['stepsDone']}/{entry['stepsAsked']} steps, "
            f"{entry['retries']} failed pods retried")


def _phase(plan: TrainingPlan, states: Mapping[str, str]) -> str:
    if FAILED in states.values():
        return FAILED_PHASE
    if all(state == SUCCEEDED for state in states.values()):
        return SUCCEEDED_PHASE
    if states.get(DATA_JOB) == RUNNING:
        return FETCHING_PHASE
    if states.get(PARTITION_JOB) == RUNNING:
        return PARTITIONING_PHASE
    if any(state != ABSENT for state in states.values()):
        return TRAINING_PHASE
    return PENDING_PHASE
