"""Write the CRDs, the chart's copies and the chart's derived values schema from the declarations.

Each custom resource's fields are declared once in Python (``ddm.deploy.crd`` for the
DDMDeployment, ``ddm.deploy.training_crd`` for the DDMTraining; ``ddm.deploy.schema`` holds the
types and the generator); this script writes ``crds/<plural>.<group>.yaml`` and the chart's copy
of each, and, in the chart's hand-written ``values.schema.json``, the settings that mirror a
declaration (``VALUES_PARTS``). ``make lint`` and tests/unit/test_generated_crds.py fail while a
committed file differs from what this writes.

    python scripts/generate_crds.py            # rewrite them (make generate)
    python scripts/generate_crds.py --check    # exit 1 naming each file out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ddm.deploy.accelerators import image_families
from ddm.deploy.crd import DDM_DEPLOYMENT
from ddm.deploy.schema import CustomResource, Field, String, crd_yaml, openapi
from ddm.deploy.training_crd import DDM_TRAINING
from ddm.operator.policy import CHECKPOINT_ENTRY_PATTERN, NAME_ENTRY_PATTERN, WORD_ENTRY_PATTERN
from ddm.sampling_params import STRATEGY

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "ddm-operator"
VALUES_SCHEMA = CHART / "values.schema.json"
#: The custom resources this repository defines: one file each under crds/ and the chart's crds/.
RESOURCES: tuple[CustomResource, ...] = (DDM_DEPLOYMENT, DDM_TRAINING)
#: The chart values that take what a declaration takes, by their path in values.schema.json: a
#: field declared (its schema), or the JSON written there. An image per image family of the
#: accelerator registry (``ddm.deploy.accelerators``) and the operator's own; the operator's
#: policy settings (``ddm.operator.policy``), each entry checked as the operator checks it.
IMAGES = ("properties", "images")
TENANTS = ("properties", "tenants", "properties")
VALUES_PARTS: dict[tuple[str, ...], Field | Any] = {
    (*IMAGES, "required"): ["operator", *sorted(image_families())],
    **{(*IMAGES, "properties", name): {"$ref": "#/definitions/image"}
       for name in ("operator", *sorted(image_families()))},
    (*TENANTS, "allowedImages", "items"): String(min_length=1, pattern=WORD_ENTRY_PATTERN),
    (*TENANTS, "allowedCheckpointSources", "items"): String(pattern=CHECKPOINT_ENTRY_PATTERN),
    (*TENANTS, "allowedSecrets", "items"): String(pattern=NAME_ENTRY_PATTERN),
    (*TENANTS, "allowedClaims", "items"): String(pattern=NAME_ENTRY_PATTERN),
    (*TENANTS, "allowedTolerationKeys", "items"): String(min_length=1, pattern=WORD_ENTRY_PATTERN),
    (*TENANTS, "allowedNodeSelectorKeys", "items"):
        String(min_length=1, pattern=WORD_ENTRY_PATTERN),
    (*TENANTS, "allowedStrategies", "items"): String(pattern=STRATEGY.pattern),
}
#: The widest line of values.schema.json: a container that fits stays on one line.
JSON_WIDTH = 100


def values_schema(hand_written: dict[str, Any]) -> str:
    """``hand_written`` (the chart's values schema) with every part of ``VALUES_PARTS`` set from
    its declaration, as the JSON text committed; a path whose parent is not there is an
    error."""
    for path, declared in VALUES_PARTS.items():
        parent = hand_written
        for key in path[:-1]:
            if not isinstance(parent.get(key), dict):
                raise KeyError(f"{VALUES_SCHEMA.name}: no object at {'.'.join(path[:-1])}")
            parent = parent[key]
        parent[path[-1]] = openapi(declared) if isinstance(declared, Field) else declared
    return _json(hand_written, 0) + "\n"


def _json(value: Any, indent: int, used: int = 0) -> str:
    """``value`` as JSON at ``indent`` spaces, after ``used`` columns of its line (its key): on
    one line when that fits in ``JSON_WIDTH`` columns, else one entry a line."""
    flat = json.dumps(value, ensure_ascii=False)
    if (not isinstance(value, (dict, list)) or not value
            or indent + used + len(flat) <= JSON_WIDTH):
        return flat
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        entries = [f"{pad}{json.dumps(k)}: {_json(v, indent + 2, len(json.dumps(k)) + 2)}"
                   for k, v in value.items()]
        open_, close = "{", "}"
    else:
        entries = [f"{pad}{_json(v, indent + 2)}" for v in value]
        open_, close = "[", "]"
    return open_ + "\n" + ",\n".join(entries) + "\n" + " " * indent + close


def generated() -> dict[Path, str]:
    """Every generated file's path and the text it must hold."""
    files: dict[Path, str] = {}
    for resource in RESOURCES:
        text = crd_yaml(resource)
        files[ROOT / "crds" / f"{resource.name}.yaml"] = text
        files[CHART / "crds" / f"{resource.name}.yaml"] = text
    files[VALUES_SCHEMA] = values_schema(json.loads(VALUES_SCHEMA.read_text()))
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only check that the committed files are what this writes")
    args = parser.parse_args(argv)
    files = generated()
    if args.check:
        stale = [path for path, text in files.items()
                 if not path.is_file() or path.read_text() != text]
        for path in stale:
            print(f"{path.relative_to(ROOT)} is not what its declarations generate: run `make "
                  "generate` (python scripts/generate_crds.py) and commit the result",
                  file=sys.stderr)
        return 1 if stale else 0
    for path, text in files.items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
