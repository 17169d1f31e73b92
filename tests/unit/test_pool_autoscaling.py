"""Pools that autoscale (issue 37 item 4), and what the operator's status says of a pool: the
spec's rules, a pool's demand as the sum of its experts', the plan's scaled units, the
Deployment leaving replicas to the scaler, ``ddm up`` running a pool at zero on demand, and
``status.pools`` / ``PoolsReady`` naming a pool that cannot start and why."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

import pytest

from ddm.deploy.autoscaler import Demand, History, decide
from ddm.deploy.plan import plan_deployment
from ddm.deploy.pools import MemberDeclaration, member_disagreements
from ddm.deploy.spec import DDMManifest, SpecError, parse_spec
from ddm.operator.config import OperatorConfig
from ddm.operator.diagram import render_mermaid
from ddm.operator.manifests import build_pool_deployment
from ddm.operator.scaler import operator_scaled
from ddm.operator.status import ready_status
from ddm.runtime.local import plan_local

META = {"name": "t2i", "namespace": "ml", "uid": "u-1", "generation": 2}
SCALING = {"minReplicas": 0, "maxReplicas": 2, "scaleDownDelaySeconds": 30}
#: What a pool's pod says when its members do not fit (pool_memory's refusal, cut).
REFUSAL = ("pool of expert-2, expert-3: the pool's members do not fit: sum 840,000,000 bytes > "
           "limit 536,870,912 bytes (--memory-limit-bytes); expert-2 420,000,000 bytes; "
           "expert-3 420,000,000 bytes")


def _raw(pool: dict[str, Any] | None = None) -> dict[str, Any]:
    """A text DDM: experts 0 and 1 alone, 2 and 3 in pool ``rare`` (with ``pool``'s fields)."""
    def checkpoint(name: str) -> dict[str, str]:
        return {"uri": f"image:///opt/ddm/checkpoints/text2img/{name}"}

    return {
        "conditioning": "text", "sampling": {"strategy": "top1"},
        "router": {"checkpoint": checkpoint("router"), "missingExpert": {"policy": "wait"}},
        "textEncoder": {"checkpoint": checkpoint("text_encoder")},
        "decoder": {"checkpoint": checkpoint("decoder")},
        "pools": [{"name": "rare", "accelerator": {"type": "cpu"}, **(pool or {})}],
        "experts": [{"name": f"expert-{i}", "checkpoint": checkpoint(f"expert_{i}"),
                     **({"pool": "rare"} if i >= 2 else {})} for i in range(4)],
    }


def _problems(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_spec(raw)
    return list(caught.value.problems)


def test_a_pool_of_experts_autoscales_on_the_sum_of_their_demand() -> None:
    spec = parse_spec(_raw({"autoscaling": SCALING}))
    (unit,) = plan_deployment(spec).autoscaled
    assert (unit.name, unit.experts, unit.pool, unit.key) == (
        "rare", ("expert-2", "expert-3"), True, "pool/rare")
    assert unit.rules.min_replicas == 0 and unit.rules.scale_down_delay_s == 30
    assert operator_scaled(spec) == (unit,)
    # 40 + 100 rows/s at the default 64 per replica: ceil(140 / 64) = 3, capped at 2
    demand = unit.demand({"expert-2": Demand(40.0, 0, True), "expert-3": Demand(100.0, 0)})
    assert demand == Demand(140.0, 0, True)
    assert decide(unit.rules, 1, demand, History.start(0.0), 1.0)[0] == 2


def test_a_generation_waiting_for_any_member_wakes_the_pool_at_zero() -> None:
    unit = plan_deployment(parse_spec(_raw({"autoscaling": SCALING}))).autoscaled[0]
    idle = {"expert-2": Demand(0.0, 0), "expert-3": Demand(0.0, 0)}
    assert decide(unit.rules, 0, unit.demand(idle), History(), 0.0)[0] == 0
    waiting = {**idle, "expert-3": Demand(0.0, 1)}
    assert unit.demand(waiting) == Demand(0.0, 1)
    assert decide(unit.rules, 0, unit.demand(waiting), History(), 0.0)[0] == 1


def test_an_autoscaled_pools_deployment_leaves_replicas_to_the_scaler() -> None:
    fixed, scaled = (parse_spec(_raw(pool)) for pool in ({"replicas": 2},
                                                          {"autoscaling": SCALING}))
    config = OperatorConfig()
    assert build_pool_deployment(fixed, fixed.pools[0], META, config)["spec"]["replicas"] == 2
    assert "replicas" not in build_pool_deployment(scaled, scaled.pools[0], META, config)["spec"]


def test_a_pool_without_experts_has_no_demand_to_scale_by() -> None:
    raw = _raw({"autoscaling": SCALING})
    raw["textEncoder"]["pool"] = "rare"
    for expert in raw["experts"]:
        expert.pop("pool", None)
    assert _problems(raw) == [
        "spec.pools[0].autoscaling: pool 'rare' holds no expert, so no demand to scale by "
        "(the routers count rows per expert); set replicas"]


def test_a_pool_holding_a_stage_keeps_a_replica() -> None:
    raw = _raw({"autoscaling": SCALING})
    raw["decoder"]["pool"] = "rare"
    assert _problems(raw) == [
        "spec.pools[0].autoscaling: minReplicas 0 would leave spec.decoder (in pool 'rare') "
        "without a server, and every generation needs it; keep minReplicas at 1 or more, or "
        "give the stage a pool (or placement) of its own"]
    raw["pools"][0]["autoscaling"] = {**SCALING, "minReplicas": 1}
    assert parse_spec(raw).pools[0].autoscaling.min_replicas == 1


def test_every_expert_at_zero_through_its_pool_is_refused() -> None:
    raw = _raw({"autoscaling": SCALING})
    for expert in raw["experts"]:
        expert["pool"] = "rare"
    assert _problems(raw) == [
        "spec.experts: every expert has autoscaling.minReplicas 0 (its own or its pool's); "
        "keep at least one replica of one expert (the router needs a ready expert to serve at "
        "all)"]


def test_members_that_disagree_are_named_in_pairs_with_their_values() -> None:
    expert = MemberDeclaration("expert", (4, 8, 8), 128, "ours")
    members = {"expert-0": expert, "text-encoder": MemberDeclaration("text_encoder",
                                                                     text_width=128),
               "expert-1": MemberDeclaration("expert", (4, 16, 16), 256, "flow-match-1000"),
               "router-network": MemberDeclaration("router", (4, 8, 8), None,
                                                   "flow-match-1000")}
    assert member_disagreements(members) == [
        "members expert-0 and expert-1 disagree on latent_shape: [4, 8, 8] for expert-0, "
        "[4, 16, 16] for expert-1",
        "members expert-0 and expert-1 disagree on text_width: 128 for expert-0, 256 for "
        "expert-1",
        "members expert-0 and expert-1 disagree on convention: ours for expert-0, "
        "flow-match-1000 for expert-1"]
    # a router network's convention is its own; undeclared values are not compared
    assert member_disagreements({"expert-0": expert, "router-network": members[
        "router-network"], "decoder": MemberDeclaration("decoder")}) == []


def test_ddm_up_runs_a_pool_at_zero_on_demand_and_the_others_at_once(tmp_path: Path) -> None:
    raw = _raw({"autoscaling": SCALING})
    raw["experts"][0]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 1}
    plan = plan_local(DDMManifest("t2i", None, parse_spec(raw)), itertools.count(20000).__next__,
                      8080, cache_dir=tmp_path)
    assert {(d.scaled.key, d.processes) for d in plan.on_demand} == {
        ("expert-0", ("expert-0/0",)), ("pool/rare", ("pool-rare/0",))}
    assert [p.name for p in plan.pools] == ["pool-rare/0"]
    assert [d.label for d in plan.on_demand] == ["expert-0", "pool rare"]


def test_a_pool_the_operator_may_scale_to_zero_needs_a_policy_that_starts_it() -> None:
    raw = _raw({"autoscaling": SCALING})
    del raw["router"]["missingExpert"]
    assert _problems(raw) == [
        "spec.pools[0].autoscaling.minReplicas: 0 needs spec.router.missingExpert.policy "
        "wait or reroute: under fail (the default) a generation that needs it while it is at "
        "zero fails, and nothing starts it"]


def test_a_cpu_pools_memory_limit_is_what_its_members_must_fit_in() -> None:
    raw = _raw({"resources": {"limits": {"memory": "512Mi"}}})
    (pool,) = plan_deployment(parse_spec(raw)).pools
    assert pool.args[-2:] == ("--memory-limit-bytes", str(512 * 2**20))
    raw["pools"][0]["accelerator"] = {"type": "nvidia"}  # a GPU's own free memory instead
    (pool,) = plan_deployment(parse_spec(raw)).pools
    assert "--memory-limit-bytes" not in pool.args


def _crashing_pool_pod() -> dict[str, Any]:
    return {"metadata": {"name": "t2i-pool-rare-x", "labels": {
        "ddm.dev/deployment": "t2i", "app.kubernetes.io/component": "pool",
        "ddm.dev/pool": "rare"}}, "status": {"containerStatuses": [{
            "name": "pool", "ready": False, "restartCount": 2,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}},
            "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                         "message": f"Traceback ...\nValueError\n{REFUSAL}"}}}]}}


def test_a_pool_that_cannot_start_is_named_with_its_pods_message() -> None:
    spec = parse_spec(_raw())
    deployments = {"t2i-expert-expert-0": {"status": {"readyReplicas": 1}},
                   "t2i-expert-expert-1": {"status": {"readyReplicas": 1}},
                   "t2i-router": {"status": {"readyReplicas": 1}}}
    status = ready_status(spec, META, deployments=deployments, previous={}, now="T",
                          pods=[_crashing_pool_pod()])
    why = f"container pool restarted 2 times; last exit 1: {REFUSAL}"
    assert status["phase"] == "Progressing"
    assert status["pools"] == [{"name": "rare", "accelerator": "cpu",
                                "members": ["expert-2", "expert-3"], "replicas": 1,
                                "readyReplicas": 0, "reason": "CrashLoopBackOff",
                                "message": why}]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["PoolsReady"]["status"] == "False"
    assert conditions["PoolsReady"]["message"] == f"pool rare: 0/1 ready: {why}"
    # told once for the pool, naming its experts; the Ready condition repeats it
    assert conditions["ExpertsReady"]["message"] == (
        f"pool rare (experts expert-2, expert-3): 0/1 ready: {why}")
    assert conditions["Ready"]["message"] == conditions["ExpertsReady"]["message"]
    ready = ready_status(spec, META, deployments={
        **deployments, "t2i-pool-rare": {"status": {"readyReplicas": 1}}}, previous={},
        now="T")
    assert ready["phase"] == "Ready"
    assert {c["type"]: c["message"] for c in ready["conditions"]}["PoolsReady"] == (
        "1 pool(s) ready")


def test_a_pool_of_stages_alone_holds_readiness_back() -> None:
    raw = _raw()
    raw["textEncoder"]["pool"] = "rare"
    for expert in raw["experts"]:
        expert.pop("pool", None)
    deployments = {f"t2i-expert-expert-{i}": {"status": {"readyReplicas": 1}} for i in range(4)}
    status = ready_status(parse_spec(raw), META, deployments={
        **deployments, "t2i-router": {"status": {"readyReplicas": 1}}}, previous={}, now="T",
        pods=[_crashing_pool_pod()])
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["ExpertsReady"]["status"] == "True"
    assert conditions["Ready"]["reason"] == "PoolsNotReady"
    assert REFUSAL in conditions["Ready"]["message"]


def test_an_autoscaled_pool_at_zero_is_ready() -> None:
    spec = parse_spec(_raw({"autoscaling": SCALING}))
    deployments = {"t2i-expert-expert-0": {"status": {"readyReplicas": 1}},
                   "t2i-expert-expert-1": {"status": {"readyReplicas": 1}},
                   "t2i-pool-rare": {"spec": {"replicas": 0}, "status": {}},
                   "t2i-router": {"status": {"readyReplicas": 1}}}
    status = ready_status(spec, META, deployments=deployments, previous={}, now="T")
    assert status["phase"] == "Ready"
    assert status["expertReplicas"] == "expert-0 1/1, expert-1 1/1, expert-2 0/0, expert-3 0/0"
    scaling_up = copy.deepcopy(deployments)
    scaling_up["t2i-pool-rare"]["spec"]["replicas"] = 1
    waiting = ready_status(spec, META, deployments=scaling_up, previous={}, now="T")
    assert waiting["phase"] == "Progressing"
    assert waiting["pools"][0]["replicas"] == 1


def test_the_diagram_shows_an_autoscaled_pools_range() -> None:
    text = render_mermaid(parse_spec(_raw({"autoscaling": SCALING})), "t2i")
    assert "pool rare<br/>expert-2, expert-3<br/>0 to 2 replicas (autoscaled) on CPU" in text
