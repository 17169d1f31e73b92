"""The pure manifest builders: accelerator expansion, pass-through, checkpoint sources, the
restricted security context on every pod, labels, hashes, the router's configuration, its
bearer token, and the NetworkPolicies."""

from __future__ import annotations

import base64
import copy
import dataclasses
import ipaddress
import json
import re
from pathlib import Path
from typing import Any

import netpolicy
import pytest
from podsecurity import violations

from ddm.checkpoints.fetch import FetchError, FetchPolicy, fetch_checkpoint
from ddm.operator import names
from ddm.operator.fetcher import build_checkpoint_secrets
from ddm.checkpoints.destinations import METADATA_ADDRESSES, REFUSED, parse_networks
from ddm.operator.access import build_token_secrets
from ddm.operator.config import Images, OperatorConfig
from ddm.operator.policy import AllowLists, policy_problems
from ddm.operator.manifests import (
    CONTAINER_SECURITY_CONTEXT,
    build_children,
    build_expert_deployment,
    build_pool_deployment,
    with_spec_hash,
)
from ddm.deploy.limits import PULL_S
from ddm.deploy.spec import parse_spec
from ddm.deploy.router_config import DnsDiscovery, RouterConfigFile

META = {"name": "digits", "namespace": "ml", "uid": "1234", "generation": 1}
CONFIG = OperatorConfig(images=Images({"cpu": "reg/ddm:1", "cuda": "reg/ddm-cuda:1",
                                       "neuron": "reg/ddm-neuron:1", "tpu": "reg/ddm-tpu:1"}))


def _spec(*experts: dict, **extra) -> dict:
    return {"sampling": {"strategy": "top1"}, "router": {"checkpoint": {"uri": "image:///r"}},
            "experts": list(experts), **extra}


def _expert(name: str = "e", **fields) -> dict:
    return {"name": name, "checkpoint": {"uri": "image:///models/e"}, **fields}


def _children(raw: dict, config: OperatorConfig = CONFIG) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c
            for c in build_children(parse_spec(raw, allow_host_paths=True), META, config)}


def _expert_pod(raw_expert: dict, config: OperatorConfig = CONFIG) -> dict:
    spec = parse_spec(_spec(raw_expert), allow_host_paths=True)
    return build_expert_deployment(spec.experts[0], META, config)["spec"]["template"]["spec"]


def _container(pod: dict) -> dict:
    (container,) = pod["containers"]
    return container


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def test_a_ddm_has_these_children() -> None:
    children = _children(_spec(_expert("a"), _expert("b")))
    assert sorted(children) == [
        ("ConfigMap", "digits-router-config"),
        ("Deployment", "digits-expert-a"), ("Deployment", "digits-expert-b"),
        ("Deployment", "digits-router"),
        ("Service", "digits-expert-a"), ("Service", "digits-expert-b"),
        ("Service", "digits-router"),
    ]
    assert all(c["metadata"]["namespace"] == "ml" for c in children.values())


def test_neuron_devices() -> None:
    pod = _expert_pod(_expert(accelerator={"type": "neuron", "count": 2}))
    container = _container(pod)
    assert container["resources"]["limits"] == {"aws.amazon.com/neuron": "2"}
    assert pod["tolerations"] == [{"key": "aws.amazon.com/neuron", "operator": "Exists",
                                   "effect": "NoSchedule"}]
    assert container["image"] == "reg/ddm-neuron:1"
    assert _flag(container["command"], "--backend") == "neuron"
    assert "--device" not in container["command"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["NEURON_CC_FLAGS"] == "--cache_dir=/var/cache/neuron/compiler"
    assert env["DDM_NEURON_CACHE"].startswith("/var/cache/neuron")
    assert {"name": "neuron-cache", "emptyDir": {}} in pod["volumes"]
    assert {"name": "neuron-cache", "mountPath": "/var/cache/neuron"} in container["volumeMounts"]
    assert "nodeSelector" not in pod


def test_neuron_cores() -> None:
    pod = _expert_pod(_expert(accelerator={"type": "neuron", "unit": "core", "count": 4}))
    assert _container(pod)["resources"]["limits"] == {"aws.amazon.com/neuroncore": "4"}


@pytest.mark.parametrize("framework, device", [("torch", "cuda"), ("jax", "gpu")])
def test_nvidia_gpus(framework: str, device: str) -> None:
    pod = _expert_pod(_expert(framework=framework, accelerator={
        "type": "nvidia", "count": 2, "product": "NVIDIA-H100-80GB-HBM3"}))
    container = _container(pod)
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                   "effect": "NoSchedule"}]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert container["image"] == "reg/ddm-cuda:1"
    assert (_flag(container["command"], "--backend"),
            _flag(container["command"], "--device")) == (framework, device)


def test_nvidia_without_a_product_selects_no_node_label() -> None:
    assert "nodeSelector" not in _expert_pod(_expert(accelerator={"type": "nvidia"}))


@pytest.mark.parametrize("framework, device", [("jax", "tpu"), ("torch", "xla")])
def test_tpu_chips(framework: str, device: str) -> None:
    pod = _expert_pod(_expert(framework=framework, accelerator={"type": "tpu", "count": 4}))
    container = _container(pod)
    assert container["resources"]["limits"] == {"google.com/tpu": "4"}
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "2x2"}
    assert pod["tolerations"] == [{"key": "google.com/tpu", "operator": "Exists",
                                   "effect": "NoSchedule"}]
    assert container["image"] == "reg/ddm-tpu:1"
    assert _flag(container["command"], "--device") == device


@pytest.mark.parametrize("accelerator, strategy", [
    ({"type": "nvidia"}, {"maxSurge": 0, "maxUnavailable": 1}),
    ({"type": "neuron", "unit": "core", "count": 2}, {"maxSurge": 0, "maxUnavailable": 1}),
    ({"type": "tpu", "count": 4}, {"maxSurge": 0, "maxUnavailable": 1}),
    ({"type": "cpu"}, None)])
def test_a_server_on_a_device_is_updated_old_pod_first(accelerator: dict,
                                                       strategy: dict | None) -> None:
    """Kubernetes' default would make the new pod first, which waits forever for a device
    the old pod holds; on the CPU the default (the new replica ready before an old one goes)
    stays."""
    spec = parse_spec(_spec(_expert("e", accelerator=accelerator)))
    deployments = [build_expert_deployment(spec.experts[0], META, CONFIG)]
    if accelerator["type"] != "neuron":  # pools serve with torch or jax, not neuronx
        pooled = parse_spec({**_spec(_expert("e", pool="p")),
                             "pools": [{"name": "p", "accelerator": accelerator}]})
        deployments.append(build_pool_deployment(pooled, pooled.pools[0], META, CONFIG))
    for deployment in deployments:
        assert deployment["spec"].get("strategy") == (
            strategy and {"type": "RollingUpdate", "rollingUpdate": strategy})
        # A start may take its whole budget before Kubernetes calls the rollout stalled.
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        probe = container["startupProbe"]
        assert deployment["spec"]["progressDeadlineSeconds"] == (
            PULL_S + probe["periodSeconds"] * probe["failureThreshold"])


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_cpu_adds_nothing(framework: str) -> None:
    pod = _expert_pod(_expert(framework=framework))
    container = _container(pod)
    assert "resources" not in container and "tolerations" not in pod
    assert "nodeSelector" not in pod
    assert container["image"] == "reg/ddm:1"
    assert _flag(container["command"], "--device") == "cpu"


def test_the_expert_command_is_the_servers() -> None:
    command = _container(_expert_pod(_expert(maxBatch=32, maxDelayMs=5)))["command"]
    assert command == ["ddm", "serve", "expert", "--checkpoint", "/models/e", "--host", "0.0.0.0",
                       "--port", "8000", "--metrics-port", "9090", "--backend", "torch",
                       "--device", "cpu",
                       "--max-batch", "32", "--max-delay-ms", "5", "--drain-s", "5"]


def test_placement_and_resources_pass_through() -> None:
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "zone", "operator": "In", "values": ["a"]}]}]}}}
    toleration = {"key": "dedicated", "operator": "Equal", "value": "ddm", "effect": "NoSchedule"}
    pod = _expert_pod(_expert(
        accelerator={"type": "nvidia", "product": "NVIDIA-H100-80GB-HBM3"},
        nodeSelector={"pool": "gpu"}, tolerations=[toleration], affinity=affinity,
        resources={"requests": {"cpu": 2, "memory": "8Gi"}, "limits": {"memory": "16Gi"}},
        image="my/own:image"))
    container = _container(pod)
    assert pod["nodeSelector"] == {"pool": "gpu",
                                   "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert toleration in pod["tolerations"] and len(pod["tolerations"]) == 2
    assert pod["affinity"] == affinity
    assert container["resources"] == {"requests": {"cpu": "2", "memory": "8Gi"},
                                      "limits": {"memory": "16Gi", "nvidia.com/gpu": "1"}}
    assert container["image"] == "my/own:image"


def test_a_checkpoint_on_a_volume_claim_with_a_sub_path() -> None:
    pod = _expert_pod(_expert(checkpoint={"uri": "pvc://models/digits/low"}))
    assert {"name": "checkpoint", "persistentVolumeClaim": {"claimName": "models",
                                                            "readOnly": True}} in pod["volumes"]
    container = _container(pod)
    assert {"name": "checkpoint", "mountPath": "/models/expert", "readOnly": True,
            "subPath": "digits/low"} in container["volumeMounts"]
    assert _flag(container["command"], "--checkpoint") == "/models/expert"


def test_a_checkpoint_on_a_whole_claim() -> None:
    mounts = _container(_expert_pod(_expert(checkpoint={"uri": "pvc://models"})))["volumeMounts"]
    assert {"name": "checkpoint", "mountPath": "/models/expert", "readOnly": True} in mounts


def test_a_checkpoint_inside_the_image_mounts_nothing() -> None:
    pod = _expert_pod(_expert(checkpoint={"uri": "image:///opt/ddm/ckpt"}))
    assert _flag(_container(pod)["command"], "--checkpoint") == "/opt/ddm/ckpt"
    assert all(v["name"] != "checkpoint" for v in pod["volumes"])


def _stager_pod(children: dict[tuple[str, str], dict]) -> dict:
    return children[("Deployment", "digits-stager")]["spec"]["template"]["spec"]


@pytest.mark.parametrize("uri", ["https://example.com/e.tar", "s3://bucket/e", "gs://bucket/e"])
def test_a_remote_checkpoint_is_fetched_by_the_stager_and_copied_by_the_expert(uri: str) -> None:
    config = dataclasses.replace(CONFIG, fetch_max_bytes=1 << 30)
    children = _children(_spec(_expert(checkpoint={"uri": uri})), config)
    staged = f"expert-e-{names.digest(uri)}"
    fetch_step, = _stager_pod(children)["initContainers"]
    assert fetch_step["command"] == ["ddm", "fetch-checkpoint", "--max-bytes", str(1 << 30),
                                     f"/stage/{staged}"]
    assert {"name": "DDM_CHECKPOINT_URI", "valueFrom": {"secretKeyRef": {
        "name": names.checkpoint_secret_name("digits", "1234", "expert-e", uri),
        "key": "uri"}}} in fetch_step["env"]
    assert fetch_step["image"] == "reg/ddm:1"  # the operator's own image, never a tenant's
    assert fetch_step["resources"]["requests"]["ephemeral-storage"] == str(1 << 30)
    assert fetch_step["resources"]["limits"]["memory"]
    (server,) = _stager_pod(children)["containers"]
    assert server["command"] == ["ddm", "serve-checkpoints", "/stage", "--port", "8070"]
    assert {"name": "stage", "mountPath": "/stage", "readOnly": True} in server["volumeMounts"]

    pod = children[("Deployment", "digits-expert-e")]["spec"]["template"]["spec"]
    (copy_step,) = pod["initContainers"]
    host = "digits-stager.ml.svc.cluster.local"
    assert copy_step["command"] == [
        "ddm", "fetch-checkpoint", f"http://{host}:8070/{staged}", "/models/expert",
        "--allow-host", host, "--max-bytes", str(1 << 30)]
    assert "env" not in copy_step or all(e["name"] != "DDM_CHECKPOINT_URI"
                                         for e in copy_step["env"])
    assert copy_step["resources"]["requests"]["ephemeral-storage"] == str(1 << 30)
    assert copy_step["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert {"name": "checkpoint", "mountPath": "/models/expert"} in copy_step["volumeMounts"]
    assert {"name": "checkpoint", "emptyDir": {"sizeLimit": str(1 << 30)}} in pod["volumes"]
    assert {"name": "checkpoint", "mountPath": "/models/expert", "readOnly": True} in \
        _container(pod)["volumeMounts"]
    assert not violations(_stager_pod(children))


def test_no_stager_without_a_fetched_checkpoint() -> None:
    children = _children(_spec(_expert(checkpoint={"uri": "pvc://models/e"})))
    assert all(kind != "Deployment" or "stager" not in name for kind, name in children)
    assert ("Service", "digits-stager") not in children


SIGNED = "https://store.example/m.tar.gz?X-Amz-Signature=c2VjcmV0&X-Amz-Credential=AKIA"


def test_the_operator_caps_fetches_as_the_fetcher_does() -> None:
    assert OperatorConfig().fetch_max_bytes == FetchPolicy().max_bytes


def _uris(secrets: list[dict]) -> dict[str, str]:
    return {s["metadata"]["name"]: base64.b64decode(s["data"]["uri"]).decode() for s in secrets}


def test_a_fetched_uri_is_in_an_immutable_secret_of_its_own_and_nowhere_else() -> None:
    raw = _spec(_expert("a", checkpoint={"uri": SIGNED}), _expert("b"))
    raw["router"] = {"checkpoint": {"uri": "s3://models/router"}}
    spec = parse_spec(raw)
    children = build_children(spec, META, CONFIG)
    assert "X-Amz" not in json.dumps(children)
    secrets = build_checkpoint_secrets(spec, META)
    assert all(s["immutable"] is True and s["kind"] == "Secret" for s in secrets)
    expert_secret = names.checkpoint_secret_name("digits", "1234", "expert-a", SIGNED)
    router_secret = names.checkpoint_secret_name("digits", "1234", "router",
                                                 "s3://models/router")
    assert _uris(secrets) == {expert_secret: SIGNED, router_secret: "s3://models/router"}
    pods = {c["metadata"]["name"]: c["spec"]["template"] for c in children
            if c["kind"] == "Deployment"}
    fetches = {c["name"]: c for c in pods["digits-stager"]["spec"]["initContainers"]}
    assert {"name": "DDM_CHECKPOINT_URI", "valueFrom": {"secretKeyRef": {
        "name": expert_secret, "key": "uri"}}} in fetches["fetch-expert-a"]["env"]
    assert {"name": "DDM_CHECKPOINT_URI", "valueFrom": {"secretKeyRef": {
        "name": router_secret, "key": "uri"}}} in fetches["fetch-router"]["env"]
    assert expert_secret not in json.dumps(pods["digits-expert-a"])  # it copies, never reads
    assert pods["digits-expert-a"]["metadata"]["annotations"] == {
        **names.SCRAPE_ANNOTATIONS, names.CHECKPOINT_HASH_ANNOTATION: names.digest(SIGNED)}
    assert names.CHECKPOINT_HASH_ANNOTATION not in pods["digits-expert-b"]["metadata"][
        "annotations"]
    assert names.CHECKPOINT_HASH_ANNOTATION in pods["digits-router"]["metadata"]["annotations"]
    assert build_checkpoint_secrets(parse_spec(_spec(_expert())), META) == []


def test_a_new_uri_is_a_new_secret_and_a_new_ddm_never_reuses_an_old_ones() -> None:
    """Content-named: the operator only ever creates (a changed URI is another name, so the
    pods roll to it); the uid in the name keeps a re-created DDMDeployment of the same name
    from taking a Secret the garbage collector is about to delete."""
    def secret_name(uri: str, meta: dict = META) -> str:
        (secret,) = build_checkpoint_secrets(parse_spec(_spec(_expert(
            "a", checkpoint={"uri": uri}))), meta)
        return secret["metadata"]["name"]
    first = secret_name("s3://models/a-v1")
    assert secret_name("s3://models/a-v1") == first
    assert secret_name("s3://models/a-v2") != first
    assert secret_name("s3://models/a-v1", {**META, "uid": "5678"}) != first
    assert first.startswith("digits-checkpoint-") and len(first) <= 253


def test_a_pinned_fetch_with_credentials_and_allowed_networks() -> None:
    digest = "AB" * 32
    config = dataclasses.replace(CONFIG, fetch_allow_networks=("10.0.3.7/32", "fd00:1::/64"))
    uri = "http://store.example/m.tar.gz"
    children = _children(_spec(_expert(checkpoint={
        "uri": uri, "sha256": f"sha256:{digest}",
        "credentialsSecret": {"name": "store-login", "key": "headers.txt"}})), config)
    stager = _stager_pod(children)
    (fetch,) = stager["initContainers"]
    assert fetch["command"] == [
        "ddm", "fetch-checkpoint", "--sha256", digest.lower(),
        "--headers-file", "/var/run/secrets/ddm/checkpoint-credentials/headers",
        "--allow-network", "10.0.3.7/32", "--allow-network", "fd00:1::/64",
        "--max-bytes", str(16 << 30), f"/stage/expert-e-{names.digest(uri)}"]
    assert {"name": "credentials-expert-e", "secret": {
        "secretName": "store-login", "defaultMode": 0o400,
        "items": [{"key": "headers.txt", "path": "headers"}]}} in stager["volumes"]
    credentials = {"name": "credentials-expert-e", "readOnly": True,
                   "mountPath": "/var/run/secrets/ddm/checkpoint-credentials"}
    assert credentials in fetch["volumeMounts"]
    assert credentials not in _container(stager)["volumeMounts"]  # the fetch step's alone
    expert = children[("Deployment", "digits-expert-e")]["spec"]["template"]["spec"]
    assert "store-login" not in json.dumps(expert)  # serving pods never see the credentials
    (copy_step,) = expert["initContainers"]
    assert "--sha256" not in copy_step["command"]  # the archive's pin: the stager checked it


def test_a_pinned_directory_is_copied_from_the_stager_under_the_same_pin() -> None:
    children = _children(_spec(_expert(checkpoint={"uri": "http://store.example/models/e",
                                                   "sha256": "cd" * 32})))
    expert = children[("Deployment", "digits-expert-e")]["spec"]["template"]["spec"]
    (copy_step,) = expert["initContainers"]
    assert copy_step["command"][4:6] == ["--sha256", "cd" * 32]  # config.json's, served as is


def test_the_admin_sets_the_fetch_cap() -> None:
    assert OperatorConfig.from_env({"DDM_FETCH_MAX_BYTES": "1073741824"}).fetch_max_bytes == \
        1 << 30
    for bad in ("-1", "1Gi", "0"):
        with pytest.raises(ValueError, match="DDM_FETCH_MAX_BYTES must be a positive number"):
            OperatorConfig.from_env({"DDM_FETCH_MAX_BYTES": bad})


def test_the_operators_fetch_networks_must_be_cidrs() -> None:
    assert OperatorConfig.from_env({"DDM_FETCH_ALLOW_NETWORKS": " 10.0.0.0/8, ,::1 "}
                                   ).fetch_allow_networks == ("10.0.0.0/8", "::1")
    with pytest.raises(ValueError, match="DDM_FETCH_ALLOW_NETWORKS: allowed network '10.0.0.1/8'"):
        OperatorConfig.from_env({"DDM_FETCH_ALLOW_NETWORKS": "10.0.0.1/8"})


def test_a_host_path_checkpoint() -> None:
    pod = _expert_pod(_expert(checkpoint={"uri": "file:///srv/models/e"}))
    assert {"name": "checkpoint", "hostPath": {"path": "/srv/models/e", "type": "Directory"}} \
        in pod["volumes"]


def test_probes_wait_for_the_model_and_allow_long_compiles() -> None:
    neuron = _container(_expert_pod(_expert(accelerator={"type": "neuron"})))
    cpu = _container(_expert_pod(_expert()))
    for container in (neuron, cpu):
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
        assert container["startupProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}

    def budget(c: dict) -> int:
        return c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert budget(neuron) == 1800 and budget(cpu) == 600


def _pods(children: dict) -> list[dict]:
    return [c["spec"]["template"]["spec"] for c in children.values() if c["kind"] == "Deployment"]


def test_every_pod_runs_restricted_with_writable_scratch() -> None:
    children = _children(_spec(
        _expert("a", accelerator={"type": "neuron"}, checkpoint={"uri": "s3://bkt/a"}),
        _expert("b", accelerator={"type": "nvidia"}, checkpoint={"uri": "pvc://m/b"}),
        _expert("c", accelerator={"type": "tpu"}),
        router={"checkpoint": {"uri": "https://example.com/router"}}))
    pods = _pods(children)
    assert len(pods) == 5  # the experts, the router, the stager
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 10001
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"] + pod.get("initContainers", []):
            context = container["securityContext"]
            assert context == CONTAINER_SECURITY_CONTEXT
            assert context["readOnlyRootFilesystem"] is True
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"] == {"drop": ["ALL"]}
            assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
        assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]


def test_every_pod_passes_the_restricted_pod_security_profile() -> None:
    children = _children(_spec(
        _expert("a", accelerator={"type": "neuron"}, checkpoint={"uri": "s3://bkt/a"}),
        _expert("b", accelerator={"type": "nvidia"}, checkpoint={"uri": "pvc://m/b"}),
        _expert("c", accelerator={"type": "tpu"}, checkpoint={"uri": "gs://bkt/c"}),
        router={"checkpoint": {"uri": "https://example.com/router"}, "auth": {}}))
    pods = _pods(children)
    assert len(pods) == 5 and sum(bool(pod.get("initContainers")) for pod in pods) == 4
    for pod in pods:
        assert violations(pod) == []


def test_a_host_path_is_the_one_documented_exception_to_the_profile() -> None:
    pod = _expert_pod(_expert(checkpoint={"uri": "file:///srv/models/e"}))
    assert violations(pod) == ["volume 'checkpoint' has type ['hostPath']"]


def test_every_container_reports_why_it_failed() -> None:
    pods = _pods(_children(_spec(_expert("a", checkpoint={"uri": "s3://bkt/a"}))))
    for pod in pods:
        for container in pod["containers"] + pod.get("initContainers", []):
            assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
            assert container["terminationMessagePath"] == "/dev/termination-log"


def test_no_dollar_in_a_uri_is_expanded_by_kubernetes() -> None:
    uri = "https://example.com/$(HOME)/e?sig=a$b"
    spec = parse_spec(_spec(_expert(checkpoint={"uri": uri})))
    pod = build_expert_deployment(spec.experts[0], META, CONFIG)["spec"]["template"]["spec"]
    # A Secret's value reaches the env as it is (Kubernetes expands $(VAR) in `value` only).
    assert list(_uris(build_checkpoint_secrets(spec, META)).values()) == [uri]
    assert "$" not in json.dumps(pod["initContainers"])
    # Kubernetes turns $$ into $, and leaves $(VAR) unexpanded only when so escaped.
    image = _expert_pod(_expert(checkpoint={"uri": "image:///m/$(HOME)"}))
    assert _flag(_container(image)["command"], "--checkpoint") == "/m/$$(HOME)"


def _router_pod(children: dict) -> dict:
    return children[("Deployment", "digits-router")]["spec"]["template"]["spec"]


def _expert_pods(children: dict) -> list[dict]:
    return [c["spec"]["template"]["spec"] for (kind, name), c in children.items()
            if kind == "Deployment" and name != "digits-router"]


def _router_yaml(children: dict) -> RouterConfigFile:
    return RouterConfigFile.from_yaml(
        children[("ConfigMap", "digits-router-config")]["data"]["router.yaml"])


def test_the_routers_strategies_are_the_operators() -> None:
    assert _router_yaml(_children(_spec(_expert("a")))).sampling.strategies == ()
    config = dataclasses.replace(CONFIG, allowed=AllowLists(strategies=("top1", "topk:2")))
    sampling = _router_yaml(_children(_spec(_expert("a")), config)).sampling
    assert (sampling.strategy, sampling.strategies) == ("top1", ("top1", "topk:2"))


def test_without_authentication_the_router_mounts_no_token() -> None:
    children = _children(_spec(_expert("a")))
    assert _router_yaml(children).auth is None
    assert all("secret" not in v for v in _router_pod(children)["volumes"])


TOKEN = names.router_token_name("digits", "1234")
EXPERT_TOKEN = names.expert_token_name("digits", "1234")
AUTH_ON = OperatorConfig(images=CONFIG.images, router_auth=True)


@pytest.mark.parametrize("auth, config, secret, key", [
    ({}, CONFIG, TOKEN, "token"),
    (None, AUTH_ON, TOKEN, "token"),
    ({"secretName": "team-tokens", "key": "ddm"}, CONFIG, "team-tokens", "ddm"),
])
def test_an_authenticated_router_reads_its_token_from_a_read_only_secret(
        auth: dict | None, config: OperatorConfig, secret: str, key: str) -> None:
    raw = _spec(_expert("a"))
    if auth is not None:
        raw["router"]["auth"] = auth
    children = _children(raw, config)
    pod = _router_pod(children)
    volume = next(v for v in pod["volumes"] if v["name"] == "router-token")
    assert volume["secret"] == {"secretName": secret, "defaultMode": 0o440,
                                "items": [{"key": key, "path": "token"}]}
    assert {"name": "router-token", "mountPath": "/var/run/secrets/ddm/router-token",
            "readOnly": True} in _container(pod)["volumeMounts"]
    assert _router_yaml(children).auth.token_file == "/var/run/secrets/ddm/router-token/token"
    assert all(c["kind"] != "Secret" for c in children.values())  # created apart, once


def test_experts_require_a_token_of_their_own_and_never_see_the_public_one() -> None:
    children = _children(_spec(_expert("a"), _expert("b")), AUTH_ON)
    router, config = _router_pod(children), _router_yaml(children)
    expert_volume = {"name": "expert-token", "secret": {
        "secretName": EXPERT_TOKEN, "defaultMode": 0o440,
        "items": [{"key": "token", "path": "token"}]}}
    assert expert_volume in router["volumes"]
    assert config.auth.expert_token_file == "/var/run/secrets/ddm/expert-token/token"
    assert config.auth.expert_token_file != config.auth.token_file
    for expert in _expert_pods(children):
        assert expert_volume in expert["volumes"]
        assert {"name": "expert-token", "mountPath": "/var/run/secrets/ddm/expert-token",
                "readOnly": True} in _container(expert)["volumeMounts"]
        assert _flag(_container(expert)["command"], "--auth-token-file") == \
            config.auth.expert_token_file
        assert TOKEN not in json.dumps(expert)  # the public token's Secret: the router's alone


def test_without_authentication_experts_take_no_token() -> None:
    expert = _expert_pods(_children(_spec(_expert("a"))))[0]
    assert "--auth-token-file" not in _container(expert)["command"]
    assert all("secret" not in v for v in expert["volumes"])


@pytest.mark.parametrize("auth, config, created", [
    (None, CONFIG, []),
    ({}, CONFIG, [TOKEN, EXPERT_TOKEN]),
    (None, AUTH_ON, [TOKEN, EXPERT_TOKEN]),
    ({"secretName": "team-tokens"}, CONFIG, [EXPERT_TOKEN]),
])
def test_the_operator_makes_immutable_token_secrets_named_after_the_ddms_uid(
        auth: dict | None, config: OperatorConfig, created: list[str]) -> None:
    raw = _spec(_expert("a"))
    if auth is not None:
        raw["router"]["auth"] = auth
    tokens = iter(["first", "second"])
    secrets = build_token_secrets(parse_spec(raw), META, config, lambda: next(tokens))
    assert [s["metadata"]["name"] for s in secrets] == created
    for secret, token in zip(secrets, ["first", "second"]):
        assert (secret["kind"], secret["type"], secret["immutable"]) == ("Secret", "Opaque", True)
        assert secret["metadata"]["labels"][names.DEPLOYMENT_LABEL] == "digits"
        assert secret["stringData"] == {"token": token}
    assert names.router_token_name("digits", "5678") != TOKEN


def _pod_labels(children: dict, name: str) -> dict:
    return children[("Deployment", name)]["spec"]["template"]["metadata"]["labels"]


def _matches(selector: dict, labels: dict) -> bool:
    return selector["matchLabels"].items() <= labels.items()


def test_network_policies_let_only_the_router_reach_the_experts() -> None:
    config = OperatorConfig(images=CONFIG.images, network_policy=True)
    children = _children(_spec(_expert("a"), _expert("b")), config)
    experts = [_pod_labels(children, f"digits-expert-{e}") for e in ("a", "b")]
    router = _pod_labels(children, "digits-router")
    policy = children[("NetworkPolicy", "digits-experts")]["spec"]
    assert all(_matches(policy["podSelector"], labels) for labels in experts)
    assert not _matches(policy["podSelector"], router)
    assert policy["policyTypes"] == ["Ingress", "Egress"] and policy["egress"] == []
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    assert _matches(source["podSelector"], router)
    assert not any(_matches(source["podSelector"], labels) for labels in experts)
    expert_ports = {p["name"]: p["containerPort"] for p in _container(
        children[("Deployment", "digits-expert-a")]["spec"]["template"]["spec"])["ports"]}
    assert [p["port"] for p in rule["ports"]] == [expert_ports["http"]]

    router_policy = children[("NetworkPolicy", "digits-router")]["spec"]
    assert _matches(router_policy["podSelector"], router)
    assert not any(_matches(router_policy["podSelector"], labels) for labels in experts)
    (router_rule,) = router_policy["ingress"]
    assert "from" not in router_rule  # clients anywhere, on the router's port only
    assert [p["port"] for p in router_rule["ports"]] == [
        p["containerPort"] for p in _container(_router_pod(children))["ports"]
        if p["name"] == "http"]


#: Prometheus in its own namespace, and a scraper outside the cluster.
SCRAPERS = ({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
             "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
            {"ipBlock": {"cidr": "10.9.0.0/16"}})


def test_the_metrics_port_is_named_and_admits_only_the_configured_scrapers() -> None:
    quiet = _children(_spec(_expert("a")), OperatorConfig(images=CONFIG.images,
                                                          network_policy=True))
    scraped = _children(_spec(_expert("a")), OperatorConfig(
        images=CONFIG.images, network_policy=True, metrics_from=SCRAPERS))
    for children in (quiet, scraped):
        for name, component in (("digits-expert-a", "experts"), ("digits-router", "router")):
            template = children[("Deployment", name)]["spec"]["template"]
            container = _container(template["spec"])
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports["metrics"] == names.METRICS_PORT != ports["http"]
            assert _flag(container["command"], "--metrics-port") == str(names.METRICS_PORT)
            assert template["metadata"]["annotations"]["prometheus.io/port"] == str(
                names.METRICS_PORT)
            rules = children[("NetworkPolicy", f"digits-{component}")]["spec"]["ingress"]
            to_metrics = [r for r in rules
                          if any(p["port"] == names.METRICS_PORT for p in r["ports"])]
            if children is quiet:  # no scrapers configured: nobody reaches the port
                assert to_metrics == []
            else:  # only them, and on the metrics port alone
                (rule,) = to_metrics
                assert rule["from"] == list(SCRAPERS)
                assert [p["port"] for p in rule["ports"]] == [names.METRICS_PORT]


@pytest.mark.parametrize("peers, message", [
    ([{}], "non-empty mapping"),
    ([{"podSelector": {}, "ipBlock": {"cidr": "10.0.0.0/8"}}], "cannot be combined"),
    ([{"ipBlock": {"cidr": "10.0.0.300/8"}}], "ipBlock"),
    ([{"podSelector": {"app": "x"}}], "label selector"),
    ({"podSelector": {}}, "must be a list"),
])
def test_malformed_scrapers_are_refused_by_name(peers: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OperatorConfig.from_env({"DDM_METRICS_FROM": json.dumps(peers)})


#: What the stager must never reach unless an admin allows it.
CLOSED = {"private": ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"],
          "loopback": ["127.0.0.0/8", "::1/128"], "link-local": ["169.254.0.0/16", "fe80::/10"],
          "CGNAT": ["100.64.0.0/10"], "ULA": ["fc00::/7"],
          "metadata": [f"{a}/{a.max_prefixlen}" for a in METADATA_ADDRESSES]}
DNS_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
            "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}


def _policies(children: dict[tuple[str, str], dict]) -> list[dict]:
    return [c for (kind, _), c in children.items() if kind == "NetworkPolicy"]


def test_serving_pods_send_only_to_their_experts_the_stager_and_the_cluster_dns() -> None:
    config = OperatorConfig(images=CONFIG.images, network_policy=True)
    raw = _spec(_expert("a", checkpoint={"uri": "s3://models/a"}), _expert("b"))
    children = _children(raw, config)
    policies = _policies(children)
    stager = _pod_labels(children, "digits-stager")
    for name in ("digits-expert-a", "digits-expert-b", "digits-router"):
        labels = _pod_labels(children, name)
        rules = netpolicy.egress_rules(policies, labels)
        assert rules, name  # restricted, and to something
        for rule in rules:
            for peer in rule["to"]:
                assert "ipBlock" not in peer, name
                if "namespaceSelector" in peer:  # the cluster DNS, port 53 only
                    assert peer == DNS_PEER
                    assert {p["port"] for p in rule["ports"]} == {53}
                else:
                    assert peer["podSelector"]["matchLabels"][names.DEPLOYMENT_LABEL] == "digits"
                    assert peer["podSelector"]["matchLabels"][names.COMPONENT_LABEL] in (
                        "expert", "stager")
        assert not netpolicy.admits_address(rules, ipaddress.ip_address("8.8.8.8"))
        to_stager = [r for r in rules for p in r["to"]
                     if "podSelector" in p and "namespaceSelector" not in p
                     and netpolicy.selects(p["podSelector"], stager)]
        assert [p["port"] for r in to_stager for p in r["ports"]] == [8070]
        assert not netpolicy.selects(children[("NetworkPolicy", "digits-stager")]["spec"][
            "podSelector"], labels)


@pytest.mark.parametrize("allowed", [(), ("10.0.3.7/32", "169.254.0.0/16", "fd00:1::/64")])
def test_the_stager_reaches_public_stores_never_private_or_metadata_ranges(allowed) -> None:
    config = OperatorConfig(images=CONFIG.images, network_policy=True,
                            fetch_allow_networks=allowed)
    children = _children(_spec(_expert("a", checkpoint={"uri": "s3://models/a"})), config)
    stager = _pod_labels(children, "digits-stager")
    rules = netpolicy.egress_rules(_policies(children), stager)
    for kind, networks in CLOSED.items():
        for network in networks:
            for address in netpolicy.samples(network):
                readmitted = any(address in ipaddress.ip_network(n) for n in allowed)
                assert netpolicy.admits_address(rules, address) == (
                    readmitted and kind != "metadata"), (kind, address)
    for public in ("8.8.8.8", "52.216.0.1", "2600:1f18::1"):
        assert netpolicy.admits_address(rules, ipaddress.ip_address(public))
    ingress = children[("NetworkPolicy", "digits-stager")]["spec"]["ingress"]
    assert ingress == [{"from": [{"podSelector": {"matchLabels": {
        names.DEPLOYMENT_LABEL: "digits"}}}], "ports": [{"protocol": "TCP", "port": 8070}]}]


IDENTITY = ("169.254.169.254", "fd00:ec2::254", "169.254.170.23", "fd00:ec2::23")


def test_cloud_identity_opens_the_identity_endpoints_to_the_stager_alone_on_port_80(
        tmp_path) -> None:
    """GKE Workload Identity, EC2 instance profiles and EKS Pod Identity answer on these
    addresses; the other metadata endpoints and the rest of link-local stay closed, the serving
    pods' policies and the fetch step do not change, and the fetcher still refuses a
    checkpoint URL naming an identity endpoint."""
    raw = _spec(_expert("a", checkpoint={"uri": "s3://models/a"}))
    off = _children(raw, OperatorConfig(images=CONFIG.images, network_policy=True))
    on = _children(raw, OperatorConfig(images=CONFIG.images, network_policy=True,
                                       fetch_cloud_identity=True))
    stager = _pod_labels(on, "digits-stager")
    rules = netpolicy.egress_rules(_policies(on), stager)
    closed = netpolicy.egress_rules(_policies(off), stager)
    for address in map(ipaddress.ip_address, IDENTITY):
        assert not netpolicy.admits_address(closed, address)
        (rule,) = [r for r in rules if netpolicy.admits_address([r], address)]
        assert rule["ports"] == [{"protocol": "TCP", "port": 80}]
    for other in ({str(a) for a in METADATA_ADDRESSES} - set(IDENTITY)) | {"169.254.1.1",
                                                                          "10.0.0.1"}:
        assert not netpolicy.admits_address(rules, ipaddress.ip_address(other)), other
    for name, child in on.items():
        if name != ("NetworkPolicy", "digits-stager"):
            assert child == off[name], name  # serving pods and the fetch step alike
    (fetch,) = _stager_pod(on)["initContainers"]
    networks = [fetch["command"][i + 1] for i, arg in enumerate(fetch["command"])
                if arg == "--allow-network"]
    for url in ("http://169.254.169.254/latest/meta-data/iam/security-credentials/m.tar.gz",
                "http://[fd00:ec2::254]/m.tar.gz", "http://169.254.170.23/v1/m.tar.gz"):
        with pytest.raises(FetchError, match=REFUSED):
            fetch_checkpoint(url, tmp_path / "m", FetchPolicy(
                allowed_networks=parse_networks([*networks, "169.254.0.0/16", "fd00::/8"])),
                sha256="0" * 64)


def test_cloud_identity_is_read_as_a_switch() -> None:
    assert OperatorConfig.from_env({}).fetch_cloud_identity is False
    assert OperatorConfig.from_env({"DDM_FETCH_CLOUD_IDENTITY": "true"}).fetch_cloud_identity
    with pytest.raises(ValueError, match="DDM_FETCH_CLOUD_IDENTITY must be true or false"):
        OperatorConfig.from_env({"DDM_FETCH_CLOUD_IDENTITY": "on"})


def test_without_fetches_experts_send_nothing() -> None:
    config = OperatorConfig(images=CONFIG.images, network_policy=True)
    children = _children(_spec(_expert("a")), config)
    assert children[("NetworkPolicy", "digits-experts")]["spec"]["egress"] == []
    assert ("NetworkPolicy", "digits-stager") not in children


def test_the_cluster_dns_is_the_admins_choice() -> None:
    config = OperatorConfig.from_env({
        "DDM_NETWORK_POLICY": "true",
        "DDM_DNS_NAMESPACE_SELECTOR": '{"matchLabels": {"name": "dns"}}',
        "DDM_DNS_POD_SELECTOR": '{"matchLabels": {"app": "coredns"}}'})
    children = _children(_spec(_expert("a")), config)
    (_, dns) = children[("NetworkPolicy", "digits-router")]["spec"]["egress"]
    assert dns["to"] == [{"namespaceSelector": {"matchLabels": {"name": "dns"}},
                          "podSelector": {"matchLabels": {"app": "coredns"}}}]
    with pytest.raises(ValueError, match="label selector"):
        OperatorConfig.from_env({"DDM_DNS_POD_SELECTOR": '{"app": "coredns"}'})


def test_network_policies_only_when_turned_on() -> None:
    assert all(c["kind"] != "NetworkPolicy" for c in _children(_spec(_expert("a"))).values())


def test_the_router_allows_as_many_steps_as_the_ddms_default() -> None:
    children = _children(_spec(_expert("a"), sampling={"strategy": "top1", "steps": 900}))
    config = _router_yaml(children)
    assert config.sampling.steps == 900 and config.limits.max_steps == 900


def test_the_routers_clients_behind_the_operators_trusted_proxies_are_forwarded_ones() -> None:
    config = _router_yaml(_children(_spec(_expert("a"))))
    assert config.trusted_proxies == ()
    assert config.limits.max_concurrent_per_client < config.limits.max_concurrent
    behind = _router_yaml(_children(_spec(_expert("a")), OperatorConfig(
        images=CONFIG.images, router_trusted_proxies=("10.42.7.0/24",))))
    assert behind.trusted_proxies == ("10.42.7.0/24",)
    with pytest.raises(ValueError, match="DDM_ROUTER_TRUSTED_PROXIES: .*'10.42.7.1/24'"):
        OperatorConfig.from_env({"DDM_ROUTER_TRUSTED_PROXIES": "10.42.7.1/24"})


def test_labels_and_selectors() -> None:
    children = _children(_spec(_expert("a")))
    for child in children.values():
        labels = child["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "ddm"
        assert labels["app.kubernetes.io/instance"] == "digits"
        assert labels["app.kubernetes.io/part-of"] == "ddm"
        assert labels["app.kubernetes.io/managed-by"] == "ddm-operator"
        assert labels["ddm.dev/deployment"] == "digits"
    expert = children[("Deployment", "digits-expert-a")]
    assert expert["metadata"]["labels"]["app.kubernetes.io/component"] == "expert"
    assert expert["metadata"]["labels"]["ddm.dev/expert"] == "a"
    assert children[("Deployment", "digits-router")]["metadata"]["labels"][
        "app.kubernetes.io/component"] == "router"
    for name in ("digits-expert-a", "digits-router"):
        deployment = children[("Deployment", name)]
        selector = deployment["spec"]["selector"]["matchLabels"]
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items()
        assert children[("Service", name)]["spec"]["selector"] == selector


def test_expert_services_are_headless_and_list_only_ready_pods() -> None:
    service = _children(_spec(_expert("a")))[("Service", "digits-expert-a")]["spec"]
    assert service["clusterIP"] == "None"
    assert service["publishNotReadyAddresses"] is False
    assert service["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"},
        {"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    router = _children(_spec(_expert("a")))[("Service", "digits-router")]["spec"]
    assert "clusterIP" not in router and router["ports"][0]["port"] == 8080
    # a ServiceMonitor names the port: both Services list ``metrics``
    assert router["ports"][1] == service["ports"][1]


def test_the_router_reads_its_config_map() -> None:
    children = _children(_spec(_expert("a", classes=[0, 1]), _expert("b", classes=[2]),
                               numClasses=3, sampling={"steps": 20, "solver": "heun",
                                                       "strategy": "top2"}))
    text = children[("ConfigMap", "digits-router-config")]["data"]["router.yaml"]
    config = RouterConfigFile.from_yaml(text)
    assert [e.name for e in config.experts] == ["a", "b"]
    assert config.experts[0].classes == (0, 1)
    assert config.experts[0].discovery == DnsDiscovery(
        dns="digits-expert-a.ml.svc.cluster.local", port=8000)
    assert (config.sampling.steps, config.sampling.solver, config.sampling.strategy) == (
        20, "heun", "top2")
    assert config.num_classes == 3 and config.router_checkpoint == "/r"
    router = children[("Deployment", "digits-router")]["spec"]["template"]["spec"]
    container = _container(router)
    assert container["command"] == ["ddm", "serve", "router", "--config", "/etc/ddm/router.yaml",
                                    "--host", "0.0.0.0", "--port", "8080",
                                    "--metrics-port", "9090", "--drain-s", "5"]
    assert {"name": "config", "configMap": {"name": "digits-router-config"}} in router["volumes"]


def test_the_router_has_default_requests_and_limits_the_spec_can_replace() -> None:
    def router_resources(**router: dict) -> dict:
        children = _children(_spec(_expert("a"), router={"checkpoint": {"uri": "image:///r"},
                                                         **router}))
        pod = children[("Deployment", "digits-router")]["spec"]["template"]["spec"]
        assert violations(pod) == []
        return _container(pod)["resources"]

    assert router_resources() == {"requests": {"cpu": "250m", "memory": "384Mi"},
                                  "limits": {"cpu": "2", "memory": "1Gi"}}
    assert router_resources(resources={"limits": {"memory": "4Gi"}}) == {
        "limits": {"memory": "4Gi"}}


def test_the_crd_documents_the_routers_default_resources() -> None:
    import yaml

    from ddm.operator.manifests import ROUTER_RESOURCES

    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "crds"
                          / "ddmdeployments.ddm.dev.yaml").read_text())
    router = (crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
              ["properties"]["router"]["properties"])
    text = " ".join(router["resources"]["description"].split())
    requests, limits = ROUTER_RESOURCES["requests"], ROUTER_RESOURCES["limits"]
    assert (f"requests cpu {requests['cpu']} and memory {requests['memory']}, limits cpu "
            f"{limits['cpu']} and memory {limits['memory']}") in text


def test_an_oracle_router_needs_no_checkpoint() -> None:
    raw = _spec(_expert("a", classes=list(range(10))), sampling={"strategy": "oracle"})
    del raw["router"]
    children = _children(raw)
    config = RouterConfigFile.from_yaml(
        children[("ConfigMap", "digits-router-config")]["data"]["router.yaml"])
    assert config.router_checkpoint is None
    pod = children[("Deployment", "digits-router")]["spec"]["template"]["spec"]
    assert all(v["name"] != "checkpoint" for v in pod["volumes"])


def test_the_cluster_domain_is_configurable() -> None:
    config = OperatorConfig.from_env({"DDM_CLUSTER_DOMAIN": "corp.local",
                                      "DDM_IMAGE_CUDA": "x/cuda:2"})
    children = _children(_spec(_expert("a", accelerator={"type": "nvidia"})), config)
    text = children[("ConfigMap", "digits-router-config")]["data"]["router.yaml"]
    assert "digits-expert-a.ml.svc.corp.local" in text
    pod = children[("Deployment", "digits-expert-a")]["spec"]["template"]["spec"]
    assert _container(pod)["image"] == "x/cuda:2"
    with pytest.raises(ValueError, match="DDM_ALLOW_HOST_PATHS"):
        OperatorConfig.from_env({"DDM_ALLOW_HOST_PATHS": "maybe"})


def test_the_operators_switches_are_strict_and_off_by_default() -> None:
    default = OperatorConfig.from_env({})
    assert (default.allowed.host_paths, default.router_auth, default.network_policy) == (
        (), False, False)
    on = OperatorConfig.from_env({"DDM_ROUTER_AUTH": "true", "DDM_NETWORK_POLICY": "True"})
    assert (on.router_auth, on.network_policy) == (True, True)
    for name in ("DDM_ROUTER_AUTH", "DDM_NETWORK_POLICY"):
        with pytest.raises(ValueError, match=f"{name} must be true or false, got 'on'"):
            OperatorConfig.from_env({name: "on"})


def _hashes(raw: dict) -> dict[tuple[str, str], str]:
    return {key: with_spec_hash(child)["metadata"]["annotations"][names.SPEC_HASH_ANNOTATION]
            for key, child in _children(raw).items()}


def test_a_change_to_one_expert_changes_only_its_hash() -> None:
    before = _spec(_expert("a", classes=[0]), _expert("b", classes=[1]))
    after = copy.deepcopy(before)
    after["experts"][1]["replicas"] = 3
    old, new = _hashes(before), _hashes(after)
    assert [key for key in old if old[key] != new[key]] == [("Deployment", "digits-expert-b")]


def test_a_change_to_the_experts_classes_rolls_the_router() -> None:
    before = _spec(_expert("a", classes=[0]), _expert("b", classes=[1]))
    after = copy.deepcopy(before)
    after["experts"][1]["classes"] = [1, 2]
    old, new = _hashes(before), _hashes(after)
    assert sorted(key for key in old if old[key] != new[key]) == [
        ("ConfigMap", "digits-router-config"), ("Deployment", "digits-router")]

    def config_hash(raw: dict) -> str:
        template = _children(raw)[("Deployment", "digits-router")]["spec"]["template"]
        return template["metadata"]["annotations"][names.CONFIG_HASH_ANNOTATION]
    assert config_hash(before) != config_hash(after)


def test_the_hash_ignores_an_existing_hash() -> None:
    child = _children(_spec(_expert("a")))[("Service", "digits-expert-a")]
    assert with_spec_hash(with_spec_hash(child)) == with_spec_hash(child)


@pytest.mark.parametrize("accelerator", [{"type": "cpu"}, {"type": "nvidia"}, {"type": "neuron"},
                                         {"type": "tpu", "count": 4}])
def test_every_container_command_is_a_valid_ddm_command_listening_on_all_addresses(
        accelerator: dict) -> None:
    from ddm.cli import build_parser

    framework = "torch" if accelerator["type"] in ("cpu", "nvidia", "neuron") else "jax"
    children = _children(_spec(_expert("a", accelerator=accelerator, framework=framework)))
    for child in children.values():
        if child["kind"] != "Deployment":
            continue
        for container in child["spec"]["template"]["spec"]["containers"]:
            command = container["command"]
            assert command[0] == "ddm"
            args = build_parser().parse_args(command[1:])  # SystemExit if a flag is unknown
            assert args.host == "0.0.0.0", command


def test_a_uri_held_in_the_users_secret_is_read_by_the_fetch_step_alone() -> None:
    held = {"uriFrom": {"secretKeyRef": {"name": "signed-urls", "key": "expert-a"}},
            "sha256": "ab" * 32}
    raw = _spec(_expert("a", checkpoint=held))
    spec = parse_spec(raw)
    assert build_checkpoint_secrets(spec, META) == []  # the operator holds no copy
    children = _children(raw)
    (fetch,) = _stager_pod(children)["initContainers"]
    assert {"name": "DDM_CHECKPOINT_URI", "valueFrom": {"secretKeyRef": {
        "name": "signed-urls", "key": "expert-a"}}} in fetch["env"]
    assert fetch["command"][:4] == ["ddm", "fetch-checkpoint", "--sha256", "ab" * 32]
    expert = children[("Deployment", "digits-expert-a")]["spec"]["template"]
    assert "signed-urls" not in json.dumps(expert["spec"])
    assert expert["metadata"]["annotations"][names.CHECKPOINT_HASH_ANNOTATION] == names.digest(
        "secret://signed-urls/expert-a")


@pytest.mark.parametrize("checkpoint, problem", [
    ({"uri": "s3://m/a", "uriFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
     "checkpoint.uriFrom: give uri or uriFrom, not both"),
    ({"uriFrom": {}}, "checkpoint.uriFrom.secretKeyRef: is required"),
    ({"uriFrom": {"secretKeyRef": {"name": "s"}}}, "secretKeyRef.key: is required"),
    ({}, "checkpoint.uri: is required (or uriFrom.secretKeyRef)"),
    ({"uri": "secret://s/k"}, "is not a checkpoint URI"),
])
def test_a_checkpoint_names_one_uri_or_one_secret_key(checkpoint: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse_spec(_spec(_expert("a", checkpoint=checkpoint)))


def test_an_allow_list_admits_secret_held_uris_only_by_their_own_entry() -> None:
    spec = parse_spec(_spec(_expert("a", checkpoint={
        "uriFrom": {"secretKeyRef": {"name": "digits-urls", "key": "a"}}})))
    sources = ("image://", "s3://models/")
    assert policy_problems(spec, "digits", AllowLists(checkpoint_sources=sources), ()) == [
        "spec.experts[0].checkpoint.uri: 'secret://digits-urls/a' is not among the checkpoint "
        "sources this operator allows (DDM_ALLOWED_CHECKPOINT_SOURCES: image://, s3://models/)"]
    assert policy_problems(spec, "digits", AllowLists(
        checkpoint_sources=(*sources, "secret://")), ()) == []
    (problem,) = policy_problems(spec, "mnist", AllowLists(secrets=("ddm-*",)), ())
    assert problem.startswith("spec.experts[0].checkpoint.uriFrom.secretKeyRef.name: Secret "
                              "'digits-urls' is neither the DDM's own (mnist-*")
