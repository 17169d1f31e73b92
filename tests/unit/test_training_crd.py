"""The shipped DDMTraining example passes both the CRD's schema (crds/, generated from
``ddm.deploy.training_crd``) and the parser (``ddm.deploy.training_spec``); that the two agree
field by field is tests/unit/test_generated_crds.py's walk."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import yaml

from ddm.deploy import training_spec as ts

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "ddmtrainings.ddm.dev.yaml").read_text())
(VERSION,) = CRD["spec"]["versions"]


def test_the_example_passes_the_crds_schema_and_the_parser():
    document = yaml.safe_load((ROOT / "examples" / "training.yaml").read_text())
    jsonschema.Draft7Validator(VERSION["schema"]["openAPIV3Schema"]).validate(document)
    assert ts.parse_training_manifest(document).name == "digits"
