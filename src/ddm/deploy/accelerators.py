"""The accelerator registry: one declaration per accelerator type, and the checks a spec's
``accelerator`` must pass against it. Everything that differs between accelerators is declared
here and nowhere else: the device plugin's resources and the counts a pod may request, the
taint their nodes carry, the node labels that pick a product, the image family, the start-up
budget, the model server's backend and device per framework, a compile cache. The spec reader,
the plan, the operator's pods (``ddm.operator.placement``), the operator's images, ``ddm
diagram`` and the importers read it; a new accelerator is a declaration in :data:`ACCELERATORS`
plus the model code its backend needs.

- ``neuron`` (AWS Trainium/Inferentia, Neuron device plugin): ``aws.amazon.com/neuron`` whole
  devices (1-16, a trn1.32xlarge has 16) or ``aws.amazon.com/neuroncore`` cores (1-32); torch
  only (the server's neuron backend is torch-neuronx), with a compile cache directory.
- ``nvidia`` (NVIDIA device plugin / GPU operator): ``nvidia.com/gpu`` 1-8; an optional
  ``nvidia.com/gpu.product`` node selector (a GPU feature discovery label).
- ``tpu`` (GKE): ``google.com/tpu`` chips of a single-host slice, 1, 4 or 8 (TPU v5e topologies
  1x1, 2x2, 2x4), picked by the ``gke-tpu-accelerator`` and ``gke-tpu-topology`` labels.
- ``cpu``: no device; size the pod with ``resources`` instead. The router's and the checkpoint
  fetcher's pods run on it too (:data:`HOST`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from types import MappingProxyType
from typing import Callable, Mapping

#: The accelerator type of no device: the host's processors (the router's own pods).
HOST = "cpu"
#: How long a server may take to load (and compile) its model before it is restarted, unless
#: its accelerator declares longer.
DEFAULT_STARTUP_BUDGET_S = 600


@dataclass(frozen=True)
class DeviceUnit:
    """What one pod may request of an accelerator: the device plugin's extended resource and
    the counts it offers per pod."""

    resource: str
    counts: tuple[int, ...]


@dataclass(frozen=True)
class ProductLabels:
    """The node labels that pick an accelerator's product: ``product`` (required with
    ``default_product`` when set, else only when the spec names one) and, for sliced
    accelerators, ``topology`` with its default per count (``topologies``)."""

    product: str
    default_product: str | None = None
    topology: str | None = None
    topologies: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CompileCache:
    """A directory the backend's compiler fills at start (in a pod: the emptyDir ``volume``
    mounted at ``directory``), and the variables pointing it there (``{dir}`` in a value is
    the directory)."""

    directory: str
    volume: str
    env: tuple[tuple[str, str], ...]

    def environment(self, directory: str) -> tuple[tuple[str, str], ...]:
        """The variables for the cache at ``directory``."""
        return tuple((name, value.replace("{dir}", directory)) for name, value in self.env)


@dataclass(frozen=True)
class AcceleratorType:
    """One accelerator type. ``units``: what a pod requests (empty: no device; several: the
    spec's ``unit`` picks, the first by default); ``taint``: the key of the taint its nodes
    carry (tolerated with effect NoSchedule); ``image_family``: the operator's image that runs
    on it (``DDM_IMAGE_<FAMILY>``, the chart's ``images.<family>``), published as ``image``;
    ``backends``: framework -> the model server's ``--backend`` and ``--device`` (None: the
    backend picks); ``backend_note``: why a framework it lacks cannot run (the default lists
    the ones it has); ``title``: its name in ``ddm diagram``; ``train_devices``: framework ->
    ``ddm train``'s ``--device`` where it is not the server's (``backends``)."""

    name: str
    title: str
    image_family: str
    image: str
    backends: Mapping[str, tuple[str, str | None]]
    units: Mapping[str | None, DeviceUnit] = field(default_factory=dict)
    taint: str | None = None
    labels: ProductLabels | None = None
    startup_budget_s: int = DEFAULT_STARTUP_BUDGET_S
    cache: CompileCache | None = None
    backend_note: str | None = None
    train_devices: Mapping[str, str] = field(default_factory=dict)

    @property
    def default_unit(self) -> str | None:
        """The unit a spec gets when it names none."""
        return next(iter(self.units), None)

    def train_device(self, framework: str) -> str:
        """``ddm train``'s ``--device`` for ``framework`` here (one it runs)."""
        return self.train_devices.get(framework) or self.backends[framework][1] or framework

    def framework_problem(self, framework: str) -> str | None:
        """Why ``framework`` cannot run here, or None."""
        if framework in self.backends:
            return None
        why = self.backend_note or f"use framework {' or '.join(self.backends)}"
        return f"{self.name} cannot run framework {framework}: {why}"


#: Where the neuron backend keeps the modules torch-neuronx traced (``ddm.models.backends``);
#: the operator points it into the Neuron compile cache's volume.
NEURON_CACHE_ENV = "DDM_NEURON_CACHE"
#: Every accelerator type by name, in the order the CRD's ``accelerator.type`` enum lists them.
#: Declaring one more is adding it here (``ACCELERATORS[name] = AcceleratorType(...)``).
ACCELERATORS: dict[str, AcceleratorType] = {
    "neuron": AcceleratorType(
        name="neuron", title="AWS Neuron", image_family="neuron", image="ddm-neuron",
        backends=MappingProxyType({"torch": ("neuron", None)}),
        units=MappingProxyType({"device": DeviceUnit("aws.amazon.com/neuron", tuple(range(1, 17))),
                                "core": DeviceUnit("aws.amazon.com/neuroncore",
                                                   tuple(range(1, 33)))}),
        taint="aws.amazon.com/neuron", startup_budget_s=1800,
        train_devices=MappingProxyType({"torch": "xla"}),  # torch-xla trains; neuronx serves
        cache=CompileCache("/var/cache/neuron", "neuron-cache",
                           ((NEURON_CACHE_ENV, "{dir}/traced"),
                            ("NEURON_CC_FLAGS", "--cache_dir={dir}/compiler"))),
        backend_note="the neuron backend is torch-neuronx, use framework torch"),
    "nvidia": AcceleratorType(
        name="nvidia", title="NVIDIA GPU", image_family="cuda", image="ddm-cuda",
        backends=MappingProxyType({"torch": ("torch", "cuda"), "jax": ("jax", "gpu")}),
        units=MappingProxyType({None: DeviceUnit("nvidia.com/gpu", tuple(range(1, 9)))}),
        taint="nvidia.com/gpu", labels=ProductLabels("nvidia.com/gpu.product")),
    "tpu": AcceleratorType(
        name="tpu", title="Google TPU", image_family="tpu", image="ddm-tpu",
        backends=MappingProxyType({"torch": ("torch", "xla"), "jax": ("jax", "tpu")}),
        units=MappingProxyType({None: DeviceUnit("google.com/tpu", (1, 4, 8))}),
        taint="google.com/tpu",
        labels=ProductLabels("cloud.google.com/gke-tpu-accelerator", "tpu-v5-lite-podslice",
                             "cloud.google.com/gke-tpu-topology",
                             MappingProxyType({1: "1x1", 4: "2x2", 8: "2x4"}))),
    HOST: AcceleratorType(
        name=HOST, title="CPU", image_family="cpu", image="ddm",
        backends=MappingProxyType({"torch": ("torch", "cpu"), "jax": ("jax", "cpu")})),
}


def accelerator_type(name: str) -> AcceleratorType:
    """The declaration of ``name``; a ValueError naming the known ones if there is none."""
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise ValueError(f"unknown accelerator type {name!r}; known: "
                         f"{', '.join(ACCELERATORS)}") from None


def unit_names() -> tuple[str, ...]:
    """Every named unit (the spec's ``accelerator.unit`` choices), in declaration order."""
    return tuple(dict.fromkeys(unit for a in ACCELERATORS.values() for unit in a.units
                               if unit is not None))


def accelerator_resources() -> frozenset[str]:
    """Every extended resource the ``accelerator`` field controls (users may not set them by
    hand)."""
    return frozenset(u.resource for a in ACCELERATORS.values() for u in a.units.values())


def image_families() -> tuple[str, ...]:
    """The operator's image families, one per accelerator type, in declaration order."""
    return tuple(dict.fromkeys(a.image_family for a in ACCELERATORS.values()))


def _label_owners() -> dict[str, str]:
    """Node label -> the accelerator type it picks: a node selector naming one for another
    type (or with a value the accelerator contradicts) matches no node the pod could run on."""
    return {label: a.name for a in ACCELERATORS.values() if a.labels is not None
            for label in (a.labels.product, a.labels.topology) if label is not None}


@dataclass(frozen=True)
class Accelerator:
    """Devices for one replica. ``count`` is 0 for cpu; ``unit`` is set where its type has
    named units (neuron); ``product`` and ``topology`` are the node labels to require (tpu
    gets both by default)."""

    type: str = HOST
    count: int = 0
    unit: str | None = None
    product: str | None = None
    topology: str | None = None

    @property
    def declared(self) -> AcceleratorType:
        """Its type's declaration."""
        return accelerator_type(self.type)

    @property
    def resource(self) -> str | None:
        """The extended resource name, or None for cpu."""
        unit = self.declared.units.get(self.unit)
        return unit.resource if unit is not None else None

    def problems(self, framework: str) -> list[tuple[str, str]]:
        """What the platform does not offer, as (field under ``accelerator``, message) pairs."""
        kind = self.declared
        found: list[tuple[str, str]] = []
        if not kind.units:
            if self.count:
                found.append(("count", f"does not apply to {self.type}; size the pod with "
                                       "resources"))
        elif self.unit in kind.units:
            allowed = kind.units[self.unit].counts
            if self.count not in allowed:
                what = f"{self.type} {self.unit}s" if self.unit else self.type
                found.append(("count", f"{self.count} is not a size {what} offers per pod; "
                                       f"use one of {_ranges(allowed)}"))
        if self.unit is not None and self.unit not in kind.units:
            found.append(("unit", f"applies to {_having(lambda a: a.default_unit)} only"))
        labels = kind.labels
        if self.product is not None and labels is None:
            found.append(("product", f"applies to {_having(lambda a: a.labels)} only"))
        if self.topology is not None:
            if labels is None or labels.topology is None:
                found.append(("topology", f"applies to "
                                          f"{_having(lambda a: a.labels and a.labels.topology)} "
                                          "only"))
            elif prod(int(d) for d in self.topology.split("x")) != self.count:
                found.append(("topology", f"{self.topology} has "
                                          f"{prod(int(d) for d in self.topology.split('x'))} "
                                          f"chips but count is {self.count}"))
        framework_problem = kind.framework_problem(framework)
        if framework_problem is not None:
            found.append(("type", framework_problem))
        return found

    def describe(self) -> str:
        """A short human description, e.g. ``nvidia x1 (NVIDIA-H100-80GB-HBM3)``."""
        kind = self.declared
        if not kind.units:
            return self.type
        unit = f" {self.unit}s" if self.unit != kind.default_unit else ""
        detail = [p for p in (self.product, self.topology) if p]
        return f"{self.type} x{self.count}{unit}" + (f" ({', '.join(detail)})" if detail else "")


def with_defaults(accelerator: Accelerator) -> Accelerator:
    """Fill what the platform implies: count 1, the default unit, the default product and
    topology labels (TPU v5e)."""
    kind = accelerator.declared
    if not kind.units:
        return accelerator
    count = accelerator.count or 1
    labels = kind.labels
    product = accelerator.product or (labels.default_product if labels else None)
    topology = accelerator.topology or (labels.topologies.get(count)
                                        if labels and labels.topology else None)
    return Accelerator(accelerator.type, count, accelerator.unit or kind.default_unit, product,
                       topology)


def node_selector(accelerator: Accelerator) -> dict[str, str]:
    """The node labels a pod with this (validated) accelerator must match."""
    labels = accelerator.declared.labels
    selector: dict[str, str] = {}
    if labels is None:
        return selector
    product = accelerator.product or labels.default_product
    if product:
        selector[labels.product] = product
    if labels.topology is not None:
        selector[labels.topology] = accelerator.topology or labels.topologies[accelerator.count]
    return selector


def node_label_conflicts(accelerator: Accelerator,
                         selector: Mapping[str, str]) -> list[tuple[str, str]]:
    """(node selector key, message) for each label the user's selector sets against the
    accelerator (valid: ``problems()`` empty); such a pod could never be scheduled."""
    implied = node_selector(accelerator)
    owners = _label_owners()
    found: list[tuple[str, str]] = []
    for key, value in selector.items():
        family = owners.get(key)
        if family is not None and family != accelerator.type:
            found.append((key, f"selects {family} nodes but accelerator.type is "
                               f"{accelerator.type}"))
        elif key in implied and implied[key] != value:
            found.append((key, f"{value!r} contradicts the accelerator, which requires "
                               f"{implied[key]!r} (set accelerator.product or "
                               "accelerator.topology instead)"))
    return found


def _having(has: Callable[[AcceleratorType], object]) -> str:
    """The types for which ``has(declaration)`` is true, e.g. ``nvidia and tpu``."""
    return " and ".join(a.name for a in ACCELERATORS.values() if has(a))


def _ranges(values: tuple[int, ...]) -> str:
    """``1..16`` for a contiguous run, else ``1, 4, 8``."""
    contiguous = list(values) == list(range(values[0], values[-1] + 1))
    return f"{values[0]}..{values[-1]}" if contiguous and len(values) > 2 else \
        ", ".join(map(str, values))
