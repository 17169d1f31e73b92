"""Who may reach what: the tokens and the NetworkPolicies (pure builders).

Authentication: the spec's ``router.auth`` names a Secret (and key) holding the public API
token, or asks for one without naming it; the operator-wide ``router_auth`` setting asks for
one for every DDM. With authentication on there are two tokens. The public one (the spec's
Secret, or one the operator creates with a random token) is mounted into the router alone.
The router presents a second one to its experts, which require it: always a Secret the
operator creates (``names.expert_token_name``), mounted into the router and the experts, so a
compromised expert pod never holds the token clients use. The operator's token Secrets are
immutable, named after the DDMDeployment's uid, created once and never read back (``create``
is the operator's only verb on Secrets); the status lists the ones it made
(``status.tokenSecrets``), so one that was there before the operator's first create is
recognised as planted and never used (``reconcile``). Each server reads its token from a
read-only file (``ROUTER_TOKEN_FILE``, ``EXPERT_TOKEN_FILE``).

NetworkPolicies (operator-wide ``network_policy``): expert pods accept traffic only from their
own router's pods, on the expert port, and send none; router pods accept traffic on the router
port only and send only to their experts and DNS; both accept scrapers (operator-wide
``metrics_from``) on their metrics port, which serves ``/metrics`` alone. A NetworkPolicy
selects pods, not containers, so the pods whose init container fetches a checkpoint (labelled
``names.FETCH_LABEL``) may send to DNS and to any address but the cloud metadata ones and
link-local, their server container included (the fetcher's own checks are the first line,
``ddm.checkpoints.destinations``). The selectors are ``names.selector``'s, the labels every
pod of these Deployments carries.
"""

from __future__ import annotations

import copy
import ipaddress
from typing import Any, Callable, Mapping

from ddm.checkpoints.destinations import METADATA_ADDRESSES, parse_networks
from ddm.operator import names
from ddm.operator.config import OperatorConfig
from ddm.deploy.spec import DDMSpec, RouterAuth

#: Where the router reads the public API token (the Secret's key, mounted as a file ``token``).
ROUTER_TOKEN_DIR = "/var/run/secrets/ddm/router-token"
ROUTER_TOKEN_FILE = f"{ROUTER_TOKEN_DIR}/token"
#: Where the router and the experts read the token the router presents to the experts.
EXPERT_TOKEN_DIR = "/var/run/secrets/ddm/expert-token"
EXPERT_TOKEN_FILE = f"{EXPERT_TOKEN_DIR}/token"
#: The key of the token Secrets the operator creates.
TOKEN_SECRET_KEY = "token"
#: The component label of the operator's token Secrets (``reconcile`` checks they are its own).
TOKEN_COMPONENT = "token"


def router_token(spec: DDMSpec, meta: Mapping[str, Any], config: OperatorConfig
                 ) -> RouterAuth | None:
    """Where the router's public token is (a Secret and key), or None when the router needs
    none: the spec's ``router.auth``, else the operator's own Secret when ``router_auth`` is on."""
    auth = spec.router.auth or (RouterAuth() if config.router_auth else None)
    if auth is None or not creates_token_secret(spec, config):
        return auth
    return RouterAuth(secret_name=names.router_token_name(meta["name"], meta["uid"]),
                      key=TOKEN_SECRET_KEY)


def expert_token(spec: DDMSpec, meta: Mapping[str, Any], config: OperatorConfig
                 ) -> RouterAuth | None:
    """Where the token the router presents to its experts is: the operator's own Secret
    whenever the router requires a token, else None (the experts require none)."""
    if router_token(spec, meta, config) is None:
        return None
    return RouterAuth(secret_name=names.expert_token_name(meta["name"], meta["uid"]),
                      key=TOKEN_SECRET_KEY)


def creates_token_secret(spec: DDMSpec, config: OperatorConfig) -> bool:
    """Whether the operator must create the public token's Secret: auth is on and the spec
    names no Secret."""
    auth = spec.router.auth or (RouterAuth() if config.router_auth else None)
    return auth is not None and auth.secret_name is None


def build_token_secrets(spec: DDMSpec, meta: Mapping[str, Any], config: OperatorConfig,
                        new_token: Callable[[], str]) -> list[dict[str, Any]]:
    """The token Secrets the operator creates (once): the experts' whenever auth is on, the
    public one when the spec names none. ``new_token()``: a fresh random token (the caller's,
    so that this builder stays pure)."""
    wanted = [expert_token(spec, meta, config)]
    if creates_token_secret(spec, config):
        wanted.insert(0, router_token(spec, meta, config))
    return [{
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "immutable": True,
        "metadata": _metadata(str(token.secret_name), meta,
                              names.labels(meta["name"], TOKEN_COMPONENT)),
        "stringData": {TOKEN_SECRET_KEY: new_token()},
    } for token in wanted if token is not None]


def build_network_policies(meta: Mapping[str, Any], allow_networks: tuple[str, ...] = (),
                           metrics_from: tuple[Mapping[str, Any], ...] = ()
                           ) -> list[dict[str, Any]]:
    """Experts accept traffic only from their own router's pods, on the expert port, and send
    none; the router accepts traffic from anywhere on its port and sends only to its experts
    and to DNS; a pod that fetches a checkpoint (``names.FETCH_LABEL``) may also reach DNS and
    any address but the cloud metadata ones and link-local (``store_egress``). Both servers'
    metrics port admits ``metrics_from`` (NetworkPolicyPeers: the scrapers), and nobody when
    it is empty (a rule with no peers would admit everyone)."""
    owner = meta["name"]
    scrape = ([{"from": [dict(peer) for peer in metrics_from],
                "ports": [{"protocol": "TCP", "port": names.METRICS_PORT}]}]
              if metrics_from else [])
    experts = _network_policy(
        names.network_policy_name(owner, "experts"), meta, names.selector(owner, "expert"),
        ingress=[{"from": [{"podSelector": {"matchLabels": names.selector(owner, "router")}}],
                  "ports": [{"protocol": "TCP", "port": names.EXPERT_PORT}]}, *scrape],
        egress=[])
    router = _network_policy(
        names.network_policy_name(owner, "router"), meta, names.selector(owner, "router"),
        ingress=[{"ports": [{"protocol": "TCP", "port": names.ROUTER_PORT}]},
                 *copy.deepcopy(scrape)],
        egress=[{"to": [{"podSelector": {"matchLabels": names.selector(owner, "expert")}}],
                 "ports": [{"protocol": "TCP", "port": names.EXPERT_PORT}]}, DNS_EGRESS])
    fetch = _network_policy(
        names.network_policy_name(owner, "fetch"), meta,
        {names.DEPLOYMENT_LABEL: owner, names.FETCH_LABEL: "true"},
        ingress=None, egress=[DNS_EGRESS, store_egress(allow_networks)])
    return [experts, router, fetch]


#: Name lookups, to whatever resolver the pod has (a node-local cache may be link-local).
DNS_EGRESS = {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
_LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))


def store_egress(allow_networks: tuple[str, ...]) -> dict[str, Any]:
    """Egress to a checkpoint store: any address, any port, except the cloud metadata
    addresses (``destinations.METADATA_ADDRESSES``, always) and link-local networks (unless
    the operator allows one of them to the fetcher, ``allow_networks``). The fetcher checks
    the same itself; this is the second line, enforced by the CNI."""
    allowed = parse_networks(allow_networks)
    blocks = []
    for everything, link_local in ((ipaddress.ip_network("0.0.0.0/0"), _LINK_LOCAL[0]),
                                   (ipaddress.ip_network("::/0"), _LINK_LOCAL[1])):
        closed = [] if any(a.version == link_local.version and a.overlaps(link_local)
                           for a in allowed) else [link_local]
        closed += [ipaddress.ip_network(a) for a in sorted(METADATA_ADDRESSES, key=str)
                   if a.version == everything.version
                   and not any(a in network for network in closed)]
        blocks.append({"ipBlock": {"cidr": str(everything),
                                   "except": [str(n) for n in closed]}})
    return {"to": blocks}


def _metadata(name: str, meta: Mapping[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": meta["namespace"], "labels": labels}


def _network_policy(name: str, meta: Mapping[str, Any], pods: dict[str, str], *,
                    ingress: list[dict[str, Any]] | None, egress: list[dict[str, Any]] | None
                    ) -> dict[str, Any]:
    """A policy on ``pods``; None: the direction is not restricted, []: nothing is allowed."""
    owner = meta["name"]
    spec: dict[str, Any] = {"podSelector": {"matchLabels": dict(pods)}, "policyTypes": []}
    for kind, rules in (("Ingress", ingress), ("Egress", egress)):
        if rules is not None:
            spec["policyTypes"].append(kind)
            spec[kind.lower()] = rules
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(name, meta, names.labels(owner, "network-policy")),
        "spec": spec,
    }
