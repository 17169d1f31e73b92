"""The shipped DDMTraining examples pass both the CRD's schema (crds/, generated from
``ddm.deploy.training_crd``) and the parser (``ddm.deploy.training_spec``); that the two agree
field by field is tests/unit/test_generated_crds.py's walk."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from ddm.deploy import training_spec as ts

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "ddmtrainings.ddm.dev.yaml").read_text())
(VERSION,) = CRD["spec"]["versions"]


@pytest.mark.parametrize("example, name", [("training.yaml", "digits"),
                                           ("training-text2img.yaml", "text2img")])
def test_the_examples_pass_the_crds_schema_and_the_parser(example, name):
    document = yaml.safe_load((ROOT / "examples" / example).read_text())
    jsonschema.Draft7Validator(VERSION["schema"]["openAPIV3Schema"]).validate(document)
    assert ts.parse_training_manifest(document).name == name
