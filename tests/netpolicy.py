"""NetworkPolicy semantics as a checker over API objects: which policies select a pod, and what
their egress admits.

The dev cluster's CNI does not enforce NetworkPolicies, so tests evaluate the policies the
operator wrote (rendered, or read back from the API server) against the real pods' labels,
following the API's documented meaning
(https://kubernetes.io/docs/concepts/services-networking/network-policies/): policies add up;
a pod selected by no policy with ``Egress`` may send anywhere; a rule without ``to`` admits
every peer; an ``ipBlock`` admits its ``cidr`` less its ``except``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A label selector (``matchLabels``, ``matchExpressions``) against ``labels``; an empty
    selector selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get(
            "values") or []
        present = key in labels
        if not {"In": present and labels[key] in values,
                "NotIn": not present or labels[key] not in values,
                "Exists": present, "DoesNotExist": not present}[operator]:
            return False
    return True


def egress_policies(policies: Iterable[Mapping[str, Any]], labels: Mapping[str, str]
                    ) -> list[Mapping[str, Any]]:
    """The policies that restrict the egress of a pod with ``labels`` (same namespace)."""
    return [p for p in policies if "Egress" in (p["spec"].get("policyTypes") or [])
            and selects(p["spec"].get("podSelector"), labels)]


def egress_rules(policies: Iterable[Mapping[str, Any]], labels: Mapping[str, str]
                 ) -> list[Mapping[str, Any]] | None:
    """Every egress rule that applies to the pod; None: its egress is not restricted."""
    selecting = egress_policies(policies, labels)
    if not selecting:
        return None
    return [rule for p in selecting for rule in p["spec"].get("egress") or []]


def admits_address(rules: list[Mapping[str, Any]] | None, address: Address) -> bool:
    """Whether some rule lets the pod send to ``address`` (on some port)."""
    if rules is None:
        return True
    for rule in rules:
        peers = rule.get("to")
        if not peers:
            return True
        for peer in peers:
            block = peer.get("ipBlock")
            if block is None:
                continue
            cidr = ipaddress.ip_network(block["cidr"])
            closed = [ipaddress.ip_network(n) for n in block.get("except") or []]
            if address.version == cidr.version and address in cidr and not any(
                    address in n for n in closed):
                return True
    return False


def samples(network: str) -> list[Address]:
    """The first, a middle and the last address of ``network``."""
    net = ipaddress.ip_network(network)
    return [net[0], net[net.num_addresses // 2], net[-1]]
