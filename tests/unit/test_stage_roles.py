"""A text DDM's stage roles are named once (``ddm.checkpoints.roles``, the registry that
``ddm.checkpoints.declared`` reads): the role a stage
checkpoint declares, the stage's name in a deployment plan and its key in router.yaml. The
spec, the plan, router.yaml, the router and ``ddm serve stage`` all go by those names, so a
stage planned under one name is found under it everywhere."""

from __future__ import annotations

from pathlib import Path

from ddm.checkpoints.declared import (CONFIG_KEYS, DECODER, EXPERT, PLAN_NAMES, ROLES, ROUTER,
                                      STAGE_ROLES, TEXT_ENCODER)
from ddm.deploy.plan import plan_deployment
from ddm.deploy.router_config import STAGE_FIELDS, DnsDiscovery
from ddm.deploy.spec import parse_spec
from ddm.models.stages import FAMILIES
from ddm.serving.router.api.state import STAGES
from tests.unit.test_stage_spec import _text


def test_the_names_of_each_stage():
    assert ROLES == (EXPERT, TEXT_ENCODER, DECODER, ROUTER)  # the registry's order
    assert STAGE_ROLES == (TEXT_ENCODER, DECODER, ROUTER)
    assert PLAN_NAMES == {TEXT_ENCODER: "text-encoder", DECODER: "decoder",
                          ROUTER: "router-network"}
    assert CONFIG_KEYS == {TEXT_ENCODER: "text_encoder", DECODER: "decoder",
                           ROUTER: "router_network"}
    assert set(FAMILIES.values()) == set(ROLES)  # every family plays a declared role


def test_a_stage_keeps_its_name_from_the_spec_through_the_plan_to_the_router(tmp_path: Path):
    spec = parse_spec(_text())
    assert set(spec.stages) == set(PLAN_NAMES.values())
    plan = plan_deployment(spec)
    by_name = {stage.role: stage for stage in plan.stages}
    assert {by_name[PLAN_NAMES[role]].config_key for role in STAGE_ROLES} == set(STAGE_FIELDS)
    places = {stage.role: (DnsDiscovery(f"{stage.role}.svc", 8000) if stage.separate
                           else str(tmp_path / stage.role)) for stage in plan.stages}
    config = plan.router_config({e.name: DnsDiscovery(f"{e.name}.svc", 8000)
                                 for e in plan.experts}, None, stage_places=places)
    for role in STAGE_ROLES:
        assert getattr(config, CONFIG_KEYS[role]) is not None, role
        assert STAGES[CONFIG_KEYS[role]] == role  # what the router loads it as
