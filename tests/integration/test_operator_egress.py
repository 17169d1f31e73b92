"""Who a DDM's pods may send to, read back from the real API server: the NetworkPolicies the
operator wrote, evaluated (``netpolicy``) against the labels of the real pods the scheduler
bound. No policy lets a serving pod (expert, router) send beyond the DDM's own experts, its
checkpoint stager and the cluster DNS; the stager, the one pod that fetches, reaches no
private, loopback, link-local, CGNAT, unique-local or metadata address an admin did not list.

The dev cluster's CNI does not enforce NetworkPolicies, so this checks what the policies say,
not packets; a CNI that enforces them (Calico, Cilium) turns what they say into what happens.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from typing import Any

import netpolicy
import pytest
from test_operator import (  # the shared helpers of the operator's cluster tests
    DEFAULT_CONFIG,
    OWNER_LABEL,
    Cluster,
    OperatorThread,
    _bound_pods,
    _deploy,
    crd,  # noqa: F401  (a fixture: the CRD applied)
    operator,  # noqa: F401  (a fixture: the operator running with default settings)
)

from ddm.checkpoints.destinations import METADATA_ADDRESSES
from ddm.operator import names
from ddm.operator.config import OperatorConfig

#: The admin's one private store, which the stager alone may reach.
ON_PREM_STORE = "10.0.3.7/32"
CONFIG = OperatorConfig(images=DEFAULT_CONFIG.images, network_policy=True,
                        fetch_allow_networks=(ON_PREM_STORE,))
#: Two experts, one fetched from a bucket and one in its image; the router network's URI in
#: the user's Secret (a pre-signed URL).
SPEC = {"sampling": {"strategy": "top1"},
        "router": {"checkpoint": {"uriFrom": {"secretKeyRef": {"name": "egress-signed-urls",
                                                               "key": "router"}}}},
        "experts": [{"name": "a", "checkpoint": {"uri": "s3://ddm-models/a"}, "classes": [0, 1]},
                    {"name": "b", "checkpoint": {"uri": "image:///models/b"},
                     "classes": [2, 3]}]}
CLOSED = {"private": ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"],
          "loopback": ["127.0.0.0/8", "::1/128"], "link-local": ["169.254.0.0/16", "fe80::/10"],
          "CGNAT": ["100.64.0.0/10"], "ULA": ["fc00::/7"],
          "metadata": [f"{a}/{a.max_prefixlen}" for a in METADATA_ADDRESSES]}


@pytest.fixture(scope="module")
def cluster(kube_client: Any) -> Cluster:
    return Cluster(kube_client)


@pytest.fixture
def fetching_ddm(operator: OperatorThread, cluster: Cluster, kube_namespace: str  # noqa: F811
                 ) -> Iterator[dict[str, list[dict]]]:
    """The DDM's bound pods by component, with the operator writing NetworkPolicies."""
    operator.restart(CONFIG)
    try:
        _deploy(cluster, kube_namespace, "egress", SPEC)
        pods = _bound_pods(cluster, kube_namespace, f"{OWNER_LABEL}=egress", 4)
        by_component: dict[str, list[dict]] = {}
        for pod in pods:
            component = pod["metadata"]["labels"][names.COMPONENT_LABEL]
            by_component.setdefault(component, []).append(pod)
        assert sorted(by_component) == ["expert", "router", "stager"]
        yield by_component
    finally:
        operator.restart(DEFAULT_CONFIG)


def _names(pods: list[dict]) -> set[str]:
    return {p["metadata"]["name"] for p in pods}


def test_no_policy_lets_a_serving_pod_send_beyond_its_experts_stager_and_dns(
        fetching_ddm: dict[str, list[dict]], cluster: Cluster, kube_namespace: str) -> None:
    policies = cluster.list("NetworkPolicy", kube_namespace, "")  # ours and anyone else's
    everyone = cluster.list("Pod", kube_namespace, "")
    allowed_pods = _names(fetching_ddm["expert"] + fetching_ddm["stager"])
    dns = {"namespaceSelector": CONFIG.dns_namespace_selector,
           "podSelector": CONFIG.dns_pod_selector}
    for pod in fetching_ddm["expert"] + fetching_ddm["router"]:
        name = pod["metadata"]["name"]
        rules = netpolicy.egress_rules(policies, pod["metadata"]["labels"])
        assert rules is not None, f"{name}: no policy restricts its egress"
        for rule in rules:
            assert rule.get("to"), f"{name}: a rule without peers admits every destination"
            for peer in rule["to"]:
                assert "ipBlock" not in peer, f"{name}: {peer}"
                if "namespaceSelector" in peer:
                    assert peer == dns, f"{name}: {peer}"
                    assert {(p["protocol"], p["port"]) for p in rule["ports"]} == {
                        ("UDP", 53), ("TCP", 53)}
                else:
                    reached = _names([p for p in everyone if netpolicy.selects(
                        peer["podSelector"], p["metadata"]["labels"])])
                    assert reached and reached <= allowed_pods, f"{name}: {peer} -> {reached}"
        for address in ("8.8.8.8", "10.0.3.7", "169.254.169.254", "2600:1f18::1"):
            assert not netpolicy.admits_address(rules, ipaddress.ip_address(address)), name


def test_the_stager_reaches_stores_but_no_private_or_metadata_range(
        fetching_ddm: dict[str, list[dict]], cluster: Cluster, kube_namespace: str) -> None:
    policies = cluster.list("NetworkPolicy", kube_namespace, "")
    (stager,) = fetching_ddm["stager"]
    rules = netpolicy.egress_rules(policies, stager["metadata"]["labels"])
    for kind, networks in CLOSED.items():
        for network in networks:
            for address in netpolicy.samples(network):
                assert not netpolicy.admits_address(rules, address) or (
                    kind == "private" and address in ipaddress.ip_network(ON_PREM_STORE)), (
                    f"the stager may send to {address} ({kind})")
    assert netpolicy.admits_address(rules, ipaddress.ip_address("10.0.3.7"))  # the admin's
    for public in ("8.8.8.8", "52.216.0.1", "2600:1f18::1"):
        assert netpolicy.admits_address(rules, ipaddress.ip_address(public))
    (policy,) = [p for p in policies if netpolicy.selects(p["spec"]["podSelector"],
                                                          stager["metadata"]["labels"])]
    everyone = cluster.list("Pod", kube_namespace, "")
    for rule in policy["spec"]["ingress"]:  # only the DDM's own pods reach it
        for peer in rule["from"]:
            reached = _names([p for p in everyone if netpolicy.selects(
                peer["podSelector"], p["metadata"]["labels"])])
            assert reached <= _names([p for pods in fetching_ddm.values() for p in pods])
    (fetch, held) = stager["spec"]["initContainers"]
    assert fetch["resources"]["requests"]["ephemeral-storage"] == str(CONFIG.fetch_max_bytes)
    uid = cluster.ddm(kube_namespace, "egress")["metadata"]["uid"]
    assert {"name": "DDM_CHECKPOINT_URI", "valueFrom": {"secretKeyRef": {
        "name": names.checkpoint_secret_name("egress", uid, "expert-a", "s3://ddm-models/a"),
        "key": "uri"}}} in fetch["env"]
    assert {"name": "DDM_CHECKPOINT_URI", "valueFrom": {"secretKeyRef": {
        "name": "egress-signed-urls", "key": "router"}}} in held["env"]  # the user's, never read
