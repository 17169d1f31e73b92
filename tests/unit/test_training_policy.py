"""A DDMTraining's NetworkPolicies (``training_manifests.build_network_policy``), evaluated
against the labels of the pods its jobs run (``tests/netpolicy.py``): which pods each selects,
which peers a job's pods admit and reach (multi-node on and off), and the stores (on and off,
the cloud identity opt-in on and off)."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest
import yaml

from ddm.deploy.training_plan import plan_training
from ddm.deploy.training_spec import parse_training_manifest
from ddm.operator.access import IDENTITY_ENDPOINTS, dns_egress, identity_egress, store_egress
from ddm.operator.config import OperatorConfig
from ddm.operator.render import render_file, render_training
from ddm.operator.training_manifests import build_network_policy
from tests.netpolicy import admits_address, egress_rules, samples, selects
from tests.unit.test_training_manifests import EXAMPLE, _document, _stores

CONFIG = OperatorConfig(network_policy=True)
#: A private store the admin allows (the stager's setting, reused).
ALLOWED = "10.0.3.7/32"


def _pods(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Job name -> the labels of the pods it runs (a Job's template, a TrainJob's runtime
    patch of the runtime's node job)."""
    pods = {}
    for obj in objects:
        if obj["kind"] == "Job":
            pods[obj["metadata"]["name"]] = obj["spec"]["template"]["metadata"]["labels"]
        elif obj["kind"] == "TrainJob":
            (patch,) = obj["spec"]["runtimePatches"]
            (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
            pods[obj["metadata"]["name"]] = node["template"]["spec"]["template"]["metadata"][
                "labels"]
    return pods


def _policies(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "NetworkPolicy"}


def _peers(rules: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [peer for rule in rules for peer in rule.get(key) or []]


def _admitted(policy: dict[str, Any], pods: dict[str, dict[str, str]]) -> set[str]:
    """The jobs whose pods ``policy``'s ingress admits."""
    peers = _peers(policy["spec"]["ingress"], "from")
    return {job for job, labels in pods.items()
            if any(selects(peer["podSelector"], labels) for peer in peers)}


@pytest.mark.parametrize("engine", ["job", "kubeflow-trainer"])
def test_each_job_is_confined_by_one_policy_of_its_name_selecting_its_pods_alone(engine):
    objects = render_training(_stores(engine), CONFIG)
    pods, policies = _pods(objects), _policies(objects)
    assert set(policies) == set(pods)
    for policy, job in zip(objects[:-1:2], objects[1:-1:2]):  # each policy before its job
        assert (policy["kind"], policy["metadata"]["name"]) == (
            "NetworkPolicy", job["metadata"]["name"])
    for job, labels in pods.items():
        assert [name for name, p in policies.items()
                if selects(p["spec"]["podSelector"], labels)] == [job]
        policy = policies[job]
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
        assert policy["metadata"]["labels"] == {
            "app.kubernetes.io/managed-by": "ddm-operator", "ddm.dev/training": "digits",
            "ddm.dev/job": labels["ddm.dev/job"],
            "app.kubernetes.io/component": "network-policy"}
        assert policy["metadata"]["namespace"] == "default"
        # no rule admits every peer or every namespace: the API server is never reached
        for rule in policy["spec"]["egress"]:
            assert rule.get("to"), rule
            for peer in rule["to"]:
                assert "namespaceSelector" not in peer or rule == dns_egress(CONFIG)


def test_one_node_jobs_admit_nobody_and_reach_the_dns_alone():
    """engine: job: torchrun --standalone and the JAX coordinator are on the pod's loopback."""
    objects = render_training(_document("job"), CONFIG)
    policies = _policies(objects)
    assert set(policies) == {"digits-expert-digits-0-4", "digits-expert-digits-5-9",
                             "digits-router"}
    for policy in policies.values():
        assert policy["spec"]["ingress"] == []
        assert policy["spec"]["egress"] == [dns_egress(CONFIG)]


def test_a_multi_node_trainjob_admits_and_reaches_its_own_pods_alone():
    document = _document("kubeflow-trainer")
    document["spec"]["experts"][0]["nodes"] = 2  # torch: 2 pods of 2 processes
    # digits-5-9 (JAX, 2 processes): 2 pods of 1 process; the router: 1 pod of 2 processes
    objects = render_training(document, CONFIG)
    pods, policies = _pods(objects), _policies(objects)
    for job in ("digits-expert-digits-0-4", "digits-expert-digits-5-9"):
        (trainjob,) = [o for o in objects if o["metadata"]["name"] == job
                       and o["kind"] == "TrainJob"]
        assert trainjob["spec"]["trainer"]["numNodes"] == 2
        policy = policies[job]
        assert _admitted(policy, pods) == {job}
        # any port: the rendezvous and the collectives choose theirs
        assert all("ports" not in rule for rule in policy["spec"]["ingress"])
        reached = {j for j, labels in pods.items()
                   if any(selects(peer.get("podSelector"), labels)
                          for peer in _peers(policy["spec"]["egress"], "to")
                          if "podSelector" in peer and "namespaceSelector" not in peer)}
        assert reached == {job}
        assert len(policy["spec"]["egress"]) == 2  # the DNS and its pods
    router = policies["digits-router"]
    assert router["spec"]["ingress"] == [] and router["spec"]["egress"] == [dns_egress(CONFIG)]


def test_only_the_jobs_that_fetch_or_upload_reach_the_stores_as_the_stager_does():
    config = OperatorConfig(network_policy=True, fetch_allow_networks=(ALLOWED,))
    document = _stores("job")
    document["spec"]["partition"] = {"kmeans": {"clusters": 2, "imageSize": 8}}
    objects = render_training(document, config)
    pods, policies = _pods(objects), _policies(objects)
    store = store_egress((ALLOWED,))
    reaching = {job for job, p in policies.items() if store in p["spec"]["egress"]}
    assert reaching == {"digits-data", "digits-expert-digits-0-4", "digits-expert-digits-5-9",
                        "digits-router"}
    partition = policies["digits-partition"]["spec"]
    assert partition["egress"] == [dns_egress(config)]  # it reads and writes the volume alone
    public, private = ipaddress.ip_address("52.216.0.1"), ipaddress.ip_address("10.0.3.8")
    for job in reaching:
        rules = egress_rules(policies.values(), pods[job])
        assert admits_address(rules, public)
        assert admits_address(rules, ipaddress.ip_address("10.0.3.7"))
        assert not admits_address(rules, private)
        for closed in ("169.254.0.0/16", "127.0.0.0/8", "192.168.0.0/16", "fd00::/8"):
            assert not any(admits_address(rules, a) for a in samples(closed)), (job, closed)
    rules = egress_rules(policies.values(), pods["digits-partition"])
    assert not admits_address(rules, public)
    # the pods' own fetcher and upload admit the same private networks (and no other job's)
    env = {o["metadata"]["name"]: {e["name"]: e["value"] for e in
                                   o["spec"]["template"]["spec"]["containers"][0]["env"]}
           for o in objects if o["kind"] == "Job"}
    assert {job for job, variables in env.items()
            if variables.get("DDM_FETCH_ALLOW_NETWORKS") == ALLOWED} == reaching


@pytest.mark.parametrize("engine", ["job", "kubeflow-trainer"])
def test_without_stores_no_job_reaches_an_address(engine):
    objects = render_training(_document(engine), CONFIG)
    pods, policies = _pods(objects), _policies(objects)
    for labels in pods.values():
        rules = egress_rules(policies.values(), labels)
        assert not any(admits_address(rules, ipaddress.ip_address(a))
                       for a in ("52.216.0.1", "10.96.0.1", "169.254.169.254"))


def test_cloud_identity_opens_the_identity_endpoints_to_the_store_jobs_alone_on_port_80():
    document = _document("job")
    document["spec"]["data"] = {"dataset": "mnist", "uri": "s3://datasets/mnist"}
    spec = parse_training_manifest(document).spec
    plan = plan_training(spec)
    meta = {"name": "digits", "namespace": "ml"}
    on = OperatorConfig(network_policy=True, fetch_cloud_identity=True)
    egress = {job.name: build_network_policy(spec, job, meta, on)["spec"]["egress"]
              for job in plan.jobs}
    assert {name for name, rules in egress.items() if identity_egress() in rules} == {"data"}
    (rule,) = [r for r in egress["data"] if r == identity_egress()]
    assert rule["ports"] == [{"protocol": "TCP", "port": 80}]
    assert [p["ipBlock"]["cidr"].split("/")[0] for p in rule["to"]] == [
        str(a) for a in IDENTITY_ENDPOINTS]
    off = OperatorConfig(network_policy=True)
    for job in plan.jobs:
        rules = build_network_policy(spec, job, meta, off)["spec"]["egress"]
        assert identity_egress() not in rules
        assert not admits_address(rules, ipaddress.ip_address("169.254.169.254"))


def test_text2img_jobs_reach_a_store_only_to_fetch_its_data():
    document = yaml.safe_load(EXAMPLE.with_name("training-text2img.yaml").read_text())
    document["spec"]["data"] = {"dataset": "coloured-mnist", "uri": "gs://datasets/mnist"}
    policies = _policies(render_training(document, CONFIG))
    reaching = {job for job, p in policies.items()
                if store_egress(()) in p["spec"]["egress"]}
    assert reaching == {"text2img-data"}
    assert len(policies) == 13


def test_ddm_render_prints_each_policy_before_its_job_and_none_when_turned_off(tmp_path):
    path = tmp_path / "training.yaml"
    path.write_text(yaml.safe_dump(_document("kubeflow-trainer")))
    objects = list(yaml.safe_load_all(render_file(path, {})))  # the chart's defaults: on
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        *((kind, f"digits-{job}") for job in ("expert-digits-0-4", "expert-digits-5-9",
                                              "router")
          for kind in ("NetworkPolicy", "TrainJob")),
        ("DDMDeployment", "digits-trained")]
    objects = list(yaml.safe_load_all(render_file(path, {"DDM_NETWORK_POLICY": "false"})))
    assert [o["kind"] for o in objects] == ["TrainJob"] * 3 + ["DDMDeployment"]
