"""What the product's wheel carries: the product, not the repository's tools.

The dev cluster (tools/devcluster, ``ddm_devcluster``: a Kubernetes build, namespaces, a DNS
server, image builds, a C pause binary) is a tool for developing and testing, its own
distribution; the wheel users install and the images are built from holds none of it.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _wheel(project: Path, out: Path) -> tuple[str, list[str], str]:
    """Build ``project``'s wheel as users get it (``pip wheel --no-deps``): its file name, the
    files it holds and its entry points."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "--wheel-dir", str(out), str(project)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        files = archive.namelist()
        entry_points = next(f for f in files if f.endswith(".dist-info/entry_points.txt"))
        return wheel.name, files, archive.read(entry_points).decode()


def test_the_product_wheel_holds_no_dev_cluster(tmp_path: Path) -> None:
    name, files, entry_points = _wheel(ROOT, tmp_path)
    assert name.startswith("ddm_operator-")
    assert "ddm/operator/runner.py" in files  # the wheel is the product's
    assert [f for f in files if "devcluster" in f or f.endswith("pause.c")] == []
    assert "ddm = ddm.cli:main" in entry_points and "dev-cluster" not in entry_points


def test_the_dev_cluster_is_its_own_distribution_with_its_command(tmp_path: Path) -> None:
    name, files, entry_points = _wheel(ROOT / "tools" / "devcluster", tmp_path)
    assert name.startswith("ddm_devcluster-")
    assert "ddm_devcluster/pause.c" in files and "ddm_devcluster/images.py" in files
    assert [f for f in files if f.startswith("ddm/")] == []
    assert "ddm-dev-cluster = ddm_devcluster.command:main" in entry_points
