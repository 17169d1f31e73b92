"""Find or build the control-plane binaries: kube-apiserver, kube-controller-manager,
kube-scheduler (one Kubernetes release, from one place) and etcd.

Lookup order for the three Kubernetes binaries, all three from the same directory so that
their versions match:

1. ``$KUBEBUILDER_ASSETS`` (envtest assets usually hold only kube-apiserver and etcd, so this
   directory is used only when it has all three);
2. ``$PATH``;
3. the build cache, ``$DDM_KUBE_CACHE`` (default ``~/.cache/ddm/kube``) ``/v1.20.2/bin``.

If none has them, ``ensure_binaries`` builds them from Debian bookworm's ``kubernetes``
source package (1.20.2, vendored dependencies) with Debian's Go 1.19, after replacing the
vendored ``github.com/modern-go/reflect2`` v1.0.1 by Debian's v1.0.2: v1.0.1 predates
Go 1.18 and crashes the API server ("fatal error: fault") on its first JSON encoding of a
map. Each step leaves a stamp file in the work directory, so an interrupted build resumes
where it stopped; a file lock keeps two builds from running at once.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ddm_devcluster.apt import AptError, Log, ensure_apt_packages, ensure_deb_src

KUBE_VERSION = "1.20.2"
KUBE_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
# The real node's binaries, built in the same `make` from the same tree (versions match).
NODE_BINARIES = ("kubelet", "kube-proxy")
ALL_BINARIES = KUBE_BINARIES + NODE_BINARIES
# What the source build needs from Debian; ``openssl`` is what `cluster` uses for certificates.
APT_PACKAGES = (
    "golang-go",
    "rsync",
    "make",
    "etcd-server",
    "golang-github-modern-go-reflect2-dev",
    "dpkg-dev",
    "openssl",
)
REFLECT2_SYSTEM = Path("/usr/share/gocode/src/github.com/modern-go/reflect2")


def log_stderr(message: str) -> None:
    """Default progress printer: one line on stderr."""
    print(f"[ddm-dev-cluster] {message}", file=sys.stderr, flush=True)


class BuildError(RuntimeError):
    """The binaries are not available and could not be built; the message says why."""


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of the control-plane executables; ``origin`` says where they came from."""

    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    etcd: Path
    origin: str


def cache_root() -> Path:
    """``$DDM_KUBE_CACHE`` or ``~/.cache/ddm/kube``; one subdirectory per Kubernetes version."""
    env = os.environ.get("DDM_KUBE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ddm" / "kube"


def cache_bin_dir(root: Path | None = None) -> Path:
    """Where a finished build's binaries live."""
    return (root or cache_root()) / f"v{KUBE_VERSION}" / "bin"


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _trio_in(directory: Path) -> tuple[Path, Path, Path] | None:
    paths = tuple(directory / name for name in KUBE_BINARIES)
    return paths if all(_executable(p) for p in paths) else None  # type: ignore[return-value]


def _trio_on_path() -> tuple[Path, Path, Path] | None:
    found = [shutil.which(name) for name in KUBE_BINARIES]
    if all(found):
        return tuple(Path(p).resolve() for p in found)  # type: ignore[arg-type,return-value]
    return None


def _find_etcd(preferred: Sequence[Path]) -> Path | None:
    for directory in preferred:
        if _executable(directory / "etcd"):
            return directory / "etcd"
    on_path = shutil.which("etcd")
    if on_path:
        return Path(on_path).resolve()
    return Path("/usr/bin/etcd") if _executable(Path("/usr/bin/etcd")) else None


def find_binaries(cache: Path | None = None) -> Binaries | None:
    """The binaries already on this machine (see the module docstring for the order), or None."""
    assets_env = os.environ.get("KUBEBUILDER_ASSETS")
    assets = Path(assets_env).expanduser() if assets_env else None
    candidates: list[tuple[str, tuple[Path, Path, Path] | None, list[Path]]] = []
    if assets is not None:
        candidates.append(("KUBEBUILDER_ASSETS", _trio_in(assets), [assets]))
    candidates.append(("PATH", _trio_on_path(), [assets] if assets else []))
    bin_dir = cache_bin_dir(cache)
    candidates.append(("cache", _trio_in(bin_dir), [bin_dir] + ([assets] if assets else [])))
    for origin, trio, etcd_dirs in candidates:
        if trio is None:
            continue
        etcd = _find_etcd([trio[0].parent, *etcd_dirs])
        if etcd is not None:
            return Binaries(*trio, etcd=etcd, origin=origin)
    return None


def ensure_binaries(
    cache: Path | None = None, *, allow_build: bool = True, log: Log = log_stderr
) -> Binaries:
    """Return the control-plane binaries, building (and apt-installing the tools) if needed.

    Raises BuildError when they are missing and ``allow_build`` is False, or the build fails.
    """
    found = find_binaries(cache)
    if found is not None:
        return found
    if not allow_build:
        raise BuildError(
            "kube-apiserver, kube-controller-manager and kube-scheduler were not found in "
            f"$KUBEBUILDER_ASSETS, on $PATH or in {cache_bin_dir(cache)}; "
            "run `ddm-dev-cluster build`"
        )
    build_from_debian_source(cache, log=log)
    found = find_binaries(cache)
    if found is None:
        raise BuildError(f"build finished but binaries are still missing in {cache_bin_dir(cache)}")
    return found


# --- the source build -------------------------------------------------------------------


def _run(cmd: Sequence[str], log: Log, **kwargs: object) -> None:
    log("$ " + " ".join(cmd))
    result = subprocess.run(list(cmd), **kwargs)  # type: ignore[call-overload]
    if result.returncode != 0:
        raise BuildError(f"command failed ({result.returncode}): {' '.join(cmd)}")


def _stamp(work: Path, step: str) -> Path:
    return work / f".ddm-{step}.done"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_from_debian_source(cache: Path | None = None, *, log: Log = log_stderr) -> Path:
    """Build the three Kubernetes binaries into the cache's ``bin`` directory and return it.

    Needs Debian (bookworm) with apt; installs APT_PACKAGES when missing (as root only).
    Takes about 7 minutes on 2 cores the first time; resumes after an interruption.
    """
    version_dir = (cache or cache_root()) / f"v{KUBE_VERSION}"
    work = version_dir / "work"
    bin_dir = version_dir / "bin"
    with _locked(version_dir / "build.lock"):
        try:
            _build_locked(work, bin_dir, log)
        except AptError as error:
            raise BuildError(str(error)) from error
    return bin_dir


def _all_in(directory: Path) -> bool:
    return all(_executable(directory / name) for name in ALL_BINARIES)


def _build_locked(work: Path, bin_dir: Path, log: Log) -> None:
    if _all_in(bin_dir):  # built before (or by another process while we waited)
        ensure_apt_packages(("etcd-server",), log=log)  # the one runtime dependency
        return
    started = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    ensure_apt_packages(APT_PACKAGES, log=log)
    source = _fetch_source(work, log)
    _patch_reflect2(source, work, log)
    _make(source, work, log)
    _install(source, bin_dir, log)
    log(f"built Kubernetes v{KUBE_VERSION} in {time.monotonic() - started:.0f} s -> {bin_dir}")


def _fetch_source(work: Path, log: Log) -> Path:
    """``apt-get source kubernetes`` into ``work/src``; returns the unpacked source root."""
    src = work / "src"
    if _stamp(work, "source").is_file():
        return Path(_stamp(work, "source").read_text().strip())
    ensure_deb_src("kubernetes", log=log)
    if src.exists():  # a previous attempt was interrupted while unpacking: start over
        shutil.rmtree(src)
    src.mkdir(parents=True)
    log(f"downloading the Debian source package kubernetes into {src}")
    # bookworm's version string is 1.20.5+really1.20.2-1.1+deb12u1: the 1.20.2 tree.
    _run(["apt-get", "source", "--only-source", "kubernetes"], log, cwd=src)
    roots = [p for p in src.iterdir() if p.is_dir() and (p / "cmd" / "kube-apiserver").is_dir()]
    if len(roots) != 1 or KUBE_VERSION not in roots[0].name:
        raise BuildError(f"expected one unpacked Kubernetes {KUBE_VERSION} tree in {src}: {roots}")
    _stamp(work, "source").write_text(str(roots[0]))
    return roots[0]


def _patch_reflect2(source: Path, work: Path, log: Log) -> None:
    """Replace vendored reflect2 v1.0.1 with Debian's v1.0.2 (Go 1.18+ map iteration)."""
    if _stamp(work, "reflect2").is_file():
        return
    vendored = source / "vendor" / "github.com" / "modern-go" / "reflect2"
    if not vendored.is_dir() or not REFLECT2_SYSTEM.is_dir():
        raise BuildError(f"cannot patch reflect2: {vendored} or {REFLECT2_SYSTEM} is missing")
    log(f"replacing {vendored} with {REFLECT2_SYSTEM} (v1.0.2)")
    for old in vendored.iterdir():
        if old.suffix in (".go", ".s"):
            old.unlink()
    for new in REFLECT2_SYSTEM.iterdir():
        if new.suffix in (".go", ".s") and not new.name.endswith("_test.go"):
            shutil.copyfile(new, vendored / new.name)
    _stamp(work, "reflect2").write_text("v1.0.2\n")


def _go_root() -> Path:
    """Debian's Go 1.19 (golang-go), ahead of any other Go on PATH: Kubernetes 1.20 needs it."""
    for candidate in (Path("/usr/lib/go-1.19"), Path("/usr/lib/go")):
        if _executable(candidate / "bin" / "go"):
            return candidate
    raise BuildError("Go not found in /usr/lib/go-1.19 or /usr/lib/go (apt-get install golang-go)")


def _make(source: Path, work: Path, log: Log) -> None:
    # "make-node": builds from before the real node made only the control plane's three.
    if _stamp(work, "make-node").is_file():
        return
    gopath = work / "gopath"
    link = gopath / "src" / "k8s.io" / "kubernetes"
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() and link.resolve() != source.resolve():
        link.unlink()
    if not link.is_symlink():
        link.symlink_to(source)
    env = {
        **os.environ,
        "GOPATH": str(gopath),
        "CGO_ENABLED": "0",
        "PATH": f"{_go_root() / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "KUBE_GIT_VERSION": f"v{KUBE_VERSION}",
        "KUBE_GIT_TREE_STATE": "clean",
    }
    targets = " ".join(f"cmd/{name}" for name in ALL_BINARIES)
    # Kubernetes' scripts keep Go's build cache in _output/local/go/cache: a rerun after an
    # interruption is incremental.
    log(f"compiling {targets} (about 12 minutes on 2 idle cores)")
    _run(["make", f"WHAT={targets}"], log, cwd=link, env=env)
    _stamp(work, "make-node").write_text("ok\n")


def _install(source: Path, bin_dir: Path, log: Log) -> None:
    built = source / "_output" / "bin"
    if not _all_in(built):
        built = source / "_output" / "local" / "bin" / "linux" / "amd64"
    if not _all_in(built):
        raise BuildError(f"make succeeded but the binaries are not in {source / '_output'}")
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in ALL_BINARIES:
        partial = bin_dir / f".{name}.partial"
        shutil.copy2(built / name, partial)
        partial.replace(bin_dir / name)  # atomic: a reader never sees half a binary
    log(f"installed {', '.join(ALL_BINARIES)} in {bin_dir}")
