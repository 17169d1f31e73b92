"""The layers `make lint` enforces (import-linter contracts in pyproject.toml).

Each case copies the real package, adds one import that breaks a rule, and checks that
`lint-imports` fails and names that import; the unchanged tree passes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=300,
    )


def _copy_of_package(tmp_path: Path) -> Path:
    """The product and the dev cluster (both root packages of the contracts)."""
    for package in (ROOT / "src" / "ddm", ROOT / "tools" / "devcluster" / "src" / "ddm_devcluster"):
        shutil.copytree(package, tmp_path / package.name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_the_tree_keeps_every_contract(tmp_path: Path) -> None:
    result = _lint(_copy_of_package(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


@pytest.mark.parametrize(("module", "added_import", "reported"), [
    # a cycle inside a package: reconcile already imports kube (the linter names the edge
    # whose removal breaks the cycle: the one the test added)
    ("operator/kube.py", "from ddm.operator import reconcile", ".kube -> .reconcile"),
    # a low layer reaching up: the convention importing the CLI
    ("convention.py", "import ddm.cli", "ddm.convention -> ddm.cli"),
    # the operator pulling in an ML framework
    ("operator/names.py", "import torch", "ddm.operator.names -> torch"),
    # the plan pulling in a model
    ("deploy/router_config.py", "import ddm.models.config",
     "ddm.deploy.router_config -> ddm.models"),
    # the product reaching for the dev cluster, a tool of the repository
    ("cli.py", "import ddm_devcluster", "ddm.cli -> ddm_devcluster"),
])
def test_an_import_against_the_rules_fails_the_lint(
    tmp_path: Path, module: str, added_import: str, reported: str
) -> None:
    tree = _copy_of_package(tmp_path)
    target = tree / "ddm" / module
    target.write_text(target.read_text() + f"\n{added_import}  # noqa: E402,F401\n")
    result = _lint(tree)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout
    assert reported in result.stdout, result.stdout
