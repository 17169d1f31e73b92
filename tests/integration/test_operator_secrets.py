"""Tenants on the real API server: a fetched URI's secret query stays in the operator's own
immutable Secret (a new URI is a new Secret), a token Secret planted under one of its names is
never adopted, the operator's defaults refuse each hostile DDM of issue 35 (a namespace
Secret, any image, another application's claim, every taint, the control plane, a node by
name), and its settings refuse a DDM outside its allow-lists."""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
from typing import Any

import pytest
from test_operator import (  # the shared helpers of the operator's cluster tests
    CPU_SPEC,
    DEFAULT_CONFIG,
    Cluster,
    OperatorThread,
    crd,  # noqa: F401  (a fixture: the CRD applied)
    operator,  # noqa: F401  (a fixture: the operator running with default settings)
    wait_for,
)

from ddm.operator import names
from ddm.operator.policy import AllowLists, repository
from tests.support.hostile_tenants import HOSTILE, hostile_spec

SIGNATURE = "5f3c9e1d0b7a4c2e8f6d1a3b5c7e9f0a2b4d6f8e1c3a5b7d9f0e2c4a6b8d0f1e"
SIGNED = (f"https://store.example/ddm/a.tar.gz?X-Amz-Algorithm=AWS4-HMAC-SHA256"
          f"&X-Amz-Credential=AKIAEXAMPLE%2F20261123&X-Amz-Signature={SIGNATURE}")


@pytest.fixture(scope="module")
def cluster(kube_client: Any) -> Cluster:
    return Cluster(kube_client)


#: Every kind a DDM's children (and their controllers' products) come in.
KINDS = ("Deployment", "ReplicaSet", "Pod", "Service", "ConfigMap", "NetworkPolicy")


def _everything_but_the_secret(cluster: Cluster, namespace: str, name: str) -> str:
    """The DDM's status, every event of the namespace and every child, as text (the DDM's
    spec holds the URI: the tenant wrote it there)."""
    children = [item for kind in KINDS
                for item in cluster.list(kind, namespace, f"ddm.dev/deployment={name}")]
    return json.dumps([cluster.ddm(namespace, name).get("status"), cluster.events(namespace),
                       children])


@pytest.mark.usefixtures("operator")
def test_a_presigned_query_never_shows_outside_the_operators_secret(cluster: Cluster,
                                                                     kube_namespace: str
                                                                     ) -> None:
    ns = kube_namespace
    spec = copy.deepcopy(CPU_SPEC)
    spec["experts"][0]["checkpoint"] = {"uri": SIGNED}
    cluster.create_ddm(ns, "signed", spec)
    # an invalid DDM quoting the URI in its status: unpinned plain http
    invalid = copy.deepcopy(spec)
    invalid["experts"][0]["checkpoint"] = {"uri": SIGNED.replace("https:", "http:")}
    cluster.create_ddm(ns, "refused", invalid)

    pod = wait_for(lambda: (cluster.list(
        "Pod", ns, "ddm.dev/deployment=signed,app.kubernetes.io/component=stager") or [None])[0],
        60, "the stager's pod")
    (fetch,) = pod["spec"]["initContainers"]
    assert fetch["command"][:2] == ["ddm", "fetch-checkpoint"]
    uid = cluster.ddm(ns, "signed")["metadata"]["uid"]
    first = names.checkpoint_secret_name("signed", uid, "expert-a", SIGNED)
    assert {"name": "DDM_CHECKPOINT_URI", "valueFrom": {"secretKeyRef": {
        "name": first, "key": "uri"}}} in fetch["env"]
    secret = cluster.get("Secret", ns, first)
    assert base64.b64decode(secret["data"]["uri"]).decode() == SIGNED
    assert secret["immutable"] is True
    refused = wait_for(lambda: (cluster.ddm(ns, "refused").get("status") or {}).get(
        "conditions"), 60, "the refused DDM's status")
    (valid,) = [c for c in refused if c["type"] == "SpecValid"]
    assert valid["status"] == "False"
    assert "'http://store.example/ddm/a.tar.gz': plain http is refused" in valid["message"]
    wait_for(lambda: any(e["reason"] == "InvalidSpec" for e in cluster.events(ns, "refused")),
             60, "the InvalidSpec event")
    wait_for(lambda: (cluster.ddm(ns, "signed").get("status") or {}).get("phase"), 60,
             "the status")

    for name in ("signed", "refused"):
        shown = _everything_but_the_secret(cluster, ns, name)
        assert SIGNATURE not in shown and "X-Amz-Credential" not in shown

    # a new URI (a re-signed one) is a new Secret, and the stager's pods roll to it; the old
    # one stays, unchanged, for the old ReplicaSet (a rollback), until the DDM goes
    resigned = SIGNED.replace(SIGNATURE, SIGNATURE[::-1])
    spec["experts"][0]["checkpoint"]["uri"] = resigned
    cluster.patch_ddm_spec(ns, "signed", spec)
    second = names.checkpoint_secret_name("signed", uid, "expert-a", resigned)
    created = wait_for(lambda: cluster.get("Secret", ns, second), 60, "the new URI's Secret")
    assert base64.b64decode(created["data"]["uri"]).decode() == resigned
    wait_for(lambda: second in json.dumps(cluster.get("Deployment", ns, "signed-stager")[
        "spec"]["template"]), 60, "the stager to read the new Secret")
    assert cluster.get("Secret", ns, first)["data"] == secret["data"]
    assert SIGNATURE[::-1] not in _everything_but_the_secret(cluster, ns, "signed")
    cluster.custom.delete_namespaced_custom_object("ddm.dev", "v1alpha1", ns, "ddmdeployments",
                                                   "signed")
    for name in (first, second):
        wait_for(lambda: cluster.get("Secret", ns, name) is None, 60,
                 "the garbage collector to delete the URIs' Secrets")


def test_a_planted_token_secret_is_not_adopted(cluster: Cluster, kube_namespace: str,
                                               request: pytest.FixtureRequest) -> None:
    """A token Secret's name is known once the DDM exists (a digest of its uid): someone who
    may create Secrets and wins the race to the operator's first run plants one with a token
    they know. The operator cannot read it; the status, which lists the token Secrets the
    operator created, says it is not its own, so nothing that would read it runs."""
    ns = kube_namespace
    running: OperatorThread = request.getfixturevalue("operator")
    running.stop()  # the race won: planted before the operator's first run
    try:
        spec = {**copy.deepcopy(CPU_SPEC), "router": {"auth": {}}}
        uid = cluster.create_ddm(ns, "planted", spec)["metadata"]["uid"]
        token = names.router_token_name("planted", uid)
        labels = {"app.kubernetes.io/managed-by": "ddm-operator",
                  "ddm.dev/deployment": "planted"}
        cluster.core.create_namespaced_secret(ns, {
            "metadata": {"name": token, "labels": labels},
            "stringData": {"token": "known-to-the-attacker"}})
    finally:
        running.start(DEFAULT_CONFIG)

    def refused() -> dict | None:
        status = cluster.ddm(ns, "planted").get("status") or {}
        return status if status.get("phase") == "Failed" else None
    status = wait_for(refused, 60, "the status to refuse the planted Secret")
    (ready,) = [c for c in status["conditions"] if c["type"] == "Ready"]
    assert f"Secret {token} exists but the operator did not create it" in ready["message"]
    assert "routerTokenSecret" not in status and token not in status.get("tokenSecrets", [])
    # nothing reads the token: the router that requires it (the experts use their own)
    assert cluster.get("Deployment", ns, "planted-router") is None
    planted = cluster.get("Secret", ns, token)
    assert base64.b64decode(planted["data"]["token"]) == b"known-to-the-attacker"
    assert not planted["metadata"].get("ownerReferences")  # not changed either

    # Once it is gone, the operator makes its own and the router runs.
    cluster.core.delete_namespaced_secret(token, ns)
    spec["router"]["replicas"] = 2  # a change, so the operator reconciles now
    cluster.patch_ddm_spec(ns, "planted", spec)
    wait_for(lambda: (cluster.get("Deployment", ns, "planted-router") or {}).get(
        "spec", {}).get("replicas") == 2, 60, "the router once the planted Secret is gone")
    ours = cluster.get("Secret", ns, token)
    assert base64.b64decode(ours["data"]["token"]) != b"known-to-the-attacker"
    (ref,) = ours["metadata"]["ownerReferences"]
    assert (ref["uid"], ref["controller"]) == (uid, True)
    status = wait_for(lambda: (cluster.ddm(ns, "planted").get("status") or {}).get(
        "routerTokenSecret"), 60, "the status to name the operator's Secret")
    assert status == token
    assert token in cluster.ddm(ns, "planted")["status"]["tokenSecrets"]


def _condition(cluster: Cluster, ns: str, name: str, kind: str) -> dict | None:
    status = cluster.ddm(ns, name).get("status") or {}
    found = [c for c in status.get("conditions", []) if c["type"] == kind]
    return found[0] if found else None


@pytest.mark.usefixtures("operator")
def test_the_defaults_refuse_each_hostile_ddm_naming_the_setting(cluster: Cluster,
                                                                 kube_namespace: str) -> None:
    """Issue 35: each rendered before (a Secret of the namespace in the router's pod, any
    image, any claim, every taint tolerated, control-plane nodes, a node by name); now each is
    refused by the operator's defaults, in its status and in an InvalidSpec event, and nothing
    of it runs. A DDM beside them, within the defaults, runs."""
    ns = kube_namespace
    own = ", ".join(sorted({repository(i) for i in DEFAULT_CONFIG.images.by_family.values()}))
    made = {}
    for index, attack in enumerate(HOSTILE):
        name = f"hostile-{index}"
        made[name] = HOSTILE[attack][1].format(name=name, own=own)
        cluster.create_ddm(ns, name, hostile_spec(CPU_SPEC, HOSTILE[attack][0]))
    inside = copy.deepcopy(CPU_SPEC)
    inside["experts"][0]["image"] = DEFAULT_CONFIG.images.cpu.partition(":")[0] + ":other-tag"
    cluster.create_ddm(ns, "contained", inside)
    for name, refusal in made.items():
        valid = wait_for(lambda: _condition(cluster, ns, name, "SpecValid"), 60,
                         f"{name}'s refusal")
        assert (valid["status"], valid["reason"], valid["message"]) == ("False", "Invalid",
                                                                        refusal)
        events = wait_for(lambda: [e for e in cluster.events(ns, name)
                                   if e["reason"] == "InvalidSpec"], 60, f"{name}'s event")
        assert events[0]["type"] == "Warning" and refusal in events[0]["message"]
        assert cluster.children(ns, name) == {}
    assert wait_for(lambda: _condition(cluster, ns, "contained", "SpecValid"), 60,
                    "the contained DDM's status")["status"] == "True"


def test_a_ddm_outside_the_allow_lists_is_invalid(cluster: Cluster, kube_namespace: str,
                                                  request: pytest.FixtureRequest) -> None:
    ns = kube_namespace
    running: OperatorThread = request.getfixturevalue("operator")
    running.restart(dataclasses.replace(DEFAULT_CONFIG, allowed=AllowLists(
        images=("registry.acme.example/ddm/",), checkpoint_sources=("image:///models/",),
        secrets=("team-*",), toleration_keys=("team-a/dedicated",), tolerate_all_taints=True)))
    try:
        spec = copy.deepcopy(CPU_SPEC)
        spec["experts"][1]["image"] = "evil.example/miner:1"
        spec["experts"][2]["checkpoint"] = {"uri": "s3://elsewhere/c?X-Amz-Signature=abc"}
        spec["experts"][0]["tolerations"] = [{"key": "team-b/dedicated", "operator": "Exists"},
                                             {"operator": "Exists"}]
        spec["router"] = {"auth": {"secretName": "cluster-admin-token"}}
        cluster.create_ddm(ns, "outside", spec)
        allowed = copy.deepcopy(CPU_SPEC)
        allowed["experts"][0]["image"] = "registry.acme.example/ddm/cpu:1"
        allowed["router"] = {"auth": {"secretName": "team-token"}}
        cluster.create_ddm(ns, "inside", allowed)
        own = ", ".join(sorted({repository(i) for i in DEFAULT_CONFIG.images.by_family.values()}))
        valid = wait_for(lambda: _condition(cluster, ns, "outside", "SpecValid"), 60,
                         "the refusal")
        assert valid["status"] == "False"
        assert valid["message"] == (
            "spec.experts[0].tolerations[0]: key 'team-b/dedicated' is not among the keys "
            "this operator allows (DDM_ALLOWED_TOLERATION_KEYS: team-a/dedicated); "
            "spec.experts[1].image: 'evil.example/miner:1' is neither of the operator's own "
            f"repositories ({own}) nor among the images it allows (DDM_ALLOWED_IMAGES: "
            "registry.acme.example/ddm/); "
            "spec.experts[2].checkpoint.uri: 's3://elsewhere/c' is not among the checkpoint "
            "sources this operator allows (DDM_ALLOWED_CHECKPOINT_SOURCES: image:///models/); "
            "spec.router.auth.secretName: Secret 'cluster-admin-token' is neither the DDM's "
            "own (outside-*, but the operator's tokens and checkpoint URIs) nor among the "
            "Secrets this operator lets a spec name (DDM_ALLOWED_SECRETS: team-*)")
        assert cluster.children(ns, "outside") == {}
        assert wait_for(lambda: _condition(cluster, ns, "inside", "SpecValid"), 60,
                        "the other DDM's status")["status"] == "True"
    finally:
        running.restart(DEFAULT_CONFIG)


@pytest.mark.usefixtures("operator")
def test_a_uri_in_the_users_secret_is_read_by_the_stager_alone(cluster: Cluster,
                                                               kube_namespace: str) -> None:
    ns = kube_namespace
    spec = copy.deepcopy(CPU_SPEC)
    spec["experts"][0]["checkpoint"] = {"uriFrom": {"secretKeyRef": {"name": "held-signed-urls",
                                                                      "key": "a"}}}
    cluster.create_ddm(ns, "held", spec)
    stager = wait_for(lambda: cluster.get("Deployment", ns, "held-stager"), 60, "the stager")
    (fetch,) = stager["spec"]["template"]["spec"]["initContainers"]
    assert {"name": "DDM_CHECKPOINT_URI", "valueFrom": {"secretKeyRef": {
        "name": "held-signed-urls", "key": "a"}}} in fetch["env"]
    expert = wait_for(lambda: cluster.get("Deployment", ns, "held-expert-a"), 60, "the expert")
    assert "held-signed-urls" not in json.dumps(expert)
    wait_for(lambda: (cluster.ddm(ns, "held").get("status") or {}).get("phase"), 60,
             "the status")
    assert cluster.list("Secret", ns, "ddm.dev/deployment=held,"
                        "app.kubernetes.io/component=checkpoints") == []  # no copy of the URI
