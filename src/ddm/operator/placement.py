"""What an expert's accelerator adds to its pod on Kubernetes: the extended-resource limit, the
toleration of the taint its nodes carry, the node selector, and the image family."""

from __future__ import annotations

from dataclasses import dataclass

from ddm.deploy.accelerators import Accelerator, node_selector

#: The taint key each family's nodes carry (value ``present``, effect NoSchedule).
_TAINTS = {"neuron": "aws.amazon.com/neuron", "nvidia": "nvidia.com/gpu", "tpu": "google.com/tpu"}
#: Accelerator type -> image family (a key of ``OperatorConfig.images``).
IMAGE_FAMILIES = {"cpu": "cpu", "nvidia": "cuda", "neuron": "neuron", "tpu": "tpu"}
#: Where the Neuron compile cache lives in the pod (an emptyDir; see the serving backends).
NEURON_CACHE_DIR = "/var/cache/neuron"


@dataclass(frozen=True)
class Placement:
    """What an accelerator adds to a pod: limits, tolerations, node selector, image family."""

    limits: dict[str, str]
    tolerations: list[dict[str, str]]
    node_selector: dict[str, str]
    image_family: str


def placement(accelerator: Accelerator) -> Placement:
    """The pod settings for a validated (``problems()`` empty) accelerator."""
    limits: dict[str, str] = {}
    tolerations: list[dict[str, str]] = []
    if accelerator.resource is not None:
        limits[accelerator.resource] = str(accelerator.count)
        tolerations.append({"key": _TAINTS[accelerator.type], "operator": "Exists",
                            "effect": "NoSchedule"})
    return Placement(limits, tolerations, node_selector(accelerator),
                     IMAGE_FAMILIES[accelerator.type])
