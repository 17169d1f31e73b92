"""Field declarations and the OpenAPI v3 schemas generated from them (pure).

A custom resource's fields are declared once, in Python, as a tree of the small frozen types
below (types, bounds, enums, patterns, defaults, descriptions, required keys), next to the
constants the parsers check against; :func:`crd` turns a :class:`CustomResource` into its
CustomResourceDefinition and :func:`crd_yaml` into the YAML committed under ``crds/``
(``scripts/generate_crds.py`` writes it; a test and ``make lint`` check it is current), as
KubeRay generates its CRDs from its Go types.

The schemas are structural (what the API server requires of a CRD): every object declares its
properties (or passes unknown ones through, ``preserve_unknown``), every field a type. A
declaration used in several places becomes one YAML anchor, named after its first field.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml


@dataclass(frozen=True, kw_only=True)
class Field(ABC):
    """What every field may have: a ``description`` and a ``default`` the API server fills in
    (None: no default; the parser's own default, if any, applies)."""

    description: str = ""
    default: Any = None

    @abstractmethod
    def schema(self) -> dict[str, Any]:
        """This field's OpenAPI v3 schema (without its children: :func:`openapi` adds them)."""

    def described(self, description: str) -> Field:
        """The same field with another description (a shared declaration used in a place of
        its own)."""
        return dataclasses.replace(self, description=description)


@dataclass(frozen=True, kw_only=True)
class Integer(Field):
    """An integer within ``minimum`` .. ``maximum``; ``format`` (``int64``) as Kubernetes
    spells wide ones."""

    minimum: int | None = None
    maximum: int | None = None
    format: str | None = None

    def schema(self) -> dict[str, Any]:
        return _present(type="integer", format=self.format, minimum=self.minimum,
                        maximum=self.maximum)


@dataclass(frozen=True, kw_only=True)
class Number(Field):
    """A number within ``minimum`` (excluded when ``exclusive_minimum``) .. ``maximum``."""

    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False

    def schema(self) -> dict[str, Any]:
        return _present(type="number", minimum=_plain(self.minimum),
                        exclusiveMinimum=self.exclusive_minimum or None,
                        maximum=_plain(self.maximum))


@dataclass(frozen=True, kw_only=True)
class Boolean(Field):
    """true or false."""

    def schema(self) -> dict[str, Any]:
        return {"type": "boolean"}


@dataclass(frozen=True, kw_only=True)
class String(Field):
    """A string: one of ``choices``, or matching ``pattern``, of ``min_length`` ..
    ``max_length`` characters; ``format`` (``date-time``) as OpenAPI spells it."""

    choices: tuple[str, ...] = ()
    pattern: str | None = None
    min_length: int | None = None
    max_length: int | None = None
    format: str | None = None

    def schema(self) -> dict[str, Any]:
        return _present(type="string", format=self.format,
                        enum=list(self.choices) or None, minLength=self.min_length,
                        maxLength=self.max_length, pattern=self.pattern)


@dataclass(frozen=True, kw_only=True)
class Quantity(Field):
    """A Kubernetes quantity: an integer, or a string matching ``pattern`` (``500m``, ``2Gi``)."""

    pattern: str | None = None

    def schema(self) -> dict[str, Any]:
        return _present(anyOf=[{"type": "integer"}, {"type": "string"}],
                        **{"x-kubernetes-int-or-string": True}, pattern=self.pattern)


@dataclass(frozen=True, kw_only=True)
class Object(Field):
    """An object of declared ``properties`` (in this order), ``required`` keys, and
    ``one_of`` groups of keys of which exactly one must be given; ``values`` instead declares
    a map's values (at most ``max_properties`` entries); ``preserve_unknown`` passes it
    through unchecked (the API server checks it where it lands)."""

    properties: Mapping[str, Field] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    one_of: tuple[tuple[str, ...], ...] = ()
    values: Field | None = None
    max_properties: int | None = None
    preserve_unknown: bool = False

    def schema(self) -> dict[str, Any]:
        return _present(type="object", maxProperties=self.max_properties,
                        **{"x-kubernetes-preserve-unknown-fields": self.preserve_unknown or None},
                        required=list(self.required) or None,
                        oneOf=[{"required": list(group)} for group in self.one_of] or None)


@dataclass(frozen=True)
class Array(Field):
    """A list of ``items``, ``min_items`` .. ``max_items`` long; ``map_keys``: a list of
    objects unique by those keys (``x-kubernetes-list-type: map``); ``unique``: a set."""

    items: Field
    min_items: int | None = None
    max_items: int | None = None
    map_keys: tuple[str, ...] = ()
    unique: bool = False

    def schema(self) -> dict[str, Any]:
        list_type = "map" if self.map_keys else "set" if self.unique else None
        return _present(type="array", minItems=self.min_items, maxItems=self.max_items,
                        **{"x-kubernetes-list-type": list_type,
                           "x-kubernetes-list-map-keys": list(self.map_keys) or None})


@dataclass(frozen=True)
class Column:
    """A printer column of ``kubectl get``: ``name`` showing ``json_path`` as ``type``."""

    name: str
    json_path: str
    type: str = "string"
    description: str = ""


@dataclass(frozen=True)
class CustomResource:
    """One custom resource's definition: its identity, its schema (``root``: the object with
    ``spec`` and ``status``), printer columns and subresources. ``scale``: the JSON paths of
    the scale subresource (spec replicas, status replicas, label selector), None: none.
    ``comment``: the lines written atop the YAML file."""

    group: str
    version: str
    kind: str
    plural: str
    root: Object
    short_names: tuple[str, ...] = ()
    columns: tuple[Column, ...] = ()
    status_subresource: bool = True
    scale: tuple[str, str, str | None] | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    comment: str = ""

    @property
    def name(self) -> str:
        """The CRD's own name (``ddmdeployments.ddm.dev``), also its file's stem."""
        return f"{self.plural}.{self.group}"


def openapi(declared: Field, anchors: dict[int, str] | None = None,
            memo: dict[int, dict[str, Any]] | None = None, key: str = "schema"
            ) -> dict[str, Any]:
    """``declared``'s OpenAPI v3 schema with its children. A declaration met twice gives the
    same dict (``memo``), which YAML writes once with an anchor; ``anchors`` records each
    dict's name (the field ``key`` it was first met under)."""
    memo = {} if memo is None else memo
    if id(declared) in memo:
        return memo[id(declared)]
    found = _present(description=declared.description or None)
    found.update(declared.schema())
    if declared.default is not None:
        found["default"] = declared.default
    if isinstance(declared, Object):
        if declared.properties:
            found["properties"] = {name: openapi(child, anchors, memo, name)
                                   for name, child in declared.properties.items()}
        if declared.values is not None:
            found["additionalProperties"] = openapi(declared.values, anchors, memo,
                                                    f"{key}Value")
    elif isinstance(declared, Array):
        found["items"] = openapi(declared.items, anchors, memo, f"{key}Item")
    memo[id(declared)] = found
    if anchors is not None:
        anchors.setdefault(id(found), key)
    return found


def crd(resource: CustomResource, anchors: dict[int, str] | None = None) -> dict[str, Any]:
    """The CustomResourceDefinition (apiextensions.k8s.io/v1) of ``resource``."""
    version: dict[str, Any] = {"name": resource.version, "served": True, "storage": True}
    subresources: dict[str, Any] = {}
    if resource.status_subresource:
        subresources["status"] = {}
    if resource.scale is not None:
        spec_path, status_path, selector = resource.scale
        subresources["scale"] = _present(specReplicasPath=spec_path,
                                         statusReplicasPath=status_path,
                                         labelSelectorPath=selector)
    if subresources:
        version["subresources"] = subresources
    if resource.columns:
        version["additionalPrinterColumns"] = [
            _present(name=c.name, type=c.type, description=c.description or None,
                     jsonPath=c.json_path) for c in resource.columns]
    version["schema"] = {"openAPIV3Schema": openapi(resource.root, anchors)}
    names = _present(kind=resource.kind, listKind=f"{resource.kind}List",
                     plural=resource.plural, singular=resource.kind.lower(),
                     shortNames=list(resource.short_names) or None)
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": _present(name=resource.name, labels=dict(resource.labels) or None),
            "spec": {"group": resource.group, "scope": "Namespaced", "names": names,
                     "versions": [version]}}


def crd_yaml(resource: CustomResource) -> str:
    """The CRD of ``resource`` as the YAML file committed for it: its comment, then the
    document, shared declarations written once (YAML anchors named after their fields)."""
    anchors: dict[int, str] = {}
    document = crd(resource, anchors)
    comment = "".join(f"# {line}".rstrip() + "\n" for line in resource.comment.splitlines())
    return comment + yaml.dump(document, Dumper=_dumper(anchors), sort_keys=False, width=88,
                               allow_unicode=True)


def _dumper(names: dict[int, str]) -> type[yaml.SafeDumper]:
    """A YAML dumper that names each anchor after its field (``name``, then ``name1``, ...)."""
    given: set[str] = set()

    class Dumper(yaml.SafeDumper):
        def generate_anchor(self, node: yaml.Node) -> str:
            key = next(k for k, n in self.represented_objects.items() if n is node)
            base = names.get(key, "shared")
            anchor = next(f"{base}{i or ''}" for i in range(len(given) + 2)
                          if f"{base}{i or ''}" not in given)
            given.add(anchor)
            return anchor

        def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
            super().increase_indent(flow, False)  # a list indented under its key

        def represent_list(self, data: list[Any]) -> yaml.SequenceNode:
            # A list of names on one line ([labels, text]); a list of objects a block.
            flow = all(not isinstance(item, (dict, list)) for item in data)
            return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)

        def represent_str(self, data: str) -> yaml.ScalarNode:
            # A long description reads as a folded paragraph, as a person would write it.
            style = ">" if len(data) > 60 and " " in data and data == " ".join(data.split()) \
                else None
            return self.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    Dumper.add_representer(str, Dumper.represent_str)
    Dumper.add_representer(list, Dumper.represent_list)
    return Dumper


def _plain(value: float | None) -> float | int | None:
    """An integral bound written as an integer (``maximum: 50``, as people write it)."""
    return int(value) if value is not None and float(value).is_integer() else value


def _present(**entries: Any) -> dict[str, Any]:
    return {key: value for key, value in entries.items() if value is not None}
