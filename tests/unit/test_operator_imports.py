"""The operator runs without any ML framework: its image (images/operator/Dockerfile) installs
the product without numpy, PyTorch or JAX.

import-linter checks the operator's own modules statically; this checks what actually runs in
the operator's container: the ``ddm`` command up to ``ddm operator`` and the image's entry point
(operator/main.py), in a fresh interpreter whose imports of those frameworks fail.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: What the operator image does not install (numpy is a core dependency of the ML roles).
ABSENT = ("numpy", "torch", "jax", "flax", "optax", "safetensors", "sklearn", "PIL")

_WITHOUT_ML = textwrap.dedent(f"""
    import sys

    class Absent:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {ABSENT!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}} (not in the operator image)")
            return None

    sys.meta_path.insert(0, Absent())
""")


def _run_without_ml(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _WITHOUT_ML + textwrap.dedent(code)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_blocker_refuses_what_the_image_lacks() -> None:
    result = _run_without_ml("import numpy")
    assert result.returncode != 0 and "not in the operator image" in result.stderr


def test_ddm_operator_help_runs_without_an_ml_framework() -> None:
    result = _run_without_ml("""
        from ddm.cli import main
        try:
            main(["operator", "--help"])
        except SystemExit as done:
            assert done.code == 0, done.code
    """)
    assert result.returncode == 0, result.stderr
    assert "--liveness-port" in result.stdout


def test_the_operators_modules_and_entry_point_import_without_an_ml_framework() -> None:
    result = _run_without_ml("""
        import runpy
        import ddm.checkpoints.uri, ddm.deploy.plan, ddm.operator.diagram
        import ddm.operator.handlers, ddm.operator.runner
        runpy.run_path("operator/main.py", run_name="operator_main")  # imports, does not run
        print(sorted(m for m in sys.modules if m.split(".")[0] in {"kopf", "kubernetes"})[:1])
    """)
    assert result.returncode == 0, result.stderr
    assert "kopf" in result.stdout  # the operator's own stack is there
