"""The shipped examples by kind: most are DDMDeployments, examples/training.yaml a DDMTraining."""

from __future__ import annotations

from pathlib import Path

import yaml

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"


def examples_of(kind: str) -> list[Path]:
    """Every examples/*.yaml of ``kind``, sorted by name."""
    return [path for path in sorted(EXAMPLES_DIR.glob("*.yaml"))
            if yaml.safe_load(path.read_text()).get("kind") == kind]


def deployment_examples() -> list[Path]:
    """Every examples/*.yaml whose kind is DDMDeployment, sorted by name."""
    return examples_of("DDMDeployment")
