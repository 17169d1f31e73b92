"""The DDMDeployment an import writes beside its checkpoints (``DST/ddm.yaml``), pure.

Any import source (``ddm import paris``, ``ddm import text2img``) describes what it found as an
:class:`ImportedDDM`; :func:`imported_manifest` places it on the accelerators the user chose:
experts cycle through ``accelerators`` (``--accelerator nvidia,neuron`` alternates them),
the text encoder, decoder and router network go on the first one in a pod of their own
(``placement: separate``), or, on CPU, inside the router pod. Its API asks for a bearer
token (``router.auth``: the operator makes a Secret with a random one, ``ddm up`` a private
file, each saying where), as a DDM reached from beyond its machine must. The document is
checked with the spec's own parser before it is returned, so an import never writes a
ddm.yaml that ``ddm up`` or the operator would refuse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import yaml

from ddm.deploy.accelerators import ACCELERATORS, HOST
from ddm.deploy.limits import DEFAULT_SOLVER, PRECISIONS
from ddm.deploy.spec import API_VERSION, KIND, parse_manifest

#: Stage directories of an import (``ddm.checkpoints.importers``), in DST.
TEXT_ENCODER_DIR, DECODER_DIR, ROUTER_DIR = "text_encoder", "decoder", "router"


def expert_dir(k: int) -> str:
    """The directory of the expert at the router network's output ``k``."""
    return f"expert_{k}"


@dataclass(frozen=True)
class ImportedDDM:
    """What an import holds: ``experts`` of them (directories ``expert_0..``), a router network
    when there is more than one, a text encoder and decoder where present, and the sampler's
    defaults from the source (steps, routing strategy, guidance scale). Expert ``k`` runs on
    ``frameworks[k % len(frameworks)]`` (``("torch", "jax")`` alternates them)."""

    experts: int
    conditioning: str
    steps: int
    strategy: str
    guidance_scale: float
    router: bool = True
    text_encoder: bool = True
    decoder: bool = True
    frameworks: tuple[str, ...] = ("torch",)


def imported_manifest(ddm: ImportedDDM, name: str, checkpoint_base: str,
                      accelerators: Sequence[str] = (HOST,), precision: str | None = None,
                      separate_stages: bool = False) -> dict[str, Any]:
    """The DDMDeployment ``name`` serving ``ddm`` from the checkpoints under
    ``checkpoint_base`` (a URI ending with ``/``: ``file:///abs/DST/``, ``pvc://claim/paris/``);
    ``separate_stages``: the text encoder and decoder in pods of their own on CPU too.
    Raises ``ValueError`` naming a bad argument, ``SpecError`` for a document we would
    refuse."""
    if not accelerators or any(a not in ACCELERATORS for a in accelerators):
        raise ValueError(f"accelerators must be among {', '.join(ACCELERATORS)}, got "
                         f"{list(accelerators)}")
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if not checkpoint_base.endswith("/"):
        raise ValueError(f"the checkpoint base {checkpoint_base!r} must end with '/'")

    def checkpoint(directory: str) -> dict[str, str]:
        return {"uri": checkpoint_base + directory}

    with_precision = {"precision": precision} if precision else {}

    def stage_place(separate: bool = False) -> dict[str, Any]:
        """Fresh for each stage (shared dicts would be written as YAML aliases)."""
        if accelerators[0] == HOST and not separate:
            return {"placement": "router", **with_precision}
        return {"placement": "separate", "accelerator": {"type": accelerators[0]},
                "replicas": 1, **with_precision}

    sampling = {"steps": ddm.steps, "solver": DEFAULT_SOLVER, "strategy": ddm.strategy,
                **({"guidanceScale": ddm.guidance_scale}
                   if ddm.conditioning == "text" else {})}
    spec: dict[str, Any] = {"conditioning": ddm.conditioning, "sampling": sampling}
    if ddm.text_encoder:
        spec["textEncoder"] = {"checkpoint": checkpoint(TEXT_ENCODER_DIR),
                               **stage_place(separate_stages)}
    if ddm.decoder:
        spec["decoder"] = {"checkpoint": checkpoint(DECODER_DIR), **stage_place(separate_stages)}
    spec["router"] = {"replicas": 1, "auth": {}}  # a token: a random one unless named
    if ddm.router:
        spec["router"].update(checkpoint=checkpoint(ROUTER_DIR),
                              network=stage_place())
    spec["experts"] = [
        {"name": f"expert-{k}", "framework": ddm.frameworks[k % len(ddm.frameworks)],
         "accelerator": {"type": accelerators[k % len(accelerators)]},
         "checkpoint": checkpoint(expert_dir(k)), **with_precision}
        for k in range(ddm.experts)]
    document = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
                "spec": spec}
    parse_manifest(document, allow_host_paths=True)
    return document


def manifest_text(document: dict[str, Any], header: str) -> str:
    """``document`` as YAML, after ``header``'s lines as comments."""
    comments = "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines())
    return comments + yaml.safe_dump(document, sort_keys=False)
