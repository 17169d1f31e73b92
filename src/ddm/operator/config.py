"""The operator's own settings (not the user's spec), read once from its environment.

The Helm chart sets these variables; each has a default that works for a plain install.
"""

from __future__ import annotations

import copy
import ipaddress
import json
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Mapping

from ddm.checkpoints.destinations import parse_networks
from ddm.checkpoints.uri import FETCH_ALLOW_NETWORKS_ENV, FETCH_MAX_BYTES, FETCH_MAX_BYTES_ENV
from ddm.deploy.accelerators import ACCELERATORS, HOST
from ddm.operator import policy

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
#: The operator's variable setting the imagePullPolicy of the containers it creates.
IMAGE_PULL_POLICY_ENV = "DDM_IMAGE_PULL_POLICY"
#: The operator's variable naming the cluster's DNS domain (``cluster_domain``).
CLUSTER_DOMAIN_ENV = "DDM_CLUSTER_DOMAIN"
#: The operator's switch putting every router behind a bearer token (``router_auth``).
ROUTER_AUTH_ENV = "DDM_ROUTER_AUTH"
#: The operator's switch giving DDMDeployments and DDMTrainings' jobs NetworkPolicies
#: (``network_policy``).
NETWORK_POLICY_ENV = "DDM_NETWORK_POLICY"
#: The operator's switch letting checkpoint stagers reach the clouds' identity endpoints (the
#: node's metadata service, EKS Pod Identity's agent), for the SDKs' credential chains.
FETCH_CLOUD_IDENTITY_ENV = "DDM_FETCH_CLOUD_IDENTITY"
#: The operator's variables selecting the cluster DNS's pods (JSON label selectors): the one
#: place the serving pods and the stager may send name lookups to.
DNS_NAMESPACE_SELECTOR_ENV = "DDM_DNS_NAMESPACE_SELECTOR"
DNS_POD_SELECTOR_ENV = "DDM_DNS_POD_SELECTOR"
DEFAULT_DNS_NAMESPACE_SELECTOR = {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}}
DEFAULT_DNS_POD_SELECTOR = {"matchLabels": {"k8s-app": "kube-dns"}}
#: The operator's variable listing who may scrape the servers' metrics port: a JSON list of
#: NetworkPolicyPeers (the chart's ``networkPolicy.metricsFrom``).
METRICS_FROM_ENV = "DDM_METRICS_FROM"
#: The operator's own pods, a JSON list of NetworkPolicyPeers (the chart sets it): the routers'
#: metrics port admits them, for the autoscaler to read the demand (``ddm.operator.scaler``).
OPERATOR_FROM_ENV = "DDM_OPERATOR_FROM"
#: The operator's variable listing the proxies in front of every router (comma-separated
#: CIDRs, router.yaml's ``trusted_proxies``).
TRUSTED_PROXIES_ENV = "DDM_ROUTER_TRUSTED_PROXIES"
#: Where the release workflow (.github/workflows/release.yml) publishes the images: the
#: chart's defaults too, pinned equal by tests/unit/test_release.py.
REGISTRY = "ghcr.io/ddm-operator"
_PEER_KEYS = ("podSelector", "namespaceSelector", "ipBlock")
_SELECTOR_KEYS = ("matchLabels", "matchExpressions")


def _default_tag() -> str:
    try:
        return version("ddm-operator")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "latest"


def _list(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    """A comma-separated variable; blanks around and between entries are dropped."""
    return tuple(part.strip() for part in env.get(name, "").split(",") if part.strip())


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """A true/false variable; anything else is an error (a typo must not flip a default)."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    value = raw.strip().lower()
    if value not in _TRUE + _FALSE:
        raise ValueError(f"{name} must be true or false, got {raw!r}")
    return value in _TRUE


def check_peers(peers: Any, setting: str = METRICS_FROM_ENV) -> tuple[dict[str, Any], ...]:
    """``peers`` as NetworkPolicyPeers, or a ValueError naming the first malformed one: each a
    non-empty mapping of ``podSelector``/``namespaceSelector`` (label selectors) or an
    ``ipBlock`` alone (a ``cidr`` and optional ``except`` CIDRs). A mistake here must fail the
    operator's start, not open the metrics port to the cluster or to nobody silently."""
    if not isinstance(peers, (list, tuple)):
        raise ValueError(f"{setting} must be a list of NetworkPolicyPeers, got {peers!r}")
    for index, peer in enumerate(peers):
        where = f"{setting}[{index}]"
        if not isinstance(peer, Mapping) or not peer or set(peer) - set(_PEER_KEYS):
            raise ValueError(f"{where} must be a non-empty mapping of {', '.join(_PEER_KEYS)}; "
                             f"got {peer!r}")
        if "ipBlock" in peer and len(peer) > 1:
            raise ValueError(f"{where}: ipBlock cannot be combined with a selector")
        for key in ("podSelector", "namespaceSelector"):
            selector = peer.get(key, {})
            if not isinstance(selector, Mapping) or set(selector) - set(_SELECTOR_KEYS):
                raise ValueError(f"{where}.{key} must be a label selector (matchLabels, "
                                 f"matchExpressions); got {selector!r}")
        block = peer.get("ipBlock")
        if block is not None:
            if not isinstance(block, Mapping) or set(block) - {"cidr", "except"}:
                raise ValueError(f"{where}.ipBlock needs cidr (and optional except); "
                                 f"got {block!r}")
            try:
                for cidr in (block.get("cidr"), *block.get("except", ())):
                    ipaddress.ip_network(str(cidr))
            except ValueError as error:
                raise ValueError(f"{where}.ipBlock: {error}") from None
    return tuple(json.loads(json.dumps(peer)) for peer in peers)


def _selector(env: Mapping[str, str], name: str, default: dict[str, Any]) -> dict[str, Any]:
    raw = env.get(name, "").strip()
    if not raw:
        return copy.deepcopy(default)
    try:
        return json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(f"{name} is not JSON: {error}") from None


def _bytes(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit():
        raise ValueError(f"{name} must be a positive number of bytes, got {raw!r}")
    return int(raw)


def _peers(env: Mapping[str, str], name: str = METRICS_FROM_ENV) -> tuple[dict[str, Any], ...]:
    raw = env.get(name, "").strip()
    if not raw:
        return ()
    try:
        return check_peers(json.loads(raw), name)
    except json.JSONDecodeError as error:
        raise ValueError(f"{name} is not JSON: {error}") from None


@dataclass(frozen=True)
class Images:
    """The image of each family (one per accelerator type, its declaration's
    ``image_family``): ``by_family["cpu"]`` also runs the router and the checkpoint fetcher."""

    by_family: Mapping[str, str]

    @classmethod
    def defaults(cls, tag: str) -> Images:
        """The published images (the chart's defaults) of version ``tag``."""
        return cls({a.image_family: f"{REGISTRY}/{a.image}:{tag}" for a in ACCELERATORS.values()})

    @classmethod
    def from_env(cls, env: Mapping[str, str], tag: str) -> Images:
        """``DDM_IMAGE_<FAMILY>`` for each family, else its published image of ``tag``."""
        defaults = cls.defaults(tag).by_family
        return cls({family: env.get(image_env(family)) or image
                    for family, image in defaults.items()})

    @property
    def cpu(self) -> str:
        """The host's image: the router's, the fetcher's and CPU experts'."""
        return self.for_family(ACCELERATORS[HOST].image_family)

    def for_family(self, family: str) -> str:
        """The image of ``family``; a ValueError naming the setting when there is none."""
        try:
            return self.by_family[family]
        except KeyError:
            raise ValueError(f"no image for the {family} family: the operator's "
                             f"{image_env(family)} is not set") from None


def image_env(family: str) -> str:
    """The operator's variable naming the image of ``family``: ``DDM_IMAGE_CUDA``."""
    return f"DDM_IMAGE_{family.upper()}"


@dataclass(frozen=True)
class OperatorConfig:
    """``allowed``: what a DDMDeployment may use beyond the containing defaults
    (``policy.AllowLists``: images, checkpoint sources, Secrets, claims, toleration and
    nodeSelector keys, the host paths file:// checkpoints may mount, routing strategies, and
    switches for keyless tolerations, control-plane nodes and named nodes); ``router_auth``
    puts every router behind a bearer token, even when its spec asks for none;
    ``network_policy`` gives each DDMDeployment NetworkPolicies that let only its router
    reach its experts (and removes them when turned off), and each DDMTraining's job one
    (``training_manifests.build_network_policy``); ``fetch_allow_networks``: the
    non-public
    networks (CIDRs) checkpoint fetchers may reach (the cluster's private stores; the
    fetcher's ``--allow-network``): an admin's choice, never a tenant's, so not in the CRD;
    ``fetch_cloud_identity``: the stagers' NetworkPolicy admits the clouds' identity endpoints
    (``access.IDENTITY_ENDPOINTS``) for GKE Workload Identity, EC2 instance profiles and EKS
    Pod Identity (off: those pods' node credentials stay out of a tenant's reach; IRSA and
    store credentials Secrets need no endpoint);
    ``router_trusted_proxies``: CIDRs of the proxies in front of every router (the
    cluster's ingress controllers: an admin's knowledge), whose
    ``X-Forwarded-For`` names the client a request counts against; ``metrics_from``: the
    NetworkPolicyPeers that may reach the servers' metrics port (empty: none; only with
    ``network_policy``, as without policies every port is open); ``operator_from``: the
    operator's own pods (NetworkPolicyPeers), which the routers' metrics port admits too, for
    the autoscaler to read their demand; ``fetch_max_bytes``: the
    cap on each fetched checkpoint (downloaded and extracted), also the size of the volumes
    and the ephemeral storage its fetch requests; ``dns_namespace_selector`` and
    ``dns_pod_selector``: label selectors of the cluster DNS's pods, the only peer the DDM's
    pods may send name lookups to."""

    images: Images = field(default_factory=lambda: Images.defaults(_default_tag()))
    image_pull_policy: str = "IfNotPresent"
    cluster_domain: str = "cluster.local"
    allowed: policy.AllowLists = policy.AllowLists()
    router_auth: bool = False
    network_policy: bool = False
    fetch_allow_networks: tuple[str, ...] = ()
    fetch_cloud_identity: bool = False
    metrics_from: tuple[dict[str, Any], ...] = ()
    operator_from: tuple[dict[str, Any], ...] = ()
    router_trusted_proxies: tuple[str, ...] = ()
    fetch_max_bytes: int = FETCH_MAX_BYTES
    dns_namespace_selector: dict[str, Any] = field(
        default_factory=lambda: copy.deepcopy(DEFAULT_DNS_NAMESPACE_SELECTOR))
    dns_pod_selector: dict[str, Any] = field(
        default_factory=lambda: copy.deepcopy(DEFAULT_DNS_POD_SELECTOR))

    def __post_init__(self) -> None:
        check_peers(self.metrics_from)
        check_peers(self.operator_from, OPERATOR_FROM_ENV)
        check_peers([{"namespaceSelector": self.dns_namespace_selector,
                      "podSelector": self.dns_pod_selector}], DNS_POD_SELECTOR_ENV)
        if not self.fetch_max_bytes > 0:
            raise ValueError(f"{FETCH_MAX_BYTES_ENV} must be a positive number of bytes, "
                             f"got {self.fetch_max_bytes}")
        try:
            parse_networks(self.router_trusted_proxies)
        except ValueError as error:
            raise ValueError(f"{TRUSTED_PROXIES_ENV}: {error}") from None
        try:
            parse_networks(self.fetch_allow_networks)
        except ValueError as error:
            raise ValueError(f"{FETCH_ALLOW_NETWORKS_ENV}: {error}") from None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OperatorConfig:
        """From ``DDM_IMAGE_<FAMILY>`` (one per accelerator type's image family: ``CPU``,
        ``CUDA``, ``NEURON``, ``TPU``), ``DDM_IMAGE_PULL_POLICY``,
        ``DDM_CLUSTER_DOMAIN``, the true/false switches ``DDM_ROUTER_AUTH``,
        ``DDM_NETWORK_POLICY`` and ``DDM_FETCH_CLOUD_IDENTITY`` (false when unset), and the
        comma-separated lists ``DDM_FETCH_ALLOW_NETWORKS`` (CIDRs), ``DDM_ALLOWED_IMAGES``,
        ``DDM_ALLOWED_CHECKPOINT_SOURCES``, ``DDM_ALLOWED_SECRETS``, ``DDM_ALLOWED_CLAIMS``,
        ``DDM_ALLOWED_TOLERATION_KEYS``, ``DDM_ALLOWED_NODE_SELECTOR_KEYS``,
        ``DDM_ALLOW_HOST_PATHS`` and ``DDM_ALLOWED_STRATEGIES`` (see ``policy``), empty when
        unset, the switches ``DDM_ALLOW_TOLERATE_ALL_TAINTS``, ``DDM_ALLOW_CONTROL_PLANE`` and
        ``DDM_ALLOW_NODE_NAMES`` (false when unset),
        ``DDM_ROUTER_TRUSTED_PROXIES`` (CIDRs), ``DDM_METRICS_FROM`` and ``DDM_OPERATOR_FROM``
        (JSON lists of NetworkPolicyPeers; unset: none), ``DDM_FETCH_MAX_BYTES`` (unset: 16 GiB) and
        ``DDM_DNS_NAMESPACE_SELECTOR``/``DDM_DNS_POD_SELECTOR`` (JSON label selectors; unset:
        kube-system's ``k8s-app: kube-dns``)."""
        base = cls()
        return cls(images=Images.from_env(env, _default_tag()),
                   image_pull_policy=env.get(IMAGE_PULL_POLICY_ENV) or base.image_pull_policy,
                   cluster_domain=env.get(CLUSTER_DOMAIN_ENV) or base.cluster_domain,
                   router_auth=_flag(env, ROUTER_AUTH_ENV, base.router_auth),
                   network_policy=_flag(env, NETWORK_POLICY_ENV, base.network_policy),
                   fetch_allow_networks=_list(env, FETCH_ALLOW_NETWORKS_ENV),
                   fetch_cloud_identity=_flag(env, FETCH_CLOUD_IDENTITY_ENV,
                                              base.fetch_cloud_identity),
                   allowed=policy.AllowLists(
                       images=_list(env, policy.IMAGES_ENV),
                       checkpoint_sources=_list(env, policy.CHECKPOINTS_ENV),
                       secrets=_list(env, policy.SECRETS_ENV),
                       claims=_list(env, policy.CLAIMS_ENV),
                       toleration_keys=_list(env, policy.TOLERATION_KEYS_ENV),
                       node_selector_keys=_list(env, policy.NODE_SELECTOR_KEYS_ENV),
                       host_paths=_list(env, policy.HOST_PATHS_ENV),
                       strategies=_list(env, policy.STRATEGIES_ENV),
                       tolerate_all_taints=_flag(env, policy.TOLERATE_ALL_TAINTS_ENV, False),
                       control_plane=_flag(env, policy.CONTROL_PLANE_ENV, False),
                       node_names=_flag(env, policy.NODE_NAMES_ENV, False)),
                   metrics_from=_peers(env),
                   operator_from=_peers(env, OPERATOR_FROM_ENV),
                   router_trusted_proxies=_list(env, TRUSTED_PROXIES_ENV),
                   fetch_max_bytes=_bytes(env, FETCH_MAX_BYTES_ENV, base.fetch_max_bytes),
                   dns_namespace_selector=_selector(env, DNS_NAMESPACE_SELECTOR_ENV,
                                                    DEFAULT_DNS_NAMESPACE_SELECTOR),
                   dns_pod_selector=_selector(env, DNS_POD_SELECTOR_ENV,
                                              DEFAULT_DNS_POD_SELECTOR))
