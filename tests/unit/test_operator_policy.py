"""The operator's tenancy policy (``ddm.operator.policy``): the containing defaults (the
operator's own image repositories, the DDM's own Secrets and claims, no keyless toleration,
control-plane or named node) and the settings that widen them: images, checkpoint sources,
Secrets, claims, toleration and nodeSelector keys, host-path prefixes, strategies."""

from __future__ import annotations

import pytest

from ddm.deploy.spec import SpecError, parse_spec
from ddm.operator.config import OperatorConfig
from ddm.operator.policy import AllowLists, policy_problems, repository
from tests.support.hostile_tenants import HOSTILE, hostile_spec

IMAGES = ("registry.acme.example/ddm/", "ddm:")
SOURCES = ("image://", "s3://acme-models/", "https://models.acme.example/ddm/")
LISTS = AllowLists(images=IMAGES, checkpoint_sources=SOURCES)
#: The operator's own images (``DDM_IMAGE_*``), as the chart sets them.
OWN = ("ddm:0.1.0", "ddm-cuda:0.1.0", "reg.example:5000/ddm/neuron@sha256:" + "1" * 64)
NAME = "team"


def _problems(raw: dict, allowed: AllowLists = AllowLists(), **parse: bool) -> list[str]:
    """``policy_problems`` of the DDM ``NAME`` under the operator images ``OWN``."""
    return policy_problems(parse_spec(raw, **parse), NAME, allowed, OWN)


def _spec(uri: str = "image:///m", image: str | None = None) -> dict:
    expert = {"name": "e", "checkpoint": {"uri": uri}, **({"image": image} if image else {})}
    return {"sampling": {"strategy": "top1"}, "router": {"checkpoint": {"uri": "image:///r"}},
            "experts": [expert]}


@pytest.mark.parametrize("image", [None, "registry.acme.example/ddm/cpu:1", "ddm:2.0",
                                   "registry.acme.example/ddm/sub/x@sha256:" + "0" * 64])
def test_images_inside_the_list_are_allowed(image: str | None) -> None:
    assert _problems(_spec(image=image), LISTS) == []


@pytest.mark.parametrize("image", ["registry.acme.example/ddm-evil/x:1", "ddm-evil:1",
                                   "evil.example/registry.acme.example/ddm/x:1"])
def test_an_image_outside_the_list_is_refused_naming_the_field(image: str) -> None:
    assert _problems(_spec(image=image), LISTS) == [
        f"spec.experts[0].image: {image!r} is neither of the operator's own repositories "
        "(ddm, ddm-cuda, reg.example:5000/ddm/neuron) nor among the images it allows "
        "(DDM_ALLOWED_IMAGES: registry.acme.example/ddm/, ddm:)"]


@pytest.mark.parametrize("uri", ["s3://acme-models/a", "https://models.acme.example/ddm/a.tgz"])
def test_sources_inside_the_list_are_allowed(uri: str) -> None:
    assert _problems(_spec(uri), LISTS) == []


@pytest.mark.parametrize("uri, shown", [
    ("s3://acme-models-evil/a", "s3://acme-models-evil/a"),
    ("https://models.acme.example.evil.test/ddm/a?X-Amz-Signature=s",
     "https://models.acme.example.evil.test/ddm/a"),
    ("pvc://team-models/a", "pvc://team-models/a"),
])
def test_a_source_outside_the_list_is_refused_redacted(uri: str, shown: str) -> None:
    assert _problems(_spec(uri), LISTS) == [
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


@pytest.mark.parametrize("attack", list(HOSTILE))
def test_the_defaults_refuse_each_attack_and_name_the_setting_that_allows_it(
        attack: str) -> None:
    change, refusal, allowance = HOSTILE[attack]
    raw = hostile_spec(_spec(), change)
    assert _problems(raw, OperatorConfig.from_env({}).allowed) == [
        refusal.format(name=NAME, own="ddm, ddm-cuda, reg.example:5000/ddm/neuron")]
    assert _problems(raw, OperatorConfig.from_env(allowance).allowed) == []


def test_the_operator_may_restrict_the_strategies() -> None:
    allowed = OperatorConfig.from_env({"DDM_ALLOWED_STRATEGIES": "top1,topk:2"}).allowed
    assert _problems(_spec(), allowed) == []  # top1
    raw = hostile_spec(_spec(), {"sampling": {"strategy": "ensemble"}})
    assert _problems(raw, allowed) == [
        "spec.sampling.strategy: 'ensemble' is not among the strategies this operator allows "
        "(DDM_ALLOWED_STRATEGIES: top1, topk:2)"]
    assert _problems(hostile_spec(_spec(), {"sampling": {"strategy": "threshold:0.5"}}),
                     allowed) == [
        "spec.sampling.strategy: 'threshold:0.5' is not among the strategies this operator "
        "allows (DDM_ALLOWED_STRATEGIES: top1, topk:2)"]


def test_the_defaults_allow_what_is_the_ddms_own() -> None:
    """The operator's repositories (any tag or digest), Secrets and claims named after the
    DDM, keyed tolerations, nodeSelectors and nodeAffinities that keep pods off the
    control plane."""
    raw = _spec("pvc://team-models/e", "ddm-cuda:2.0")
    raw["router"].update(image="reg.example:5000/ddm/neuron:3", auth={"secretName": "team-api"})
    raw["router"]["checkpoint"] = {"uriFrom": {"secretKeyRef": {"name": "team-urls",
                                                                "key": "router"}}}
    raw["experts"].append({"name": "f", "image": "ddm@sha256:" + "2" * 64,
                           "checkpoint": _fetched("team-store-login")})
    raw["experts"][0].update(
        tolerations=[{"key": "team-a/dedicated", "operator": "Exists"}],
        nodeSelector={"topology.kubernetes.io/zone": "eu-1a"},
        affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "node-role.kubernetes.io/control-plane", "operator": "DoesNotExist"}],
                "matchFields": [{"key": "metadata.name", "operator": "NotIn",
                                 "values": ["control-plane-1"]}]}]}}})
    assert _problems(raw) == []


@pytest.mark.parametrize("secret", ["team-router-token-0123abcd", "team-expert-token-0123abcd",
                                    "team-checkpoint-0123456789abcdef",
                                    "team-b-expert-token-0123abcd"])
def test_the_operators_own_secrets_are_never_a_specs(secret: str) -> None:
    """``team-*`` would cover them, and ``team-b-*`` (another DDM's): a checkpoint fetched
    from the tenant's server with another DDM's expert token as its credentials sends it
    there."""
    raw = _spec("s3://acme-models/a")
    raw["experts"][0]["checkpoint"] = _fetched(secret)
    assert _problems(raw) == [
        f"spec.experts[0].checkpoint.credentialsSecret.name: Secret {secret!r} is neither "
        "the DDM's own (team-*, but the operator's tokens and checkpoint URIs) nor among the "
        "Secrets this operator lets a spec name (DDM_ALLOWED_SECRETS: none)"]


@pytest.mark.parametrize("image, repo", [
    ("ddm", "ddm"), ("ddm:1", "ddm"), ("ddm@sha256:" + "0" * 64, "ddm"),
    ("reg.example:5000/ddm/cpu:1@sha256:" + "0" * 64, "reg.example:5000/ddm/cpu"),
    ("reg.example:5000/ddm", "reg.example:5000/ddm")])
def test_an_images_repository_drops_its_tag_and_digest_not_a_registrys_port(
        image: str, repo: str) -> None:
    assert repository(image) == repo


def test_a_star_allows_any_image_secret_and_claim() -> None:
    raw = hostile_spec(_spec(), {"router.image": "evil.example/pwn:latest",
                        "router.auth": {"secretName": "prod-db-credentials"},
                        "experts.0.checkpoint": {"uri": "pvc://other-apps-data/db"}})
    assert len(_problems(raw)) == 3
    assert _problems(raw, AllowLists(images=("*",), secrets=("*",), claims=("*",))) == []


def test_the_lists_come_from_the_environment_and_a_stretchable_entry_is_refused() -> None:
    config = OperatorConfig.from_env({"DDM_ALLOWED_IMAGES": "ddm:, reg.example/",
                                      "DDM_ALLOWED_CHECKPOINT_SOURCES": "pvc://,s3://m/"})
    assert (config.allowed.images, config.allowed.checkpoint_sources) == (
        ("ddm:", "reg.example/"), ("pvc://", "s3://m/"))
    with pytest.raises(ValueError, match="'https://models.acme.example' must be a scheme"):
        OperatorConfig.from_env({"DDM_ALLOWED_CHECKPOINT_SOURCES": "https://models.acme.example"})
    with pytest.raises(ValueError, match="DDM_ALLOWED_CLAIMS: 'Data_1' is not a claim name"):
        OperatorConfig.from_env({"DDM_ALLOWED_CLAIMS": "Data_1"})
    with pytest.raises(ValueError, match="DDM_ALLOWED_STRATEGIES: 'all' is not a routing"):
        OperatorConfig.from_env({"DDM_ALLOWED_STRATEGIES": "top1,all"})
    with pytest.raises(ValueError, match="DDM_ALLOW_CONTROL_PLANE must be true or false"):
        OperatorConfig.from_env({"DDM_ALLOW_CONTROL_PLANE": "yes please"})


def test_a_stores_credentials_file_is_held_to_the_same_secret_rule() -> None:
    """``storeCredentialsSecret`` names a Secret as ``credentialsSecret`` does: the DDM's own
    (``team-*``), never another DDM's token or one of another tenant's Secrets."""
    raw = _spec("s3://acme-models/a")
    raw["experts"][0]["checkpoint"]["storeCredentialsSecret"] = {"name": "team-aws", "key": "c"}
    raw["router"]["checkpoint"] = {"uri": "gs://acme-models/r", "storeCredentialsSecret": {
        "name": "other-gcp-key", "key": "key.json"}}
    assert _problems(raw) == [
        "spec.router.checkpoint.storeCredentialsSecret.name: Secret 'other-gcp-key' is neither "
        "the DDM's own (team-*, but the operator's tokens and checkpoint URIs) nor among the "
        "Secrets this operator lets a spec name (DDM_ALLOWED_SECRETS: none)"]
    raw["router"]["checkpoint"]["storeCredentialsSecret"]["name"] = "team-expert-token-0123abcd"
    assert len(_problems(raw)) == 1


def _fetched(credentials: str) -> dict:
    return {"uri": "s3://acme-models/a", "credentialsSecret": {"name": credentials, "key": "h"}}


def test_listed_secrets_may_be_named_beside_the_ddms_own() -> None:
    lists = AllowLists(secrets=("ddm-*", "shared-token"))
    raw = _spec()
    raw["router"]["auth"] = {"secretName": "shared-token"}
    raw["experts"][0]["checkpoint"] = _fetched("ddm-store-login")
    assert _problems(raw, lists) == []
    raw["router"]["auth"] = {"secretName": "shared-token-2"}
    raw["router"]["checkpoint"] = _fetched("cluster-admin-token")
    raw["experts"][0]["checkpoint"] = _fetched("team")  # the DDM's own are 'team-*'
    refusal = ("is neither the DDM's own (team-*, but the operator's tokens and checkpoint "
               "URIs) nor among the Secrets this operator lets a spec name "
               "(DDM_ALLOWED_SECRETS: ddm-*, shared-token)")
    assert _problems(raw, lists) == [
        f"spec.router.auth.secretName: Secret 'shared-token-2' {refusal}",
        f"spec.router.checkpoint.credentialsSecret.name: Secret 'cluster-admin-token' "
        f"{refusal}",
        f"spec.experts[0].checkpoint.credentialsSecret.name: Secret 'team' {refusal}"]


def test_only_listed_toleration_and_node_selector_keys_may_be_used() -> None:
    lists = AllowLists(toleration_keys=("team-a/dedicated",),
                       node_selector_keys=("topology.kubernetes.io/zone",),
                       tolerate_all_taints=True)
    raw = _spec()
    raw["experts"][0].update(
        tolerations=[{"key": "team-a/dedicated", "operator": "Exists"}, {"operator": "Exists"}],
        nodeSelector={"topology.kubernetes.io/zone": "eu-1a"},
        accelerator={"type": "nvidia"})  # the accelerator's own are the operator's
    assert _problems(raw, lists) == []
    raw["router"]["tolerations"] = [{"key": "team-b/dedicated", "operator": "Exists"}]
    raw["experts"][0]["nodeSelector"] = {"pool": "ingress"}
    assert _problems(raw, lists) == [
        "spec.router.tolerations[0]: key 'team-b/dedicated' is not among the keys this "
        "operator allows (DDM_ALLOWED_TOLERATION_KEYS: team-a/dedicated)",
        "spec.experts[0].nodeSelector: key 'pool' is not among the keys this "
        "operator allows (DDM_ALLOWED_NODE_SELECTOR_KEYS: topology.kubernetes.io/zone)"]


def test_node_affinity_keys_are_held_to_the_node_selector_list() -> None:
    """A nodeAffinity places a pod as a nodeSelector does; it passed any list before."""
    lists = AllowLists(node_selector_keys=("topology.kubernetes.io/zone",), node_names=True)
    zone = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["eu-1a"]}
    host = {"key": "kubernetes.io/hostname", "operator": "In", "values": ["control-plane"]}
    name = {"key": "metadata.name", "operator": "In", "values": ["control-plane"]}
    raw = _spec()
    raw["experts"][0]["affinity"] = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [zone]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "preference": {"matchExpressions": [zone]}}]}}
    assert _problems(raw, lists) == []
    raw["experts"][0]["affinity"] = {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [zone]}, {"matchExpressions": [host]},
            {"matchFields": [name]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "preference": {"matchExpressions": [host]}}]}}
    refusal = ("is not among the keys this operator allows (DDM_ALLOWED_NODE_SELECTOR_KEYS: "
               "topology.kubernetes.io/zone)")
    assert _problems(raw, lists) == [
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
    problems = _problems(_spec(f"file://{path}"), lists, allow_host_paths=True)
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
    with pytest.raises(ValueError, match="DDM_ALLOWED_SECRETS: 'Team_Token' is not a Secret name"):
        OperatorConfig.from_env({"DDM_ALLOWED_SECRETS": "Team_Token"})
