"""The GPU check as a lent device machine runs it (issue 37): ``benchmarks/gpu-check.sh``, the
wheels it carries (``benchmarks.device_wheels``) and the order ``paris-pools`` measures in.

A device session has 15 minutes in all, so the script must fail in seconds, with the reason,
where it cannot run, and a run cut short must keep what it measured. These tests run the real
script on this machine, which has no NVIDIA GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.device_wheels import NAMES, pinned, wanted
from benchmarks.paris_pools import ParisPoolSettings, measuring_order
from ddm.runtime.local import REPOSITORY_ROOT

SCRIPT = REPOSITORY_ROOT / "benchmarks" / "gpu-check.sh"

no_nvidia = pytest.mark.skipif(shutil.which("nvidia-smi") is not None,
                               reason="this machine has an NVIDIA GPU: the check would run")


def run_script(tmp_path: Path, *args: str, wheels: Path | None = None,
               pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The script run from ``tmp_path`` (not the repository), its $OUT under it, with
    ``wheels`` as its carried wheels (none by default) and ``pythonpath`` as the image's own
    extra packages."""
    wheelhouse = wheels or tmp_path / "no-wheels"
    wheelhouse.mkdir(exist_ok=True)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "DDM_DEVICE_WHEELS": str(wheelhouse), "DDM_DEVICE_SITE": str(tmp_path / "site")}
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@no_nvidia
def test_without_a_gpu_the_check_stops_at_once_and_says_why(tmp_path: Path) -> None:
    done = run_script(tmp_path)
    assert done.returncode == 1
    log = (tmp_path / "out" / "log.txt").read_text()
    assert log == done.stdout  # everything it printed is in the log that comes back
    assert "PyTorch" in log and "CUDA False" in log  # the preflight ran, from any directory
    assert "nvidia-smi is not here: the GPU check needs an NVIDIA device" in log
    assert not (tmp_path / "out" / "gpu-check.json").exists()


def test_a_missing_package_is_named_before_any_measuring(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    (shadow / "fastapi").mkdir(parents=True)  # an import that fails, as on an image without it
    (shadow / "fastapi" / "__init__.py").write_text(
        "raise ImportError('No module named fastapi')")
    done = run_script(tmp_path, pythonpath=shadow)
    assert done.returncode == 1
    assert "cannot import what the check needs" in done.stdout
    assert "fastapi: ImportError: No module named fastapi" in done.stdout
    assert not (tmp_path / "out" / "nvidia-smi.txt").exists()  # stopped before the check


def test_carried_wheels_are_installed_and_come_first(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                            "--no-build-isolation", "--wheel-dir", str(wheels),
                            str(marker_project(tmp_path))],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    done = run_script(tmp_path, "--help", wheels=wheels)
    assert done.returncode == 0, done.stdout
    assert "installing 1 carried wheels" in done.stdout
    assert (tmp_path / "site" / "ddm_device_marker.py").is_file()
    assert "usage:" in done.stdout and "--quick" in done.stdout  # gpu-check's own help


def marker_project(tmp_path: Path) -> Path:
    project = tmp_path / "marker"
    project.mkdir()
    (project / "ddm_device_marker.py").write_text("")
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "ddm-device-marker"\nversion = "1.0"\n'
        '[tool.setuptools]\npy-modules = ["ddm_device_marker"]\n')
    return project


def test_the_device_wheels_are_pinned_to_what_the_tests_ran_with() -> None:
    names = wanted(NAMES.read_text())
    assert {"diffusers", "fastapi", "uvicorn", "httptools", "pydantic-core"} <= set(names)
    pins = pinned(names)
    assert [pin.split("==")[0] for pin in pins] == names
    import pydantic_core

    assert f"pydantic-core=={pydantic_core.__version__}" in pins  # the one pydantic needs
    with pytest.raises(SystemExit, match="not installed here: no-such-package"):
        pinned(["fastapi", "no-such-package"])


def test_comments_and_blank_lines_name_no_wheel() -> None:
    assert wanted("# a comment\n\nfastapi  # the servers\n  uvicorn\n") == ["fastapi", "uvicorn"]


def test_compiled_deployments_are_measured_last() -> None:
    settings = ParisPoolSettings(deployments=("alone", "pooled", "in_process"),
                                 compile=("reduce-overhead", "none"))
    assert measuring_order(settings) == [
        ("alone", "none"), ("pooled", "none"), ("in_process", "none"),
        ("alone", "reduce-overhead"), ("pooled", "reduce-overhead")]
    only_compiled = ParisPoolSettings(deployments=("pooled", "in_process"),
                                      compile=("default",))
    assert measuring_order(only_compiled) == [("in_process", "none"), ("pooled", "default")]
