"""crds/ddmtrainings.ddm.dev.yaml and ddm.deploy.training_spec agree: the names, enums and
limits the parser checks are the CRD's, and the example passes both."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import yaml

from ddm.deploy import training_spec as ts
from ddm.deploy.accelerators import ACCELERATORS
from ddm.deploy.limits import FRAMEWORKS

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "ddmtrainings.ddm.dev.yaml").read_text())
(VERSION,) = CRD["spec"]["versions"]
SPEC = VERSION["schema"]["openAPIV3Schema"]["properties"]["spec"]
EXPERT = SPEC["properties"]["experts"]["items"]["properties"]


def test_identity_columns_and_status_subresource():
    assert (CRD["spec"]["group"], VERSION["name"], CRD["spec"]["names"]["kind"],
            CRD["spec"]["names"]["plural"]) == (ts.GROUP, ts.VERSION, ts.KIND, ts.PLURAL)
    assert CRD["metadata"]["name"] == f"{ts.PLURAL}.{ts.GROUP}"
    assert VERSION["subresources"] == {"status": {}}
    assert [c["name"] for c in VERSION["additionalPrinterColumns"]] == [
        "Engine", "Phase", "Experts", "Steps", "Age"]


def test_enums_and_limits_equal_the_parsers():
    props = SPEC["properties"]
    assert tuple(props["engine"]["enum"]) == ts.ENGINES
    assert tuple(props["data"]["properties"]["dataset"]["enum"]) == ts.DATASETS
    kmeans = props["partition"]["properties"]["kmeans"]["properties"]
    assert tuple(kmeans["features"]["enum"]) == ts.FEATURES
    assert (kmeans["clusters"]["maximum"], kmeans["imageSize"]["maximum"],
            kmeans["seed"]["maximum"]) == (ts.MAX_KMEANS, ts.MAX_IMAGE_SIZE, ts.MAX_SEED)
    assert tuple(EXPERT["framework"]["enum"]) == FRAMEWORKS
    assert tuple(EXPERT["accelerator"]["properties"]["type"]["enum"]) == tuple(ACCELERATORS)
    assert (EXPERT["nodes"]["maximum"], EXPERT["processesPerNode"]["maximum"],
            EXPERT["steps"]["maximum"], EXPERT["batchSize"]["maximum"]) == (
        ts.MAX_NODES, ts.MAX_PROCESSES_PER_NODE, ts.MAX_STEPS, ts.MAX_BATCH_SIZE)
    assert EXPERT["model"]["pattern"] == ts.MODEL_CONFIG_PATTERN
    assert EXPERT["model"]["default"] == "digits-small"
    assert props["deployment"]["properties"]["name"]["pattern"] == ts.NAME_PATTERN


def test_the_example_passes_the_crds_schema_and_the_parser():
    document = yaml.safe_load((ROOT / "examples" / "training.yaml").read_text())
    jsonschema.Draft7Validator(VERSION["schema"]["openAPIV3Schema"]).validate(document)
    assert ts.parse_training_manifest(document).name == "digits"
