"""The accelerator registry: a type declared in a test alone (AMD GPUs, ``amd.com/gpu``) is
checked, planned and rendered like the shipped ones, and every list of accelerator types
outside Python (the CRD's enum, the chart's images) is the registry's."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import yaml

from ddm.cli import main
from ddm.deploy import accelerators
from ddm.deploy.accelerators import (
    ACCELERATORS,
    AcceleratorType,
    DeviceUnit,
    ProductLabels,
    image_families,
)
from ddm.deploy.spec import SpecError, parse_manifest

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ddm-operator"
#: Not shipped: declared here only, to show that an accelerator is one declaration.
ROCM = AcceleratorType(
    name="rocm", title="AMD GPU", image_family="rocm", image="ddm-rocm",
    backends=MappingProxyType({"torch": ("torch", "cuda")}),  # ROCm builds of torch say cuda
    units=MappingProxyType({None: DeviceUnit("amd.com/gpu", (1, 2, 4, 8))}),
    taint="amd.com/gpu", labels=ProductLabels("amd.com/gpu.product-name"),
    startup_budget_s=900)


@pytest.fixture
def rocm(monkeypatch: pytest.MonkeyPatch) -> AcceleratorType:
    monkeypatch.setitem(ACCELERATORS, ROCM.name, ROCM)
    return ROCM


def _manifest(tmp_path: Path, accelerator: dict[str, Any], framework: str = "torch") -> Path:
    document = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    document["spec"]["experts"][0].update(accelerator=accelerator, framework=framework)
    path = tmp_path / "ddm.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def _render(path: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    assert main(["render", str(path)]) == 0
    return [o for o in yaml.safe_load_all(capsys.readouterr().out) if o]


def test_a_declared_accelerator_renders_its_limit_toleration_selector_image_and_budget(
        rocm: AcceleratorType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DDM_IMAGE_ROCM", "registry.example/ddm-rocm:7")
    path = _manifest(tmp_path, {"type": "rocm", "count": 2, "product": "AMD-Instinct-MI300X"})
    (deployment,) = [o for o in _render(path, capsys) if o["kind"] == "Deployment"
                     and o["metadata"]["name"] == "digits-expert-digits-0-4"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["amd.com/gpu"] == "2"
    assert {"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        pod["tolerations"]
    assert pod["nodeSelector"]["amd.com/gpu.product-name"] == "AMD-Instinct-MI300X"
    assert container["image"] == "registry.example/ddm-rocm:7"
    assert container["command"][container["command"].index("--device") + 1] == "cuda"
    probe = container["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] == rocm.startup_budget_s
    assert main(["diagram", str(path)]) == 0
    assert 'subgraph rocm["AMD GPU"]' in capsys.readouterr().out


def test_a_declared_accelerator_is_checked_against_its_declaration(
        rocm: AcceleratorType, tmp_path: Path) -> None:
    path = _manifest(tmp_path, {"type": "rocm", "count": 3, "topology": "2x2"}, "jax")
    with pytest.raises(SpecError) as refused:
        parse_manifest(yaml.safe_load(path.read_text()))
    message = str(refused.value)
    assert "accelerator.count: 3 is not a size rocm offers per pod; use one of 1, 2, 4, 8" \
        in message
    assert "accelerator.topology: applies to tpu only" in message
    assert "accelerator.type: rocm cannot run framework jax: use framework torch" in message


def test_without_its_declaration_the_type_is_refused_naming_the_known_ones(
        tmp_path: Path) -> None:
    path = _manifest(tmp_path, {"type": "rocm"})
    with pytest.raises(SpecError, match="accelerator.type: must be one of neuron, nvidia, tpu, "
                                        "cpu, got 'rocm'"):
        parse_manifest(yaml.safe_load(path.read_text()))
    with pytest.raises(ValueError, match="unknown accelerator type 'rocm'; known: neuron"):
        accelerators.accelerator_type("rocm")


def test_the_charts_images_are_one_per_image_family() -> None:
    """The chart renders one ``DDM_IMAGE_<FAMILY>`` per key of ``images`` besides the
    operator's own settings (tests/unit/test_chart.py renders it): those keys, and the ones
    its schema requires, are the registry's families."""
    own = {"tag", "pullPolicy", "operator"}
    values = yaml.safe_load((CHART / "values.yaml").read_text())["images"]
    assert set(values) - own == set(image_families())
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    images = schema["properties"]["images"]
    assert set(images["properties"]) - own == set(image_families())
    assert set(images["required"]) - own == set(image_families())


def test_a_unit_on_a_type_without_units_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    """It once raised KeyError ('tpu', 'device') out of the checks: an internal error."""
    path = _manifest(tmp_path, {"type": "tpu", "count": 4, "unit": "device"}, "jax")
    with pytest.raises(SpecError, match=r"spec.experts\[0\].accelerator.unit: applies to neuron "
                                        "only"):
        parse_manifest(yaml.safe_load(path.read_text()))


def test_every_declared_count_is_within_the_specs_bound() -> None:
    """The spec reader bounds ``accelerator.count`` (and the CRD with it) before the registry
    checks it: a declared size above the bound could never be asked for."""
    from ddm.deploy.limits import MAX_ACCELERATOR_COUNT

    counts = [c for a in ACCELERATORS.values() for u in a.units.values() for c in u.counts]
    assert max(counts) == MAX_ACCELERATOR_COUNT
