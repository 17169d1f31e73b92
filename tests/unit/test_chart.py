"""The Helm chart, rendered by the real helm: lint, values schema, RBAC, security, copies.

Server-side checks (dry-run, install, upgrade, uninstall) are in tests/e2e/test_helm_install.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from helm_tool import ensure_helm
from podsecurity import violations

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ddm-operator"


@pytest.fixture(scope="module")
def helm() -> Path:
    return ensure_helm()


def helm_run(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60)


def render(helm: Path, *sets: str, namespace: str = "ddm-system") -> list[dict[str, Any]]:
    """The chart's objects for these ``--set`` values (CRDs not included)."""
    args = ["template", "ddm", str(CHART), "--namespace", namespace]
    for value in sets:
        args += ["--set", value]
    result = helm_run(helm, *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def test_lint_strict_passes(helm: Path) -> None:
    for sets in ([], ["watchNamespaces={team-a,team-b}", "example.enabled=true"]):
        args = ["lint", "--strict", str(CHART)]
        for value in sets:
            args += ["--set", value]
        result = helm_run(helm, *args)
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("value, message", [
    ("replicas=2", "Additional property replicas is not allowed"),
    ("images.gpu=x", "images: Additional property gpu is not allowed"),
    ("routerAuth.enabled=maybe", "routerAuth.enabled"),
    ("watchNamespaces={Team_A}", "watchNamespaces"),
    ("images.pullPolicy=Sometimes", "pullPolicy"),
    ("operator.livenessPort=80", "livenessPort"),
])
def test_values_schema_rejects_bad_values_by_name(helm: Path, value: str, message: str) -> None:
    result = helm_run(helm, "template", "ddm", str(CHART), "--set", value)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_every_rendered_pod_meets_the_restricted_profile(helm: Path) -> None:
    for sets in ([], ["watchNamespaces={a}", "networkPolicy.enabled=true"]):
        deployments = by_kind(render(helm, *sets), "Deployment")
        assert deployments
        for deployment in deployments:
            assert violations(deployment["spec"]["template"]["spec"]) == []


def test_operator_deployment_is_one_recreated_replica_with_a_liveness_probe(helm: Path) -> None:
    (deployment,) = by_kind(render(helm), "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    (container,) = spec["template"]["spec"]["containers"]
    assert container["command"][:2] == ["ddm", "operator"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["limits"]["memory"]


def env_of(objects: list[dict[str, Any]]) -> dict[str, str]:
    (deployment,) = by_kind(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"]}


def test_images_get_the_app_version_unless_they_carry_a_tag_or_digest(helm: Path) -> None:
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    env = env_of(render(helm, "images.cuda=registry.example:5000/ddm-cuda",
                        "images.neuron=ecr.example/ddm-neuron:7",
                        "images.tpu=gcr.example/ddm-tpu@sha256:" + "0" * 64))
    assert env["DDM_IMAGE_CPU"] == f"ghcr.io/ddm-operator/ddm:{version}"
    assert env["DDM_IMAGE_CUDA"] == f"registry.example:5000/ddm-cuda:{version}"
    assert env["DDM_IMAGE_NEURON"] == "ecr.example/ddm-neuron:7"
    assert env["DDM_IMAGE_TPU"] == "gcr.example/ddm-tpu@sha256:" + "0" * 64
    assert env_of(render(helm, "images.tag=1.2.3"))["DDM_IMAGE_CPU"] == \
        "ghcr.io/ddm-operator/ddm:1.2.3"


def test_the_operator_runs_its_own_image_not_the_workloads(helm: Path) -> None:
    """The operator's pod runs the slim operator image (no ML framework); the images it hands
    to its children are the workload images: by default the published ones, which the release
    workflow pushes (tests/unit/test_release.py)."""
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    objects = render(helm)
    (deployment,) = by_kind(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"ghcr.io/ddm-operator/ddm-operator:{version}"
    assert env_of(objects)["DDM_IMAGE_CPU"] == f"ghcr.io/ddm-operator/ddm:{version}"
    (moved,) = by_kind(render(helm, "images.operator=reg.example/ops/ddm-operator"), "Deployment")
    assert moved["spec"]["template"]["spec"]["containers"][0]["image"] == \
        f"reg.example/ops/ddm-operator:{version}"


def test_operator_settings_reach_the_operator_environment(helm: Path) -> None:
    from ddm.operator.config import OperatorConfig

    env = env_of(render(helm, "watchNamespaces={a,b}", "networkPolicy.enabled=true",
                        "routerAuth.enabled=false", "clusterDomain=corp.internal"))
    assert env["DDM_WATCH_NAMESPACES"] == "a,b"
    assert env["DDM_NETWORK_POLICY"] == "true" and env["DDM_ROUTER_AUTH"] == "false"
    config = OperatorConfig.from_env(env)
    assert config.cluster_domain == "corp.internal" and config.allowed.host_paths == ()
    host_paths = env_of(render(helm, "allowHostPaths={/srv/ddm/,/var/lib/ddm/}"))
    assert OperatorConfig.from_env(host_paths).allowed.host_paths == ("/srv/ddm/",
                                                                      "/var/lib/ddm/")
    result = helm_run(helm, "template", "ddm", str(CHART), "--set", "allowHostPaths=true")
    assert result.returncode != 0 and "allowHostPaths" in result.stderr


def rules_of(role: dict[str, Any]) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(group, resource, tuple(rule["verbs"]))
            for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"]]


def test_rbac_has_no_wildcards_and_only_creates_secrets(helm: Path) -> None:
    for sets in ([], ["watchNamespaces={a,b}"]):
        objects = render(helm, *sets)
        roles = by_kind(objects, "ClusterRole") + by_kind(objects, "Role")
        assert len(roles) == (1 if not sets else 2)
        for role in roles:
            secrets = [verbs for group, resource, verbs in rules_of(role)
                       if resource == "secrets" and group == ""]
            assert secrets == [("create",)], role["metadata"]["name"]  # immutable, never read
            for group, resource, verbs in rules_of(role):
                assert "*" not in (group, resource, *verbs), role["metadata"]["name"]


def test_cluster_wide_install_binds_one_cluster_role(helm: Path) -> None:
    objects = render(helm)
    (cluster_role,) = by_kind(objects, "ClusterRole")
    assert ("ddm.dev", "ddmdeployments", ("get", "list", "watch", "patch")) in rules_of(
        cluster_role)
    assert not by_kind(objects, "Role") and not by_kind(objects, "RoleBinding")
    (binding,) = by_kind(objects, "ClusterRoleBinding")
    (account,) = by_kind(objects, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": "ddm-system"}]


def test_trainings_may_create_jobs_and_trainjobs_only_where_trainer_is_installed(
        helm: Path) -> None:
    for sets in ([], ["watchNamespaces={a}"]):
        (role,) = by_kind(render(helm, *sets), "ClusterRole" if not sets else "Role")
        rules = rules_of(role)
        assert ("batch", "jobs", ("list", "watch", "create")) in rules
        assert ("", "pods/log", ("get",)) in rules  # the progress the jobs log
        assert ("ddm.dev", "ddmtrainings/status", ("patch",)) in rules
        assert ("ddm.dev", "ddmdeployments", ("create",)) in rules  # from the outputs
        assert not [r for r in rules if r[0] == "trainer.kubeflow.org"]
    (role,) = by_kind(render(helm, "kubeflowTrainer=true"), "ClusterRole")
    assert ("trainer.kubeflow.org", "trainjobs", ("list", "create")) in rules_of(role)


def test_watched_namespaces_get_a_role_each_and_nothing_cluster_scoped(helm: Path) -> None:
    objects = render(helm, "watchNamespaces={team-a,team-b}")
    roles = by_kind(objects, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in by_kind(objects, "RoleBinding")) == [
        "team-a", "team-b"]
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")


def test_fetch_networks_reach_the_operator_and_bad_ones_fail_the_install(helm: Path) -> None:
    from ddm.operator.config import OperatorConfig

    env = env_of(render(helm, "checkpointFetch.allowNetworks={10.0.3.7/32,fd00:1::/64}"))
    assert OperatorConfig.from_env(env).fetch_allow_networks == ("10.0.3.7/32", "fd00:1::/64")
    assert env_of(render(helm))["DDM_FETCH_ALLOW_NETWORKS"] == ""
    result = helm_run(helm, "template", "ddm", str(CHART), "--set",
                      "checkpointFetch.allowNetworks={store.example}")
    assert result.returncode != 0 and "allowNetworks" in result.stderr


def test_cloud_identity_is_off_unless_the_value_turns_it_on(helm: Path) -> None:
    from ddm.operator.config import OperatorConfig

    assert OperatorConfig.from_env(env_of(render(helm))).fetch_cloud_identity is False
    env = env_of(render(helm, "checkpointFetch.cloudIdentity=true"))
    assert OperatorConfig.from_env(env).fetch_cloud_identity is True
    result = helm_run(helm, "template", "ddm", str(CHART), "--set-string",
                      "checkpointFetch.cloudIdentity=yes please")
    assert result.returncode != 0 and "cloudIdentity" in result.stderr


def test_metrics_scrapers_reach_the_operator_and_malformed_ones_fail_the_install(
        helm: Path) -> None:
    from ddm.operator.config import OperatorConfig

    assert OperatorConfig.from_env(env_of(render(helm))).metrics_from == ()
    env = env_of(render(
        helm, "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=monitoring",
        "networkPolicy.metricsFrom[1].ipBlock.cidr=10.9.0.0/16"))
    assert OperatorConfig.from_env(env).metrics_from == (
        {"namespaceSelector": {"matchLabels": {"team": "monitoring"}}},
        {"ipBlock": {"cidr": "10.9.0.0/16"}})
    for bad in ("networkPolicy.metricsFrom[0].podSelector.app=x",
                "networkPolicy.metricsFrom[0].ipBlock.cidr=everyone"):
        result = helm_run(helm, "template", "ddm", str(CHART), "--set", bad)
        assert result.returncode != 0 and "metricsFrom" in result.stderr, bad


def test_the_routers_trusted_proxies_reach_the_operator(helm: Path) -> None:
    from ddm.operator.config import OperatorConfig

    assert OperatorConfig.from_env(env_of(render(helm))).router_trusted_proxies == ()
    env = env_of(render(helm, "routerClients.trustedProxies={10.42.7.0/24,fd00:7::/64}"))
    assert OperatorConfig.from_env(env).router_trusted_proxies == ("10.42.7.0/24", "fd00:7::/64")
    result = helm_run(helm, "template", "ddm", str(CHART), "--set",
                      "routerClients.trustedProxies={ingress.example}")
    assert result.returncode != 0 and "trustedProxies" in result.stderr


def test_tenant_allow_lists_reach_the_operator(helm: Path) -> None:
    from ddm.operator.config import OperatorConfig
    from ddm.operator.policy import AllowLists

    env = env_of(render(helm, "tenants.allowedImages={reg.example/ddm/,ddm:}",
                        "tenants.allowedCheckpointSources={pvc://,s3://models/}",
                        "tenants.allowedSecrets={ddm-*,store-login}",
                        "tenants.allowedClaims={shared-models,*}",
                        "tenants.allowedTolerationKeys={team-a/dedicated}",
                        "tenants.allowedNodeSelectorKeys={topology.kubernetes.io/zone}",
                        "tenants.allowedStrategies={oracle,top1}",
                        "tenants.allowControlPlane=true"))
    allowed = OperatorConfig.from_env(env).allowed
    assert allowed.images == ("reg.example/ddm/", "ddm:")
    assert allowed.checkpoint_sources == ("pvc://", "s3://models/")
    assert allowed.secrets == ("ddm-*", "store-login")
    assert allowed.claims == ("shared-models", "*")
    assert allowed.toleration_keys == ("team-a/dedicated",)
    assert allowed.node_selector_keys == ("topology.kubernetes.io/zone",)
    assert allowed.strategies == ("oracle", "top1")
    assert (allowed.control_plane, allowed.tolerate_all_taints, allowed.node_names) == (
        True, False, False)
    # the chart's defaults are the operator's: containing
    assert OperatorConfig.from_env(env_of(render(helm))).allowed == AllowLists()
    for bad in ("tenants.allowedSecrets={Team_Token}", "tenants.allowedTolerationKeys={a b}",
                "tenants.allowedClaims={Data_1}", "tenants.allowedStrategies={all}",
                "tenants.allowNodeNames=yes"):
        result = helm_run(helm, "template", "ddm", str(CHART), "--set", bad)
        assert result.returncode != 0 and bad.split("=")[0].split(".")[1] in result.stderr
    result = helm_run(helm, "template", "ddm", str(CHART), "--set",
                      "tenants.allowedCheckpointSources={https://store.example}")
    assert result.returncode != 0 and "allowedCheckpointSources" in result.stderr


def test_example_is_the_shipped_digits_manifest(helm: Path) -> None:
    assert not by_kind(render(helm), "DDMDeployment")
    (example,) = by_kind(render(helm, "example.enabled=true"), "DDMDeployment")
    shipped = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    assert example["spec"] == shipped["spec"]
    assert example["metadata"]["namespace"] == "ddm-system"


def test_the_charts_example_is_the_example() -> None:
    """Helm reads only files inside the chart: the example is a copy (its CRDs are generated:
    tests/unit/test_generated_crds.py)."""
    assert (CHART / "examples" / "digits.yaml").read_text() == (
        ROOT / "examples" / "digits.yaml").read_text(), (
        "charts/ddm-operator/examples/digits.yaml differs from examples/digits.yaml: run "
        "`make chart-sync`")


def test_the_fetch_cap_and_the_cluster_dns_reach_the_operator(helm: Path) -> None:
    from ddm.operator.config import OperatorConfig

    default = OperatorConfig.from_env(env_of(render(helm)))
    assert default.fetch_max_bytes == 16 << 30
    assert default.dns_namespace_selector == {
        "matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}
    assert default.dns_pod_selector == {"matchLabels": {"k8s-app": "kube-dns"}}
    config = OperatorConfig.from_env(env_of(render(
        helm, "checkpointFetch.maxBytes=1073741824",
        "networkPolicy.dns.podSelector.matchLabels.app=node-cache")))
    assert config.fetch_max_bytes == 1 << 30
    assert config.dns_pod_selector == {"matchLabels": {"k8s-app": "kube-dns",
                                                       "app": "node-cache"}}
    result = helm_run(helm, "template", "ddm", str(CHART), "--set", "checkpointFetch.maxBytes=0")
    assert result.returncode != 0 and "maxBytes" in result.stderr
