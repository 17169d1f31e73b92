"""Status aggregation from child Deployments and their pods: readiness, phases, conditions
and their transition times, why a replica is not ready, and the status of an invalid spec."""

from __future__ import annotations

from ddm.deploy.spec import SpecError, parse_spec
from ddm.operator.status import Trouble, invalid_status, pod_trouble, ready_status

META = {"name": "digits", "namespace": "ml", "generation": 3}
SPEC = parse_spec({
    "sampling": {"strategy": "oracle"},
    "router": {"replicas": 2},
    "experts": [
        {"name": "low", "checkpoint": {"uri": "image:///l"}, "classes": [0, 1, 2, 3, 4],
         "accelerator": {"type": "nvidia", "count": 1}},
        {"name": "high", "checkpoint": {"uri": "image:///h"}, "classes": [5, 6, 7, 8, 9],
         "replicas": 2},
    ],
})


def _deployments(low: int, high: int, router: int) -> dict:
    return {name: {"status": {"readyReplicas": ready} if ready else {}}
            for name, ready in (("digits-expert-low", low), ("digits-expert-high", high),
                                ("digits-router", router))}


def _conditions(status: dict) -> dict:
    return {c["type"]: c for c in status["conditions"]}


def test_nothing_ready_is_pending() -> None:
    status = ready_status(SPEC, META, deployments={}, previous={}, now="T1")
    assert status["phase"] == "Pending" and status["expertsReady"] == "0/2"
    assert status["observedGeneration"] == 3
    assert status["routerURL"] == "http://digits-router.ml.svc:8080"
    conditions = _conditions(status)
    assert conditions["Ready"]["status"] == "False"
    assert conditions["Ready"]["reason"] == "ExpertsNotReady"
    assert conditions["ExpertsReady"]["message"] == (
        "waiting for low (0/1 ready), high (0/2 ready)")
    assert conditions["SpecValid"]["status"] == "True"
    assert all(c["lastTransitionTime"] == "T1" and c["observedGeneration"] == 3
               for c in conditions.values())
    assert status["experts"][0] == {"name": "low", "accelerator": "nvidia x1", "replicas": 1,
                                    "readyReplicas": 0}


def test_some_ready_is_progressing() -> None:
    status = ready_status(SPEC, META, deployments=_deployments(1, 1, 0), previous={}, now="T1")
    assert status["phase"] == "Progressing" and status["expertsReady"] == "1/2"
    assert _conditions(status)["ExpertsReady"]["message"] == "waiting for high (1/2 ready)"


def test_everything_ready_is_ready() -> None:
    status = ready_status(SPEC, META, deployments=_deployments(1, 2, 2), previous={}, now="T1")
    assert status["phase"] == "Ready" and status["expertsReady"] == "2/2"
    assert {t: c["status"] for t, c in _conditions(status).items()} == {
        "Ready": "True", "SpecValid": "True", "ExpertsReady": "True", "RouterReady": "True"}
    assert status["router"] == {"replicas": 2, "readyReplicas": 2}


def test_the_router_alone_can_hold_readiness_back() -> None:
    status = ready_status(SPEC, META, deployments=_deployments(1, 2, 1), previous={}, now="T1")
    ready = _conditions(status)["Ready"]
    assert (ready["status"], ready["reason"], ready["message"]) == (
        "False", "RouterNotReady", "1/2 router replicas ready")


def test_an_expert_scaled_to_zero_is_not_ready() -> None:
    spec = parse_spec({"router": {"checkpoint": {"uri": "image:///r"}}, "experts": [
        {"name": "a", "checkpoint": {"uri": "image:///a"}, "replicas": 0}]})
    status = ready_status(spec, META, deployments={}, previous={}, now="T1")
    assert _conditions(status)["ExpertsReady"]["message"] == "waiting for a (0/0 ready)"


def test_transition_times_move_only_on_transitions() -> None:
    first = ready_status(SPEC, META, deployments={}, previous={}, now="T1")
    same = ready_status(SPEC, META, deployments={}, previous=first, now="T2")
    assert same == first  # nothing to write
    ready = ready_status(SPEC, META, deployments=_deployments(1, 2, 2), previous=first, now="T3")
    times = {t: c["lastTransitionTime"] for t, c in _conditions(ready).items()}
    assert times == {"Ready": "T3", "SpecValid": "T1", "ExpertsReady": "T3", "RouterReady": "T3"}


def test_a_failed_apply_is_failed() -> None:
    status = ready_status(SPEC, META, deployments={}, previous={}, now="T1",
                          failure="applying Service x: forbidden")
    assert status["phase"] == "Failed"
    ready = _conditions(status)["Ready"]
    assert (ready["reason"], ready["message"]) == ("ApplyFailed", "applying Service x: forbidden")


def test_an_invalid_spec_keeps_what_the_children_report() -> None:
    before = ready_status(SPEC, META, deployments=_deployments(1, 2, 2), previous={}, now="T1")
    error = SpecError(["spec.a: bad", "spec.b: worse"])
    status = invalid_status(error, {**META, "generation": 4}, previous=before, now="T2")
    assert status["phase"] == "Invalid" and status["observedGeneration"] == 4
    assert status["expertsReady"] == "2/2" and status["experts"] == before["experts"]
    conditions = _conditions(status)
    assert conditions["SpecValid"]["status"] == "False"
    assert conditions["SpecValid"]["message"] == "spec.a: bad; spec.b: worse"
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == ("False",
                                                                              "SpecInvalid")
    assert conditions["ExpertsReady"] == _conditions(before)["ExpertsReady"]


# ------------------------------------------------------------ why a replica is not ready

def _pod(name: str, expert: str | None, **status) -> dict:
    labels = {"ddm.dev/deployment": "digits",
              "app.kubernetes.io/component": "router" if expert is None else "expert"}
    if expert is not None:
        labels["ddm.dev/expert"] = expert
    return {"metadata": {"name": name, "labels": labels}, "status": status}


def _crash_looping(name: str, expert: str | None, message: str, restarts: int = 3) -> dict:
    return _pod(name, expert, phase="Running", containerStatuses=[{
        "name": "expert", "ready": False, "restartCount": restarts,
        "state": {"waiting": {"reason": "CrashLoopBackOff",
                              "message": "back-off 40s restarting failed container"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message}}}])


SHA_MISMATCH = ("checkpoint /models/expert: weights.safetensors has sha256 12ab..., "
                "config.json says 34cd...")


def test_a_crash_loop_says_how_often_and_what_the_container_said() -> None:
    trouble = pod_trouble([_crash_looping("p", "low", SHA_MISMATCH)])
    assert trouble == Trouble("CrashLoopBackOff",
                              f"container expert restarted 3 times; last exit 1: {SHA_MISMATCH}")


def test_a_log_tail_is_cut_to_its_last_line() -> None:
    log = "Traceback (most recent call last):\n  File x\nValueError: " + "y" * 1000 + "\n\n"
    trouble = pod_trouble([_crash_looping("p", "low", log, restarts=1)])
    assert "restarted 1 time; last exit 1: ValueError: yyy" in trouble.message
    assert trouble.message.endswith("...") and len(trouble.message) < 500


def test_an_image_that_cannot_be_pulled() -> None:
    pod = _pod("p", "low", phase="Pending", containerStatuses=[{
        "name": "expert", "ready": False, "restartCount": 0,
        "state": {"waiting": {"reason": "ImagePullBackOff",
                              "message": 'Back-off pulling image "reg/ddm:nope"'}}}])
    assert pod_trouble([pod]) == Trouble(
        "ImagePullBackOff",
        'container expert: ImagePullBackOff: Back-off pulling image "reg/ddm:nope"')


def test_a_failing_fetch_is_an_init_container_trouble() -> None:
    pod = _pod("p", "low", phase="Pending", initContainerStatuses=[{
        "name": "fetch-checkpoint", "ready": False, "restartCount": 2,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "message": "s3://b/k: 403 Forbidden"}}}],
        containerStatuses=[{"name": "expert", "ready": False, "restartCount": 0,
                            "state": {"waiting": {"reason": "PodInitializing"}}}])
    assert pod_trouble([pod]).message == (
        "init container fetch-checkpoint restarted 2 times; last exit 1: s3://b/k: 403 Forbidden")


def test_a_pod_no_node_takes() -> None:
    pod = _pod("digits-expert-low-1", "low", phase="Pending", conditions=[{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}])
    assert pod_trouble([pod]) == Trouble(
        "Unschedulable", "pod digits-expert-low-1 cannot be scheduled: 0/4 nodes are "
                         "available: 4 Insufficient nvidia.com/gpu.")


def test_pods_that_are_merely_starting_or_going_say_nothing() -> None:
    starting = _pod("a", "low", phase="Pending", containerStatuses=[{
        "name": "expert", "ready": False, "restartCount": 0,
        "state": {"waiting": {"reason": "ContainerCreating"}}}])
    fetched = _pod("b", "low", phase="Running", initContainerStatuses=[{
        "name": "fetch-checkpoint", "ready": True, "restartCount": 0,
        "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}])
    leaving = _crash_looping("c", "low", SHA_MISMATCH)
    leaving["metadata"]["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    assert pod_trouble([starting, fetched, leaving]) is None
    assert pod_trouble([]) is None


def test_the_status_says_why_an_expert_and_the_router_are_not_ready() -> None:
    pods = [_crash_looping("l1", "low", SHA_MISMATCH),
            _crash_looping("r1", None, "router.yaml: auth.token_file: no such file")]
    status = ready_status(SPEC, META, deployments=_deployments(0, 1, 0), previous={}, now="T1",
                          pods=pods)
    experts = {e["name"]: e for e in status["experts"]}
    assert experts["low"]["reason"] == "CrashLoopBackOff"
    assert experts["low"]["message"].endswith(SHA_MISMATCH)
    assert "reason" not in experts["high"]  # not ready yet, but nothing says why
    conditions = _conditions(status)
    assert conditions["ExpertsReady"]["message"] == (
        f"expert low: 0/1 ready: container expert restarted 3 times; last exit 1: "
        f"{SHA_MISMATCH}; waiting for high (1/2 ready)")
    assert conditions["Ready"]["message"] == conditions["ExpertsReady"]["message"]
    assert conditions["RouterReady"]["message"] == (
        "0/2 router replicas ready: container expert restarted 3 times; last exit 1: "
        "router.yaml: auth.token_file: no such file")
    assert status["router"]["reason"] == "CrashLoopBackOff"


def test_a_ready_expert_reports_no_trouble_from_a_stray_pod() -> None:
    pods = [_crash_looping("l2", "low", SHA_MISMATCH)]
    status = ready_status(SPEC, META, deployments=_deployments(1, 2, 2), previous={}, now="T1",
                          pods=pods)
    assert status["phase"] == "Ready" and "reason" not in status["experts"][0]


def test_the_status_names_the_token_secret_never_the_token() -> None:
    status = ready_status(SPEC, META, deployments={}, previous={}, now="T1",
                          token_secret="digits-router-token")
    assert status["routerTokenSecret"] == "digits-router-token"
    assert "routerTokenSecret" not in ready_status(SPEC, META, deployments={}, previous={},
                                                   now="T1")


def test_a_failing_stager_is_why_the_pods_that_copy_from_it_wait() -> None:
    spec = parse_spec({
        "sampling": {"strategy": "oracle"}, "router": {"replicas": 2},
        "experts": [{"name": "low", "checkpoint": {"uri": "s3://models/low"},
                     "classes": [0, 1, 2, 3, 4]},
                    {"name": "high", "checkpoint": {"uri": "image:///h"},
                     "classes": [5, 6, 7, 8, 9]}]})
    stager = {"metadata": {"name": "digits-stager-1", "labels": {
        "ddm.dev/deployment": "digits", "app.kubernetes.io/component": "stager"}},
        "status": {"phase": "Pending", "initContainerStatuses": [{
            "name": "fetch-expert-low", "ready": False, "restartCount": 1,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": 1,
                                         "message": "s3://models/low: HTTP 403 Forbidden"}}}]}}
    copying = _pod("l1", "low", phase="Pending", initContainerStatuses=[{
        "name": "copy-checkpoint", "ready": False, "restartCount": 0,
        "state": {"running": {}}}])
    status = ready_status(spec, META, deployments=_deployments(0, 0, 0), previous={},
                          now="T1", pods=[stager, copying])
    experts = {e["name"]: e for e in status["experts"]}
    assert experts["low"]["message"] == (
        "checkpoint stager: init container fetch-expert-low restarted 1 time; last exit 1: "
        "s3://models/low: HTTP 403 Forbidden")
    assert "reason" not in experts["high"]  # its checkpoint is in its image


def test_a_pooled_expert_is_as_ready_as_its_pools_deployment_and_says_why_not() -> None:
    spec = parse_spec({
        "conditioning": "text", "sampling": {"strategy": "top1"},
        "router": {"checkpoint": {"uri": "image:///r"}},
        "textEncoder": {"checkpoint": {"uri": "image:///t"}, "pool": "gpu"},
        "pools": [{"name": "gpu", "accelerator": {"type": "nvidia"}, "replicas": 2}],
        "experts": [{"name": "a", "checkpoint": {"uri": "image:///a"}, "pool": "gpu"},
                    {"name": "b", "checkpoint": {"uri": "image:///b"}}]})
    pending = {"metadata": {"name": "p", "labels": {
        "ddm.dev/deployment": "digits", "app.kubernetes.io/component": "pool",
        "ddm.dev/pool": "gpu"}}, "status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}}
    status = ready_status(spec, META, deployments={
        "digits-pool-gpu": {"status": {"readyReplicas": 1}},
        "digits-expert-b": {"status": {"readyReplicas": 1}},
        "digits-router": {"status": {"readyReplicas": 1}}}, previous={}, now="T1",
        pods=[pending])
    assert status["expertReplicas"] == "a 1/2, b 1/1"
    assert status["experts"][0]["accelerator"] == "nvidia x1"
    assert "Insufficient nvidia.com/gpu" in status["experts"][0]["message"]
    ready = ready_status(spec, META, deployments={
        "digits-pool-gpu": {"status": {"readyReplicas": 2}},
        "digits-expert-b": {"status": {"readyReplicas": 1}},
        "digits-router": {"status": {"readyReplicas": 1}}}, previous={}, now="T1")
    assert ready["phase"] == "Ready"


# ------------------------------------------------------------ an update rolling out

def _deployment(generation: int, seen: int, *, replicas: int, running: int, updated: int,
                ready: int) -> dict:
    """A Deployment as the API server shows it: at spec ``generation``, the controller having
    seen ``seen``; ``running`` pods of which ``updated`` run the current template."""
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": seen, "replicas": running,
                       "updatedReplicas": updated, "readyReplicas": ready}}


def _settled() -> dict:
    return {"digits-expert-low": _deployment(2, 2, replicas=1, running=1, updated=1, ready=1),
            "digits-expert-high": _deployment(1, 1, replicas=2, running=2, updated=2, ready=2),
            "digits-router": _deployment(1, 1, replicas=2, running=2, updated=2, ready=2)}


def test_a_ddm_is_not_ready_until_its_update_runs_on_every_replica() -> None:
    """Its old replicas still answer, but Ready means the spec as written is what serves:
    ``kubectl wait --for=condition=Ready`` after an apply must not return on the old model."""
    assert ready_status(SPEC, META, deployments=_settled(), previous={},
                        now="T1")["phase"] == "Ready"
    unseen = {**_settled(), "digits-expert-low": _deployment(
        3, 2, replicas=1, running=1, updated=1, ready=1)}
    status = ready_status(SPEC, META, deployments=unseen, previous={}, now="T1")
    assert status["phase"] == "Progressing" and status["expertsReady"] == "1/2"
    assert _conditions(status)["ExpertsReady"]["message"] == (
        "waiting for low (1/1 ready, update not yet observed)")
    # The controller made the new pod first (surging, as a CPU server's does) and no node can
    # take it.
    surging = {**_settled(), "digits-expert-low": _deployment(
        3, 3, replicas=1, running=2, updated=1, ready=1)}
    new_pod = _pod("digits-expert-low-new", "low", phase="Pending", conditions=[{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}])
    old_pod = _pod("digits-expert-low-old", "low", phase="Running")
    status = ready_status(SPEC, META, deployments=surging, previous={}, now="T1",
                          pods=[old_pod, new_pod])
    conditions = _conditions(status)
    assert (conditions["Ready"]["status"], conditions["Ready"]["reason"]) == (
        "False", "ExpertsNotReady")
    assert conditions["ExpertsReady"]["message"] == (
        "expert low: 1/1 ready, 1 old replica left: pod digits-expert-low-new cannot be "
        "scheduled: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")
    assert status["experts"][0]["reason"] == "Unschedulable"
    # Replacing instead (a server on an accelerator): the old pod went first.
    replacing = {**_settled(), "digits-expert-low": _deployment(
        3, 3, replicas=1, running=0, updated=0, ready=0)}
    assert _conditions(ready_status(SPEC, META, deployments=replacing, previous={},
                                    now="T1"))["ExpertsReady"]["message"] == (
        "waiting for low (0/1 ready)")


def test_the_router_and_a_pool_say_how_far_their_update_got() -> None:
    spec = parse_spec({
        "sampling": {"strategy": "oracle"},
        "pools": [{"name": "gpu", "accelerator": {"type": "nvidia"}}],
        "experts": [{"name": "a", "checkpoint": {"uri": "image:///a"}, "classes": [0, 1, 2, 3, 4],
                     "pool": "gpu"},
                    {"name": "b", "checkpoint": {"uri": "image:///b"},
                     "classes": [5, 6, 7, 8, 9],
                     "pool": "gpu"}]})
    rolling = {"digits-pool-gpu": _deployment(4, 3, replicas=1, running=1, updated=1, ready=1),
               "digits-router": _deployment(2, 2, replicas=1, running=2, updated=1, ready=1)}
    conditions = _conditions(ready_status(spec, META, deployments=rolling, previous={},
                                          now="T1"))
    assert conditions["PoolsReady"]["message"] == "pool gpu: 1/1 ready, update not yet observed"
    assert conditions["RouterReady"]["message"] == (
        "1/1 router replicas ready, 1 old replica left")
    assert conditions["ExpertsReady"]["message"] == (
        "waiting for a (1/1 ready, update not yet observed), "
        "b (1/1 ready, update not yet observed)")
