"""Status aggregation from child Deployments: readiness, phases, conditions and their
transition times, and the status of an invalid spec."""

from __future__ import annotations

from ddm.operator.spec import SpecError, parse_spec
from ddm.operator.status import invalid_status, ready_status

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
