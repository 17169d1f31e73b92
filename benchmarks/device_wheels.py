"""``python -m benchmarks.device_wheels`` (``make device-wheels``): the wheels the GPU check
needs on the device machine, where nothing can be fetched.

The names are benchmarks/device-wheels.txt's; each is pinned to the version installed here
(the one the tests ran with) and downloaded for the device's Python (3.12, manylinux x86-64)
into ``.whl/``, replacing what was there (one version of each: two stop the install). The run
carries ``.whl/`` beside the working tree, and both must fit the 64 MiB a run may send, so the
total is printed and a set that does not fit is refused. To fit, each wheel is slimmed first:
its executables (py-spy's) stripped of their symbols, where ``strip`` is installed, and the
parts of it the check never imports (``LEFT_OUT``) taken out.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
NAMES = ROOT / "benchmarks" / "device-wheels.txt"
#: What the device image already holds (what the carried wheels may require without carrying).
IMAGE = ROOT / "benchmarks" / "device-image-packages.txt"
WHEELS = ROOT / ".whl"
#: The device machine's Python and platforms (the device tool's README).
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
#: What one run may send: the working tree and the carried paths together.
TRAVEL_LIMIT_BYTES = 64 * 2**20
#: Folders of a carried wheel that the check never imports, by package: diffusers' pipelines
#: (the check builds its networks from ``diffusers.models`` and loads them with
#: ``from_pretrained``; no pipeline class runs), 4.1 of its 6.2 MiB.
LEFT_OUT = {"diffusers": ("diffusers/pipelines/", "diffusers/modular_pipelines/")}


def wanted(text: str) -> list[str]:
    """The package names of a device-wheels.txt or device-image-packages.txt (one per line;
    ``#`` starts a comment)."""
    return [line.split("#", 1)[0].strip() for line in text.splitlines()
            if line.split("#", 1)[0].strip()]


def pinned(names: list[str]) -> list[str]:
    """``name==version`` for each of ``names``, at the version installed here."""
    pins, missing = [], []
    for name in names:
        try:
            pins.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            missing.append(name)
    if missing:
        raise SystemExit(f"device-wheels: not installed here: {', '.join(missing)} (make test "
                         "installs every extra first)")
    return pins


def tree_bytes() -> int:
    """The bytes of what a run sends besides ``.whl/``: the tracked and the untracked but not
    ignored files."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, capture_output=True, check=True)
    files = (ROOT / name for name in listed.stdout.decode().split("\0") if name)
    return sum(path.stat().st_size for path in files if path.is_file())


def slim(wheel: Path, left_out: tuple[str, ...] = ()) -> list[str]:
    """Slim ``wheel`` in place: its ELF executables (its ``*.data/scripts``) stripped of their
    symbols (where ``strip`` is installed), the files under the ``left_out`` folders removed,
    its RECORD rewritten to match; the paths changed or removed."""
    with zipfile.ZipFile(wheel) as archive:
        entries = [(info, archive.read(info)) for info in archive.infolist()]
    removed = {info.filename for info, _ in entries if info.filename.startswith(left_out)}
    stripped: dict[str, bytes] = {}
    for info, data in entries:
        if (".data/scripts/" in info.filename and data.startswith(b"\x7fELF")
                and shutil.which("strip")):
            with tempfile.TemporaryDirectory() as directory:
                binary = Path(directory) / "binary"
                binary.write_bytes(data)
                subprocess.run(["strip", str(binary)], check=True)
                if binary.read_bytes() != data:
                    stripped[info.filename] = binary.read_bytes()
    if not stripped and not removed:
        return []
    rewritten = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(rewritten, "w", zipfile.ZIP_DEFLATED) as archive:
        for info, data in entries:
            if info.filename in removed:
                continue
            if info.filename.endswith(".dist-info/RECORD"):
                data = _record(data.decode(), stripped, removed).encode()
            archive.writestr(info, stripped.get(info.filename, data),
                             compress_type=zipfile.ZIP_DEFLATED)
    rewritten.replace(wheel)
    return sorted([*stripped, *removed])


def _record(record: str, changed: dict[str, bytes], removed: set[str]) -> str:
    """A wheel's RECORD (``path,sha256=...,size`` lines) with ``changed`` files' hashes and
    sizes, and no line for the ``removed`` files."""
    lines = []
    for line in record.splitlines():
        path = line.split(",", 1)[0]
        if path in removed:
            continue
        if path in changed:
            digest = base64.urlsafe_b64encode(hashlib.sha256(changed[path]).digest())
            line = f"{path},sha256={digest.rstrip(b'=').decode()},{len(changed[path])}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def main() -> int:
    pins = pinned(wanted(NAMES.read_text()))
    shutil.rmtree(WHEELS, ignore_errors=True)
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--only-binary=:all:", "--python-version", PYTHON_VERSION,
                    "--implementation", "cp", *platforms, "--dest", str(WHEELS), *pins],
                   check=True)
    for wheel in WHEELS.glob("*.whl"):
        package = canonicalize_name(wheel.name.split("-", 1)[0])
        slim(wheel, LEFT_OUT.get(package, ()))
    wheels = sum(path.stat().st_size for path in WHEELS.glob("*.whl"))
    tree = tree_bytes()
    print(f"device-wheels: {len(pins)} wheels, {wheels / 2**20:.1f} MiB in {WHEELS}; with the "
          f"working tree ({tree / 2**20:.1f} MiB) a run sends {(wheels + tree) / 2**20:.1f} "
          f"of {TRAVEL_LIMIT_BYTES / 2**20:.0f} MiB")
    if wheels + tree > TRAVEL_LIMIT_BYTES:
        print("device-wheels: error: that is over what a run may send: carry fewer wheels or "
              "ignore large files the check does not read", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
