"""The hostile DDMDeployments of issue 35 (item 5): what a tenant who may create one tried to
run, mount and schedule. Shared by the policy's unit tests, ``ddm render``'s and the operator's
on the real control plane (tests/integration/test_operator_secrets.py)."""

from __future__ import annotations

import copy

#: Each attack: its change to a valid spec (dotted fields), the refusal the operator's defaults
#: give (``{name}``: the DDM's name; ``{own}``: the repositories of the operator's images) and
#: the setting that allows it.
HOSTILE = {
    "a namespace Secret as the router's token": (
        {"router.auth": {"secretName": "prod-db-credentials"}},
        "spec.router.auth.secretName: Secret 'prod-db-credentials' is neither the DDM's own "
        "({name}-*, but the operator's tokens and checkpoint URIs) nor among the Secrets this "
        "operator lets a spec name (DDM_ALLOWED_SECRETS: none)",
        {"DDM_ALLOWED_SECRETS": "prod-*"}),
    "any image": (
        {"router.image": "evil.example/pwn:latest"},
        "spec.router.image: 'evil.example/pwn:latest' is neither of the operator's own "
        "repositories ({own}) nor among the images it "
        "allows (DDM_ALLOWED_IMAGES: none)",
        {"DDM_ALLOWED_IMAGES": "evil.example/"}),
    "another application's claim": (
        {"experts.0.checkpoint": {"uri": "pvc://other-apps-data/db"}},
        "spec.experts[0].checkpoint.uri: claim 'other-apps-data' is neither the DDM's own "
        "({name}-*) nor among the claims this operator allows (DDM_ALLOWED_CLAIMS: none)",
        {"DDM_ALLOWED_CLAIMS": "other-apps-data"}),
    "a toleration of every taint": (
        {"experts.0.tolerations": [{"operator": "Exists"}]},
        "spec.experts[0].tolerations[0]: a toleration without a key tolerates every taint "
        "(DDM_ALLOW_TOLERATE_ALL_TAINTS=true would allow it)",
        {"DDM_ALLOW_TOLERATE_ALL_TAINTS": "true"}),
    "the control-plane taint": (
        {"experts.0.tolerations": [{"key": "node-role.kubernetes.io/control-plane",
                                    "operator": "Exists", "effect": "NoSchedule"}]},
        "spec.experts[0].tolerations[0]: key 'node-role.kubernetes.io/control-plane' "
        "tolerates the control-plane taint (DDM_ALLOW_CONTROL_PLANE=true would allow it)",
        {"DDM_ALLOW_CONTROL_PLANE": "true"}),
    "a control-plane nodeSelector": (
        {"experts.0.nodeSelector": {"node-role.kubernetes.io/master": "true"}},
        "spec.experts[0].nodeSelector: key 'node-role.kubernetes.io/master' selects "
        "control-plane nodes (DDM_ALLOW_CONTROL_PLANE=true would allow it)",
        {"DDM_ALLOW_CONTROL_PLANE": "true"}),
    "a control-plane nodeAffinity": (
        {"router.affinity": {"nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": {
                "matchExpressions": [{"key": "node-role.kubernetes.io/control-plane",
                                      "operator": "Exists"}]}}]}}},
        "spec.router.affinity.nodeAffinity.preferred matchExpressions: key "
        "'node-role.kubernetes.io/control-plane' selects control-plane nodes "
        "(DDM_ALLOW_CONTROL_PLANE=true would allow it)",
        {"DDM_ALLOW_CONTROL_PLANE": "true"}),
    "a node by name (matchFields)": (
        {"experts.0.affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In",
                                  "values": ["control-plane-1"]}]}]}}}},
        "spec.experts[0].affinity.nodeAffinity.required matchFields: key 'metadata.name' "
        "pins pods to a named node (DDM_ALLOW_NODE_NAMES=true would allow it)",
        {"DDM_ALLOW_NODE_NAMES": "true"}),
    "a node by name (hostname label)": (
        {"experts.0.nodeSelector": {"kubernetes.io/hostname": "control-plane-1"}},
        "spec.experts[0].nodeSelector: key 'kubernetes.io/hostname' pins pods to a named node "
        "(DDM_ALLOW_NODE_NAMES=true would allow it)",
        {"DDM_ALLOW_NODE_NAMES": "true"}),
}


def hostile_spec(spec: dict, change: dict) -> dict:
    """A copy of ``spec`` with ``change``'s dotted fields (``experts.0.image``) set."""
    raw = copy.deepcopy(spec)
    for dotted, value in change.items():
        *path, last = dotted.split(".")
        node: dict | list = raw
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        node[last] = value
    return raw
