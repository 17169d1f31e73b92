"""What an expert's accelerator adds to its pod on Kubernetes: the extended-resource limit, the
toleration of the taint its nodes carry, the node selector, and the image family, each read
from its type's declaration (``ddm.deploy.accelerators``)."""

from __future__ import annotations

from dataclasses import dataclass

from ddm.deploy.accelerators import Accelerator, node_selector


@dataclass(frozen=True)
class Placement:
    """What an accelerator adds to a pod: limits, tolerations, node selector, image family."""

    limits: dict[str, str]
    tolerations: list[dict[str, str]]
    node_selector: dict[str, str]
    image_family: str


def placement(accelerator: Accelerator) -> Placement:
    """The pod settings for a validated (``problems()`` empty) accelerator: its taint is
    tolerated with effect NoSchedule (any value)."""
    kind = accelerator.declared
    limits: dict[str, str] = {}
    tolerations: list[dict[str, str]] = []
    if accelerator.resource is not None:
        limits[accelerator.resource] = str(accelerator.count)
    if kind.taint is not None:
        tolerations.append({"key": kind.taint, "operator": "Exists", "effect": "NoSchedule"})
    return Placement(limits, tolerations, node_selector(accelerator), kind.image_family)
