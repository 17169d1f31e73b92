"""The deployment guides agree with the product: every DDMDeployment in the docs renders with
the operator's own renderer (``ddm render``) under the chart's defaults, and the pods it makes
for docs/deploy-eks.md schedule onto that guide's eksctl node groups (taints tolerated, labels
selected), accelerator pods only onto their accelerator's group; the labels, taints and images
the pods of each guide ask for are named in its text.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddm.operator.config import OperatorConfig
from ddm.operator.render import CHART_DEFAULTS, render_objects

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
GUIDES = ("deploy-eks.md", "deploy-gke.md")
_YAML_BLOCK = re.compile(r"^```ya?ml\n(.*?)^```", re.S | re.M)


def yaml_documents(path: Path) -> list[Any]:
    """Every YAML document of every ```yaml block of ``path``."""
    return [doc for block in _YAML_BLOCK.findall(path.read_text())
            for doc in yaml.safe_load_all(block) if doc is not None]


def of_kind(path: Path, kind: str) -> list[dict[str, Any]]:
    return [d for d in yaml_documents(path) if isinstance(d, dict) and d.get("kind") == kind]


def rendered_pods(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod specs of the Deployments ``ddm render`` makes for ``document``."""
    objects = render_objects(document, OperatorConfig.from_env(CHART_DEFAULTS))
    return [o["spec"]["template"]["spec"] for o in objects if o["kind"] == "Deployment"]


DDM_BLOCKS = [pytest.param(path, index, id=f"{path.name}#{index}")
              for path in sorted(DOCS.glob("*.md"))
              for index, _ in enumerate(of_kind(path, "DDMDeployment"))]


def test_each_guide_has_a_deployment() -> None:
    for guide in GUIDES:
        assert of_kind(DOCS / guide, "DDMDeployment"), f"docs/{guide} has no DDMDeployment block"


@pytest.mark.parametrize("path, index", DDM_BLOCKS)
def test_every_ddmdeployment_in_the_docs_renders(path: Path, index: int) -> None:
    assert rendered_pods(of_kind(path, "DDMDeployment")[index])


def tolerates(pod: dict[str, Any], taint: dict[str, str]) -> bool:
    return any(t.get("key") == taint["key"] and t.get("effect") in (None, taint["effect"])
               and (t.get("operator") == "Exists" or t.get("value") == taint.get("value"))
               for t in pod.get("tolerations", []))


def extended_resources(pod: dict[str, Any]) -> set[str]:
    return {name for c in pod["containers"] for name in c.get("resources", {}).get("limits", {})
            if "/" in name}


def schedulable(pod: dict[str, Any], group: dict[str, Any]) -> bool:
    """Whether ``pod`` may run on a node of eksctl node group ``group``: its labels, its
    taints, and its devices (a group tainted with a device's resource name offers it, as the
    guide's accelerator groups are)."""
    labels = group.get("labels", {})
    offered = {taint["key"] for taint in group.get("taints", [])}
    return (all(labels.get(k) == v for k, v in pod.get("nodeSelector", {}).items())
            and all(tolerates(pod, taint) for taint in group.get("taints", []))
            and extended_resources(pod) <= offered)


def test_the_eks_pods_schedule_onto_the_guides_node_groups() -> None:
    guide = DOCS / "deploy-eks.md"
    (cluster,) = of_kind(guide, "ClusterConfig")
    groups = cluster["managedNodeGroups"]
    (ddm,) = of_kind(guide, "DDMDeployment")
    pods = rendered_pods(ddm)
    assert {r for pod in pods for r in extended_resources(pod)} == {"nvidia.com/gpu",
                                                                    "aws.amazon.com/neuron"}
    expected = {"nvidia.com/gpu": ["gpu"], "aws.amazon.com/neuron": ["trainium"]}
    for pod in pods:
        fits = [g["name"] for g in groups if schedulable(pod, g)]
        (where,) = [expected[r] for r in extended_resources(pod)] or [["cpu"]]
        assert fits == where, (pod["containers"][0]["name"], fits)


@pytest.mark.parametrize("guide", GUIDES)
def test_what_the_pods_ask_for_is_named_in_the_guide(guide: str) -> None:
    """Every node label (key and value), taint key and image family a guide's pods ask for
    appears in its text."""
    text = (DOCS / guide).read_text()
    for document in of_kind(DOCS / guide, "DDMDeployment"):
        for pod in rendered_pods(document):
            for key, value in pod.get("nodeSelector", {}).items():
                assert key in text and value in text, (guide, key, value)
            for toleration in pod.get("tolerations", []):
                assert toleration["key"] in text, (guide, toleration)
            for resource in extended_resources(pod):
                assert resource in text, (guide, resource)
