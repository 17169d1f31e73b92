"""The operator's own settings (not the user's spec), read once from its environment.

The Helm chart sets these variables; each has a default that works for a plain install.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Mapping


def _default_tag() -> str:
    try:
        return version("ddm-operator")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "latest"


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
    """``allow_host_paths`` lets specs mount node directories (file:// checkpoints)."""

    images: Images = field(default_factory=lambda: Images.defaults(_default_tag()))
    image_pull_policy: str = "IfNotPresent"
    cluster_domain: str = "cluster.local"
    allow_host_paths: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OperatorConfig:
        """From ``DDM_IMAGE_{CPU,CUDA,NEURON,TPU}``, ``DDM_IMAGE_PULL_POLICY``,
        ``DDM_CLUSTER_DOMAIN`` and ``DDM_ALLOW_HOST_PATHS`` (true/false)."""
        base = cls()
        images = Images(**{family: env.get(f"DDM_IMAGE_{family.upper()}") or default
                           for family, default in vars(base.images).items()})
        allow = env.get("DDM_ALLOW_HOST_PATHS", "false").strip().lower()
        if allow not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"DDM_ALLOW_HOST_PATHS must be true or false, got {allow!r}")
        return cls(images=images,
                   image_pull_policy=env.get("DDM_IMAGE_PULL_POLICY") or base.image_pull_policy,
                   cluster_domain=env.get("DDM_CLUSTER_DOMAIN") or base.cluster_domain,
                   allow_host_paths=allow in ("true", "1", "yes"))
