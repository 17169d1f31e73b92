"""docs/crd.md is generated from the CRD and must equal a fresh generation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("crd_docs", ROOT / "scripts" / "crd_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_field_reference_is_the_crds() -> None:
    crd = yaml.safe_load((ROOT / "crds" / "ddmdeployments.ddm.dev.yaml").read_text())
    expected = _script().render(crd)
    assert (ROOT / "docs" / "crd.md").read_text() == expected, (
        "docs/crd.md is out of date: run python scripts/crd_docs.py")


def test_every_field_of_the_schema_has_a_row() -> None:
    text = _script().render(yaml.safe_load(
        (ROOT / "crds" / "ddmdeployments.ddm.dev.yaml").read_text()))
    for path in ("spec.experts[].accelerator.count", "spec.router.auth.secretName",
                 "spec.experts[].tolerations[].effect", "status.routerTokenSecret",
                 "status.experts[].message", "status.conditions[].reason"):
        assert f"| `{path}` |" in text, path
    row = next(line for line in text.splitlines() if line.startswith("| `spec.sampling.steps`"))
    assert "| `40` |" in row and "1..1000" in row
