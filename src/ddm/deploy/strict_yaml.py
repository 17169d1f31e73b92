"""The one way a user's YAML is parsed (DDMDeployment files, router.yaml): safe, and strict.

PyYAML keeps the last of two equal keys in a mapping, so a second ``replicas:`` would silently
win; here it is an error naming the key and both lines, as kubectl makes it. Bytes are decoded
by the parser (UTF-8, or UTF-16/32 by their BOM), so a binary file is a YAML error too.
"""

from __future__ import annotations

import io
from typing import Any, Hashable

import yaml
from yaml.constructor import ConstructorError

_MERGE = "tag:yaml.org,2002:merge"


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (``<<`` merges may
    still be overridden: that is what they are for)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, Hashable):
                continue  # the SafeLoader's own error follows
            if key in seen:
                raise ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r} (first on line {seen[key].line + 1})",
                    key_node.start_mark)
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def load_yaml(source: str | bytes, name: str) -> Any:
    """The one document in ``source``; ``name`` (its file) is what error marks cite. Raises
    ``yaml.YAMLError`` for bad YAML, a key given twice, or bytes that are not text."""
    stream = io.BytesIO(source) if isinstance(source, bytes) else io.StringIO(source)
    stream.name = name  # what the reader's marks cite, not "<byte string>"
    loader = StrictLoader(stream)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
