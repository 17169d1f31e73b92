"""Who may reach what: the router's bearer token and the NetworkPolicies (pure builders).

Authentication: the spec's ``router.auth`` names a Secret (and key) holding the token, or asks
for one without naming it; the operator-wide ``router_auth`` setting asks for one for every
DDM. A Secret nobody named is created by the operator, once, with a random token, owned by
the DDMDeployment (so it goes with it); the operator never reads Secrets, so it never sees
the token again. The router reads the token from a read-only file (``ROUTER_TOKEN_FILE``).

NetworkPolicies (operator-wide ``network_policy``): expert pods accept traffic only from their
own router's pods, on the expert port; router pods accept traffic on the router port only.
The selectors are ``names.selector``'s, the labels every pod of these Deployments carries.
"""

from __future__ import annotations

from typing import Any, Mapping

from ddm.operator import names
from ddm.operator.config import OperatorConfig
from ddm.deploy.spec import DDMSpec, RouterAuth

#: Where the router reads its bearer token (the Secret's key, mounted as a file ``token``).
ROUTER_TOKEN_DIR = "/var/run/secrets/ddm/router-token"
ROUTER_TOKEN_FILE = f"{ROUTER_TOKEN_DIR}/token"
#: The key of the Secret the operator creates.
TOKEN_SECRET_KEY = "token"


def router_token(spec: DDMSpec, meta: Mapping[str, Any], config: OperatorConfig
                 ) -> RouterAuth | None:
    """Where the router's token is (a Secret and key), or None when the router needs none:
    the spec's ``router.auth``, else the operator's own Secret when ``router_auth`` is on."""
    auth = spec.router.auth or (RouterAuth() if config.router_auth else None)
    if auth is None or not creates_token_secret(spec, config):
        return auth
    return RouterAuth(secret_name=names.router_token_name(meta["name"]), key=TOKEN_SECRET_KEY)


def creates_token_secret(spec: DDMSpec, config: OperatorConfig) -> bool:
    """Whether the operator must create the token Secret: auth is on and no Secret is named."""
    auth = spec.router.auth or (RouterAuth() if config.router_auth else None)
    return auth is not None and auth.secret_name is None


def build_router_token_secret(meta: Mapping[str, Any], token: str) -> dict[str, Any]:
    """The Secret the operator creates (once) when auth is on and the spec names no Secret;
    ``token``: a fresh random one (the caller's: this builder stays pure)."""
    owner = meta["name"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(names.router_token_name(owner), meta, names.labels(owner, "router")),
        "stringData": {TOKEN_SECRET_KEY: token},
    }


def build_network_policies(meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Experts accept traffic only from their own router's pods, on the expert port; the
    router accepts traffic from anywhere on its port (and nothing else)."""
    owner = meta["name"]
    experts = _network_policy(
        names.network_policy_name(owner, "experts"), meta, names.selector(owner, "expert"),
        {"from": [{"podSelector": {"matchLabels": names.selector(owner, "router")}}],
         "ports": [{"protocol": "TCP", "port": names.EXPERT_PORT}]})
    router = _network_policy(
        names.network_policy_name(owner, "router"), meta, names.selector(owner, "router"),
        {"ports": [{"protocol": "TCP", "port": names.ROUTER_PORT}]})
    return [experts, router]


def _metadata(name: str, meta: Mapping[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": meta["namespace"], "labels": labels}


def _network_policy(name: str, meta: Mapping[str, Any], pods: dict[str, str],
                    ingress: dict[str, Any]) -> dict[str, Any]:
    owner = meta["name"]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(name, meta, names.labels(owner, "network-policy")),
        "spec": {"podSelector": {"matchLabels": dict(pods)}, "policyTypes": ["Ingress"],
                 "ingress": [ingress]},
    }
