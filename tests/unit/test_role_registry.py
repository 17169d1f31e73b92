"""The stage-role registry: each stage's ``/v1/info`` is held to what its role declares it
reports, a role declared in a test alone is checked the same way, and the places a stage has
outside Python (the CRD's spec fields, router.yaml's keys) are the registry's."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddm.checkpoints.roles import ROLE_REGISTRY, StageRole, stage_roles
from ddm.deploy.limits import MAX_EXPERT_TEXT
from ddm.deploy.pools import STAGE_FIELDS
from ddm.deploy.router_config import RouterConfigFile
from ddm.serving.router.fleet.replicas import InvalidReport
from ddm.serving.router.fleet.stage_clients import StageInfo

ROOT = Path(__file__).resolve().parents[2]
#: A whole report of every field a stage may report, each valid for any role.
FIELDS: dict[str, Any] = {"text_width": 8, "latent_shape": [4, 8, 8],
                          "image_shape": [3, 32, 32], "clusters": 2}
#: Not shipped (images -> whether each is safe): declared here only, to show that a role is
#: one declaration.
SAFETY_CHECKER = StageRole("safety_checker", ("check",), ("image_shape",), "safetyChecker",
                           "spec", "safety-checker")


def _report(role: StageRole) -> dict[str, Any]:
    return {"role": role.name, "max_batch": 4, "wire_dtype": "float32",
            **{name: FIELDS[name] for name in role.reports}}


@pytest.mark.parametrize("role", stage_roles(), ids=lambda r: r.name)
def test_each_stage_report_needs_what_its_role_declares(role: StageRole) -> None:
    info = StageInfo.from_json(_report(role))
    for name in role.reports:
        value = getattr(info, name)
        assert (list(value) if isinstance(value, tuple) else value) == FIELDS[name]
        with pytest.raises(InvalidReport, match=name):
            StageInfo.from_json({k: v for k, v in _report(role).items() if k != name})


def test_a_stage_report_says_its_device_as_a_short_string_or_nothing() -> None:
    router = ROLE_REGISTRY["router"]
    assert StageInfo.from_json({**_report(router), "device": "cuda:0"}).device == "cuda:0"
    assert StageInfo.from_json(_report(router)).device is None
    assert StageInfo.from_json({**_report(router), "device": ["cuda"]}).device is None
    long = StageInfo.from_json({**_report(router), "device": "x" * 10**6}).device
    assert long is not None and len(long) == MAX_EXPERT_TEXT


def test_a_role_declared_in_a_test_is_checked_by_its_declaration(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidReport, match="role must be one of text_encoder, decoder, "
                                            "router, got 'safety_checker'"):
        StageInfo.from_json(_report(SAFETY_CHECKER))
    monkeypatch.setitem(ROLE_REGISTRY, SAFETY_CHECKER.name, SAFETY_CHECKER)
    assert StageInfo.from_json(_report(SAFETY_CHECKER)).image_shape == (3, 32, 32)
    with pytest.raises(InvalidReport, match="image_shape"):
        StageInfo.from_json({**_report(SAFETY_CHECKER), "image_shape": None})
    assert SAFETY_CHECKER in stage_roles()
    assert SAFETY_CHECKER.spec_field == "spec.safetyChecker"


def test_each_stage_has_the_spec_field_and_router_yaml_key_its_role_declares() -> None:
    crd = yaml.safe_load((ROOT / "crds" / "ddmdeployments.ddm.dev.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    config_fields = {f.name for f in dataclasses.fields(RouterConfigFile)}
    for role in stage_roles():
        where = schema
        for part in role.spec_field.split("."):
            where = where[part]
            where = where.get("properties", where)
        assert where, role.spec_field
        assert role.config_key in config_fields
        assert STAGE_FIELDS[role.plan_name] == role.spec_field
