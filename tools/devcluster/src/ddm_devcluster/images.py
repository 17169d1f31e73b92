"""The project's container images, built here without a registry or a Docker engine.

``buildah`` builds them into its own storage under the image cache (``$DDM_IMAGE_CACHE``,
default ``~/.cache/ddm/images``), so that a second build reuses every unchanged layer:

* the pod sandbox image (``pause``): a static C program of a dozen lines, compiled with gcc;
* the base image: Debian bookworm with python3 from ``debootstrap --variant=minbase`` (the
  Dockerfiles' default ``python:3.12-slim-bookworm`` lives on a registry we cannot reach; the
  Dockerfiles take their base as the ``PYTHON_IMAGE`` build argument);
* the project's images: ``images/operator/Dockerfile`` and ``images/cpu/Dockerfile`` (and
  ``Dockerfile.cuda`` on request) with
  ``buildah bud --layers --network host``. Host networking keeps buildah from enabling the
  host's ip_forward and adding iptables chains, and its network configuration directory is in
  the cache too (not ``/etc/cni``). pip inside a RUN step sees the host's CA
  bundle and the host's pip configuration (index, extra indexes, wheelhouse), mounted
  read-only, so the build installs what the host's pip would.

The node's containerd gets them through an OCI archive (``ctr images import``), named as the
chart and the operator name them by default (``ghcr.io/ddm-operator/ddm:0.1.0``, the published
names), so pods find them present and never pull.
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ddm_devcluster.apt import Log, debian_mirror, ensure_apt_packages

VERSION = "0.1.0"  # the chart's appVersion: the tag the chart's images default to
#: The chart's default registry (``ddm.operator.config.REGISTRY``; tests/unit/test_release.py
#: pins them equal): built under the published names, the images need no chart setting.
REGISTRY = "ghcr.io/ddm-operator"
BASE_IMAGE = "localhost/ddm-dev/bookworm-python:3.11"
PAUSE_IMAGE = "localhost/ddm-dev/pause:1"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
APT_PACKAGES = ("buildah", "debootstrap", "gcc", "libc6-dev", "containerd")
DEBOOTSTRAP_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")


class ImageError(RuntimeError):
    """An image could not be built or imported; the message says which step and why."""


@dataclass(frozen=True)
class ProjectImage:
    """One of the project's images: its Dockerfile (from the repository root) and its name."""

    family: str
    dockerfile: str
    name: str  # the chart's default, fully qualified
    # Whether pip may use the host's wheelhouse (``find-links``). The host's holds the CPU
    # build of torch, which satisfies the pin ``torch==2.13.0`` too: the CUDA image must not
    # see it.
    wheelhouse: bool = True


CPU = ProjectImage("cpu", "images/cpu/Dockerfile", f"{REGISTRY}/ddm:{VERSION}")
#: The operator alone, no ML framework: what the chart's operator Deployment runs.
OPERATOR = ProjectImage("operator", "images/operator/Dockerfile",
                        f"{REGISTRY}/ddm-operator:{VERSION}")
CUDA = ProjectImage("cuda", "Dockerfile.cuda", f"{REGISTRY}/ddm-cuda:{VERSION}",
                    wheelhouse=False)
PROJECT_IMAGES = {image.family: image for image in (CPU, OPERATOR, CUDA)}
#: What the chart runs on a CPU-only cluster (``ddm-dev-cluster images`` builds these).
CHART_IMAGES = (OPERATOR, CPU)
#: A superseded image (its name now points at a newer build) and its archive are deleted
#: once this old: a build from another checkout sharing the cache may still be importing it.
SUPERSEDED_GRACE_S = 3600.0
#: Where the Dockerfiles' earlier stages are named (:func:`build_stages`).
STAGES = "localhost/ddm-dev/stages"


def cache_dir() -> Path:
    """``$DDM_IMAGE_CACHE`` or ``~/.cache/ddm/images``."""
    env = os.environ.get("DDM_IMAGE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ddm" / "images"


def repository_root() -> Path:
    """The checkout this package runs from (the images' build context)."""
    root = Path(__file__).resolve().parents[4]  # tools/devcluster/src/ddm_devcluster
    if not (root / CPU.dockerfile).is_file():
        raise ImageError(f"{root} is not a checkout of the project (no {CPU.dockerfile}); "
                         "images are built from a source checkout")
    return root


def _buildah_env(cache: Path) -> dict[str, str]:
    """buildah's storage (layers, images), network configuration and temporary files, all
    under ``cache``: left to its defaults, buildah makes ``/etc/cni/net.d`` (with a lock file)
    on the host at its first ``from`` or ``bud``, even with host networking."""
    storage, containers = cache / "storage.conf", cache / "containers.conf"
    cache.mkdir(parents=True, exist_ok=True)
    if not storage.is_file():
        storage.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{cache / "storage"}"\n'
                           f'runroot = "{cache / "run"}"\n')
    if not containers.is_file():
        containers.write_text(f'[network]\nnetwork_config_dir = "{cache / "cni"}"\n')
    (cache / "tmp").mkdir(parents=True, exist_ok=True)
    return {**os.environ, "CONTAINERS_STORAGE_CONF": str(storage),
            "CONTAINERS_CONF": str(containers), "TMPDIR": str(cache / "tmp")}


def _run(cmd: Sequence[str], log: Log, *, env: dict[str, str], quiet: bool = False,
         **kwargs: object) -> str:
    log("$ " + " ".join(cmd))
    result = subprocess.run(list(cmd), env=env, text=True,  # type: ignore[call-overload]
                            stdout=subprocess.PIPE if quiet else None, **kwargs)
    if result.returncode != 0:
        raise ImageError(f"command failed ({result.returncode}): {' '.join(cmd)}")
    return result.stdout or ""


def _has_image(name: str, env: dict[str, str]) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", name], env=env,
                          capture_output=True).returncode == 0


def image_id(name: str, cache: Path | None = None) -> str:
    """The id of ``name`` in buildah's storage under ``cache``."""
    env = _buildah_env(cache or cache_dir())
    result = subprocess.run(["buildah", "inspect", "--type", "image", "--format",
                             "{{.FromImageID}}", name], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise ImageError(f"no image {name} in {cache or cache_dir()}: run `ddm-dev-cluster images`")
    return result.stdout.strip()


def ensure_pause(cache: Path, log: Log) -> None:
    """The pod sandbox image: a static ``pause`` that waits for SIGTERM and reaps zombies."""
    env = _buildah_env(cache)
    if _has_image(PAUSE_IMAGE, env):
        return
    work = Path(tempfile.mkdtemp(dir=cache / "tmp"))
    try:
        source = work / "pause.c"
        source.write_text(resources.files("ddm_devcluster").joinpath("pause.c").read_text())
        _run(["gcc", "-Os", "-static", "-o", str(work / "pause"), str(source)], log, env=env)
        container = _run(["buildah", "from", "scratch"], log, env=env, quiet=True).strip()
        try:
            _run(["buildah", "copy", container, str(work / "pause"), "/pause"], log, env=env,
                 quiet=True)
            _run(["buildah", "config", "--entrypoint", '["/pause"]', "--cmd", "[]", container],
                 log, env=env)
            _run(["buildah", "commit", "-q", container, PAUSE_IMAGE], log, env=env, quiet=True)
        finally:
            subprocess.run(["buildah", "rm", container], env=env, capture_output=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def ensure_base(cache: Path, log: Log) -> None:
    """Debian bookworm + python3 from debootstrap, committed as one layer (once per cache)."""
    env = _buildah_env(cache)
    if _has_image(BASE_IMAGE, env):
        return
    started = time.monotonic()
    rootfs = cache / "rootfs" / "bookworm-python"
    if rootfs.exists():  # an interrupted debootstrap: start over
        shutil.rmtree(rootfs)
    rootfs.parent.mkdir(parents=True, exist_ok=True)
    log("debootstrap of Debian bookworm with python3 (about 3 minutes)")
    _run(["debootstrap", "--variant=minbase", f"--include={','.join(DEBOOTSTRAP_PACKAGES)}",
          "bookworm", str(rootfs), debian_mirror()], log, env=env, quiet=True)
    for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for path in (rootfs / leftover).glob("*"):
            if path.is_file():
                path.unlink()
    container = _run(["buildah", "from", "scratch"], log, env=env, quiet=True).strip()
    try:
        mount = _run(["buildah", "mount", container], log, env=env, quiet=True).strip()
        _run(["cp", "-a", f"{rootfs}/.", f"{mount}/"], log, env=env)
        _run(["buildah", "umount", container], log, env=env, quiet=True)
        _run(["buildah", "config", "--env",
              "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
              "--env", "LANG=C.UTF-8", "--cmd", '["python3"]', container], log, env=env)
        _run(["buildah", "commit", "-q", container, BASE_IMAGE], log, env=env, quiet=True)
    finally:
        subprocess.run(["buildah", "rm", container], env=env, capture_output=True)
    shutil.rmtree(rootfs)
    log(f"base image {BASE_IMAGE} in {time.monotonic() - started:.0f} s")


# -- pip inside the build -----------------------------------------------------------------------

def host_pip_settings() -> dict[str, str]:
    """The host pip's effective settings (``pip config list`` then ``PIP_*``), key -> value."""
    result = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                            text=True)
    settings: dict[str, str] = {}
    for line in result.stdout.splitlines():
        key, _, value = line.partition("=")
        if "." in key and value:
            settings[key.split(".", 1)[1]] = value.strip().strip("'\"")
    return settings


def build_pip_config(settings: dict[str, str], *, wheelhouse: bool = True
                     ) -> tuple[str, list[Path]]:
    """The pip.conf a RUN step gets, and the local directories it names (mounted read-only).

    The Dockerfiles' own ``--index-url`` replaces pip's index, so the host's index (PyPI when
    it sets none) joins the extra indexes; the CA bundle is the host's, mounted at its path.
    """
    extra = settings.get("extra-index-url", "").split()
    index = settings.get("index-url", "https://pypi.org/simple")
    find_links = settings.get("find-links", "").split() if wheelhouse else []
    config = configparser.ConfigParser()
    config["global"] = {"extra-index-url": " ".join([index, *extra]), "cert": str(CA_BUNDLE),
                        "timeout": settings.get("default-timeout", "60")}
    if find_links:
        config["global"]["find-links"] = " ".join(find_links)
    # A local index's pages link to its files with relative paths (../../files/...): mount the
    # directory above its ``simple/``.
    local = [Path(u.removeprefix("file://")).parent for u in [*extra, index]
             if u.startswith("file://")]
    local += [Path(p.removeprefix("file://")) for p in find_links if "://" not in p
              or p.startswith("file://")]
    text = "\n".join(f"{k} = {v}" for k, v in config["global"].items())
    return f"[global]\n{text}\n", [p for p in local if p.exists()]


def build_project_image(image: ProjectImage, *, repo: Path | None = None,
                        cache: Path | None = None, log: Log) -> str:
    """Build ``image`` on the debootstrap base; returns the id of what was built. Import that
    id, not the name: a build from another checkout sharing the cache may retag the name in
    the meantime."""
    cache = cache or cache_dir()
    repo = repo or repository_root()
    ensure_apt_packages(APT_PACKAGES, log=log)
    ensure_base(cache, log)
    pip_conf_text, local_dirs = build_pip_config(host_pip_settings(),
                                                 wheelhouse=image.wheelhouse)
    pip_conf = cache / f"pip-{image.family}.conf"
    pip_conf.write_text(pip_conf_text)
    volumes = [f"{CA_BUNDLE}:{CA_BUNDLE}:ro", f"{pip_conf}:/etc/pip.conf:ro",
               *(f"{d}:{d}:ro" for d in local_dirs)]
    started = time.monotonic()
    log(f"building {image.name} from {image.dockerfile} (cold: 8 to 10 minutes; "
        "a change under src/: 2 to 3)")
    built = build_stages(repo / image.dockerfile, repo, image.name, family=image.family,
                         cache=cache, log=log,
                         args=["--network", "host", "--build-arg", f"VERSION={VERSION}",
                               "--build-arg", f"PYTHON_IMAGE={BASE_IMAGE}",
                               *(a for v in volumes for a in ("-v", v))])
    log(f"built {image.name} ({built[:12]}) in {time.monotonic() - started:.0f} s")
    prune_superseded(cache, log)
    return built


def dockerfile_stages(dockerfile: str) -> list[str]:
    """The names of a Dockerfile's stages (``FROM image AS name``) before its last, in order;
    an unnamed one there is refused, since its cache could not be kept (:func:`build_stages`)."""
    froms = [line.split() for line in dockerfile.splitlines()
             if line.split()[:1] and line.split()[0].upper() == "FROM"]
    stages = []
    for number, words in enumerate(froms[:-1], 1):
        words = [w for w in words if not w.startswith("--")]  # --platform=...
        if len(words) != 4 or words[2].upper() != "AS":
            raise ImageError(f"stage {number} ({' '.join(words)}) has no name: write "
                             "`FROM image AS name` so that its cached layers can be kept")
        stages.append(words[3])
    return stages


def stage_name(family: str, stage: str) -> str:
    """The name an earlier stage's image is kept under in the cache."""
    return f"{STAGES}/{family}-{stage}:{VERSION}"


def build_stages(dockerfile: Path, context: Path, name: str, *, family: str, cache: Path,
                 log: Log, args: Sequence[str] = ()) -> str:
    """``buildah bud --layers`` of ``dockerfile``, each earlier stage first on its own and
    named (:func:`stage_name`), then the whole file as ``name``; returns the id built.

    buildah leaves the last image of an earlier stage nameless (the ``deps`` stage that
    installs PyTorch and JAX), so :func:`prune_superseded` would remove it and, with it, the
    cached layers of every step before it: the next build would install them again. Named, it
    stays until a change to the stage (``pyproject.toml``) supersedes it. The whole build
    then finds each stage in the cache."""
    env = _buildah_env(cache)
    bud = ["buildah", "bud", "--layers", "--pull=never", *args, "-f", str(dockerfile)]
    for stage in dockerfile_stages(dockerfile.read_text()):
        _run([*bud, "--target", stage, "-t", stage_name(family, stage), str(context)], log,
             env=env)
    with tempfile.TemporaryDirectory(dir=cache / "tmp") as work:
        iidfile = Path(work) / "iid"
        _run([*bud, "-t", name, "--iidfile", str(iidfile), str(context)], log, env=env)
        return iidfile.read_text().strip().removeprefix("sha256:")


def prune_superseded(cache: Path, log: Log, *, grace_s: float = SUPERSEDED_GRACE_S) -> None:
    """Delete what earlier builds left behind, once superseded for ``grace_s``: images no name
    points at any more (a rebuild took their name; buildah removes their now unused
    intermediate layers with them) and the archives of images no name points at (unused:
    :func:`oci_archive` refreshes an archive's time whenever it hands it out). Without this
    every change under ``src/`` leaves a 0.6 GB archive (CUDA: 3.4 GB) and a layer behind.

    An image's time counts from the first prune that found it nameless (kept in
    ``superseded.json`` in the cache), not from its creation: a build that finds an image in
    the cache reuses it as old as it is, and it may lose its name years after it was made."""
    env = _buildah_env(cache)
    listing = _run(["buildah", "images", "--json", "--no-trunc"], log, env=env, quiet=True)
    images = json.loads(listing or "null") or []
    now = time.time()
    cutoff = now - grace_s
    named = {i["id"].removeprefix("sha256:") for i in images if i.get("names")}
    record = cache / "superseded.json"
    known = _first_seen(record)
    seen = {i["id"]: known.get(i["id"], now) for i in images if not i.get("names")}
    removed = 0
    for old in [i for i, since in seen.items() if since <= cutoff]:
        # one at a time: one that cannot go must not keep the others
        result = subprocess.run(["buildah", "rmi", old], env=env, capture_output=True, text=True)
        if result.returncode == 0:
            removed += 1
            del seen[old]
        else:
            log(f"kept superseded image {old.removeprefix('sha256:')[:12]}: "
                f"{result.stderr.strip()}")
    partial = record.with_name(f"{record.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(seen, indent=1))
    partial.replace(record)
    freed = 0
    for archive in (cache / "archives").glob("*.oci.tar"):
        image = archive.name.removesuffix(".oci.tar")
        if not any(i.startswith(image) for i in named) and archive.stat().st_mtime <= cutoff:
            freed += archive.stat().st_size
            archive.unlink(missing_ok=True)
    if removed or freed:
        log(f"pruned {removed} superseded images and {freed / 1e9:.1f} GB of archives "
            f"unused for {grace_s / 3600:g} h")


def _first_seen(record: Path) -> dict[str, float]:
    """:func:`prune_superseded`'s record: when it first found each image nameless. None yet,
    or one cut short or not its own: every nameless image counts from now."""
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {image: float(since) for image, since in data.items()
            if isinstance(since, (int, float)) and not isinstance(since, bool)}


def oci_archive(name: str, cache: Path, log: Log, source: str | None = None) -> Path:
    """An OCI archive of image ``source`` (an id; default: what ``name`` names now) named
    ``name``, kept per image id, so that an unchanged image is exported once."""
    env = _buildah_env(cache)
    source = source or name
    archive = cache / "archives" / f"{image_id(source, cache)[:20]}.oci.tar"
    if not archive.is_file():
        archive.parent.mkdir(parents=True, exist_ok=True)
        # Per process: two clusters starting at once may both export the same image.
        partial = archive.with_name(f"{archive.name}.{os.getpid()}.partial")
        partial.unlink(missing_ok=True)
        _run(["buildah", "push", "-q", "--disable-compression", source,
              f"oci-archive:{partial}:{name}"], log, env=env, quiet=True)
        partial.replace(archive)
    os.utime(archive)  # in use: kept by prune_superseded for another grace period
    return archive


def import_into_containerd(names: Sequence[str], ctr: Sequence[str], *,
                           cache: Path | None = None, ids: Mapping[str, str] | None = None,
                           log: Log) -> None:
    """Put images from buildah's storage into a containerd (namespace k8s.io); ``ctr`` is the
    command line of a ctr that talks to it (`ddm_devcluster.realnode.NodeLayout.ctr`). ``ids``
    maps a name to the image id to import under it (what :func:`build_project_image`
    returned); other names are imported as they name an image now."""
    cache = cache or cache_dir()
    for name in names:
        started = time.monotonic()
        archive = oci_archive(name, cache, log, (ids or {}).get(name))
        _run([*ctr, "-n", "k8s.io", "images", "import", str(archive)], log,
             env=dict(os.environ), quiet=True)
        log(f"imported {name} into the node's containerd in {time.monotonic() - started:.0f} s")
