"""The CRDs and the chart's derived values schema are generated from the declarations
(``ddm.deploy.schema``, ``ddm.deploy.crd``, ``ddm.deploy.training_crd``,
``scripts/generate_crds.py``): the committed files are what the script writes; each resource's
spec parser (DDMDeployment, DDMTraining) refuses every value the generated schema refuses
(types, bounds, enums, patterns, lengths) and takes the values at its edges and each of its
choices, so a spec no API server has seen (``ddm up``, ``ddm train-all``, ``ddm render``,
``ddm diagram``) is held to the API server's rules; and it defaults as the API server does."""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import jsonschema
import pytest
import yaml

from ddm.deploy import crd, training_crd
from ddm.deploy.schema import (Column, CustomResource, Integer, Number, Object, String,
                               crd_yaml, openapi)
from ddm.deploy.spec import SpecError, parse_spec
from ddm.deploy.training_spec import parse_training_spec
from tests.support.examples import examples_of

ROOT = Path(__file__).resolve().parents[2]
ITEM, ENTRY = "[0]", "['cpu']"


@dataclass(frozen=True)
class Resource:
    """A custom resource's declared ``spec``, the parser of its spec (``parse(raw,
    allow_host_paths=...)``), and a spec the parser takes to which each case sets one field:
    ``minimal``, with ``readers``: what a field under a path needs beside it to be read (a
    DDMTraining reads data.uri for mnist only, kmeans only without labelGroups, and text2img
    only for coloured-mnist)."""

    spec: Object
    parse: Callable[..., Any]
    minimal: dict[str, Any]
    readers: dict[tuple[str, ...], dict[str, Any]]

    def base(self, path: tuple[str, ...]) -> dict[str, Any]:
        """A copy of ``minimal`` that reads the field at ``path``."""
        document = copy.deepcopy(self.minimal)
        for prefix, needed in self.readers.items():
            if path[:len(prefix)] == prefix:
                document.update(copy.deepcopy(needed))
        return document


RESOURCES = {
    "DDMDeployment": Resource(
        crd.SPEC, parse_spec, readers={},
        minimal={"router": {"checkpoint": {"uri": "image:///r"}},
                 "experts": [{"name": "e", "checkpoint": {"uri": "image:///e"}}]}),
    "DDMTraining": Resource(
        training_crd.SPEC, parse_training_spec,
        minimal={"output": {"uri": "pvc://out"}, "partition": {"labelGroups": [[0]]},
                 "experts": [{"name": "e"}], "deployment": {"name": "d"}},
        readers={("data", "uri"): {"data": {"dataset": "mnist"}},
                 ("text2img",): {"data": {"dataset": "coloured-mnist",
                                          "uri": "pvc://datasets/mnist"}},
                 ("partition", "kmeans"): {"partition": {"kmeans": {"clusters": 1,
                                                                    "imageSize": 8}}}}),
}


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_crds",
                                                  ROOT / "scripts" / "generate_crds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_files_are_the_generated_ones() -> None:
    stale = [str(path.relative_to(ROOT)) for path, text in _script().generated().items()
             if not path.is_file() or path.read_text() != text]
    assert not stale, f"{stale} differ from their declarations: run `make generate`"


def test_the_check_names_each_stale_file_and_the_command_that_fixes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    script = _script()
    (tmp_path / "crds").mkdir()
    (tmp_path / "crds" / "a.yaml").write_text("old\n")
    monkeypatch.setattr(script, "ROOT", tmp_path)
    monkeypatch.setattr(script, "generated", lambda: {tmp_path / "crds" / "a.yaml": "new\n"})
    assert script.main(["--check"]) == 1
    assert "crds/a.yaml is not what its declarations generate: run `make generate`" in (
        capsys.readouterr().err)
    assert script.main([]) == 0 and script.main(["--check"]) == 0


def test_a_values_schema_part_must_exist_where_it_is_declared() -> None:
    with pytest.raises(KeyError, match="values.schema.json: no object at properties.images"):
        _script().values_schema({"properties": {}})


def test_a_shared_declaration_is_one_anchor_named_after_its_field() -> None:
    size = Integer(description="Images per call.", minimum=1, maximum=64, default=8)
    resource = CustomResource(
        group="example.dev", version="v1", kind="Thing", plural="things",
        root=Object(properties={"spec": Object(required=("a",), properties={
            "a": size, "b": size, "share": Number(minimum=0, maximum=1, exclusive_minimum=True),
            "mode": String(choices=("x", "y"))})}),
        columns=(Column("A", ".spec.a", type="integer"),),
        scale=(".spec.a", ".status.a", None))
    text = crd_yaml(resource)
    assert "a: &a\n" in text and "b: *a\n" in text and "enum: [x, y]" in text
    document = yaml.safe_load(text)
    assert document["metadata"]["name"] == "things.example.dev"
    version = document["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.a", "statusReplicasPath": ".status.a"}}
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["b"] == {"description": "Images per call.", "type": "integer",
                                       "minimum": 1, "maximum": 64, "default": 8}
    assert spec["properties"]["share"] == {"type": "number", "minimum": 0,
                                           "exclusiveMinimum": True, "maximum": 1}


def _leaves(schema: dict[str, Any], path: tuple[str, ...]
            ) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """Every field under ``schema`` with its path: keys, ITEM for a list's first item, ENTRY
    for a map's value under a key."""
    for key, child in schema.get("properties", {}).items():
        yield from _leaves(child, (*path, key))
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _leaves(schema["additionalProperties"], (*path, ENTRY))
    if "items" in schema:
        yield from _leaves(schema["items"], (*path, ITEM))
    yield path, schema


def _refused(schema: dict[str, Any]) -> list[Any]:
    """Values ``schema`` refuses, one per rule it declares."""
    kind, found = schema.get("type"), []
    if kind in ("integer", "number"):
        found.append("seven")
        if "maximum" in schema:
            found.append(schema["maximum"] + 1)
        if "minimum" in schema:
            found.append(schema["minimum"] - (0 if schema.get("exclusiveMinimum") else 1))
    elif kind == "string":
        found.append(7)
        if "enum" in schema:
            found.append("bogus")
        if "pattern" in schema:
            found.append("not valid!")
        if "maxLength" in schema:
            found.append("a" * (schema["maxLength"] + 1))
        if schema.get("minLength"):
            found.append("")
    elif kind == "boolean":
        found.append("seven")
    elif schema.get("x-kubernetes-int-or-string"):
        found.append("lots")
    return found


def _set(document: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """``document`` with ``value`` at ``path``, making the objects and lists on the way."""
    parent: Any = document
    for key, then in zip(path, (*path[1:], None)):
        made = [] if then == ITEM else {}
        if key == ITEM:
            if not parent:
                parent.append(made)
            parent, slot = parent, 0
        else:
            slot = "cpu" if key == ENTRY else key
            if then is not None:
                parent.setdefault(slot, made)
        if then is None:
            parent[slot] = value
        else:
            parent = parent[slot]


def _where(path: tuple[str, ...]) -> str:
    """The path the parser names a field by; a list of numbers is named as a whole
    (``classes``, ``labelGroups``)."""
    where = "spec" + "".join(k if k in (ITEM, ENTRY) else f".{k}" for k in path)
    while where.endswith(ITEM):
        where = where.removesuffix(ITEM)
    return where


CASES = [(kind, path, value) for kind, resource in RESOURCES.items()
         for path, schema in _leaves(openapi(resource.spec), ())
         for value in _refused(schema)]


@pytest.mark.parametrize("kind, path, value", CASES,
                         ids=[f"{k}:{'.'.join(p)}={v!r}"[:90] for k, p, v in CASES])
def test_the_parser_refuses_what_the_crd_refuses(kind: str, path: tuple[str, ...],
                                                 value: Any) -> None:
    resource = RESOURCES[kind]
    document = resource.base(path)
    _set(document, path, value)
    assert not jsonschema.Draft4Validator(openapi(resource.spec)).is_valid(document)
    # Reported at the field, naming the value.
    with pytest.raises(SpecError) as caught:
        resource.parse(document)
    assert any(p.startswith(_where(path)) and (repr(value) in p or str(value) in p)
               for p in caught.value.problems), caught.value.problems


@pytest.mark.parametrize("kind", list(RESOURCES))
@pytest.mark.parametrize("field", ["nodeSelector", "tolerations"])
def test_the_parser_refuses_a_pod_field_longer_than_the_crd_takes(kind: str,
                                                                  field: str) -> None:
    resource = RESOURCES[kind]
    declared = openapi(resource.spec)["properties"]["experts"]["items"]["properties"][field]
    size = declared.get("maxProperties", declared.get("maxItems")) + 1
    document = resource.base(("experts",))
    document["experts"][0][field] = (
        {f"example.com/k{i}": "v" for i in range(size)} if field == "nodeSelector"
        else [{"key": f"k{i}", "operator": "Exists"} for i in range(size)])
    assert not jsonschema.Draft4Validator(openapi(resource.spec)).is_valid(document)
    with pytest.raises(SpecError) as caught:
        resource.parse(document)
    assert any(p.startswith(f"spec.experts[0].{field}: must ") and f"got {size}" in p
               for p in caught.value.problems), caught.value.problems


def _defaulted(schema: dict[str, Any], value: Any) -> Any:
    """``value`` as the API server stores it: each absent field with a default filled in."""
    if isinstance(value, dict) and "properties" in schema:
        value = {**{key: copy.deepcopy(child["default"])
                    for key, child in schema["properties"].items() if "default" in child},
                 **value}
        return {key: _defaulted(schema["properties"].get(key, {}), child)
                for key, child in value.items()}
    if isinstance(value, list) and "items" in schema:
        return [_defaulted(schema["items"], item) for item in value]
    return value


SPECS = [(kind, "minimal", resource.minimal) for kind, resource in RESOURCES.items()] + [
    (kind, path.name, yaml.safe_load(path.read_text())["spec"])
    for kind in RESOURCES for path in examples_of(kind)]
SPEC_IDS = [f"{kind}:{name}" for kind, name, _ in SPECS]


@pytest.mark.parametrize("kind, name, raw", SPECS, ids=SPEC_IDS)
def test_the_parser_defaults_what_the_crd_defaults(kind: str, name: str,
                                                   raw: dict[str, Any]) -> None:
    """A spec read from a file (``ddm up``, ``ddm train-all``) and the one the API server
    stores (its defaults filled in) are the same resource."""
    resource = RESOURCES[kind]
    stored = _defaulted(openapi(resource.spec), raw)
    assert (resource.parse(stored, allow_host_paths=True)
            == resource.parse(raw, allow_host_paths=True))


@pytest.mark.parametrize("kind", list(RESOURCES))
def test_the_api_server_fills_defaults_into_a_minimal_spec(kind: str) -> None:
    """What the test above compares differs: the CRD's defaults reach a minimal spec."""
    minimal = RESOURCES[kind].minimal
    assert _defaulted(openapi(RESOURCES[kind].spec), minimal) != minimal



def _taken(schema: dict[str, Any]) -> list[Any]:
    """Values at the edges of what ``schema`` takes: its bounds and each of its choices."""
    if schema.get("type") in ("integer", "number"):
        low = schema.get("minimum")
        if low is not None and schema.get("exclusiveMinimum"):
            low = (low + schema["maximum"]) / 2
        return [v for v in (low, schema.get("maximum")) if v is not None]
    return list(schema.get("enum", []))


TAKEN = [(kind, path, schema, value) for kind, resource in RESOURCES.items()
         for path, schema in _leaves(openapi(resource.spec), ())
         for value in _taken(schema)]


@pytest.mark.parametrize("kind, path, schema, value", TAKEN,
                         ids=[f"{k}:{'.'.join(p)}={v!r}"[:90] for k, p, _, v in TAKEN])
def test_the_parser_takes_what_the_crd_takes(kind: str, path: tuple[str, ...],
                                             schema: dict[str, Any], value: Any) -> None:
    """At the edges of the CRD's bounds and at each of its choices the parser refuses no value
    as out of range (a rule across fields may refuse it, with a message of its own)."""
    assert jsonschema.Draft4Validator(schema).is_valid(value)
    resource = RESOURCES[kind]
    document = resource.base(path)
    _set(document, path, value)
    try:
        resource.parse(document)
    except SpecError as error:
        assert not [p for p in error.problems if "unknown fields" in p
                    or p.startswith(f"{_where(path)}:") and f"got {value!r}" in p]


def _undeclared(schema: dict[str, Any], value: Any, path: str) -> Iterator[str]:
    """The fields of ``value`` that ``schema`` does not declare (the API server prunes them)."""
    if isinstance(value, dict) and not schema.get("x-kubernetes-preserve-unknown-fields"):
        for key, child in value.items():
            if "properties" in schema and key not in schema["properties"]:
                yield f"{path}.{key}"
            else:
                yield from _undeclared(schema.get("properties", {}).get(
                    key, schema.get("additionalProperties", {})), child, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _undeclared(schema.get("items", {}), item, f"{path}[{i}]")


@pytest.mark.parametrize("kind, name, raw", SPECS, ids=SPEC_IDS)
def test_every_field_the_parser_reads_in_an_example_is_declared(kind: str, name: str,
                                                                raw: dict[str, Any]) -> None:
    """The API server would drop a field the CRD does not declare: the examples, which the
    parser reads, use none."""
    assert list(_undeclared(openapi(RESOURCES[kind].spec), raw, "spec")) == []
