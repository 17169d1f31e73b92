"""What the builders and the status make of ``autoscaling``: the Deployment leaves its replicas
to the scaler, and the status shows the replicas the scaler set (an expert at zero is ready)."""

from __future__ import annotations

from ddm.deploy.spec import parse_spec
from ddm.operator.config import OperatorConfig
from ddm.operator.manifests import build_expert_deployment
from ddm.operator.status import ready_status, reconciled_part

META = {"name": "digits", "namespace": "ml", "uid": "u-1", "generation": 2}
SPEC = parse_spec({
    "sampling": {"strategy": "oracle"},
    "router": {"missingExpert": {"policy": "wait"}},
    "experts": [
        {"name": "hot", "checkpoint": {"uri": "image:///h"}, "classes": [0, 1, 2, 3, 4],
         "replicas": 2},
        {"name": "rare", "checkpoint": {"uri": "image:///r"}, "classes": [5, 6, 7, 8, 9],
         "replicas": 3, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}},
    ],
})


def _rolled_out(replicas: int, ready: int) -> dict:
    """A Deployment as the API server shows it once its pods run its current template."""
    return {"metadata": {"generation": 2}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": 2, "replicas": replicas,
                       "updatedReplicas": replicas, "readyReplicas": ready}}


def _deployments(rare_desired: int, rare_ready: int) -> dict:
    return {"digits-expert-hot": _rolled_out(2, 2),
            "digits-expert-rare": _rolled_out(rare_desired, rare_ready),
            "digits-router": _rolled_out(1, 1)}


def test_an_autoscaled_experts_deployment_leaves_replicas_to_the_scaler() -> None:
    hot, rare = (build_expert_deployment(e, META, OperatorConfig()) for e in SPEC.experts)
    assert hot["spec"]["replicas"] == 2
    assert "replicas" not in rare["spec"]  # not the spec's 3: applying it never resets them


def test_an_expert_scaled_to_zero_is_ready_and_the_column_says_so() -> None:
    status = ready_status(SPEC, META, deployments=_deployments(0, 0), previous={}, now="T")
    assert status["phase"] == "Ready" and status["expertsReady"] == "2/2"
    assert status["expertReplicas"] == "hot 2/2, rare 0/0"
    assert status["experts"][1]["replicas"] == 0


def test_an_expert_scaling_up_is_waited_for() -> None:
    status = ready_status(SPEC, META, deployments=_deployments(1, 0), previous={}, now="T")
    assert status["phase"] == "Progressing" and status["expertReplicas"] == "hot 2/2, rare 0/1"
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["ExpertsReady"]["message"] == "waiting for rare (0/1 ready)"


def test_the_scalers_change_of_the_count_alone_does_not_flap_ready() -> None:
    """A scale-down the Deployment controller has not yet seen is no update: Ready stays
    True (it moves only when ready falls short of desired); a scale-up waits for the
    replicas, not for an update."""
    down = {**_deployments(1, 1), "digits-expert-rare": {
        "metadata": {"generation": 3}, "spec": {"replicas": 1},
        "status": {"observedGeneration": 2, "replicas": 2, "updatedReplicas": 2,
                   "readyReplicas": 2}}}
    assert ready_status(SPEC, META, deployments=down, previous={}, now="T")["phase"] == "Ready"
    up = {**_deployments(1, 1), "digits-expert-rare": {
        "metadata": {"generation": 3}, "spec": {"replicas": 3},
        "status": {"observedGeneration": 2, "replicas": 2, "updatedReplicas": 2,
                   "readyReplicas": 2}}}
    conditions = {c["type"]: c for c in ready_status(SPEC, META, deployments=up, previous={},
                                                     now="T")["conditions"]}
    assert conditions["ExpertsReady"]["message"] == "waiting for rare (2/3 ready)"


def test_the_reconciles_status_leaves_the_scalers_demand_to_the_scaler() -> None:
    """The reconcile's merge patch has no ``demand``, so the scaler's newest stays; and a
    status that differs only in the scaler's part is not rewritten."""
    demand = {"observedAt": "T0", "routers": "1/1",
              "experts": [{"name": "rare", "rowsPerSecond": 0.0, "waiting": 0}]}
    status = ready_status(SPEC, META, deployments=_deployments(0, 0), previous={}, now="T")
    assert "demand" not in status
    assert reconciled_part({**status, "demand": demand}) == status


def test_the_routers_metrics_port_admits_the_operator_the_chart_names() -> None:
    """With network policies on (the chart's default), the scaler can read the routers."""
    from helm_tool import ensure_helm
    from test_chart import env_of, render

    from ddm.operator import names
    from ddm.operator.access import build_network_policies

    config = OperatorConfig.from_env(env_of(render(ensure_helm(), namespace="ops")))
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "ddm-operator",
                                                "app.kubernetes.io/instance": "ddm"}}}
    assert config.operator_from == (operator,)
    experts, router = build_network_policies(META, config, fetches=False)
    assert {"from": [operator], "ports": [{"protocol": "TCP", "port": names.METRICS_PORT}]} in (
        router["spec"]["ingress"])
    assert all(operator not in rule.get("from", []) for rule in experts["spec"]["ingress"])


def test_the_diagram_shows_an_autoscaled_experts_range() -> None:
    from ddm.operator.diagram import render_mermaid

    text = render_mermaid(SPEC, "digits")
    assert "0 to 2 replicas (autoscaled) on CPU" in text and "2 replicas on CPU" in text
