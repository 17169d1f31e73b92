"""The Debian side of the source build: installed packages and ``deb-src`` entries."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

Log = Callable[[str], None]  # where progress lines go
DEB_SRC_FILE = Path("/etc/apt/sources.list.d/ddm-deb-src.sources")
_APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}
#: The locks apt and dpkg take (fcntl locks on these files): another apt or dpkg holding one
#: (unattended-upgrades on a fresh machine, a second build) is waited for, not failed on.
APT_LOCKS = (Path("/var/lib/dpkg/lock-frontend"), Path("/var/lib/dpkg/lock"),
             Path("/var/lib/apt/lists/lock"), Path("/var/cache/apt/archives/lock"))
#: How long an apt command waits for those locks before it gives up.
LOCK_WAIT_S = 900.0
#: apt-get's own wait for dpkg's lock (`apt-get update` cannot wait for its lists' lock, which
#: :func:`wait_for_apt_locks` waits for first).
_APT_WAITS = ("-o", f"DPkg::Lock::Timeout={LOCK_WAIT_S:.0f}")


class AptError(RuntimeError):
    """A package or source entry is missing and could not be added; the message says why."""


def _run(cmd: Sequence[str], log: Log) -> None:
    """Run an ``apt-get`` command once apt's locks are free (and with apt-get waiting for
    dpkg's itself, should another process take it in between)."""
    wait_for_apt_locks(log)
    cmd = [cmd[0], *_APT_WAITS, *cmd[1:]]
    log("$ " + " ".join(cmd))
    result = subprocess.run(cmd, env={**os.environ, **_APT_ENV})
    if result.returncode != 0:
        raise AptError(f"command failed ({result.returncode}): {' '.join(cmd)}")


def _held(lock: Path) -> bool:
    """Whether another process holds ``lock`` (taking it for a moment to find out; a lock file
    that is missing or that we may not open is nobody's)."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EACCES, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)  # releases it
    return False


def wait_for_apt_locks(log: Log, *, locks: Sequence[Path] = APT_LOCKS,
                       timeout_s: float = LOCK_WAIT_S, poll_s: float = 1.0) -> None:
    """Return once no other process holds any of apt's and dpkg's ``locks``; AptError naming
    the lock still held after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    waiting_for = None
    while held := next((lock for lock in locks if _held(lock)), None):
        if time.monotonic() >= deadline:
            raise AptError(f"{held} is still held by another apt or dpkg after "
                           f"{timeout_s:.0f} s; wait for it to finish (or stop it), then run "
                           "this again")
        if held != waiting_for:
            log(f"waiting for {held}: another apt or dpkg holds it")
            waiting_for = held
        time.sleep(poll_s)


def missing_apt_packages(packages: Sequence[str]) -> list[str]:
    """The subset of ``packages`` that dpkg does not report as installed."""
    missing = []
    for name in packages:
        result = subprocess.run(
            ["dpkg-query", "-W", "-f=${db:Status-Status}", name],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0 or result.stdout.strip() != "installed":
            missing.append(name)
    return missing


def ensure_apt_packages(packages: Sequence[str], *, log: Log) -> None:
    """apt-get install what is missing; AptError if that needs root and we are not."""
    if shutil.which("dpkg-query") is None or shutil.which("apt-get") is None:
        raise AptError("this needs a Debian system with apt and dpkg")
    missing = missing_apt_packages(packages)
    if not missing:
        return
    if os.geteuid() != 0:
        raise AptError(
            "missing Debian packages; run as root: apt-get install -y " + " ".join(missing)
        )
    log("installing " + " ".join(missing))
    _run(["apt-get", "update"], log)
    _run(["apt-get", "install", "-y", "--no-install-recommends", *missing], log)


def _has_deb_src(source_package: str) -> bool:
    result = subprocess.run(
        ["apt-cache", "showsrc", "--only-source", source_package], capture_output=True, text=True
    )
    return result.returncode == 0 and f"Package: {source_package}" in result.stdout


def deb_src_stanzas(sources_dir: Path = Path("/etc/apt")) -> str:
    """deb822 ``deb-src`` stanzas mirroring the machine's Debian archive ``deb`` entries.

    Reads ``sources.list`` (one-line format) and ``sources.list.d/*.sources`` (deb822) and
    keeps only entries whose URI is a Debian archive, so third-party repositories without
    source indexes do not break ``apt-get update``.
    """
    stanzas: list[str] = []
    one_line = sources_dir / "sources.list"
    if one_line.is_file():
        for line in one_line.read_text().splitlines():
            parts = line.split("#", 1)[0].split()
            if len(parts) >= 4 and parts[0] == "deb" and "debian" in line:
                # `[signed-by=...]` options are dropped: the default keyring signs Debian.
                uri, suite, *components = [p for p in parts[1:] if not p.startswith("[")]
                stanzas.append(
                    f"Types: deb-src\nURIs: {uri}\nSuites: {suite}\n"
                    f"Components: {' '.join(components)}"
                )
    for path in sorted((sources_dir / "sources.list.d").glob("*.sources")):
        if path == DEB_SRC_FILE or path.name == DEB_SRC_FILE.name:
            continue
        for block in path.read_text().split("\n\n"):
            fields = {}
            for line in block.splitlines():
                if ":" in line and not line.startswith(("#", " ", "\t")):
                    key, value = line.split(":", 1)
                    if value.strip():  # an inline key block (continuation lines) is dropped
                        fields[key.strip()] = value.strip()
            types = fields.get("Types", "").split()
            if "deb" in types and "deb-src" not in types and "debian" in fields.get("URIs", ""):
                fields["Types"] = "deb-src"
                stanzas.append("\n".join(f"{k}: {v}" for k, v in fields.items()))
    return "\n\n".join(stanzas) + "\n"


def ensure_deb_src(source_package: str, *, log: Log) -> None:
    """Make ``apt-get source source_package`` work, adding deb-src entries if needed (root)."""
    if _has_deb_src(source_package):
        return
    if os.geteuid() != 0:
        raise AptError(f"apt has no deb-src entries; as root, add some (e.g. {DEB_SRC_FILE})")
    stanzas = deb_src_stanzas()
    if not stanzas.strip():
        raise AptError("found no Debian archive in /etc/apt to derive a deb-src entry from")
    log(f"adding deb-src entries in {DEB_SRC_FILE}")
    DEB_SRC_FILE.write_text(stanzas)
    _run(["apt-get", "update"], log)
    if not _has_deb_src(source_package):
        raise AptError(f"apt has no source package {source_package!r} even with deb-src entries")


def debian_mirror(sources_dir: Path = Path("/etc/apt")) -> str:
    """The URI of the machine's Debian archive (what debootstrap downloads from)."""
    for stanza in deb_src_stanzas(sources_dir).split("\n\n"):
        for line in stanza.splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    return "http://deb.debian.org/debian"
