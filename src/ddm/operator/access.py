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

NetworkPolicies (operator-wide ``network_policy``): expert pods, and the pods of stages
placed on their own (text encoder, decoder, router network), accept traffic only from their
own router's pods, on the expert port; router pods accept traffic on the router port only and
send only to their experts and stages; all accept scrapers (operator-wide ``metrics_from``) on their
metrics port, which serves ``/metrics`` alone. When the DDM fetches a checkpoint, its serving
pods may also send to its checkpoint stager (which they copy the checkpoint from) and to the
cluster DNS (the operator-wide DNS selectors, port 53): nothing else, for the life of the pod.
The stager alone reaches the stores: any address except private, loopback, link-local,
CGNAT, unique-local and cloud metadata ones (``CLOSED_NETWORKS``; the operator-wide
``fetch_allow_networks`` re-admit some, metadata never), and it accepts only the DDM's own
pods. With the operator-wide ``fetch_cloud_identity`` it may also reach the clouds' identity
endpoints on port 80 (``IDENTITY_ENDPOINTS``), where the SDKs' credential chains ask for the
pod's or the node's identity; the fetcher still refuses any URL naming them. A
NetworkPolicy selects pods, not containers, which is why the fetch runs in a pod of its own
(``fetcher``). The fetcher checks the same destinations itself
(``ddm.checkpoints.destinations``); the policies are the second line, enforced by the CNI.
The selectors are ``names.selector``'s, the labels every pod of these Deployments carries.
"""

from __future__ import annotations

import copy
import ipaddress
from typing import Any, Callable, Mapping

from ddm.checkpoints.destinations import METADATA_ADDRESSES, parse_networks
from ddm.checkpoints.uri import STAGER_PORT
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


def build_network_policies(meta: Mapping[str, Any], config: OperatorConfig, *,
                           fetches: bool, stages: bool = False, pools: bool = False
                           ) -> list[dict[str, Any]]:
    """The DDM's NetworkPolicies (see the module's docstring); ``fetches``: the DDM fetches a
    checkpoint, so it has a stager; ``stages``: it has stages in pods of their own (text
    encoder, decoder, router network), which admit the router as experts do; ``pools``: it
    has pools, whose pods do the same. The metrics port admits ``config.metrics_from``
    (NetworkPolicyPeers: the scrapers), and nobody when it is empty (a rule with no peers
    would admit everyone); the routers' admits the operator too (``config.operator_from``),
    whose autoscaler reads their demand there."""
    owner = meta["name"]
    scrape = ([{"from": [dict(peer) for peer in config.metrics_from],
                "ports": [{"protocol": "TCP", "port": names.METRICS_PORT}]}]
              if config.metrics_from else [])
    copies = [_to_pods(owner, "stager", STAGER_PORT), dns_egress(config)] if fetches else []
    kinds = [("experts", "expert"), *([("stages", "stage")] if stages else []),
             *([("pools", "pool")] if pools else [])]
    servers = [_network_policy(
        names.network_policy_name(owner, plural), meta, names.selector(owner, component),
        ingress=[{"from": [{"podSelector": {"matchLabels": names.selector(owner, "router")}}],
                  "ports": [{"protocol": "TCP", "port": names.EXPERT_PORT}]},
                 *copy.deepcopy(scrape)],
        egress=copy.deepcopy(copies))
        for plural, component in kinds]
    # the operator's autoscaler reads the routers' demand from their metrics port
    autoscaler = ([{"from": [dict(peer) for peer in config.operator_from],
                    "ports": [{"protocol": "TCP", "port": names.METRICS_PORT}]}]
                  if config.operator_from else [])
    router = _network_policy(
        names.network_policy_name(owner, "router"), meta, names.selector(owner, "router"),
        ingress=[{"ports": [{"protocol": "TCP", "port": names.ROUTER_PORT}]},
                 *copy.deepcopy(scrape), *autoscaler],
        egress=[*(_to_pods(owner, component, names.EXPERT_PORT) for _, component in kinds),
                dns_egress(config), *copies[:1]])
    if not fetches:
        return [*servers, router]
    stager = _network_policy(
        names.network_policy_name(owner, "stager"), meta, names.selector(owner, "stager"),
        ingress=[{"from": [{"podSelector": {"matchLabels": {names.DEPLOYMENT_LABEL: owner}}}],
                  "ports": [{"protocol": "TCP", "port": STAGER_PORT}]}],
        egress=[dns_egress(config), store_egress(config.fetch_allow_networks),
                *([identity_egress()] if config.fetch_cloud_identity else [])])
    return [*servers, router, stager]


def dns_egress(config: OperatorConfig) -> dict[str, Any]:
    """Name lookups, to the cluster DNS's pods only (the operator's DNS selectors)."""
    return {"to": [{"namespaceSelector": copy.deepcopy(config.dns_namespace_selector),
                    "podSelector": copy.deepcopy(config.dns_pod_selector)}],
            "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}


#: What the stager may never reach unless an admin allows it (``fetch_allow_networks``):
#: private (RFC 1918), loopback, link-local (169.254.169.254 and the other metadata
#: endpoints there), CGNAT (RFC 6598), unique-local IPv6 (fd00:ec2::254 is there), and NAT64
#: (IPv6 that a gateway turns into IPv4). Metadata addresses outside these
#: (``destinations.METADATA_ADDRESSES``) are closed too, and are never re-admitted. (IPv4-mapped
#: IPv6 is IPv4 to the API server, which refuses ``::ffff:0:0/96`` inside ``::/0``.)
CLOSED_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "127.0.0.0/8", "169.254.0.0/16",
    "100.64.0.0/10", "0.0.0.0/8", "::1/128", "fe80::/10", "fc00::/7", "64:ff9b::/96"))
_EVERYWHERE = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))


def store_egress(allow_networks: tuple[str, ...]) -> dict[str, Any]:
    """Egress to a checkpoint store: any address, any port, except ``CLOSED_NETWORKS`` and
    the metadata addresses; each network in ``allow_networks`` re-admitted (less any metadata
    address in it)."""
    metadata = [ipaddress.ip_network(a) for a in sorted(METADATA_ADDRESSES, key=str)]
    blocks = []
    for whole in _EVERYWHERE:
        closed = [n for n in CLOSED_NETWORKS if n.version == whole.version]
        closed += [m for m in metadata if m.version == whole.version
                   and not any(m.subnet_of(n) for n in closed)]
        blocks.append(_block(whole, closed))
    for network in parse_networks(allow_networks):
        inside = [m for m in metadata if m.version == network.version and m.subnet_of(network)]
        if inside != [network]:  # a network that is one metadata address stays closed
            blocks.append(_block(network, inside))
    return {"to": blocks}


#: Where the clouds' credential chains ask for an identity, all on port 80: the instance
#: metadata service (EC2 instance profiles; GKE Workload Identity's metadata server) on its
#: IPv4 and IPv6 addresses, and EKS Pod Identity's node agent (botocore's container provider,
#: ``AWS_CONTAINER_CREDENTIALS_FULL_URI``) on its two. Metadata addresses all
#: (``destinations.METADATA_ADDRESSES``): only the SDKs reach them, never a fetched URL.
IDENTITY_ENDPOINTS = tuple(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "fd00:ec2::254", "169.254.170.23", "fd00:ec2::23"))
IDENTITY_PORT = 80


def identity_egress() -> dict[str, Any]:
    """Egress to the clouds' identity endpoints, port 80 only (``fetch_cloud_identity``)."""
    return {"to": [{"ipBlock": {"cidr": f"{a}/{a.max_prefixlen}"}} for a in IDENTITY_ENDPOINTS],
            "ports": [{"protocol": "TCP", "port": IDENTITY_PORT}]}


def _block(cidr: ipaddress.IPv4Network | ipaddress.IPv6Network,
           closed: list[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> dict[str, Any]:
    block: dict[str, Any] = {"cidr": str(cidr)}
    if closed:
        block["except"] = [str(n) for n in closed]
    return {"ipBlock": block}


def _to_pods(owner: str, component: str, port: int) -> dict[str, Any]:
    """Egress to the DDM's ``component`` pods on ``port``."""
    return {"to": [{"podSelector": {"matchLabels": names.selector(owner, component)}}],
            "ports": [{"protocol": "TCP", "port": port}]}


def _metadata(name: str, meta: Mapping[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": meta["namespace"], "labels": labels}


def _network_policy(name: str, meta: Mapping[str, Any], pods: dict[str, str], *,
                    ingress: list[dict[str, Any]] | None, egress: list[dict[str, Any]] | None
                    ) -> dict[str, Any]:
    """A policy of the DDMDeployment ``meta`` on ``pods`` (see :func:`network_policy`)."""
    return network_policy(name, meta, names.labels(meta["name"], "network-policy"), pods,
                          ingress=ingress, egress=egress)


def network_policy(name: str, meta: Mapping[str, Any], labels: dict[str, str],
                   pods: dict[str, str], *, ingress: list[dict[str, Any]] | None,
                   egress: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A NetworkPolicy ``name`` (labelled ``labels``, in ``meta``'s namespace) on the pods
    matching ``pods``; per direction None: not restricted, []: nothing is allowed."""
    spec: dict[str, Any] = {"podSelector": {"matchLabels": dict(pods)}, "policyTypes": []}
    for kind, rules in (("Ingress", ingress), ("Egress", egress)):
        if rules is not None:
            spec["policyTypes"].append(kind)
            spec[kind.lower()] = rules
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(name, meta, labels),
        "spec": spec,
    }
