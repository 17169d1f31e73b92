"""What the repository ships (checkpoints, examples, docs) names no path of a developer's
machine: a home, work or temporary directory means nothing on a user's machine, and tells
outsiders about ours."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]
SHIPPED = ("checkpoints", "examples", "docs")
#: An absolute path into a home, work or temporary directory (``/home/x``, ``/Users/x``,
#: ``/root/x``, ``/work/x``, ``/tmp/x``), not part of a longer path or URL
#: (``https://host/tmp/...``, ``./tmp/...``).
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:home|Users|root|work|tmp)/[\w.-]")
#: Files read as text: weights, images and archives are not.
TEXT_SUFFIXES = {".json", ".yaml", ".yml", ".md", ".txt", ".toml", ".py", ".sh", ".html",
                 ".csv", ".cfg", ".ini"}


def machine_paths(root: Path) -> list[str]:
    """``file:line: path`` (``file`` relative to ``root``) for every machine path in the text
    files under ``root``."""
    found = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in TEXT_SUFFIXES or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in MACHINE_PATH.finditer(line):
                end = line.find(" ", match.start())
                found.append(f"{path.relative_to(root)}:{number}: "
                             f"{line[match.start():end if end >= 0 else None]}")
    return found


@pytest.mark.parametrize("folder", SHIPPED)
def test_shipped_files_name_no_machine_path(folder: str) -> None:
    assert machine_paths(REPOSITORY / folder) == []


def test_the_scan_finds_machine_paths_and_passes_urls(tmp_path: Path) -> None:
    (tmp_path / "partition.json").write_text('{"source": "mnist:/work/shared/datasets/mnist"}\n'
                                             'see https://example.org/tmp/x and ./tmp/y\n'
                                             "cp a /home/me/b; cd /tmp/wt-1\n")
    (tmp_path / "weights.safetensors").write_bytes(b"/home/me/not-text")
    assert machine_paths(tmp_path) == ['partition.json:1: /work/shared/datasets/mnist"}',
                     "partition.json:3: /home/me/b;", "partition.json:3: /tmp/wt-1"]
