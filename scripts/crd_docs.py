"""Write the field references, docs/crd.md (DDMDeployment) and docs/training-crd.md
(DDMTraining), from the CRDs' openAPIV3Schema.

Each CRD (crds/*.yaml, itself generated from ddm.deploy.crd and ddm.deploy.training_crd by
scripts/generate_crds.py) is read back; tests/unit/test_crd_docs.py and `make lint` regenerate
the pages and compare, so they cannot drift. `make generate` runs both scripts.

    python scripts/crd_docs.py            # rewrite the pages
    python scripts/crd_docs.py --check    # exit 1 if a page is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import yaml

ROOT = Path(__file__).resolve().parents[1]


class Page(NamedTuple):
    """One CRD's reference page: the CRD read, the page written, what the operator checks
    beyond the schema (after the page's first sentence)."""

    crd: str
    doc: str
    checks: str


PAGES = (
    Page("crds/ddmdeployments.ddm.dev.yaml", "docs/crd.md",
         "The operator checks more than the schema can (the oracle's class partition, "
         "platform device counts, host paths, conflicting node selectors, resource "
         "quantities): it reports those in `status.conditions` (type `SpecValid`) and in a "
         "Warning event, and creates no child until the spec is valid."),
    Page("crds/ddmtrainings.ddm.dev.yaml", "docs/training-crd.md",
         "The operator checks more than the schema can (experts against the partition's "
         "parts, batch sizes against processes, nodes against the engine, the stores and "
         "volumes of the data and the output, the DDMDeployment the outputs make): it "
         "reports those in `status.message` (phase `Failed`) and in a Warning event, and "
         "creates no job until the spec is valid. The flow is in [training.md](training.md)."),
)


def _type(schema: dict[str, Any]) -> str:
    if schema.get("x-kubernetes-int-or-string"):
        return "integer or string"
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list of {_type(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema:
        return f"map of {_type(schema['additionalProperties'])}"
    return kind


def _constraints(schema: dict[str, Any]) -> str:
    """The checks the API server makes on this field, in words."""
    parts = []
    if "enum" in schema:
        parts.append("one of " + ", ".join(f"`{v}`" for v in schema["enum"]))
    if schema.get("exclusiveMinimum"):
        parts.append(f"above {schema['minimum']}, at most {schema.get('maximum', '')}")
    elif "minimum" in schema or "maximum" in schema:
        parts.append(f"{schema.get('minimum', '')}..{schema.get('maximum', '')}")
    for key, words in (("minLength", "at least {} characters"),
                       ("maxLength", "at most {} characters"),
                       ("minItems", "at least {} items"), ("maxItems", "at most {} items"),
                       ("maxProperties", "at most {} entries")):
        if key in schema:
            parts.append(words.format(schema[key]))
    if "pattern" in schema:
        parts.append(f"matches `{schema['pattern']}`")
    if schema.get("x-kubernetes-list-type") == "map":
        keys = ", ".join(schema.get("x-kubernetes-list-map-keys", []))
        parts.append(f"unique by {keys}")
    if schema.get("x-kubernetes-list-type") == "set":
        parts.append("no duplicates")
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        parts.append("passed through as given")
    values = schema.get("additionalProperties")
    if isinstance(values, dict) and _constraints(values):
        parts.append(f"each value: {_constraints(values)}")
    return "; ".join(parts)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _rows(schema: dict[str, Any], path: str, required: bool) -> Iterator[str]:
    default = json.dumps(schema["default"]) if "default" in schema else ""
    described = schema.get("description", "")
    yield (f"| `{path}` | {_cell(_type(schema))} | {'yes' if required else ''} | "
           f"{_cell(f'`{default}`' if default else '')} | {_cell(_constraints(schema))} | "
           f"{_cell(described)} |")
    children = schema.get("properties") or {}
    if schema.get("type") == "array":
        children = (schema.get("items") or {}).get("properties") or {}
        path, needed = f"{path}[]", set((schema.get("items") or {}).get("required", []))
    elif "additionalProperties" in schema and isinstance(schema["additionalProperties"], dict):
        children = schema["additionalProperties"].get("properties") or {}
        path, needed = f"{path}.*", set(schema["additionalProperties"].get("required", []))
    else:
        needed = set(schema.get("required", []))
    for name, child in children.items():
        yield from _rows(child, f"{path}.{name}", name in needed)


def render(crd: dict[str, Any], page: Page = PAGES[0]) -> str:
    """The Markdown reference of every field of ``crd``'s first version (spec and status)."""
    names, version = crd["spec"]["names"], crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    header = ("| Field | Type | Required | Default | Checked by the API server | "
              "Description |\n|---|---|---|---|---|---|")
    out = [
        f"# {names['kind']} field reference",
        "",
        f"<!-- Generated by scripts/crd_docs.py from {page.crd}; do not edit. -->",
        "",
        (f"`apiVersion: {crd['spec']['group']}/{version['name']}`, `kind: {names['kind']}` "
         f"(short name `{', '.join(names.get('shortNames', []))}`), namespaced. {page.checks}"),
    ]
    for section in ("spec", "status"):
        part = schema["properties"][section]
        out += ["", f"## {section}", "", header,
                *_rows(part, section, section in schema.get("required", []))]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only check that the pages are up to date")
    args = parser.parse_args(argv)
    stale = 0
    for page in PAGES:
        text = render(yaml.safe_load((ROOT / page.crd).read_text()), page)
        doc = ROOT / page.doc
        if not args.check:
            doc.write_text(text)
            print(f"wrote {doc}")
        elif not doc.exists() or doc.read_text() != text:
            print(f"{doc} is out of date: run python scripts/crd_docs.py", file=sys.stderr)
            stale = 1
    return stale


if __name__ == "__main__":
    sys.exit(main())
