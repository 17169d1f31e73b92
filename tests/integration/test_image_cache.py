"""The image cache does not grow with every rebuild: what a rebuild supersedes (the old image,
its archive) is pruned once a grace period is over, and nothing still named is touched; the
earlier stages of a Dockerfile stay cached however old they are. Real buildah on a cache of its
own, with tiny images committed and built from scratch."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from ddm_devcluster import images

pytestmark = pytest.mark.image

NAME = "localhost/ddm-test/tiny:1"


def _commit(cache: Path, version: int, *, created: float | None = None) -> str:
    """A two-kilobyte image named ``NAME`` (taking the name from any earlier one), made at
    ``created`` (default: now); its id."""
    env = images._buildah_env(cache)

    def buildah(*args: str) -> str:
        return subprocess.run(["buildah", *args], env=env, capture_output=True, text=True,
                              check=True).stdout.strip()

    container = buildah("from", "scratch")
    buildah("config", "--label", f"version={version}", container)
    stamp = () if created is None else ("--timestamp", str(int(created)))
    built = buildah("commit", "-q", *stamp, container, NAME)
    buildah("rm", container)
    return built


def _ids(cache: Path) -> set[str]:
    env = images._buildah_env(cache)
    listing = subprocess.run(["buildah", "images", "-a", "-q", "--no-trunc"], env=env,
                             capture_output=True, text=True, check=True).stdout
    return {line.strip().removeprefix("sha256:") for line in listing.splitlines() if line}


def _nameless(cache: Path) -> set[str]:
    """The images no name points at (intermediate layers left out)."""
    env = images._buildah_env(cache)
    listing = subprocess.run(["buildah", "images", "--json", "--no-trunc"], env=env,
                             capture_output=True, text=True, check=True).stdout
    return {i["id"].removeprefix("sha256:") for i in json.loads(listing or "[]")
            if not i.get("names")}


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


def test_an_old_image_superseded_now_is_kept_for_the_grace_from_then(cache: Path):
    """An image made long ago loses its name only now (a build that reused it from the cache,
    then a rebuild): another checkout may still be using it, so its hour starts now."""
    log: list[str] = []
    old = _commit(cache, 1, created=time.time() - 7200)
    new = _commit(cache, 2)
    images.prune_superseded(cache, log.append)
    assert {old, new} <= _ids(cache)
    images.prune_superseded(cache, log.append, grace_s=0)
    assert old not in _ids(cache) and new in _ids(cache)


def test_a_record_that_is_not_the_prunes_own_counts_every_image_from_now(cache: Path):
    log: list[str] = []
    old = _commit(cache, 1, created=time.time() - 7200)
    _commit(cache, 2)
    for garbage in ('{"sha256:%s": 0' % old, "[0]", '{"sha256:%s": "long ago"}' % old):
        (cache / "superseded.json").write_text(garbage)
        images.prune_superseded(cache, log.append)
        assert old in _ids(cache)
    assert json.loads((cache / "superseded.json").read_text())  # its own again


DOCKERFILE = """\
FROM scratch AS deps
COPY deps.txt /deps.txt

FROM scratch AS runtime
COPY --from=deps /deps.txt /deps.txt
COPY src.txt /src.txt
"""


def test_an_earlier_stage_stays_cached_when_the_image_it_made_is_superseded(cache: Path,
                                                                            tmp_path: Path):
    """The ``deps`` stage of images/cpu/Dockerfile installs PyTorch and JAX: a change under
    ``src/`` rebuilds the image, and pruning what it superseded must leave the stage cached."""
    context = tmp_path / "context"
    context.mkdir()
    (context / "Dockerfile").write_text(DOCKERFILE)
    (context / "deps.txt").write_text("the dependencies")
    log: list[str] = []

    def build(source: str) -> str:
        (context / "src.txt").write_text(source)
        return images.build_stages(context / "Dockerfile", context, NAME, family="tiny",
                                   cache=cache, log=log.append)

    first = build("version 1")
    deps = images.image_id(images.stage_name("tiny", "deps"), cache)
    second = build("version 2")
    images.prune_superseded(cache, log.append, grace_s=0)
    assert first not in _ids(cache) and second in _ids(cache)
    third = build("version 3")
    assert images.image_id(images.stage_name("tiny", "deps"), cache) == deps  # from the cache
    # and the whole build used it: no nameless stage image of its own beside what it superseded
    assert _nameless(cache) == {second} and third in _ids(cache)


def test_a_dockerfile_names_its_earlier_stages():
    assert images.dockerfile_stages(DOCKERFILE) == ["deps"]
    assert images.dockerfile_stages((images.repository_root() / images.CPU.dockerfile)
                                    .read_text()) == ["deps", "builder"]
    with pytest.raises(images.ImageError, match=r"stage 1 \(FROM scratch\) has no name"):
        images.dockerfile_stages("FROM scratch\nCOPY a /a\nFROM scratch AS runtime\n")
