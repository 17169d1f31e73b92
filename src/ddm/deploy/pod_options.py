"""The pod settings a spec passes through (image, resources, node selector, tolerations,
affinity), checked so that a value Kubernetes would refuse never reaches a child.

Each rule here is one the API server applies to a pod template: caught at the DDMDeployment,
the spec is reported invalid (with its field path) before any child exists, instead of
leaving a half-created DDM whose Deployment was refused. The CRD is generated from these
patterns (``ddm.deploy.crd``); ``affinity`` is checked by the API server alone (the operator's
dry-run of every child before it creates any; see ``reconcile``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Mapping

from ddm.deploy.accelerators import accelerator_resources
from ddm.deploy.fields import FieldReader

#: A container image reference: registry/path:tag@digest, with no space, quote or shell syntax.
IMAGE_PATTERN = r"^[A-Za-z0-9][-A-Za-z0-9._/:@]*$"
MAX_IMAGE_LENGTH = 512
#: A label value: at most 63 characters, alphanumeric at both ends (may be empty).
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
MAX_LABEL_VALUE_LENGTH = 63
#: A label key (a qualified name): an optional DNS-subdomain prefix and '/', then a name.
LABEL_KEY_PATTERN = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
#: A resource quantity as Kubernetes writes it (no sign: nothing here may be negative).
QUANTITY_PATTERN = (r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]"
                    r"|([eE][-+]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
#: The most labels a nodeSelector, and tolerations a component, may list (far more than any
#: placement needs); a toleration's key is a label key (a 253-character prefix, '/', a name).
MAX_NODE_SELECTOR_LABELS = 32
MAX_TOLERATIONS = 32
MAX_TOLERATION_KEY_LENGTH = 316
TOLERATION_OPERATORS = ("Exists", "Equal")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
#: The most one pod may ask for: beyond any machine a cloud rents (a typo like 1000Gi for
#: 1000Mi, or an attempt to make the scheduler reject every pod).
MAX_AMOUNTS = {"cpu": Decimal(1024), "memory": Decimal(16 * 2**40),
               "ephemeral-storage": Decimal(64 * 2**40)}
_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
             "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


@dataclass(frozen=True)
class PodOptions:
    """Passed through to the pods as given (treat the mappings as read-only)."""

    image: str | None = None
    resources: Mapping[str, Any] | None = None
    node_selector: Mapping[str, str] | None = None
    tolerations: tuple[Mapping[str, Any], ...] = ()
    affinity: Mapping[str, Any] | None = None


def parse_quantity(value: Any) -> Decimal | None:
    """A Kubernetes quantity (``500m``, ``2``, ``1Gi``, ``1e3``) as a number; None if it is
    not one."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    text = str(value)
    if not re.match(QUANTITY_PATTERN, text):
        return None
    match = re.match(r"^\+?([0-9.]+)(.*)$", text)
    assert match is not None  # the pattern above guarantees it
    number, suffix = match.groups()
    try:
        if suffix in _SUFFIXES:
            return Decimal(number) * Decimal(_SUFFIXES[suffix])
        return Decimal(number) * Decimal(10) ** Decimal(suffix[1:])  # an exponent: e3, E-2
    except ArithmeticError:  # InvalidOperation, or an exponent too large for Decimal
        return None


def label_key_problem(key: Any) -> str | None:
    """Why ``key`` is not a label key, or None."""
    if not isinstance(key, str) or not re.match(LABEL_KEY_PATTERN, key):
        return f"{key!r} is not a label key (an optional DNS prefix and '/', then a name)"
    prefix, _, name = key.rpartition("/")
    if len(name) > 63 or len(prefix) > 253:
        return f"{key!r} is too long for a label key (name 63, prefix 253 characters)"
    return None


def label_value_problem(value: Any) -> str | None:
    """Why ``value`` is not a label value, or None."""
    if (not isinstance(value, str) or len(value) > MAX_LABEL_VALUE_LENGTH
            or not re.match(LABEL_VALUE_PATTERN, value)):
        return (f"{value!r} is not a label value (at most 63 letters, digits, '-', '_' and '.', "
                "alphanumeric at both ends)")
    return None


def parse_pod_options(reader: FieldReader) -> PodOptions:
    """The pod fields of ``reader`` (an expert or the router), every problem recorded."""
    node_selector = reader.mapping("nodeSelector")
    if node_selector is not None and len(node_selector) > MAX_NODE_SELECTOR_LABELS:
        reader.problem("nodeSelector", f"must hold at most {MAX_NODE_SELECTOR_LABELS} labels, "
                                       f"got {len(node_selector)}")
    for key, value in (node_selector or {}).items():
        problem = label_key_problem(key) or label_value_problem(value)
        if problem:
            reader.problem(f"nodeSelector[{key!r}]", problem)
    tolerations = reader.items("tolerations")
    if len(tolerations) > MAX_TOLERATIONS:
        reader.problem("tolerations", f"must list at most {MAX_TOLERATIONS} tolerations, got "
                                      f"{len(tolerations)}")
    for i, toleration in enumerate(tolerations):
        _check_toleration(FieldReader(toleration, f"{reader.path}.tolerations[{i}]",
                                      reader.problems))
    resources = reader.mapping("resources")
    _check_resources(reader, resources or {})
    return PodOptions(
        image=reader.string("image", None, pattern=IMAGE_PATTERN, max_length=MAX_IMAGE_LENGTH,
                            hint="an image reference such as registry.example.com/ddm:1.0"),
        resources=resources,
        node_selector=node_selector,
        tolerations=tuple(t for t in tolerations if isinstance(t, Mapping)),
        affinity=reader.mapping("affinity"),
    )


def _check_toleration(reader: FieldReader) -> None:
    key = reader.value("key") or ""
    operator = reader.string("operator", "Equal", choices=TOLERATION_OPERATORS)
    value = reader.value("value")
    effect = reader.string("effect", None, choices=TAINT_EFFECTS)
    seconds = reader.integer("tolerationSeconds", None, -(2**63), 2**63 - 1)
    reader.done()
    if isinstance(key, str) and len(key) > MAX_TOLERATION_KEY_LENGTH:
        reader.problem("key", f"must be at most {MAX_TOLERATION_KEY_LENGTH} characters, got "
                              f"{len(key)}")
    for field, problem in (("key", key and label_key_problem(key)),
                           ("value", value is not None and label_value_problem(value))):
        if problem:
            reader.problem(field, problem)
    if operator == "Exists" and value:
        reader.problem("value", f"must be empty with operator Exists, got {value!r} (Exists "
                                "matches every value; use Equal to match one)")
    if not key and operator != "Exists":
        reader.problem("operator", "must be Exists when key is empty (it then tolerates "
                                   "every taint)")
    if seconds is not None and effect != "NoExecute":
        reader.problem("tolerationSeconds", "applies only with effect NoExecute")


def _check_resources(reader: FieldReader, resources: Mapping[str, Any]) -> None:
    amounts: dict[str, dict[str, Decimal]] = {}
    for kind, values in resources.items():
        where = f"resources.{kind}"
        if kind not in ("limits", "requests") or not isinstance(values, Mapping):
            reader.problem(where, "only limits and requests (objects) are allowed")
            continue
        for name, raw in values.items():
            if name in accelerator_resources():
                reader.problem(where, f"{name} is set from accelerator; use accelerator.type "
                                      "and accelerator.count")
                continue
            problem = label_key_problem(name)
            if problem:
                reader.problem(where, problem.replace("label key", "resource name"))
                continue
            amount = parse_quantity(raw)
            if amount is None:
                reader.problem(f"{where}[{name!r}]", f"{raw!r} is not a quantity "
                                                     "(e.g. 500m, 2, 512Mi, 1Gi)")
            elif name in MAX_AMOUNTS and amount > MAX_AMOUNTS[name]:
                reader.problem(f"{where}[{name!r}]", f"{raw} is more than any node offers "
                                                     f"(at most {_human(name)} per pod)")
            else:
                amounts.setdefault(kind, {})[name] = amount
    limits, requests = amounts.get("limits", {}), amounts.get("requests", {})
    for name in sorted(set(limits) & set(requests)):
        if requests[name] > limits[name]:
            reader.problem(f"resources.requests[{name!r}]",
                           f"{resources['requests'][name]} is more than its limit "
                           f"{resources['limits'][name]}")


def _human(name: str) -> str:
    return {"cpu": "1024 cores", "memory": "16Ti", "ephemeral-storage": "64Ti"}[name]
