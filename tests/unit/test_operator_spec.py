"""The DDMDeployment spec: parsing, defaults, every rule with its message, and agreement with
the router's strategy parser (the CRD's agreement: tests/unit/test_generated_crds.py)."""

from __future__ import annotations

import copy
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddm.deploy import accelerators, limits, pod_options, spec
from ddm.operator.diagram import diagram_file, render_mermaid
from ddm.operator.render import render_file
from ddm.deploy.spec import SpecError, load_manifest, parse_manifest, parse_spec
from ddm.sampling.routing import parse_strategy

ROOT = Path(__file__).resolve().parents[2]


def _valid() -> dict:
    return {
        "sampling": {"strategy": "oracle"},
        "experts": [
            {"name": "low", "accelerator": {"type": "neuron", "count": 2},
             "checkpoint": {"uri": "pvc://models/low"}, "classes": [0, 1, 2, 3, 4]},
            {"name": "high", "framework": "jax", "accelerator": {"type": "nvidia"},
             "checkpoint": {"uri": "image:///models/high"}, "classes": [5, 6, 7, 8, 9]},
        ],
    }


def _problems(raw: dict, **kwargs) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_spec(raw, **kwargs)
    return list(caught.value.problems)


def test_a_valid_spec_parses_with_platform_defaults() -> None:
    parsed = parse_spec(_valid())
    low, high = parsed.experts
    assert (low.framework, low.accelerator.unit, low.accelerator.count) == ("torch", "device", 2)
    assert (high.accelerator.type, high.accelerator.count) == ("nvidia", 1)
    assert low.checkpoint.location == "models" and low.checkpoint.path == "/low"
    assert parsed.router.checkpoint is None and parsed.router.replicas == 1


@settings(max_examples=200, deadline=None)
@given(st.from_regex(limits.STRATEGY_PATTERN, fullmatch=True))
def test_every_strategy_the_crd_accepts_the_router_accepts(name: str) -> None:
    parse_strategy(name)


@pytest.mark.parametrize("name", ["oracle", "ensemble", "top1", "top2", "topk:2",
                                  "threshold:0.2", "threshold:1"])
def test_the_router_strategies_are_accepted(name: str) -> None:
    raw = _valid()
    raw["sampling"]["strategy"] = name
    raw["router"] = {"checkpoint": {"uri": "image:///r"}}
    assert parse_spec(raw).sampling.strategy == name


# Each case: a change to the valid spec, and what the message must say (field path included).
INVALID = {
    "duplicate expert names": (
        lambda s: s["experts"].append(copy.deepcopy(s["experts"][0])),
        "spec.experts: the name 'low' is used more than once"),
    "bad expert name": (
        lambda s: s["experts"][0].update(name="Low_Res"),
        "spec.experts[0].name: 'Low_Res' is not valid: a DNS-1123 label"),
    "unknown accelerator": (
        lambda s: s["experts"][0]["accelerator"].update(type="amd"),
        "spec.experts[0].accelerator.type: must be one of neuron, nvidia, tpu, cpu"),
    "negative replicas": (
        lambda s: s["experts"][1].update(replicas=-1),
        "spec.experts[1].replicas: must be an integer in 0..64, got -1"),
    "unknown strategy": (
        lambda s: s["sampling"].update(strategy="random"),
        "spec.sampling.strategy: 'random' is not valid: use oracle, ensemble"),
    "steps out of range": (
        lambda s: s["sampling"].update(steps=5000),
        "spec.sampling.steps: must be an integer in [1, 1000], got 5000"),
    "bad checkpoint URI": (
        lambda s: s["experts"][0]["checkpoint"].update(uri="ftp://models/low"),
        "spec.experts[0].checkpoint.uri: 'ftp://models/low' is not a checkpoint URI"),
    "parent directory in a sub-path": (
        lambda s: s["experts"][0]["checkpoint"].update(uri="pvc://models/../etc"),
        "'..' is not allowed in a checkpoint path"),
    "host path not allowed": (
        lambda s: s["experts"][0]["checkpoint"].update(uri="file:///srv/models/low"),
        "spec.experts[0].checkpoint.uri: 'file:///srv/models/low' mounts a directory of the "
        "node"),
    "oracle with overlapping classes": (
        lambda s: s["experts"][1].update(classes=[4, 5, 6, 7, 8, 9]),
        "spec.experts[1].classes: label 4 is also claimed by expert low; the oracle needs "
        "classes without overlap"),
    "oracle with uncovered labels": (
        lambda s: s["experts"][1].update(classes=[5, 6]),
        "spec.experts: labels [7, 8, 9] belong to no expert"),
    "oracle without classes": (
        lambda s: s["experts"][1].pop("classes"),
        "spec.experts[1].classes: the oracle strategy routes by label, so every expert must "
        "list its classes"),
    "too many GPUs": (
        lambda s: s["experts"][1]["accelerator"].update(count=9),
        "spec.experts[1].accelerator.count: 9 is not a size nvidia offers per pod; use one of "
        "1..8"),
    "TPU slice that does not exist": (
        lambda s: s["experts"][1]["accelerator"].update(type="tpu", count=2),
        "spec.experts[1].accelerator.count: 2 is not a size tpu offers per pod; use one of "
        "1, 4, 8"),
    "TPU topology against count": (
        lambda s: s["experts"][1]["accelerator"].update(type="tpu", count=4, topology="2x4"),
        "spec.experts[1].accelerator.topology: 2x4 has 8 chips but count is 4"),
    "neuron cores beyond a node": (
        lambda s: s["experts"][0]["accelerator"].update(unit="core", count=33),
        "spec.experts[0].accelerator.count: must be an integer in 1..32, got 33"),
    "JAX on Neuron": (
        lambda s: s["experts"][0].update(framework="jax"),
        "spec.experts[0].accelerator.type: neuron cannot run framework jax"),
    "count on cpu": (
        lambda s: s["experts"][0].update(accelerator={"type": "cpu", "count": 2}),
        "spec.experts[0].accelerator.count: does not apply to cpu"),
    "product on neuron": (
        lambda s: s["experts"][0]["accelerator"].update(product="trn1"),
        "spec.experts[0].accelerator.product: applies to nvidia and tpu only"),
    "GPU set by hand": (
        lambda s: s["experts"][1].update(resources={"limits": {"nvidia.com/gpu": 2}}),
        "spec.experts[1].resources.limits: nvidia.com/gpu is set from accelerator"),
    "class beyond numClasses": (
        lambda s: (s.update(numClasses=5), s["experts"][1].update(classes=[5, 6])),
        "spec.experts[1].classes: [5, 6] are outside 0..4 (spec.numClasses is 5)"),
    "learned strategy without a router": (
        lambda s: s["sampling"].update(strategy="top1"),
        "spec.router.checkpoint: strategy top1 needs the router network's checkpoint"),
    "top-k beyond the experts": (
        lambda s: (s["sampling"].update(strategy="top3"),
                   s.update(router={"checkpoint": {"uri": "image:///r"}})),
        "spec.sampling.strategy: top3 combines 3 experts but only 2 are defined"),
    "no experts": (
        lambda s: s.update(experts=[]),
        "spec.experts: must list 1..16 experts, got 0"),
    "unknown field": (
        lambda s: s["experts"][0].update(gpus=1),
        "spec.experts[0]: unknown fields ['gpus']"),
    "a misspelt field, with the one it resembles": (
        lambda s: s["experts"][0].update(maxBatchSize=8, framwork="jax"),
        "spec.experts[0]: unknown fields ['framwork', 'maxBatchSize'] (did you mean "
        "'framework' for 'framwork', 'maxBatch' for 'maxBatchSize'?)"),
    "a key that is not a string (YAML's 1:)": (
        lambda s: s["experts"][0].update({1: 2, "a": 3}),
        "spec.experts[0]: unknown fields [1, 'a']"),
    "missing checkpoint": (
        lambda s: s["experts"][0].pop("checkpoint"),
        "spec.experts[0].checkpoint: is required"),
    "shell in an image": (
        lambda s: s["experts"][0].update(image="ddm:1; rm -rf /"),
        "spec.experts[0].image: 'ddm:1; rm -rf /' is not valid: an image reference"),
    "a newline in a node selector value": (
        lambda s: s["experts"][0].update(nodeSelector={"pool": "a\nhostNetwork: true"}),
        "spec.experts[0].nodeSelector['pool']: 'a\\nhostNetwork: true' is not a label value"),
    "a node selector key that is no label": (
        lambda s: s["experts"][0].update(nodeSelector={"$(id)": "x"}),
        "spec.experts[0].nodeSelector['$(id)']: '$(id)' is not a label key"),
    "Exists with a value": (
        lambda s: s["experts"][0].update(tolerations=[{"key": "k", "operator": "Exists",
                                                       "value": "v"}]),
        "spec.experts[0].tolerations[0].value: must be empty with operator Exists"),
    "Equal without a key": (
        lambda s: s["experts"][0].update(tolerations=[{"value": "v"}]),
        "spec.experts[0].tolerations[0].operator: must be Exists when key is empty"),
    "tolerationSeconds without NoExecute": (
        lambda s: s["experts"][0].update(tolerations=[{"key": "k", "operator": "Exists",
                                                       "effect": "NoSchedule",
                                                       "tolerationSeconds": 5}]),
        "spec.experts[0].tolerations[0].tolerationSeconds: applies only with effect NoExecute"),
    "not a quantity": (
        lambda s: s["experts"][1].update(resources={"requests": {"cpu": "lots"}}),
        "spec.experts[1].resources.requests['cpu']: 'lots' is not a quantity"),
    "a negative quantity": (
        lambda s: s["experts"][1].update(resources={"limits": {"memory": -1}}),
        "spec.experts[1].resources.limits['memory']: -1 is not a quantity"),
    "absurd memory": (
        lambda s: s["experts"][1].update(resources={"limits": {"memory": "1000Ei"}}),
        "spec.experts[1].resources.limits['memory']: 1000Ei is more than any node offers"),
    "requests beyond limits": (
        lambda s: s["experts"][1].update(resources={"requests": {"cpu": "4"},
                                                    "limits": {"cpu": "2000m"}}),
        "spec.experts[1].resources.requests['cpu']: 4 is more than its limit 2000m"),
    "node selector against the GPU product": (
        lambda s: s["experts"][1].update(
            accelerator={"type": "nvidia", "product": "NVIDIA-H100-80GB-HBM3"},
            nodeSelector={"nvidia.com/gpu.product": "Tesla-T4"}),
        "spec.experts[1].nodeSelector['nvidia.com/gpu.product']: 'Tesla-T4' contradicts the "
        "accelerator, which requires 'NVIDIA-H100-80GB-HBM3'"),
    "node selector for TPUs on a GPU expert": (
        lambda s: s["experts"][1].update(
            nodeSelector={"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice"}),
        "spec.experts[1].nodeSelector['cloud.google.com/gke-tpu-accelerator']: selects tpu "
        "nodes but accelerator.type is nvidia"),
    "a Secret name with a path": (
        lambda s: s.update(router={"auth": {"secretName": "../token"}}),
        "spec.router.auth.secretName: '../token' is not valid: a Secret name"),
    "a Secret key that is a parent directory": (
        lambda s: s.update(router={"auth": {"key": ".."}}),
        "spec.router.auth.key: '..' is not valid: a key of the Secret"),
    "plain http unpinned": (
        lambda s: s["experts"][0]["checkpoint"].update(uri="http://store.example/m.tar.gz"),
        "spec.experts[0].checkpoint.uri: 'http://store.example/m.tar.gz': plain http is refused "
        "unless the download is pinned"),
    "credentials in the URI, shown without them": (
        lambda s: s["experts"][0]["checkpoint"].update(uri="https://me:hunter2@s.example/m?sig=x"),
        "spec.experts[0].checkpoint.uri: 'https://s.example/m': credentials in the URI are "
        "refused"),
    "a pin that is not a SHA-256": (
        lambda s: s["experts"][0]["checkpoint"].update(uri="s3://b/m", sha256="abc"),
        "spec.experts[0].checkpoint.sha256: 'abc' is not valid: 64 hexadecimal digits"),
    "a pin on a checkpoint that is not fetched": (
        lambda s: s["experts"][0]["checkpoint"].update(sha256="a" * 64),
        "spec.experts[0].checkpoint.sha256: only for a fetched checkpoint"),
    "credentials without a key": (
        lambda s: s["experts"][0]["checkpoint"].update(uri="s3://b/m",
                                                       credentialsSecret={"name": "login"}),
        "spec.experts[0].checkpoint.credentialsSecret.key: is required"),
    "a store's credentials file for a store that is not a bucket": (
        lambda s: s["experts"][0]["checkpoint"].update(
            uri="https://s.example/m.tar.gz?sig=x",
            storeCredentialsSecret={"name": "k", "key": "c"}),
        "spec.experts[0].checkpoint.storeCredentialsSecret: only for a bucket (s3://, gs:// or "
        "uriFrom); 'https://s.example/m.tar.gz' is not one"),
    "a store's credentials file on a mounted checkpoint": (
        lambda s: s["experts"][0]["checkpoint"].update(
            storeCredentialsSecret={"name": "k", "key": "c"}),
        "spec.experts[0].checkpoint.storeCredentialsSecret: only for a bucket"),
    "headers and a store's credentials file": (
        lambda s: s["experts"][0]["checkpoint"].update(
            uri="s3://b/m", credentialsSecret={"name": "login", "key": "headers"},
            storeCredentialsSecret={"name": "k", "key": "c"}),
        "spec.experts[0].checkpoint.storeCredentialsSecret: give credentialsSecret (HTTP "
        "headers) or storeCredentialsSecret, not both"),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_specs_are_reported_with_their_field(case: str) -> None:
    change, message = INVALID[case]
    raw = _valid()
    change(raw)
    problems = _problems(raw)
    assert any(message in p for p in problems), problems


def test_all_problems_are_reported_at_once() -> None:
    raw = _valid()
    raw["sampling"]["steps"] = 0
    raw["experts"][0]["replicas"] = 100
    raw["experts"][1]["accelerator"]["type"] = "gpu"
    assert len(_problems(raw)) == 3


@pytest.mark.parametrize("text, amount", [
    ("500m", Decimal("0.5")), (2, Decimal(2)), ("1Gi", Decimal(2**30)), ("1.5k", Decimal(1500)),
    ("1e3", Decimal(1000)), ("+.5", Decimal("0.5")), ("-1", None), ("1 Gi", None),
    ("1Gb", None), (True, None), ("", None)])
def test_quantities_read_as_kubernetes_reads_them(text, amount) -> None:
    assert pod_options.parse_quantity(text) == amount


def test_a_pinned_fetch_and_its_credentials_are_read() -> None:
    raw = _valid()
    raw["experts"][0]["checkpoint"] = {
        "uri": "http://store.example/m.tar.gz?X-Amz-Signature=s", "sha256": "sha256:" + "AB" * 32,
        "credentialsSecret": {"name": "login", "key": "headers"}}
    fetch = spec.parse_spec(raw).experts[0].fetch
    assert fetch == spec.FetchOptions(sha256="ab" * 32,
                                      credentials=spec.SecretKey("login", "headers"))


@pytest.mark.parametrize("checkpoint", [{"uri": "gs://models/m"},
                                        {"uriFrom": {"secretKeyRef": {"name": "u", "key": "u"}}}])
def test_a_buckets_own_credentials_file_is_read(checkpoint: dict) -> None:
    """Allowed where the scheme is a bucket's, or cannot be told (the URI in a Secret: the
    fetch step refuses it at run time)."""
    raw = _valid()
    raw["experts"][0]["checkpoint"] = {**checkpoint,
                                       "storeCredentialsSecret": {"name": "k", "key": "key.json"}}
    fetch = spec.parse_spec(raw).experts[0].fetch
    assert fetch == spec.FetchOptions(store_credentials=spec.SecretKey("k", "key.json"))
    assert fetch.secrets() == [("storeCredentialsSecret", spec.SecretKey("k", "key.json"))]


def test_a_uri_in_an_error_is_redacted() -> None:
    raw = _valid()
    raw["experts"][0]["checkpoint"] = {"uri": "ftp://s.example/m?X-Amz-Signature=secret"}
    assert not any("secret" in p for p in _problems(raw))


def test_router_authentication_defaults_to_the_token_key() -> None:
    raw = _valid()
    raw["router"] = {"auth": {}}
    assert parse_spec(raw).router.auth == spec.RouterAuth(secret_name=None, key="token")
    raw["router"] = {"auth": {"secretName": "team.tokens", "key": "ddm"}}
    assert parse_spec(raw).router.auth == spec.RouterAuth("team.tokens", "ddm")
    assert parse_spec(_valid()).router.auth is None


def test_host_paths_when_allowed() -> None:
    raw = _valid()
    raw["experts"][0]["checkpoint"]["uri"] = "file:///srv/models/low"
    parsed = parse_spec(raw, allow_host_paths=True)
    assert parsed.experts[0].checkpoint.scheme == "file"


@pytest.mark.parametrize("accelerator, text", [
    (accelerators.Accelerator(), "cpu"),
    (accelerators.Accelerator("nvidia", 2, product="NVIDIA-H100-80GB-HBM3"),
     "nvidia x2 (NVIDIA-H100-80GB-HBM3)"),
    (accelerators.Accelerator("neuron", 4, unit="core"), "neuron x4 cores"),
    (accelerators.with_defaults(accelerators.Accelerator("tpu", 4)),
     "tpu x4 (tpu-v5-lite-podslice, 2x2)"),
])
def test_accelerators_describe_themselves(accelerator, text: str) -> None:
    assert accelerator.describe() == text


def test_manifest_documents_are_checked_whole() -> None:
    document = {"apiVersion": "ddm.dev/v1alpha1", "kind": "DDMDeployment",
                "metadata": {"name": "digits", "namespace": "ml"}, "spec": _valid()}
    manifest = parse_manifest(document)
    assert (manifest.name, manifest.namespace) == ("digits", "ml")
    document["metadata"]["name"] = "a-name-far-too-long-for-children"
    document["kind"] = "Deployment"
    with pytest.raises(SpecError) as caught:
        parse_manifest(document)
    text = str(caught.value)
    assert "apiVersion/kind: must be ddm.dev/v1alpha1 DDMDeployment" in text
    assert "metadata.name: must be a string of 1..24 characters" in text


@pytest.mark.parametrize("example", ["digits.yaml", "mixed-accelerators.yaml"])
def test_the_examples_are_valid(example: str) -> None:
    manifest = load_manifest(ROOT / "examples" / example)
    assert manifest.spec.experts


#: Every command that reads a user's DDMDeployment file: ddm up (and ddm diagram), ddm render.
FILE_READERS = [pytest.param(load_manifest, id="up"), pytest.param(diagram_file, id="diagram"),
                pytest.param(lambda path: render_file(path, {}), id="render")]


@pytest.mark.parametrize("read", FILE_READERS)
def test_a_key_given_twice_is_refused_naming_the_file_the_key_and_both_lines(
        tmp_path: Path, read) -> None:
    # YAML parsers keep the last of two equal keys: the second replicas would silently win.
    lines = (ROOT / "examples" / "digits.yaml").read_text().splitlines(keepends=True)
    first = lines.index("      replicas: 1\n") + 1
    lines.insert(first, "      replicas: 3\n")
    path = tmp_path / "digits.yaml"
    path.write_text("".join(lines))
    with pytest.raises(SpecError) as caught:
        read(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: not valid YAML")
    assert f"found duplicate key 'replicas' (first on line {first})" in message
    assert f'in "{path}", line {first + 1}' in message


@pytest.mark.parametrize("read", FILE_READERS)
def test_a_file_that_is_not_text_is_refused_naming_it(tmp_path: Path, read) -> None:
    path = tmp_path / "ddm.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    with pytest.raises(SpecError) as caught:
        read(path)
    assert str(caught.value).startswith(f"{path}: not valid YAML")
    assert f'in "{path}", position 0' in str(caught.value)


def test_the_digits_example_is_the_shipped_ddm() -> None:
    digits = load_manifest(ROOT / "examples" / "digits.yaml").spec
    assert [(e.name, e.framework, e.accelerator.type, e.classes) for e in digits.experts] == [
        ("digits-0-4", "torch", "cpu", (0, 1, 2, 3, 4)),
        ("digits-5-9", "jax", "cpu", (5, 6, 7, 8, 9))]
    assert digits.router.checkpoint.uri == "image:///opt/ddm/checkpoints/digits/router"
    assert (digits.sampling.strategy, digits.sampling.steps) == ("top1", 40)


def test_the_diagram_shows_router_experts_hardware_and_replicas() -> None:
    text = render_mermaid(parse_spec(_valid()), "digits")
    assert text.startswith("flowchart LR\n")
    assert ('router["digits router<br/>strategy oracle, 40 euler steps<br/>1 replica on CPU"]'
            in text)
    assert 'subgraph neuron["AWS Neuron"]' in text and 'subgraph nvidia["NVIDIA GPU"]' in text
    assert 'expert0["low<br/>torch, classes 0-4<br/>1 replica with neuron x2 each"]' in text
    assert "router --> expert0" in text and "router --> expert1" in text


def test_the_diagram_of_a_file(tmp_path: Path) -> None:
    text = diagram_file(ROOT / "examples" / "mixed-accelerators.yaml")
    assert "2 replicas with nvidia x1 (NVIDIA-H100-80GB-HBM3) each" in text
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: DDMDeployment\nspec: {experts: []}\n")
    with pytest.raises(SpecError, match="must list 1..16 experts"):
        diagram_file(bad)


def test_importing_the_handlers_registers_nothing_and_imports_no_runner() -> None:
    """Handlers go into the registry ``run_operator`` makes (``handlers.register``); the
    runner imports the handlers, never the other way round."""
    code = ("import sys, kopf, ddm.operator.handlers; "
            "print('ddm.operator.runner' in sys.modules, "
            "len(kopf.get_default_registry()._changing.get_all_handlers()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["False", "0"]
