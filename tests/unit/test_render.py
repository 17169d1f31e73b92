"""``ddm render MANIFEST``: every object the operator would create, as a YAML stream, under the
chart's defaults (tests/integration/test_operator_render.py compares it with what the operator
creates on the real API server)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from ddm.cli import main
from ddm.operator import names
from ddm.operator.config import OperatorConfig
from ddm.operator.policy import repository
from ddm.operator.render import CHART_DEFAULTS, PLACEHOLDER_TOKEN, PLACEHOLDER_UID
from tests.support.hostile_tenants import HOSTILE, hostile_spec

ROOT = Path(__file__).resolve().parents[2]
MNIST = ROOT / "examples" / "mnist.yaml"
#: The repositories of the operator's default images, which a spec's images may be of.
OWN = ", ".join(sorted({repository(image) for image in OperatorConfig().images.by_family.values()}))


def _render(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
            *args: str, env: dict[str, str] | None = None) -> tuple[int, list[dict], str]:
    for key in [k for k in os.environ if k.startswith("DDM_")]:
        monkeypatch.delenv(key)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    status = main(["render", *args])
    out, err = capsys.readouterr()
    return status, [d for d in yaml.safe_load_all(out) if d] if status == 0 else [], err


def test_render_prints_every_child_of_the_mnist_example(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    status, objects, _ = _render(capsys, monkeypatch, str(MNIST))
    assert status == 0
    experts = [f"mnist-expert-mnist-cluster-{i}" for i in range(4)]
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("Secret", names.router_token_name("mnist", PLACEHOLDER_UID)),
        ("Secret", names.expert_token_name("mnist", PLACEHOLDER_UID)),
        ("NetworkPolicy", "mnist-experts"), ("NetworkPolicy", "mnist-router"),
        *[(kind, e) for e in experts for kind in ("Service", "Deployment")],
        ("ConfigMap", "mnist-router-config"), ("Service", "mnist-router"),
        ("Deployment", "mnist-router")]
    for obj in objects:
        assert obj["metadata"]["namespace"] == "default"
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("DDMDeployment", "mnist",
                                                                PLACEHOLDER_UID)
        if obj["kind"] == "Secret":
            assert obj["immutable"] is True and obj["stringData"] == {"token": PLACEHOLDER_TOKEN}
        else:
            assert names.SPEC_HASH_ANNOTATION in obj["metadata"]["annotations"]


def test_render_follows_the_operators_settings_and_namespace(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    status, objects, _ = _render(capsys, monkeypatch, str(MNIST), "--namespace", "team-a",
                                 env={"DDM_NETWORK_POLICY": "false", "DDM_ROUTER_AUTH": "false"})
    assert status == 0
    assert {o["kind"] for o in objects} == {"Service", "Deployment", "ConfigMap"}
    assert {o["metadata"]["namespace"] for o in objects} == {"team-a"}


def test_a_stores_credentials_file_is_mounted_into_the_stagers_fetch_step_alone(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    document = yaml.safe_load(MNIST.read_text())
    document["spec"]["experts"][0]["checkpoint"] = {
        "uri": "s3://acme-models/mnist/0", "storeCredentialsSecret": {
            "name": "mnist-aws-keys", "key": "credentials"}}
    manifest = tmp_path / "keys.yaml"
    manifest.write_text(yaml.safe_dump(document))
    status, objects, _ = _render(capsys, monkeypatch, str(manifest))
    assert status == 0
    pods = {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects
            if o["kind"] == "Deployment"}
    stager = pods.pop("mnist-stager")
    (fetch,) = stager["initContainers"]
    command = fetch["command"]
    file = "/var/run/secrets/ddm/store-credentials/credentials"
    assert command[command.index("--store-credentials-file") + 1] == file
    assert "--headers-file" not in command
    mount = {"name": "store-credentials-expert-mnist-cluster-0", "readOnly": True,
             "mountPath": "/var/run/secrets/ddm/store-credentials"}
    assert mount in fetch["volumeMounts"]
    assert {"name": mount["name"], "secret": {
        "secretName": "mnist-aws-keys", "defaultMode": 0o400,
        "items": [{"key": "credentials", "path": "credentials"}]}} in stager["volumes"]
    assert all(mount not in c.get("volumeMounts", []) for c in stager["containers"])
    assert pods and all("mnist-aws-keys" not in yaml.safe_dump(pod) for pod in pods.values())


def test_render_refuses_what_the_operator_refuses(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    status, _, err = _render(capsys, monkeypatch, str(MNIST),
                             env={"DDM_ALLOWED_IMAGES": "registry.acme.example/"})
    assert status == 0  # the operator's own images are always allowed
    document = yaml.safe_load(MNIST.read_text())
    document["spec"]["experts"][0]["image"] = "evil.example/miner:1"
    manifest = tmp_path / "evil.yaml"
    manifest.write_text(yaml.safe_dump(document))
    status, _, err = _render(capsys, monkeypatch, str(manifest),
                             env={"DDM_ALLOWED_IMAGES": "registry.acme.example/"})
    assert (status, err) == (2, "ddm: error: spec.experts[0].image: 'evil.example/miner:1' is "
                                f"neither of the operator's own repositories ({OWN}) nor among "
                                "the images it allows (DDM_ALLOWED_IMAGES: "
                                "registry.acme.example/)\n")
    document["spec"]["experts"][0]["checkpoint"] = {"uri": "file:///etc/kubernetes"}
    manifest.write_text(yaml.safe_dump(document))
    for env in ({}, {"DDM_ALLOW_HOST_PATHS": "/srv/ddm/"}):
        status, _, err = _render(capsys, monkeypatch, str(manifest), env=env)
        assert status == 2 and "'file:///etc/kubernetes'" in err, err


@pytest.mark.parametrize("attack", list(HOSTILE))
def test_render_refuses_each_hostile_spec_under_the_defaults_naming_the_setting(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        attack: str) -> None:
    """As the operator does (``children.checked_spec``), and renders it once allowed."""
    change, refusal, allowance = HOSTILE[attack]
    document = yaml.safe_load(MNIST.read_text())
    document["spec"] = hostile_spec(document["spec"], change)
    manifest = tmp_path / "hostile.yaml"
    manifest.write_text(yaml.safe_dump(document))
    status, _, err = _render(capsys, monkeypatch, str(manifest))
    assert (status, err) == (2, f"ddm: error: {refusal.format(name='mnist', own=OWN)}\n")
    status, objects, err = _render(capsys, monkeypatch, str(manifest), env=allowance)
    assert status == 0 and objects, err


def test_the_render_defaults_are_the_charts() -> None:
    values = yaml.safe_load((ROOT / "charts" / "ddm-operator" / "values.yaml").read_text())
    assert CHART_DEFAULTS == {
        "DDM_ROUTER_AUTH": str(values["routerAuth"]["enabled"]).lower(),
        "DDM_NETWORK_POLICY": str(values["networkPolicy"]["enabled"]).lower()}
