"""The GPU check as a lent device machine runs it (issue 37): ``benchmarks/gpu-check.sh``, the
wheels it carries (``benchmarks.device_wheels``) and the order ``paris-pools`` measures in.

A device session has 15 minutes in all, so the script must fail in seconds, with the reason,
where it cannot run; a run stopped at its deadline must keep what it measured and leave no
server behind; and what it carries must need nothing the device's image lacks. These tests
run the real script on this machine, which has no NVIDIA GPU.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import replace
from importlib.metadata import requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from benchmarks.device_wheels import IMAGE, LEFT_OUT, NAMES, pinned, slim, wanted
from benchmarks.fleet import BenchError
from benchmarks.gpu_check import FORWARD_CHECKS, GPU_CHECK, PARTS, gpu_check
from benchmarks.paris_pools import ParisPoolSettings, measuring_order
from ddm.runtime.local import REPOSITORY_ROOT

SCRIPT = REPOSITORY_ROOT / "benchmarks" / "gpu-check.sh"
#: The device's Python: what a carried package's requirement markers are read against.
DEVICE_PYTHON = {"python_version": "3.12", "python_full_version": "3.12.3",
                 "sys_platform": "linux", "platform_system": "Linux",
                 "platform_machine": "x86_64", "implementation_name": "cpython",
                 "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
WAIT_S = 300.0

no_nvidia = pytest.mark.skipif(shutil.which("nvidia-smi") is not None,
                               reason="this machine has an NVIDIA GPU: the check would run")


def script_env(tmp_path: Path, wheels: Path | None = None,
               pythonpath: Path | None = None) -> dict[str, str]:
    """The script's environment: $OUT under ``tmp_path``, this venv's Python, ``wheels`` as its
    carried wheels (none by default), ``pythonpath`` as the image's own extra packages, and
    temporary files (the release, the servers' paths) under ``tmp_path``."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "DDM_DEVICE_WHEELS": str(wheels or ""), "DDM_DEVICE_SITE": str(tmp_path / "site"),
           "TMPDIR": str(tmp_path / "tmp")}
    env.pop("PYTHONPATH", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


def run_script(tmp_path: Path, *args: str, **env: Path) -> subprocess.CompletedProcess[str]:
    """The script run from ``tmp_path`` (not the repository) to its end."""
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path,
                          env=script_env(tmp_path, **env), capture_output=True, text=True,
                          timeout=WAIT_S)


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
    write_wheel(wheels / "ddm_device_marker-1.0-py3-none-any.whl", "ddm_device_marker",
                "ddm_device_marker.py")
    done = run_script(tmp_path, "--help", wheels=wheels)
    assert done.returncode == 0, done.stdout
    assert "installing 1 carried wheels" in done.stdout
    assert (tmp_path / "site" / "ddm_device_marker.py").is_file()
    assert "usage:" in done.stdout  # gpu-check's own help, offering every part
    assert f"--part {{{','.join((*PARTS, *FORWARD_CHECKS))}}}" in done.stdout


def test_the_forwards_part_measures_each_way_and_says_so(tmp_path: Path) -> None:
    """``--part forwards`` through the script as the device runs it (here the small expert on
    the CPU): every level has each way's time, the pool's path eager and compiled, and the
    grouped forward gives the experts' outputs."""
    done = run_script(tmp_path, "--quick", "--part", "forwards")
    assert done.returncode == 0, done.stdout[-3000:]
    figures = json.loads((tmp_path / "out" / "forwards.json").read_text())
    assert figures["complete"] is True
    assert [level["rows"] for level in figures["levels"]] == [1, 2]
    for level, served in zip(figures["levels"], figures["served"]):
        assert level["eager_ms"] > 0 and level["eager_tflop_per_s"] > 0
        assert served["rows"] == level["rows"]
        assert served["none_ms"] > 0 and served["reduce-overhead_ms"] > 0
    (grouped,) = figures["grouped"]
    assert grouped["rows_per_expert"] == 2 and grouped["max_abs_difference"] < 1e-5
    assert grouped["one_after_the_other_ms"] > 0 and grouped["grouped_ms"] > 0
    assert grouped["grouped_profile"]["shares"]["matmul"] > 0
    assert "  2 rows: eager " in done.stdout and "served reduce-overhead" in done.stdout
    assert "  grouped, 2 rows per expert: one after the other " in done.stdout
    assert not (tmp_path / "out" / "gpu-check.json").exists()  # no deployment was measured


def test_the_kernels_part_says_where_a_forward_s_time_goes(tmp_path: Path) -> None:
    """``--part kernels`` through the script (the small expert on the CPU, whose profiler
    times operators, not kernels): the levels, then at 2 rows the shares of each kind adding
    up to the whole, the heaviest named with their kind, the forward under each attention
    kernel, timed or refused by name, and the compiled forward's breakdown; then the grouped
    forward, not the pool's path."""
    done = run_script(tmp_path, "--quick", "--part", "kernels")
    assert done.returncode == 0, done.stdout[-3000:]
    figures = json.loads((tmp_path / "out" / "kernels.json").read_text())
    assert figures["complete"] is True and "served" not in figures
    assert [level["rows_per_expert"] for level in figures["grouped"]] == [2]
    assert [level["rows"] for level in figures["levels"]] == [1, 2]
    (kernels,) = figures["kernels"]
    profile = kernels["profile"]
    assert kernels["rows"] == 2 and profile["timed"] == "operators' own CPU time"
    assert sum(profile["shares"].values()) == pytest.approx(1, abs=1e-3)
    assert profile["shares"]["matmul"] > 0.1 and profile["shares"]["attention"] > 0
    assert {"aten::addmm", "aten::native_layer_norm"} <= {k["name"] for k in profile["heaviest"]}
    assert all(k["us_per_call"] > 0 and k["per_call"] > 0 for k in profile["heaviest"])
    assert kernels["attention_default_ms"] > 0 and kernels["attention_math_ms"] > 0
    # The CPU has no cuDNN: that kernel refuses the call, and the figures say so.
    assert "No viable backend" in kernels["attention_cudnn_attention_error"]
    # The same forward compiled (inductor without CUDA graphs), timed and broken down alike.
    assert kernels["compiled_ms"] > 0
    assert sum(kernels["compiled_profile"]["shares"].values()) == pytest.approx(1, abs=1e-3)
    assert "  kernels at 2 rows: " in done.stdout and "attention default " in done.stdout
    assert "  compiled kernels at 2 rows: " in done.stdout


def write_wheel(path: Path, name: str, module: str) -> None:
    """A wheel of one empty module, as PEP 427 lays it out."""
    info = f"{name}-1.0.dist-info"
    files = {module: "", f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\n"
                                             "Version: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    record = "".join(f"{file},,\n" for file in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as wheel:
        for file, text in {**files, f"{info}/RECORD": record}.items():
            wheel.writestr(file, text)


def test_a_check_stopped_by_sigterm_stops_its_servers(tmp_path: Path) -> None:
    """What the script's deadline sends (``timeout -s TERM``): the deployment under way is
    stopped, every server with it, and the run exits by the signal."""
    log_path = tmp_path / "log"
    with log_path.open("w") as sink:
        check = subprocess.Popen(
            [sys.executable, "-m", "benchmarks", "gpu-check", "--quick", "--part", "eager",
             "--out", str(tmp_path / "out")], cwd=REPOSITORY_ROOT, stdout=sink,
            stderr=subprocess.STDOUT,
            env={**script_env(tmp_path), "PYTHONPATH": str(REPOSITORY_ROOT / "src")})
    try:
        deadline = time.monotonic() + WAIT_S
        while "pool-all/0 is ready" not in log_path.read_text():
            assert check.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the pool never started"
            time.sleep(0.1)
        servers = processes_naming(tmp_path / "tmp")
        assert servers, "no server runs from the release under the test's TMPDIR"
        check.send_signal(signal.SIGTERM)
        assert check.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if check.poll() is None:
            check.kill()
        left = processes_naming(tmp_path / "tmp")
        for pid in left:  # a failing run leaves no server behind either
            os.kill(pid, signal.SIGKILL)
    assert left == [], log_path.read_text()[-3000:]


def processes_naming(path: Path) -> list[int]:
    """The PIDs of the processes whose command line names ``path``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(path).encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue  # ended meanwhile
    return found


def test_the_device_wheels_are_pinned_to_what_the_tests_ran_with() -> None:
    names = wanted(NAMES.read_text())
    assert {"diffusers", "fastapi", "uvicorn", "httptools", "pydantic-core"} <= set(names)
    import pydantic_core

    assert f"pydantic-core=={pydantic_core.__version__}" in pinned(names)  # what pydantic needs
    with pytest.raises(SystemExit, match="not installed here: no-such-package"):
        pinned(["fastapi", "no-such-package"])


def test_every_carried_package_needs_only_what_is_carried_or_on_the_image() -> None:
    """A carried wheel's requirement on neither list would be an ImportError on the device, a
    machine start lost: carry it too (benchmarks/device-wheels.txt)."""
    carried = {canonicalize_name(name) for name in wanted(NAMES.read_text())}
    image = {canonicalize_name(name) for name in wanted(IMAGE.read_text())}
    assert {"torch", "transformers", "numpy"} <= image
    missing = {}
    for name in carried:
        for line in requires(name) or ():
            needed = Requirement(line)
            if needed.marker is None or needed.marker.evaluate(DEVICE_PYTHON):
                if canonicalize_name(needed.name) not in carried | image:
                    missing.setdefault(name, []).append(str(needed))
    assert missing == {}


_HELLO = "#include <stdio.h>\nint main(void) { puts(\"hello\"); return 0; }\n"


@pytest.mark.skipif(not (shutil.which("gcc") and shutil.which("strip")),
                    reason="needs gcc and strip (make test installs them)")
def test_a_wheels_executable_is_stripped_and_the_wheel_still_installs(tmp_path: Path) -> None:
    source = tmp_path / "hello.c"
    source.write_text(_HELLO)
    binary = tmp_path / "hello"
    subprocess.run(["gcc", "-g", "-O0", "-o", str(binary), str(source)], check=True)
    built = binary.read_bytes()
    wheel = tmp_path / "hello-1.0-py3-none-any.whl"
    script = "hello-1.0.data/scripts/hello"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        executable = zipfile.ZipInfo(script)
        executable.external_attr = 0o100755 << 16
        archive.writestr(executable, built)
        archive.writestr("hello-1.0.dist-info/METADATA",
                         "Metadata-Version: 2.1\nName: hello\nVersion: 1.0\n")
        archive.writestr("hello-1.0.dist-info/WHEEL",
                         "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n")
        archive.writestr("hello-1.0.dist-info/RECORD",
                         f"{script},sha256=unchecked,{len(built)}\n"
                         "hello-1.0.dist-info/RECORD,,\n")
    before = wheel.stat().st_size

    assert slim(wheel) == [script]

    assert wheel.stat().st_size < before
    with zipfile.ZipFile(wheel) as archive:
        stripped = archive.read(script)
        record = archive.read("hello-1.0.dist-info/RECORD").decode()
    assert len(stripped) < len(built)
    digest = base64.urlsafe_b64encode(hashlib.sha256(stripped).digest()).rstrip(b"=").decode()
    assert record == f"{script},sha256={digest},{len(stripped)}\nhello-1.0.dist-info/RECORD,,\n"
    assert slim(wheel) == []  # stripping again changes nothing
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(script) == stripped
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--target", str(site), str(wheel)], check=True)
    ran = subprocess.run([str(site / "bin" / "hello")], capture_output=True, text=True)
    assert (ran.returncode, ran.stdout) == (0, "hello\n")


def test_a_wheels_left_out_folders_are_gone_from_it_and_from_its_record(
        tmp_path: Path) -> None:
    wheel = tmp_path / "kit-1.0-py3-none-any.whl"
    write_wheel(wheel, "kit", "kit/__init__.py")
    with zipfile.ZipFile(wheel, "a") as archive:
        archive.writestr("kit/extras/big.py", "raise ImportError('left out')\n" * 1000)
        archive.writestr("kit/extras_kept.py", "")  # a prefix of a name is not its folder
    assert slim(wheel, ("kit/extras/",)) == ["kit/extras/big.py"]
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        record = archive.read("kit-1.0.dist-info/RECORD").decode()
    assert "kit/extras/big.py" not in names and "kit/extras_kept.py" in names
    assert "kit/extras/" not in record and "kit/__init__.py,," in record
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--target", str(site), str(wheel)], check=True)
    assert (site / "kit" / "__init__.py").is_file() and not (site / "kit" / "extras").exists()


def test_the_check_runs_without_what_its_wheels_leave_out(tmp_path: Path) -> None:
    """Each carried package as the device installs it, without its ``LEFT_OUT`` folders,
    ahead of this venv's: the pool part loads and serves every member of the release."""
    slimmed = tmp_path / "slimmed"
    for package, folders in LEFT_OUT.items():
        installed = Path(importlib.import_module(package).__file__).parent
        left_out = {Path(folder).name for folder in folders}
        shutil.copytree(installed, slimmed / package, ignore=lambda directory, names: [
            name for name in names
            if Path(directory) == installed and name in left_out])
        assert not any((slimmed / package / name).exists() for name in left_out)
    done = run_script(tmp_path, "--quick", "--part", "pool", pythonpath=slimmed)
    assert done.returncode == 0, done.stdout[-3000:]
    assert str(slimmed / "diffusers") in subprocess.run(
        [sys.executable, "-c", "import diffusers; print(diffusers.__file__)"],
        env={**os.environ, "PYTHONPATH": str(slimmed)}, capture_output=True, text=True,
        check=True).stdout
    figures = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert figures["complete"] is True


def test_comments_and_blank_lines_name_no_wheel() -> None:
    assert wanted("# a comment\n\nfastapi  # the servers\n  uvicorn\n") == ["fastapi", "uvicorn"]


def test_each_part_fits_a_call_and_compiled_deployments_are_measured_last() -> None:
    settings = ParisPoolSettings(deployments=("alone", "pooled", "in_process"),
                                 compile=("reduce-overhead", "none"))
    assert measuring_order(settings) == [
        ("alone", "none"), ("pooled", "none"), ("in_process", "none"),
        ("alone", "reduce-overhead"), ("pooled", "reduce-overhead")]
    only_compiled = ParisPoolSettings(deployments=("pooled", "in_process"),
                                      compile=("default",))
    assert measuring_order(only_compiled) == [("in_process", "none"), ("pooled", "default")]
    parts = {part: measuring_order(replace(GPU_CHECK, **PARTS[part])) for part in PARTS}
    assert parts == {"all": [("pooled", "none"), ("in_process", "none"),
                             ("pooled", "reduce-overhead")],
                     "eager": [("pooled", "none"), ("in_process", "none")],
                     "compiled": [("pooled", "reduce-overhead")],
                     "pool": [("pooled", "none")]}
    with pytest.raises(BenchError,
                       match="part must be one of all, eager, compiled, pool, forwards, "
                             "kernels"):
        gpu_check(Path("unused"), part="some", log=io.StringIO(), report=io.StringIO())
