"""The operator-wide allow-lists (``ddm.operator.policy``): images, checkpoint sources,
Secret references, toleration and nodeSelector keys, and host-path prefixes."""

from __future__ import annotations

import pytest

from ddm.deploy.spec import SpecError, parse_spec
from ddm.operator.config import OperatorConfig
from ddm.operator.policy import AllowLists, policy_problems

IMAGES = ("registry.acme.example/ddm/", "ddm:")
SOURCES = ("image://", "s3://acme-models/", "https://models.acme.example/ddm/")
LISTS = AllowLists(images=IMAGES, checkpoint_sources=SOURCES)


def _spec(uri: str = "image:///m", image: str | None = None) -> dict:
    expert = {"name": "e", "checkpoint": {"uri": uri}, **({"image": image} if image else {})}
    return {"sampling": {"strategy": "top1"}, "router": {"checkpoint": {"uri": "image:///r"}},
            "experts": [expert]}


@pytest.mark.parametrize("image", [None, "registry.acme.example/ddm/cpu:1", "ddm:2.0",
                                   "registry.acme.example/ddm/sub/x@sha256:" + "0" * 64])
def test_images_inside_the_list_are_allowed(image: str | None) -> None:
    assert policy_problems(parse_spec(_spec(image=image)), LISTS) == []


@pytest.mark.parametrize("image", ["registry.acme.example/ddm-evil/x:1", "ddm-evil:1",
                                   "evil.example/registry.acme.example/ddm/x:1"])
def test_an_image_outside_the_list_is_refused_naming_the_field(image: str) -> None:
    assert policy_problems(parse_spec(_spec(image=image)), LISTS) == [
        f"spec.experts[0].image: {image!r} is not among the images this operator allows "
        "(DDM_ALLOWED_IMAGES: registry.acme.example/ddm/, ddm:)"]


@pytest.mark.parametrize("uri", ["s3://acme-models/a", "https://models.acme.example/ddm/a.tgz"])
def test_sources_inside_the_list_are_allowed(uri: str) -> None:
    assert policy_problems(parse_spec(_spec(uri)), LISTS) == []


@pytest.mark.parametrize("uri, shown", [
    ("s3://acme-models-evil/a", "s3://acme-models-evil/a"),
    ("https://models.acme.example.evil.test/ddm/a?X-Amz-Signature=s",
     "https://models.acme.example.evil.test/ddm/a"),
    ("pvc://models/a", "pvc://models/a"),
])
def test_a_source_outside_the_list_is_refused_redacted(uri: str, shown: str) -> None:
    assert policy_problems(parse_spec(_spec(uri)), LISTS) == [
        f"spec.experts[0].checkpoint.uri: {shown!r} is not among the checkpoint sources this "
        f"operator allows (DDM_ALLOWED_CHECKPOINT_SOURCES: {', '.join(SOURCES)})"]


@pytest.mark.parametrize("uri", ["https://models.acme.example/ddm/%2e%2e/team-b/m.tar",
                                 "https://models.acme.example/ddm/%2E./team-b/m.tar",
                                 "s3://acme-models/.%2e/team-b/m.tar",
                                 "https://models.acme.example/ddm/x%2f..%2fteam-b/m.tar",
                                 "https://models.acme.example/ddm/x\\..\\team-b/m.tar"])
def test_a_parent_segment_however_encoded_cannot_leave_a_listed_prefix(uri: str) -> None:
    """A store decodes ``%2e`` to ``.`` (RFC 3986: the same character), and may read ``%2f``
    or ``\\`` as ``/``, so under the listed ``https://models.acme.example/ddm/`` these would
    fetch ``/team-b/m.tar``; they passed."""
    with pytest.raises(SpecError, match=r"'\.\.' is not allowed in a checkpoint path"):
        parse_spec(_spec(uri))


def test_empty_lists_allow_everything() -> None:
    raw = _spec("pvc://x/y", "any.example/x:1")
    raw["router"]["auth"] = {"secretName": "anything"}
    raw["experts"][0].update(tolerations=[{"operator": "Exists"}], nodeSelector={"any": "x"})
    assert policy_problems(parse_spec(raw), AllowLists()) == []


def test_the_lists_come_from_the_environment_and_a_stretchable_entry_is_refused() -> None:
    config = OperatorConfig.from_env({"DDM_ALLOWED_IMAGES": "ddm:, reg.example/",
                                      "DDM_ALLOWED_CHECKPOINT_SOURCES": "pvc://,s3://m/"})
    assert (config.allowed.images, config.allowed.checkpoint_sources) == (
        ("ddm:", "reg.example/"), ("pvc://", "s3://m/"))
    with pytest.raises(ValueError, match="'https://models.acme.example' must be a scheme"):
        OperatorConfig.from_env({"DDM_ALLOWED_CHECKPOINT_SOURCES": "https://models.acme.example"})


def _fetched(credentials: str) -> dict:
    return {"uri": "s3://acme-models/a", "credentialsSecret": {"name": credentials, "key": "h"}}


def test_only_listed_secrets_may_be_named_by_a_spec() -> None:
    lists = AllowLists(secrets=("ddm-*", "team-token"))
    raw = _spec()
    raw["router"]["auth"] = {"secretName": "team-token"}
    raw["experts"][0]["checkpoint"] = _fetched("ddm-store-login")
    assert policy_problems(parse_spec(raw), lists) == []
    raw["router"]["auth"] = {"secretName": "team-token-2"}
    raw["router"]["checkpoint"] = _fetched("cluster-admin-token")
    raw["experts"][0]["checkpoint"] = _fetched("ddm")  # the prefix is 'ddm-'
    listed = "(DDM_ALLOWED_SECRETS: ddm-*, team-token)"
    assert policy_problems(parse_spec(raw), lists) == [
        f"spec.router.auth.secretName: Secret 'team-token-2' is not among the Secrets this "
        f"operator lets a spec name {listed}",
        f"spec.router.checkpoint.credentialsSecret.name: Secret 'cluster-admin-token' is not "
        f"among the Secrets this operator lets a spec name {listed}",
        f"spec.experts[0].checkpoint.credentialsSecret.name: Secret 'ddm' is not among the "
        f"Secrets this operator lets a spec name {listed}"]


def test_only_listed_toleration_and_node_selector_keys_may_be_used() -> None:
    lists = AllowLists(toleration_keys=("team-a/dedicated",),
                       node_selector_keys=("topology.kubernetes.io/zone",))
    raw = _spec()
    raw["experts"][0].update(
        tolerations=[{"key": "team-a/dedicated", "operator": "Exists"}],
        nodeSelector={"topology.kubernetes.io/zone": "eu-1a"},
        accelerator={"type": "nvidia"})  # the accelerator's own are the operator's
    assert policy_problems(parse_spec(raw), lists) == []
    raw["router"]["tolerations"] = [{"key": "node-role.kubernetes.io/control-plane",
                                     "operator": "Exists"}, {"operator": "Exists"}]
    raw["experts"][0]["nodeSelector"] = {"kubernetes.io/hostname": "ingress-node"}
    assert policy_problems(parse_spec(raw), lists) == [
        "spec.router.tolerations[0]: key 'node-role.kubernetes.io/control-plane' is not among "
        "the keys this operator allows (DDM_ALLOWED_TOLERATION_KEYS: team-a/dedicated)",
        "spec.router.tolerations[1]: key none (it would tolerate every taint) is not among "
        "the keys this operator allows (DDM_ALLOWED_TOLERATION_KEYS: team-a/dedicated)",
        "spec.experts[0].nodeSelector: key 'kubernetes.io/hostname' is not among the keys this "
        "operator allows (DDM_ALLOWED_NODE_SELECTOR_KEYS: topology.kubernetes.io/zone)"]


def test_node_affinity_keys_are_held_to_the_node_selector_list() -> None:
    """A nodeAffinity places a pod as a nodeSelector does; it passed any list before."""
    lists = AllowLists(node_selector_keys=("topology.kubernetes.io/zone",))
    zone = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["eu-1a"]}
    host = {"key": "kubernetes.io/hostname", "operator": "In", "values": ["control-plane"]}
    name = {"key": "metadata.name", "operator": "In", "values": ["control-plane"]}
    raw = _spec()
    raw["experts"][0]["affinity"] = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [zone]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "preference": {"matchExpressions": [zone]}}]}}
    assert policy_problems(parse_spec(raw), lists) == []
    raw["experts"][0]["affinity"] = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [zone]}, {"matchExpressions": [host]},
            {"matchFields": [name]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "preference": {"matchExpressions": [host]}}]}}
    refusal = ("is not among the keys this operator allows (DDM_ALLOWED_NODE_SELECTOR_KEYS: "
               "topology.kubernetes.io/zone)")
    assert policy_problems(parse_spec(raw), lists) == [
        f"spec.experts[0].affinity.nodeAffinity.required matchExpressions: key "
        f"'kubernetes.io/hostname' {refusal}",
        f"spec.experts[0].affinity.nodeAffinity.required matchFields: key 'metadata.name' "
        f"{refusal}",
        f"spec.experts[0].affinity.nodeAffinity.preferred matchExpressions: key "
        f"'kubernetes.io/hostname' {refusal}"]


@pytest.mark.parametrize("path, allowed", [
    ("/srv/ddm/models/e", True), ("/srv/ddm/", True), ("/srv/ddm", True),
    ("/srv/ddm-evil/e", False), ("/srv/ddm/./e", False), ("/etc/kubernetes", False),
    ("/var/lib/ddm/e", True),
])  # ('..' and '//' the spec's parser refuses already)
def test_host_paths_must_lie_under_a_listed_prefix(path: str, allowed: bool) -> None:
    lists = AllowLists(host_paths=("/srv/ddm/", "/var/lib/ddm/"))
    problems = policy_problems(parse_spec(_spec(f"file://{path}"), allow_host_paths=True),
                               lists)
    assert problems == ([] if allowed else [
        f"spec.experts[0].checkpoint.uri: 'file://{path}' is not under a host path this "
        "operator allows (DDM_ALLOW_HOST_PATHS: /srv/ddm/, /var/lib/ddm/)"])


def test_no_host_path_is_allowed_unless_listed_and_the_entries_are_checked() -> None:
    assert OperatorConfig.from_env({}).allowed.host_paths == ()
    assert OperatorConfig.from_env({"DDM_ALLOW_HOST_PATHS": "/"}).allowed.host_paths == ("/",)
    for entry in ("true", "/srv/ddm", "/srv/../etc/", "relative/"):
        with pytest.raises(ValueError, match=f"DDM_ALLOW_HOST_PATHS: {entry!r} is not an "
                                             "absolute directory ending with '/'"):
            OperatorConfig.from_env({"DDM_ALLOW_HOST_PATHS": entry})
    with pytest.raises(ValueError, match="DDM_ALLOWED_SECRETS: 'Team_Token' is not a Secret"):
        OperatorConfig.from_env({"DDM_ALLOWED_SECRETS": "Team_Token"})
