"""The spec's ``autoscaling`` (per expert) and ``router.missingExpert``, and what the plan
carries of them into router.yaml and the local runtime."""

from __future__ import annotations

import pytest

from ddm.deploy.plan import plan_deployment
from ddm.deploy.router_config import MissingExpert, StaticDiscovery
from ddm.deploy.autoscaling import Autoscaling, ScalePolicy, ScalingRules
from ddm.deploy.spec import SpecError, parse_spec


def _spec(router: dict | None = None, autoscaling: dict | None = None) -> dict:
    expert = {"name": "e", "checkpoint": {"uri": "image:///e"}}
    if autoscaling is not None:
        expert["autoscaling"] = autoscaling
    return {"sampling": {"strategy": "oracle"}, "router": router or {},
            "experts": [{**expert, "classes": [0]},
                        {"name": "f", "checkpoint": {"uri": "image:///f"}, "classes": [1]}],
            "numClasses": 2}


def test_autoscaling_and_the_policy_reach_the_plan_and_router_yaml() -> None:
    spec = parse_spec(_spec({"missingExpert": {"policy": "wait", "waitSeconds": 30}},
                            {"minReplicas": 0, "maxReplicas": 3,
                             "scaleDownDelaySeconds": 60}))
    plan = plan_deployment(spec)
    assert plan.experts[0].autoscaling == Autoscaling(0, 3, 60)
    assert plan.experts[1].autoscaling is None
    config = plan.router_config({"e": StaticDiscovery(("h:1",)),
                                 "f": StaticDiscovery(("h:2",))}, None)
    assert config.missing_expert == MissingExpert("wait", 30.0)


def test_by_default_a_missing_expert_fails_and_scaling_is_fixed() -> None:
    spec = parse_spec(_spec())
    assert spec.router.missing_expert == MissingExpert("fail", 120.0)
    assert spec.experts[0].autoscaling is None


WAIT = {"missingExpert": {"policy": "wait"}}


def test_the_scale_down_delay_defaults_to_five_minutes_and_behavior_to_hpas() -> None:
    spec = parse_spec(_spec(WAIT, {"minReplicas": 0, "maxReplicas": 1}))
    assert spec.experts[0].autoscaling == Autoscaling(
        0, 1, 300, target_rows_per_s=64,
        scale_up=ScalingRules(0, "Max", (ScalePolicy("Percent", 100, 15),
                                         ScalePolicy("Pods", 4, 15))),
        scale_down=ScalingRules(300, "Max", (ScalePolicy("Percent", 100, 15),)))


def test_target_and_behavior_are_read_as_an_hpa_reads_them() -> None:
    spec = parse_spec(_spec(autoscaling={
        "minReplicas": 1, "maxReplicas": 8, "target": {"rowsPerSecond": 200},
        "behavior": {"scaleUp": {"stabilizationWindowSeconds": 30, "selectPolicy": "Min",
                                 "policies": [{"type": "Pods", "value": 2,
                                               "periodSeconds": 60}]},
                     "scaleDown": {"stabilizationWindowSeconds": 0}}}))
    scaling = spec.experts[0].autoscaling
    assert scaling.target_rows_per_s == 200
    assert scaling.scale_up == ScalingRules(30, "Min", (ScalePolicy("Pods", 2, 60),))
    # an omitted field keeps HPA's default
    assert scaling.scale_down == ScalingRules(0, "Max", (ScalePolicy("Percent", 100, 15),))


@pytest.mark.parametrize("router, autoscaling, problem", [
    ({"missingExpert": {"policy": "hope"}}, None,
     "spec.router.missingExpert.policy: must be one of fail, wait, reroute, got 'hope'"),
    ({"missingExpert": {"waitSeconds": 0}}, None,
     "spec.router.missingExpert.waitSeconds: must be an integer in 1..3600, got 0"),
    ({}, {"minReplicas": 2, "maxReplicas": 1},
     "spec.experts[0].autoscaling.minReplicas: 2 is above maxReplicas 1"),
    ({}, {"minReplicas": 0}, "spec.experts[0].autoscaling.maxReplicas: is required"),
    ({}, {"minReplicas": 0, "maxReplicas": 1, "target": {"cpu": 3}},
     "spec.experts[0].autoscaling.target: unknown fields ['cpu']"),
    ({}, {"minReplicas": 0, "maxReplicas": 1, "target": {"rowsPerSecond": 0}},
     "spec.experts[0].autoscaling.target.rowsPerSecond: must be an integer in 1..1000000, "
     "got 0"),
    ({}, {"minReplicas": 0, "maxReplicas": 1,
          "behavior": {"scaleUp": {"policies": [{"type": "Pods", "value": 1}]}}},
     "spec.experts[0].autoscaling.behavior.scaleUp.policies[0].periodSeconds: is required"),
    ({}, {"minReplicas": 0, "maxReplicas": 1,
          "behavior": {"scaleDown": {"selectPolicy": "Most"}}},
     "spec.experts[0].autoscaling.behavior.scaleDown.selectPolicy: must be one of Max, Min, "
     "Disabled, got 'Most'"),
    ({}, {"minReplicas": 0, "maxReplicas": 1, "behavior": {"scaleDown": {"policies": []}}},
     "spec.experts[0].autoscaling.behavior.scaleDown.policies: must list at least one policy "
     "(or be left out)"),
])
def test_bad_values_are_reported_with_their_field(router, autoscaling, problem) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(_spec(router, autoscaling))
    assert problem in caught.value.problems


def test_an_external_scaler_is_named_and_the_operator_leaves_it_the_replicas() -> None:
    spec = parse_spec(_spec(autoscaling={"minReplicas": 0, "maxReplicas": 4,
                                         "scaler": "external"}))
    assert spec.experts[0].autoscaling.scaler == "external"
    assert parse_spec(_spec(WAIT, {"minReplicas": 0, "maxReplicas": 1})
                      ).experts[0].autoscaling.scaler == "operator"


@pytest.mark.parametrize("policy", ["wait", "reroute"])
def test_an_expert_the_operator_may_scale_to_zero_needs_a_policy_that_starts_it(
        policy: str) -> None:
    """Under fail nothing waits for an expert at zero nor reroutes its rows, and those are
    what start it: a generation needing it failed (after the call's deadline), every time."""
    zero = {"minReplicas": 0, "maxReplicas": 1}
    with pytest.raises(SpecError) as caught:
        parse_spec(_spec(None, zero))
    assert caught.value.problems == (
        "spec.experts[0].autoscaling.minReplicas: 0 needs spec.router.missingExpert.policy "
        "wait or reroute: under fail (the default) a generation that needs it while it is at "
        "zero fails, and nothing starts it",)
    assert parse_spec(_spec({"missingExpert": {"policy": policy}}, zero))
    assert parse_spec(_spec(None, {**zero, "minReplicas": 1}))  # never at zero
    assert parse_spec(_spec(None, {**zero, "scaler": "external"}))  # its own signals
    with pytest.raises(SpecError) as caught:
        parse_spec(_spec(autoscaling={"minReplicas": 0, "maxReplicas": 1, "scaler": "hpa"}))
    assert ("spec.experts[0].autoscaling.scaler: must be one of operator, external, got 'hpa'"
            in caught.value.problems)


def test_one_expert_must_keep_a_replica() -> None:
    raw = _spec(WAIT, {"minReplicas": 0, "maxReplicas": 1})
    raw["experts"][1]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 2}
    with pytest.raises(SpecError) as caught:
        parse_spec(raw)
    assert caught.value.problems == (
        "spec.experts: every expert has autoscaling.minReplicas 0 (its own or its pool's); keep "
        "at least one replica of one expert (the router needs a ready expert to serve at all)",)
    raw["experts"][1]["autoscaling"]["minReplicas"] = 1
    assert parse_spec(raw).experts[1].autoscaling.min_replicas == 1
