"""checkov (PyPI, offline: ``--skip-download``) on the rendered chart and on the manifests the
operator builds for the shipped examples: a DDMDeployment's children, a DDMTraining's jobs and
their NetworkPolicies (as ``ddm render`` prints them, under the engine the example names).

Every failure must be accepted in docs/reliability.md's "checkov" table (check, resources as a
glob over checkov's ``Kind.namespace.name``, reason), and every accepted row must still match a
failure, so the table stays the true list. checkov comes with the ``dev`` extra; the test runs
the ``checkov`` next to this Python, or ``$CHECKOV``.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helm_tool import ensure_helm

from ddm.deploy.spec import load_manifest
from ddm.operator import names
from ddm.operator.children import desired_children
from ddm.operator.config import OperatorConfig
from ddm.operator.render import render_training
from ddm.deploy.training_spec import KIND as TRAINING_KIND
from tests.support.examples import deployment_examples, examples_of

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reliability.md"
#: The chart's value sets checked: its defaults with the example, and namespaced RBAC.
CHART_VALUES = (("example.enabled=true",), ("watchNamespaces={team-a,team-b}",))
#: The operator as the chart runs it, with Prometheus admitted to the metrics port; the
#: examples' objects in a namespace of their own.
CONFIG = OperatorConfig(router_auth=True, network_policy=True, metrics_from=(
    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},))
NAMESPACE = "ddm-users"


def _checkov() -> str:
    found = (os.environ.get("CHECKOV")
             or shutil.which("checkov", path=str(Path(sys.executable).parent))
             or shutil.which("checkov"))
    if not found:
        message = "checkov is not installed (pip install -e '.[dev]')"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return found


def accepted() -> list[tuple[str, str, str]]:
    """(check, resource glob, reason) from the doc's "checkov" table."""
    section = DOC.read_text().split("\n## checkov\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(CKV2?_K8S_\d+)` \| `([^`]+)` \| [^|]+ \| (.+) \|$", section, re.M)
    assert rows, "no accepted checks found in the doc's table"
    return rows


def _write_objects(directory: Path) -> None:
    helm = ensure_helm()
    for index, values in enumerate(CHART_VALUES):
        command = [str(helm), "template", "ddm", str(ROOT / "charts" / "ddm-operator"),
                   "--namespace", "ddm-system"]
        for value in values:
            command += ["--set", value]
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        (directory / f"chart-{index}.yaml").write_text(done.stdout)
    for example in deployment_examples():
        manifest = load_manifest(example, allow_host_paths=False)
        owner = {"apiVersion": names.API_VERSION, "kind": names.KIND,
                 "metadata": {"name": manifest.name, "namespace": NAMESPACE, "uid": "0"}}
        objects = desired_children(manifest.spec, owner, CONFIG, lambda: "not-a-real-token")
        (directory / f"operator-{example.stem}.yaml").write_text(yaml.safe_dump_all(objects))
    for example in examples_of(TRAINING_KIND):
        jobs = render_training(yaml.safe_load(example.read_text()), CONFIG, namespace=NAMESPACE)
        (directory / f"training-{example.stem}.yaml").write_text(yaml.safe_dump_all(
            [job for job in jobs if job["kind"] in ("Job", "NetworkPolicy")]))


def test_checkov_finds_nothing_but_the_accepted_failures(tmp_path: Path) -> None:
    checkov = _checkov()
    _write_objects(tmp_path)
    done = subprocess.run([checkov, "--directory", str(tmp_path), "--framework", "kubernetes",
                           "--skip-download", "--quiet", "--compact", "--output", "json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr  # 1: some check failed
    reports = json.loads(done.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failures = {(f["check_id"], f["resource"]) for report in reports
                for f in report["results"]["failed_checks"]}
    passed = sum(report["summary"]["passed"] for report in reports)
    assert passed > 100, "checkov checked almost nothing: were the files read?"
    rules = accepted()
    unexplained = sorted(f for f in failures
                         if not any(f[0] == check and fnmatch.fnmatchcase(f[1], glob)
                                    for check, glob, _ in rules))
    assert not unexplained, f"failures not accepted in {DOC.name}: {unexplained}"
    stale = [(check, glob) for check, glob, _ in rules
             if not any(f[0] == check and fnmatch.fnmatchcase(f[1], glob) for f in failures)]
    assert not stale, f"accepted in {DOC.name} but no longer failing: {stale}"
