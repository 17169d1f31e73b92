"""A component's config.json comes from a checkpoint store: read within a size cap, and
anything unreadable refused by name (never an exception the loader does not expect)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddm.checkpoints.declared import MAX_CONFIG_BYTES, read_declaration
from ddm.checkpoints.format import CheckpointError
from ddm.models.paris_loading import read_component_config


def _component(tmp_path: Path, text: str) -> Path:
    (tmp_path / "config.json").write_text(text)
    return tmp_path


@pytest.mark.parametrize("text, problem", [
    ("[" * 200_000, "nests its JSON too deeply"),  # small, but past the parser's recursion
    ("{" + " " * MAX_CONFIG_BYTES + "}", "larger than"),
    ("{'single': 'quotes'}", "not valid JSON"),
])
def test_an_unreadable_config_is_refused_naming_why(tmp_path, text, problem):
    directory = _component(tmp_path, text)
    with pytest.raises(CheckpointError, match=problem):
        read_component_config(directory)
    assert read_declaration(directory) is None  # the loader then says why


def test_a_declaration_is_read_from_a_valid_config(tmp_path):
    directory = _component(tmp_path, '{"_ddm": {"role": "decoder"}, "in_channels": 4}')
    assert read_declaration(directory) == {"role": "decoder"}
    assert read_component_config(directory)["in_channels"] == 4
