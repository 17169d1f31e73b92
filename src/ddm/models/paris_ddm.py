"""A Paris release directory -> a :class:`~ddm.models.ddm.DDM`, in this process.

A release's components declare nothing themselves (no ``_ddm`` block: ``ddm import`` writes
one), so each is loaded as the release's layout says: ``expert_K/`` (K = 0..N-1, the router
network's output order) and ``router/`` strictly (:mod:`ddm.models.paris_loading`),
``tokenizer/`` + ``text_encoder/`` as CLIP, ``vae/`` as AutoencoderKL. Paris's networks follow
FlowMatchEulerDiscrete (time input ``sigma * 1000``, output ``noise - data``); they declare it
(:data:`PARIS_CONVENTION`) and are converted exactly at their edge
(:func:`ddm.models.stages.network_velocity`), so the sampler works in our time and velocity on
FlowMatchEulerDiscrete's own grid. The state shape (latent channels and size) and the text
width are checked across every stage.
"""

from __future__ import annotations

from pathlib import Path

from ddm.checkpoints.declared import DECODER, EXPERT, ROUTER, TEXT_ENCODER
from ddm.checkpoints.format import CheckpointError
from ddm.models.ddm import DDM, assemble_ddm
from ddm.models.stages import (ClipTextEncoder, Stage, StageDeclaration, check_library_depth,
                               expert_directories, load_declared, precision_name)

#: Paris's networks' convention (diffusers' ``FlowMatchEulerDiscreteScheduler(1000)``), as a
#: stage checkpoint's ``_ddm.convention`` names it.
PARIS_CONVENTION = "flow-match-1000"


#: A release's components beside its experts.
RELEASE_COMPONENTS = ("router", "vae", "text_encoder", "tokenizer")


def load_paris_ddm(release: str | Path, device: str = "cpu") -> DDM:
    """Load every stage of the Paris release at ``release`` on ``device``; weights keep
    their dtype. Raises a ``CheckpointError`` naming a missing component or a stage whose
    shapes disagree with the experts'."""
    root = Path(release)
    return assemble_ddm(root, *load_release_stages(root, device))


def load_release_stages(root: Path, device: str = "cpu"
                        ) -> tuple[list[str], list[Stage], Stage, Stage, Stage]:
    """The release's expert directory names and its stages (experts, router, text encoder,
    decoder), each loaded strictly as the release's layout says; on ``device`` ``"meta"``
    every weight is checked and then let go (``ddm import`` checks a release so)."""
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory (a Paris release)")
    names = expert_directories(root)
    for role in RELEASE_COMPONENTS:
        if not (root / role).is_dir():
            raise CheckpointError(f"{root} has no {role}/ component")
    expert = StageDeclaration(role=EXPERT, family="paris-dit", convention=PARIS_CONVENTION)
    experts = [load_declared(root / name, expert, device=device) for name in names]
    router = load_declared(root / "router", StageDeclaration(
        role=ROUTER, family="paris-router", convention=PARIS_CONVENTION), device=device)
    check_library_depth(root / "text_encoder", "clip-text")
    clip = ClipTextEncoder(root / "tokenizer", root / "text_encoder", device)
    encoder = Stage(StageDeclaration(role=TEXT_ENCODER, family="clip-text",
                                     text_width=clip.width),
                    precision_name(clip.model.dtype), clip, tokens_cut=clip.tokens_cut,
                    unknown_spans=clip.unknown_spans)
    decoder = load_declared(root / "vae", StageDeclaration(role=DECODER,
                                                           family="autoencoder-kl"),
                            device=device)
    return names, experts, router, encoder, decoder
