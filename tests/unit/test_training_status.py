"""A DDMTraining's next jobs and status from its plan, its jobs' conditions and logged steps
(pure: the operator's reconcile only feeds these), and the progress line they read."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ddm.deploy.training_plan import plan_training
from ddm.deploy.training_spec import load_training_manifest, parse_training_spec
from ddm.operator.training_reconcile import JOB_INDEX_LABEL, rank_zero_pod
from ddm.operator.training_status import (
    failure_said,
    finished,
    job_state,
    to_create,
    training_status,
)
from ddm.progress import last_progress, progress_line
from ddm.training.cli import _progress

ROOT = Path(__file__).resolve().parents[2]
SPEC = load_training_manifest(ROOT / "examples" / "training.yaml").spec
PLAN = plan_training(SPEC)  # expert-digits-0-4, expert-digits-5-9, router
META = {"name": "digits", "namespace": "ns", "generation": 3}
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"


def _job(condition: str | None = None, failed: int = 0) -> dict[str, Any]:
    status: dict[str, Any] = {"failed": failed} if failed else {}
    if condition:
        status["conditions"] = [{"type": condition, "status": "True"}]
    return {"metadata": {"name": "x"}, "status": status}


def _status(jobs: dict[str, Any], logged: dict[str, int] | None = None,
            previous: dict[str, Any] | None = None, deployment: str | None = None,
            plan: Any = PLAN) -> dict[str, Any]:
    return training_status(plan, jobs, logged or {}, META, previous=previous or {}, now=T1,
                           deployment=deployment)


def test_job_state_reads_the_conditions_jobs_and_trainjobs_share() -> None:
    assert job_state(None) == "Absent"
    assert job_state(_job()) == "Running"
    assert job_state(_job("Complete")) == "Succeeded"
    assert job_state(_job("Failed", failed=7)) == "Failed"
    assert job_state({"status": {"conditions": [{"type": "Complete", "status": "False"}]}}
                     ) == "Running"


def test_experts_and_the_router_start_together() -> None:
    assert [j.name for j in to_create(PLAN, {})] == ["expert-digits-0-4", "expert-digits-5-9",
                                                     "router"]
    running = {"expert-digits-0-4": _job(), "expert-digits-5-9": _job("Complete"),
               "router": _job()}
    assert to_create(PLAN, running) == ()
    done = {**running, "expert-digits-0-4": _job("Complete")}
    assert not finished(PLAN, done)
    assert finished(PLAN, {**done, "router": _job("Complete")})


def test_a_fitted_partition_runs_first_and_alone() -> None:
    raw = {"output": {"uri": "pvc://c/p"}, "partition": {"kmeans": {"clusters": 2,
                                                                   "imageSize": 16}},
           "experts": [{"name": "a"}, {"name": "b"}], "deployment": {"name": "d", "spec": {}}}
    plan = plan_training(parse_training_spec(raw))
    assert [j.name for j in to_create(plan, {})] == ["partition"]
    status = _status({"partition": _job()}, plan=plan)
    assert status["phase"] == "Partitioning"
    assert [j.name for j in to_create(plan, {"partition": _job("Complete")})] == [
        "expert-a", "expert-b", "router"]


def test_data_in_a_store_is_fetched_first_with_no_condition_of_its_own() -> None:
    raw = {"data": {"dataset": "mnist", "uri": "gs://datasets/mnist.tar.gz"},
           "output": {"uri": "gs://models/run", "volume": "pvc://work/run"},
           "partition": {"labelGroups": [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]},
           "experts": [{"name": "a"}, {"name": "b"}], "deployment": {"name": "d", "spec": {}}}
    plan = plan_training(parse_training_spec(raw))
    assert [j.name for j in to_create(plan, {})] == ["data"]
    status = _status({"data": _job()}, plan=plan)
    assert status["phase"] == "Fetching" and "stepsDone" not in status["jobs"]["data"]
    assert [c["type"] for c in status["conditions"]] == ["Expert-a", "Expert-b", "Router"]
    assert [j.name for j in to_create(plan, {"data": _job("Complete")})] == [
        "expert-a", "expert-b", "router"]


def test_text2img_stages_count_their_steps_and_only_experts_and_router_get_conditions(
        ) -> None:
    plan = plan_training(load_training_manifest(
        ROOT / "examples" / "training-text2img.yaml").spec)
    status = _status({"tokenizer": _job("Complete"), "vae": _job(), "clip": _job()},
                     {"vae": 40, "clip": 7}, plan=plan)
    assert status["phase"] == "Training"
    assert status["jobs"]["vae"] == {"state": "Running", "retries": 0, "stepsDone": 40,
                                     "stepsAsked": 3000}
    assert "stepsAsked" not in status["jobs"]["tokenizer"]
    assert {c["type"] for c in status["conditions"]} == {
        *(f"Expert-expert-{k}" for k in range(4)), "Router"}
    assert status["expertsDone"] == "0/4"
    assert status["steps"] == {"done": 47, "asked": 2000 + 3000 + 4 * 3000 + 1500}


def test_a_failed_job_fails_the_training_naming_it_and_nothing_more_starts() -> None:
    jobs = {"expert-digits-0-4": _job("Failed", failed=7),
            "expert-digits-5-9": _job("Complete")}
    assert to_create(PLAN, jobs) == ()
    status = _status(jobs)
    assert status["phase"] == "Failed"
    assert "expert-digits-0-4" in status["message"] and "7 failed pods" in status["message"]
    assert status["jobs"]["expert-digits-0-4"]["retries"] == 7


def test_steps_per_job_and_in_all_from_logs_and_finished_jobs() -> None:
    jobs = {"expert-digits-0-4": _job(failed=1), "expert-digits-5-9": _job("Complete")}
    status = _status(jobs, logged={"expert-digits-0-4": 700})
    assert status["phase"] == "Training"
    assert status["expertsDone"] == "1/2"
    assert status["jobs"]["expert-digits-0-4"] == {
        "state": "Running", "retries": 1, "stepsDone": 700, "stepsAsked": 1500}
    assert status["jobs"]["expert-digits-5-9"]["stepsDone"] == 1500
    assert status["jobs"]["router"] == {"state": "Absent", "retries": 0, "stepsDone": 0,
                                        "stepsAsked": 1500}
    assert status["steps"] == {"done": 2200, "asked": 4500}
    conditions = {c["type"]: c for c in status["conditions"]}
    assert set(conditions) == {"Expert-digits-0-4", "Expert-digits-5-9", "Router"}
    assert conditions["Expert-digits-0-4"]["status"] == "False"
    assert conditions["Expert-digits-0-4"]["message"].startswith("700/1500 steps")
    assert conditions["Expert-digits-5-9"]["status"] == "True"
    assert status["message"] is None and "deployment" not in status


def test_a_restarted_pod_that_logged_nothing_yet_keeps_the_count() -> None:
    jobs = {"expert-digits-0-4": _job(failed=1), "expert-digits-5-9": _job()}
    before = _status(jobs, logged={"expert-digits-0-4": 500, "expert-digits-5-9": 40})
    after = _status(jobs, logged={"expert-digits-5-9": 60}, previous=before)
    assert after["jobs"]["expert-digits-0-4"]["stepsDone"] == 500
    assert after["jobs"]["expert-digits-5-9"]["stepsDone"] == 60


def test_an_unchanged_state_gives_an_equal_status() -> None:
    jobs = {"expert-digits-0-4": _job(), "expert-digits-5-9": _job()}
    first = training_status(PLAN, jobs, {}, META, previous={}, now=T0, deployment=None)
    again = training_status(PLAN, jobs, {}, META, previous=first, now=T1, deployment=None)
    assert again == first


def test_succeeded_names_the_deployment() -> None:
    jobs = {name: _job("Complete") for name in ("expert-digits-0-4", "expert-digits-5-9",
                                                 "router")}
    status = _status(jobs, deployment="digits-trained")
    assert status["phase"] == "Succeeded" and status["deployment"] == "digits-trained"
    assert status["steps"] == {"done": 4500, "asked": 4500}
    assert _status({})["phase"] == "Pending"


def test_the_newest_started_pod_of_node_zero_is_read() -> None:
    def pod(name: str, created: str, phase: str, index: str | None = None) -> dict[str, Any]:
        labels = {JOB_INDEX_LABEL: index} if index is not None else {}
        return {"metadata": {"name": name, "creationTimestamp": created, "labels": labels},
                "status": {"phase": phase}}

    old, new = pod("a", T0, "Failed"), pod("b", T1, "Running")
    assert rank_zero_pod([new, old]) is new
    assert rank_zero_pod([old, pod("c", T1, "Pending")]) is old
    assert rank_zero_pod([pod("n1", T1, "Running", "1"), pod("n0", T0, "Running", "0")]
                         )["metadata"]["name"] == "n0"
    assert rank_zero_pod([]) is None


def test_progress_lines_round_trip_and_the_last_well_formed_one_counts() -> None:
    log = "\n".join(["W torchrun noise", progress_line(10, 50), progress_line(20, 50),
                     "ddm-progress step 3x/50", "wrote /output/experts/a"])
    assert last_progress(log) == (20, 50)
    assert last_progress("nothing here") is None


def test_the_trainer_logs_progress_lines_every_interval_and_at_the_end(capsys: Any) -> None:
    quiet = argparse.Namespace(quiet=True, progress_log=None)
    assert _progress(quiet, 30, "expert") is None  # no bar, no lines: nothing to drive
    update = _progress(argparse.Namespace(quiet=True, progress_log=3600.0), 30, "expert")
    for step in (10, 20, 30):
        update(step, 0.5)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [progress_line(10, 30), progress_line(30, 30)]  # the first, then the last
    every = _progress(argparse.Namespace(quiet=True, progress_log=0.0), 30, "expert")
    for step in (10, 20):
        every(step, 0.5)
    assert last_progress(capsys.readouterr().err) == (20, 30)


def _pod(name: str, created: str, *, phase: str = "Failed", exit_code: int | None = 1,
         message: str | None = None, last: bool = False) -> dict[str, Any]:
    """A Job's pod as the API server shows it: its container ended (in ``state``, or in
    ``lastState`` with ``last``) with ``exit_code`` and termination ``message``."""
    ended = {"terminated": {"exitCode": exit_code, "reason": "Error",
                            **({"message": message} if message else {})}}
    container = {"name": "train", **({"lastState": ended, "state": {"waiting": {}}} if last
                                     else {"state": ended})}
    return {"metadata": {"name": name, "creationTimestamp": created},
            "status": {"phase": phase,
                       "containerStatuses": [] if exit_code is None else [container]}}


def test_the_newest_failed_pod_says_why_capped_to_its_last_line() -> None:
    long = "ValueError: " + "x" * 1000
    pods = [_pod("a", T0, message="OSError: disk full"),
            _pod("b", T1, message=f"Traceback (most recent call last):\n  ...\n{long}\n"),
            _pod("c", "2026-01-01T00:02:00Z", phase="Running", exit_code=None)]
    said = failure_said(pods)
    assert said == long[:397] + "..."
    assert failure_said([_pod("a", T0, message="CheckpointError: bad", last=True)]) == \
        "CheckpointError: bad"
    assert failure_said([_pod("a", T0)]) == "Error"  # no message: the reason
    evicted = {"metadata": {"name": "a"}, "status": {
        "phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: "
                                                           "memory."}}
    assert failure_said([evicted]) == "The node was low on resource: memory."
    assert failure_said([_pod("a", T0, phase="Running", exit_code=None)]) is None


def test_a_failed_jobs_reason_reaches_its_condition_and_the_message() -> None:
    jobs = {"expert-digits-0-4": _job("Failed", failed=7), "expert-digits-5-9": _job(),
            "router": _job()}
    said = failure_said([_pod("p", T0, message="ddm train expert: CUDA out of memory")])
    status = training_status(PLAN, jobs, {}, META, previous={}, now=T1, deployment=None,
                             said={"expert-digits-0-4": said})
    assert status["message"] == ("job expert-digits-0-4 failed after 7 failed pods (each "
                                 "retried from its saved state); it said: ddm train expert: "
                                 "CUDA out of memory")
    (condition,) = [c for c in status["conditions"] if c["type"] == "Expert-digits-0-4"]
    assert condition["message"].endswith("; it said: ddm train expert: CUDA out of memory")
