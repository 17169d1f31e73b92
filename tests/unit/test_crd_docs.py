"""docs/crd.md and docs/training-crd.md are generated from the CRDs and must equal a fresh
generation."""

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


def test_the_field_references_are_the_crds() -> None:
    script = _script()
    assert [page.crd for page in script.PAGES] == sorted(
        f"crds/{path.name}" for path in (ROOT / "crds").glob("*.yaml")), "a CRD without a page"
    for page in script.PAGES:
        expected = script.render(yaml.safe_load((ROOT / page.crd).read_text()), page)
        assert (ROOT / page.doc).read_text() == expected, (
            f"{page.doc} is out of date: run python scripts/crd_docs.py")


def test_the_training_reference_has_every_kind_of_field() -> None:
    script = _script()
    page = script.PAGES[1]
    text = script.render(yaml.safe_load((ROOT / page.crd).read_text()), page)
    assert text.startswith("# DDMTraining field reference\n")
    for path in ("spec.output.uri", "spec.experts[].accelerator.count",
                 "spec.partition.kmeans.clusters", "spec.router.useLabels",
                 "spec.deployment.spec", "status.phase"):
        assert f"| `{path}` |" in text, path


def test_every_field_of_the_schema_has_a_row() -> None:
    text = _script().render(yaml.safe_load(
        (ROOT / "crds" / "ddmdeployments.ddm.dev.yaml").read_text()))
    for path in ("spec.experts[].accelerator.count", "spec.router.auth.secretName",
                 "spec.experts[].tolerations[].effect", "status.routerTokenSecret",
                 "status.experts[].message", "status.conditions[].reason"):
        assert f"| `{path}` |" in text, path
    row = next(line for line in text.splitlines() if line.startswith("| `spec.sampling.steps`"))
    assert "| `40` |" in row and "1..1000" in row
