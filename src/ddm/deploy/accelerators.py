"""What each accelerator type offers: the sizes that exist, the device plugin's resource, the
node labels that pick a product. The checks a spec's ``accelerator`` must pass live here; what
a pod gets from it (limits, tolerations) is ``ddm.operator.placement``, and the expert server's
``--backend``/``--device`` per (type, framework) is ``ddm.deploy.limits.BACKEND_BY_ACCELERATOR``.

- ``neuron`` (AWS Trainium/Inferentia, Neuron device plugin): ``aws.amazon.com/neuron`` whole
  devices (1-16, a trn1.32xlarge has 16) or ``aws.amazon.com/neuroncore`` cores (1-32); torch
  only (the server's neuron backend is torch-neuronx), with a compile cache directory.
- ``nvidia`` (NVIDIA device plugin / GPU operator): ``nvidia.com/gpu`` 1-8; an optional
  ``nvidia.com/gpu.product`` node selector (a GPU feature discovery label).
- ``tpu`` (GKE): ``google.com/tpu`` chips of a single-host slice, 1, 4 or 8 (TPU v5e topologies
  1x1, 2x2, 2x4), picked by the ``gke-tpu-accelerator`` and ``gke-tpu-topology`` labels.
- ``cpu``: no device; size the pod with ``resources`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Mapping

from ddm.deploy.limits import BACKEND_BY_ACCELERATOR

DEFAULT_TPU_PRODUCT = "tpu-v5-lite-podslice"
#: Chips of a single-host TPU v5e slice -> its topology.
TPU_TOPOLOGIES = {1: "1x1", 4: "2x2", 8: "2x4"}

NVIDIA_PRODUCT_LABEL = "nvidia.com/gpu.product"
TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"

#: (type, unit) -> the extended resource requested per replica.
_RESOURCES = {
    ("neuron", "device"): "aws.amazon.com/neuron",
    ("neuron", "core"): "aws.amazon.com/neuroncore",
    ("nvidia", None): "nvidia.com/gpu",
    ("tpu", None): "google.com/tpu",
}
#: Every extended resource the ``accelerator`` field controls (users may not set them by hand).
ACCELERATOR_RESOURCES = frozenset(_RESOURCES.values())
#: (type, unit) -> the counts one pod may request.
_COUNTS: dict[tuple[str, str | None], tuple[int, ...]] = {
    ("neuron", "device"): tuple(range(1, 17)),
    ("neuron", "core"): tuple(range(1, 33)),
    ("nvidia", None): tuple(range(1, 9)),
    ("tpu", None): tuple(TPU_TOPOLOGIES),
}


@dataclass(frozen=True)
class Accelerator:
    """Devices for one expert replica. ``count`` is 0 for cpu; ``unit`` is set for neuron only;
    ``product`` and ``topology`` are the node labels to require (tpu gets both by default)."""

    type: str = "cpu"
    count: int = 0
    unit: str | None = None
    product: str | None = None
    topology: str | None = None

    @property
    def resource(self) -> str | None:
        """The extended resource name, or None for cpu."""
        return _RESOURCES.get((self.type, self.unit))

    def problems(self, framework: str) -> list[tuple[str, str]]:
        """What the platform does not offer, as (field under ``accelerator``, message) pairs."""
        found: list[tuple[str, str]] = []
        if self.type == "cpu":
            if self.count:
                found.append(("count", "does not apply to cpu; size the pod with resources"))
        else:
            allowed = _COUNTS[(self.type, self.unit)]
            if self.count not in allowed:
                what = f"{self.type} {self.unit}s" if self.unit else self.type
                found.append(("count", f"{self.count} is not a size {what} offers per pod; "
                                       f"use one of {_ranges(allowed)}"))
        if self.unit is not None and self.type != "neuron":
            found.append(("unit", "applies to neuron only"))
        if self.product is not None and self.type not in ("nvidia", "tpu"):
            found.append(("product", "applies to nvidia and tpu only"))
        if self.topology is not None:
            if self.type != "tpu":
                found.append(("topology", "applies to tpu only"))
            elif prod(int(d) for d in self.topology.split("x")) != self.count:
                found.append(("topology", f"{self.topology} has "
                                          f"{prod(int(d) for d in self.topology.split('x'))} "
                                          f"chips but count is {self.count}"))
        if (self.type, framework) not in BACKEND_BY_ACCELERATOR:
            found.append(("type", f"{self.type} cannot run framework {framework}: the neuron "
                                  "backend is torch-neuronx, use framework torch"))
        return found

    def describe(self) -> str:
        """A short human description, e.g. ``nvidia x1 (NVIDIA-H100-80GB-HBM3)``."""
        if self.type == "cpu":
            return "cpu"
        unit = f" {self.unit}s" if self.type == "neuron" and self.unit == "core" else ""
        detail = [p for p in (self.product, self.topology) if p]
        return f"{self.type} x{self.count}{unit}" + (f" ({', '.join(detail)})" if detail else "")


def with_defaults(accelerator: Accelerator) -> Accelerator:
    """Fill what the platform implies: count 1, neuron whole devices, the TPU v5e labels."""
    kind = accelerator.type
    if kind == "cpu":
        return accelerator
    count = accelerator.count or 1
    unit = accelerator.unit or ("device" if kind == "neuron" else None)
    product = accelerator.product or (DEFAULT_TPU_PRODUCT if kind == "tpu" else None)
    topology = accelerator.topology or (TPU_TOPOLOGIES.get(count) if kind == "tpu" else None)
    return Accelerator(kind, count, unit, product, topology)


def node_selector(accelerator: Accelerator) -> dict[str, str]:
    """The node labels a pod with this (validated) accelerator must match."""
    selector: dict[str, str] = {}
    if accelerator.type == "nvidia" and accelerator.product:
        selector[NVIDIA_PRODUCT_LABEL] = accelerator.product
    if accelerator.type == "tpu":
        selector[TPU_ACCELERATOR_LABEL] = accelerator.product or DEFAULT_TPU_PRODUCT
        selector[TPU_TOPOLOGY_LABEL] = accelerator.topology or TPU_TOPOLOGIES[accelerator.count]
    return selector


#: Node labels that pick one accelerator family: a node selector naming them for another type
#: (or with a value the accelerator contradicts) matches no node the pod could run on.
ACCELERATOR_LABELS = {NVIDIA_PRODUCT_LABEL: "nvidia", TPU_ACCELERATOR_LABEL: "tpu",
                      TPU_TOPOLOGY_LABEL: "tpu"}


def node_label_conflicts(accelerator: Accelerator,
                         selector: Mapping[str, str]) -> list[tuple[str, str]]:
    """(node selector key, message) for each label the user's selector sets against the
    accelerator (valid: ``problems()`` empty); such a pod could never be scheduled."""
    implied = node_selector(accelerator)
    found: list[tuple[str, str]] = []
    for key, value in selector.items():
        family = ACCELERATOR_LABELS.get(key)
        if family is not None and family != accelerator.type:
            found.append((key, f"selects {family} nodes but accelerator.type is "
                               f"{accelerator.type}"))
        elif key in implied and implied[key] != value:
            found.append((key, f"{value!r} contradicts the accelerator, which requires "
                               f"{implied[key]!r} (set accelerator.product or "
                               "accelerator.topology instead)"))
    return found


def _ranges(values: tuple[int, ...]) -> str:
    """``1..16`` for a contiguous run, else ``1, 4, 8``."""
    contiguous = list(values) == list(range(values[0], values[-1] + 1))
    return f"{values[0]}..{values[-1]}" if contiguous and len(values) > 2 else \
        ", ".join(map(str, values))
