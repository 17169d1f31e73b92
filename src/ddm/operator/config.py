"""The operator's own settings (not the user's spec), read once from its environment.

The Helm chart sets these variables; each has a default that works for a plain install.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Mapping

from ddm.checkpoints.destinations import parse_networks
from ddm.operator import policy

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")
#: The operator's variable listing the networks fetchers may reach (comma-separated CIDRs).
FETCH_ALLOW_NETWORKS_ENV = "DDM_FETCH_ALLOW_NETWORKS"


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


@dataclass(frozen=True)
class Images:
    """The image of each family: ``cpu`` also runs the router and the checkpoint fetcher."""

    cpu: str
    cuda: str
    neuron: str
    tpu: str

    @classmethod
    def defaults(cls, tag: str) -> Images:
        return cls(cpu=f"ddm:{tag}", cuda=f"ddm-cuda:{tag}", neuron=f"ddm-neuron:{tag}",
                   tpu=f"ddm-tpu:{tag}")

    def for_family(self, family: str) -> str:
        return {"cpu": self.cpu, "cuda": self.cuda, "neuron": self.neuron, "tpu": self.tpu}[family]


@dataclass(frozen=True)
class OperatorConfig:
    """``allow_host_paths`` lets specs mount node directories (file:// checkpoints);
    ``router_auth`` puts every router behind a bearer token, even when its spec asks for none;
    ``network_policy`` gives each DDMDeployment NetworkPolicies that let only its router reach
    its experts (and removes them when turned off); ``fetch_allow_networks``: the non-public
    networks (CIDRs) checkpoint fetchers may reach (the cluster's private stores; the
    fetcher's ``--allow-network``): an admin's choice, never a tenant's, so not in the CRD;
    ``allowed_images`` and ``allowed_checkpoint_sources``: the allow-lists of ``policy``
    (empty: anything)."""

    images: Images = field(default_factory=lambda: Images.defaults(_default_tag()))
    image_pull_policy: str = "IfNotPresent"
    cluster_domain: str = "cluster.local"
    allow_host_paths: bool = False
    router_auth: bool = False
    network_policy: bool = False
    fetch_allow_networks: tuple[str, ...] = ()
    allowed_images: tuple[str, ...] = ()
    allowed_checkpoint_sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            parse_networks(self.fetch_allow_networks)
        except ValueError as error:
            raise ValueError(f"{FETCH_ALLOW_NETWORKS_ENV}: {error}") from None
        policy.check_image_entries(self.allowed_images)
        policy.check_checkpoint_entries(self.allowed_checkpoint_sources)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OperatorConfig:
        """From ``DDM_IMAGE_{CPU,CUDA,NEURON,TPU}``, ``DDM_IMAGE_PULL_POLICY``,
        ``DDM_CLUSTER_DOMAIN`` and the true/false switches ``DDM_ALLOW_HOST_PATHS``,
        ``DDM_ROUTER_AUTH`` and ``DDM_NETWORK_POLICY`` (all false when unset), and the
        comma-separated lists ``DDM_FETCH_ALLOW_NETWORKS`` (CIDRs), ``DDM_ALLOWED_IMAGES``
        and ``DDM_ALLOWED_CHECKPOINT_SOURCES`` (prefixes; see ``policy``), empty when unset."""
        base = cls()
        images = Images(**{family: env.get(f"DDM_IMAGE_{family.upper()}") or default
                           for family, default in vars(base.images).items()})
        return cls(images=images,
                   image_pull_policy=env.get("DDM_IMAGE_PULL_POLICY") or base.image_pull_policy,
                   cluster_domain=env.get("DDM_CLUSTER_DOMAIN") or base.cluster_domain,
                   allow_host_paths=_flag(env, "DDM_ALLOW_HOST_PATHS", base.allow_host_paths),
                   router_auth=_flag(env, "DDM_ROUTER_AUTH", base.router_auth),
                   network_policy=_flag(env, "DDM_NETWORK_POLICY", base.network_policy),
                   fetch_allow_networks=_list(env, FETCH_ALLOW_NETWORKS_ENV),
                   allowed_images=_list(env, policy.IMAGES_ENV),
                   allowed_checkpoint_sources=_list(env, policy.CHECKPOINTS_ENV))
