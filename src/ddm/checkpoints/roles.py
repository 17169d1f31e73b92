"""The stage-role registry: one declaration per role a stage checkpoint declares
(``_ddm.role``), with everything that differs between roles, so that a new stage (a safety
checker after the decoder) is a declaration here plus its model code.

Each role declares the wire messages (``docs/protocol.md``) its server answers (a comment
says what its network computes), what its ``/v1/info`` must report (the shapes the router
checks against the other stages': ``text_width``, ``latent_shape``, ``image_shape``,
``clusters``), and, for a stage besides the experts, where it is in a DDMDeployment
(``spec.textEncoder``), its name in the plan and the objects it makes (``text-encoder``, a
DNS label) and its key in router.yaml (``text_encoder``). Plain data (no NumPy, no ML
framework): the spec, the plan, the operator, the router and the servers read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageRole:
    """One role. ``name``: what ``_ddm.role`` says (and an import's directory); ``queries``:
    the wire message kinds its server answers; ``reports``: the fields its ``/v1/info`` must
    carry; ``spec_key``: its field in a DDMDeployment's spec (under ``spec_parent``), None
    for the experts (``spec.experts``); ``plan_name``: its name in the plan."""

    name: str
    queries: tuple[str, ...]
    reports: tuple[str, ...] = ()
    spec_key: str | None = None
    spec_parent: str = "spec"
    plan_name: str | None = None

    @property
    def spec_field(self) -> str | None:
        """Its path in a DDMDeployment, e.g. ``spec.router.network``."""
        return f"{self.spec_parent}.{self.spec_key}" if self.spec_key is not None else None

    @property
    def config_key(self) -> str | None:
        """Its key in router.yaml (the plan name with ``_`` for ``-``)."""
        return self.plan_name.replace("-", "_") if self.plan_name is not None else None


EXPERT, ROUTER, TEXT_ENCODER, DECODER = "expert", "router", "text_encoder", "decoder"
#: Every role: the experts, then the other stages in the order a DDM's plan lists them.
#: Declaring one more is adding it here.
ROLE_REGISTRY: dict[str, StageRole] = {
    # a velocity (an expert of the mixture)
    EXPERT: StageRole(EXPERT, ("velocity", "integrate", "context")),
    # prompts -> text embeddings
    TEXT_ENCODER: StageRole(TEXT_ENCODER, ("encode",), ("text_width",), "textEncoder", "spec",
                            "text-encoder"),
    # latents -> images
    DECODER: StageRole(DECODER, ("decode",), ("latent_shape", "image_shape"), "decoder",
                       "spec", "decoder"),
    # the experts' weights for a state (the router network)
    ROUTER: StageRole(ROUTER, ("route",), ("latent_shape", "clusters"), "network",
                      "spec.router", "router-network"),
}


def stage_roles() -> tuple[StageRole, ...]:
    """The roles of the stages besides the experts (what ``ddm serve stage`` serves): those
    with a place of their own in the spec."""
    return tuple(role for role in ROLE_REGISTRY.values() if role.plan_name is not None)
