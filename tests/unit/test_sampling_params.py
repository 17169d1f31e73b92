"""Sampling parameters are declared once (``ddm.sampling_params``), so every reader takes and
refuses the same values: the router's API schema, ``ddm sample``'s flags, ``router.yaml``, a
DDMDeployment's ``spec.sampling`` and the CRD's openAPIV3Schema (checked as the API server
checks it), for values just inside and just outside each bound of each parameter."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import jsonschema
import pydantic
import pytest
import yaml

from ddm.cli import build_parser
from ddm.deploy.router_config import RouterConfigError, RouterConfigFile
from ddm.deploy.spec import SpecError, parse_spec
from ddm.sampling_params import (GUIDANCE_CUTOFF, MAX_STEPS, PARAMS, SOLVER, SamplingError,
                                 SamplingParams, check_sampling)
from ddm.serving.router.api.requests import request_models

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "ddmdeployments.ddm.dev.yaml").read_text())
SAMPLING_SCHEMA = (CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
                   ["spec"]["properties"]["sampling"]["properties"])
TEXT_SPEC = yaml.safe_load((ROOT / "examples" / "text2img.yaml").read_text())["spec"]

#: Per parameter: values each reader must take, and values each must refuse (just inside and
#: just outside every bound; for strings, the grammar's edges).
CASES: dict[str, tuple[list[Any], list[Any]]] = {
    "steps": ([1, 2, MAX_STEPS - 1, MAX_STEPS], [0, -1, MAX_STEPS + 1, 2.5, "30"]),
    "solver": (["euler", "heun"], ["rk4", "Euler", ""]),
    # top4: the spec's DDM has 4 experts, and a spec refuses to combine more than it has.
    "strategy": (["top1", "top4", "topk:1", "threshold:1", "threshold:0.001", "ensemble"],
                 ["top0", "top100", "threshold:0", "threshold:1.01", "best", ""]),
    "guidance_scale": ([0, 0.0, 1, 49.99, 50], [-0.01, 50.01, 1e9, "4"]),
    "guidance_cutoff": ([0.001, 0.5, 1, 1.0], [0, 0.0, -0.5, 1.001, 2, "1"]),
}


def _text_config(sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """A text DDM's router.yaml allowing every declared step count."""
    return {"experts": [{"name": "e", "discovery": {"endpoints": ["127.0.0.1:9"]}}],
            "conditioning": "text", "text_encoder": {"checkpoint": "/text_encoder"},
            "router_checkpoint": "/router", "limits": {"max_steps": MAX_STEPS},
            **({"sampling": sampling} if sampling is not None else {})}


GENERATE_REQUEST = request_models(RouterConfigFile.from_dict(_text_config()))[0]


def _api(name: str, value: Any) -> bool:
    try:
        GENERATE_REQUEST.model_validate({"prompts": ["a red seven"], name: value})
    except pydantic.ValidationError:
        return False
    return True


def _cli(name: str, value: Any) -> bool | None:
    """None: a command line holds only text, so a JSON string for a number is no case."""
    param = next(p for p in PARAMS if p.name == name)
    if isinstance(value, str) and param.kind is not str:
        return None
    flag = param.flag
    try:
        build_parser().parse_args(["sample", "--out", "x.png", f"{flag}={value}"])
    except SystemExit:
        return False
    return True


def _router_yaml(name: str, value: Any) -> bool:
    try:
        RouterConfigFile.from_dict(_text_config({name: value}))
    except RouterConfigError:
        return False
    return True


def _key(name: str) -> str:
    return next(p.key for p in PARAMS if p.name == name)


def _spec(name: str, value: Any) -> bool:
    spec = copy.deepcopy(TEXT_SPEC)
    spec["sampling"][_key(name)] = value
    try:
        parse_spec(spec)
    except SpecError:
        return False
    return True


def _crd(name: str, value: Any) -> bool:
    # The API server's structural schemas are OpenAPI 3.0: Draft 4's boolean exclusiveMinimum.
    return jsonschema.Draft4Validator(SAMPLING_SCHEMA[_key(name)]).is_valid(value)


def _declaration(name: str, value: Any) -> bool:
    try:
        check_sampling({name: value})
    except SamplingError:
        return False
    return True


READERS = {"declaration": _declaration, "api": _api, "cli": _cli, "router.yaml": _router_yaml,
           "spec": _spec, "crd": _crd}


@pytest.mark.parametrize("name", list(CASES))
def test_every_reader_takes_and_refuses_the_same_values(name: str) -> None:
    good, bad = CASES[name]
    verdicts = {reader: ([v for v in good if takes(name, v) is False],
                         [v for v in bad if takes(name, v) is True])
                for reader, takes in READERS.items()}
    wrong = {reader: f"refused {refused}, took {took}"
             for reader, (refused, took) in verdicts.items() if refused or took}
    assert not wrong, wrong


def test_every_parameter_has_cases() -> None:
    assert list(CASES) == [p.name for p in PARAMS]
    assert [f.name for f in dataclasses.fields(SamplingParams)] == [p.name for p in PARAMS]


def test_one_message_names_the_field_and_its_range_everywhere() -> None:
    with pytest.raises(SamplingError, match=r"guidance_cutoff must be a number in \(0, 1\], "
                                            r"got 0"):
        SamplingParams(guidance_cutoff=0)
    with pytest.raises(RouterConfigError, match=r"sampling.guidance_cutoff must be a number in "
                                                r"\(0, 1\], got 0"):
        RouterConfigFile.from_dict(_text_config({"guidance_cutoff": 0}))
    spec = copy.deepcopy(TEXT_SPEC)
    spec["sampling"]["guidanceCutoff"] = 0
    with pytest.raises(SpecError, match=r"spec.sampling.guidanceCutoff: must be a number in "
                                        r"\(0, 1\], got 0"):
        parse_spec(spec)
    assert GUIDANCE_CUTOFF.range() == "(0, 1]"


def test_an_integral_guidance_scale_is_kept_as_a_float() -> None:
    assert SamplingParams(guidance_scale=4).guidance_scale == 4.0
    assert isinstance(SamplingParams(guidance_scale=4).guidance_scale, float)


def test_every_declared_solver_and_strategy_is_one_the_loop_runs() -> None:
    from ddm.sampling.routing import parse_strategy
    from ddm.sampling.solvers import stepper

    for solver in SOLVER.choices:
        stepper(solver)
    for strategy in CASES["strategy"][0]:
        parse_strategy(strategy)
