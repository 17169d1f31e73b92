"""The image cache does not grow with every rebuild: what a rebuild supersedes (the old image,
its archive) is pruned once a grace period is over, and nothing still named is touched.
Real buildah on a cache of its own, with tiny images committed from scratch."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from ddm_devcluster import images

pytestmark = pytest.mark.image

NAME = "localhost/ddm-test/tiny:1"


def _commit(cache: Path, version: int) -> str:
    """A two-kilobyte image named ``NAME`` (taking the name from any earlier one); its id."""
    env = images._buildah_env(cache)

    def buildah(*args: str) -> str:
        return subprocess.run(["buildah", *args], env=env, capture_output=True, text=True,
                              check=True).stdout.strip()

    container = buildah("from", "scratch")
    buildah("config", "--label", f"version={version}", container)
    built = buildah("commit", "-q", container, NAME)
    buildah("rm", container)
    return built


def _ids(cache: Path) -> set[str]:
    env = images._buildah_env(cache)
    listing = subprocess.run(["buildah", "images", "-a", "-q", "--no-trunc"], env=env,
                             capture_output=True, text=True, check=True).stdout
    return {line.strip().removeprefix("sha256:") for line in listing.splitlines() if line}


@pytest.fixture
def cache(tmp_path: Path):
    yield tmp_path / "cache"
    env = images._buildah_env(tmp_path / "cache")
    subprocess.run(["buildah", "rmi", "--all", "--force"], env=env, capture_output=True)


def test_a_rebuild_supersedes_an_image_and_its_archive_which_go_after_the_grace(cache: Path):
    log: list[str] = []
    old = _commit(cache, 1)
    old_archive = images.oci_archive(NAME, cache, log.append)
    new = _commit(cache, 2)  # the rebuild takes the name
    new_archive = images.oci_archive(NAME, cache, log.append)
    assert old != new and {old, new} <= _ids(cache)

    images.prune_superseded(cache, log.append)  # within the grace: another import may run
    assert {old, new} <= _ids(cache) and old_archive.is_file()

    images.prune_superseded(cache, log.append, grace_s=0)
    assert old not in _ids(cache) and new in _ids(cache)
    assert not old_archive.exists() and new_archive.is_file()
    assert log[-1].startswith("pruned 1 superseded images and 0.0 GB of archives"), log


def test_an_archive_handed_out_again_is_kept_for_another_grace_period(cache: Path):
    log: list[str] = []
    first = _commit(cache, 1)
    archive = images.oci_archive(NAME, cache, log.append)
    _commit(cache, 2)  # supersedes the first
    two_hours_ago = time.time() - 7200
    os.utime(archive, (two_hours_ago, two_hours_ago))
    # another checkout imports the first image by its id: the same archive, in use again
    assert images.oci_archive(NAME, cache, log.append, source=first) == archive
    images.prune_superseded(cache, log.append)
    assert archive.is_file()
    os.utime(archive, (two_hours_ago, two_hours_ago))
    images.prune_superseded(cache, log.append)
    assert not archive.exists()
