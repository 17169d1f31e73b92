"""A whole DDM in this process: its stages loaded by role (:func:`ddm.models.stages.load_stage`)
and assembled into one :class:`DDM`, whatever it is conditioned on. A label DDM (our UNets,
exported programs, the label router network) and a text DDM (text encoder, experts, router
network, decoder) are the same type: the experts' declarations say which conditioning the
DDM takes (:attr:`DDM.conditioning`), and each stage reads its own kind from the rows'
:class:`~ddm.conditioning.Conditioning`. The in-process driver (:mod:`ddm.sampling.pipeline`)
runs it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ddm.checkpoints.declared import DECODER, EXPERT, ROUTER, TEXT_ENCODER
from ddm.checkpoints.discovery import discover
from ddm.checkpoints.format import FORMAT_KEY, CheckpointError
from ddm.checkpoints.index import read_index
from ddm.conditioning import LABELS, Conditioning
from ddm.convention import FlowMatchNetwork, TimeGrid, network_convention
from ddm.deploy.imported import expert_dir
from ddm.models.paris_loading import read_component_config
from ddm.models.stages import (DEFAULT_GUIDANCE, DEFAULT_ROUTING, DEFAULT_STEPS,
                               ConditionedRouter, ConditionedVelocity, Stage,
                               check_stage_shapes, expert_directories, load_stage,
                               release_sampling, stage_directory)
from ddm.models.text_prior import pooled_text


@dataclass(frozen=True)
class DDM:
    """A DDM's loaded stages: experts (unguided velocities ``(x, t, cond) -> v``, in the
    router network's output order) with their names and the labels each was trained on
    (empty: every label; a text expert's too), the router network as ``(x, t, cond) ->
    probabilities (B, K)`` (None: no router), the text encoder (None: the conditioning comes
    as data: labels, or precomputed embeddings), the decoder (None: the final state is what
    comes out), the null conditioning the unguided half of classifier-free guidance uses
    (one row, made once at load; None without a text encoder), the state's ``latent_shape``
    (C, H, W), the label space (0: text), the conditioning kind, the time grid and the
    DDM's sampling defaults. ``source`` names it; ``paths`` are the stage directories it was
    loaded from (what a run cache fingerprints); ``is_mixture`` is False for one model alone
    (a monolith checkpoint)."""

    expert_names: tuple[str, ...]
    experts: tuple[ConditionedVelocity, ...]
    latent_shape: tuple[int, int, int]
    expert_classes: tuple[tuple[int, ...], ...] = ()
    router: ConditionedRouter | None = None
    encode: Callable[[Sequence[str]], Conditioning] | None = None
    decode: Callable[[np.ndarray], np.ndarray] | None = None
    null: Conditioning | None = None
    num_classes: int = 0
    conditioning: str = LABELS
    grid: TimeGrid = TimeGrid()
    guidance_scale: float = DEFAULT_GUIDANCE
    steps: int = DEFAULT_STEPS
    strategy: str = DEFAULT_ROUTING
    source: Path = Path(".")
    paths: tuple[Path, ...] = ()
    is_mixture: bool = True

    @property
    def state_is_image(self) -> bool:
        """The final state is the image: no decoder follows experts that work in pixels
        (a label DDM's; a text DDM's experts work in a decoder's latents)."""
        return self.decode is None and self.conditioning == LABELS


@dataclass(frozen=True)
class DDMLayout:
    """Where a DDM directory's stages lie: its experts (in no particular order: their
    declared clusters order them), router, text encoder and decoder (None: it has none)."""

    experts: tuple[Path, ...]
    router: Path | None = None
    text_encoder: Path | None = None
    decoder: Path | None = None

    @property
    def paths(self) -> tuple[Path, ...]:
        """Every stage directory."""
        return (*self.experts, *(p for p in (self.router, self.text_encoder, self.decoder)
                                 if p is not None))


def ddm_layout(directory: str | os.PathLike, experts: Sequence[str] | None = None) -> DDMLayout:
    """The stages :func:`load_ddm` assembles from ``directory``: the directory itself where
    it is one checkpoint (a monolith); else the subfolders its root index names by role
    (:mod:`ddm.checkpoints.index`); else ``expert_0 .. expert_N-1`` with ``router/``,
    ``text_encoder/`` and ``decoder/`` (or ``vae/``); else every expert and router checkpoint
    in it by kind (a classifier or a monolith beside the experts is not part of the DDM).
    ``experts`` names other subfolders to take as the experts (``("monolith",)``)."""
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory")
    if FORMAT_KEY in read_component_config(root):
        return DDMLayout((root,))
    if read_index(root) is not None or (root / expert_dir(0)).is_dir():
        names = expert_directories(root) if experts is None else experts
        return DDMLayout(tuple(root / name for name in names),
                         *(stage_directory(root, role) for role in (ROUTER, TEXT_ENCODER,
                                                                    DECODER)))
    found = discover(root)
    routers = found.get("router", [])
    if len(routers) > 1:
        raise CheckpointError(f"{root} holds {len(routers)} routers; keep exactly one")
    chosen = found.get("expert", []) if experts is None else [root / e for e in experts]
    if not chosen:
        raise CheckpointError(f"{root} holds no expert checkpoints (found: {', '.join(found)})")
    return DDMLayout(tuple(chosen), routers[0] if routers else None)


def load_ddm(root: str | os.PathLike, dtype: str | None = None, device: str | None = None,
             backends: Sequence[str | None] = (None,), experts: Sequence[str] | None = None,
             text_prior: bool = True) -> DDM:
    """The DDM directory ``root`` (:func:`ddm_layout`) in this process, its weights cast to
    ``dtype`` (None: as stored) on ``device`` (None: :func:`~ddm.models.stages.load_stage`'s
    default). Expert ``k`` runs on ``backends[k % len(backends)]`` (None: its checkpoint's
    own framework; ``("torch", "jax")`` alternates); ``experts`` names other subfolders to
    load as the experts (``("monolith",)``); ``text_prior=False`` routes with the router
    network alone, ``p(k | x_t, t)``, ignoring the text prior it declares (the report's
    comparison). A root config.json with a release's settings gives the defaults."""
    path = Path(root)
    layout = ddm_layout(path, experts)
    ddm = load_ddm_stages(path, layout, dtype, device, backends, text_prior)
    return ddm if layout.experts != (path,) else replace(ddm, is_mixture=False)


def load_ddm_stages(source: Path, layout: DDMLayout, dtype: str | None = None,
                    device: str | None = None, backends: Sequence[str | None] = (None,),
                    text_prior: bool = True) -> DDM:
    """A :class:`DDM` of stage checkpoints wherever each lies (a DDMDeployment's), as
    :func:`load_ddm` loads them; ``source`` names the DDM (its config.json may hold a
    release's defaults)."""
    if not backends:
        raise CheckpointError("backends must name at least one framework (or None: each "
                              "checkpoint's own)")
    stages = [load_stage(p, dtype, device, backends[k % len(backends)])
              for k, p in enumerate(layout.experts)]
    for p, stage in zip(layout.experts, stages):
        if stage.role != EXPERT:
            raise CheckpointError(f"{p} is a {stage.role} checkpoint, not an expert: it "
                                  "cannot generate")
    names = [p.name if s.declaration.name is None else s.declaration.name
             for p, s in zip(layout.experts, stages)]
    loaded = {role: None if p is None else load_stage(p, dtype, device)
              for role, p in ((ROUTER, layout.router if len(stages) > 1 else None),
                              (TEXT_ENCODER, layout.text_encoder),
                              (DECODER, layout.decoder))}
    return assemble_ddm(source, names, stages, loaded[ROUTER], loaded[TEXT_ENCODER],
                        loaded[DECODER], text_prior, layout.paths)


def assemble_ddm(root: Path, names: Sequence[str], experts: Sequence[Stage],
                 router: Stage | None, encoder: Stage | None, decoder: Stage | None,
                 text_prior: bool = True, paths: Sequence[Path] = ()) -> DDM:
    """Loaded stages -> a :class:`DDM`: the experts put in their declared clusters' order
    (where every one declares its cluster), their shapes, conditioning, label space and
    convention checked to agree; the defaults come from ``root``'s config.json where it has
    a release's keys (Paris's)."""
    order = _cluster_order(root, experts)
    names, experts = [names[k] for k in order], [experts[k] for k in order]
    latent_shape = check_stage_shapes(root, experts, router, encoder, decoder)
    kinds = {(e.declaration.conditioning, e.declaration.num_classes or 0) for e in experts}
    if len(kinds) != 1:
        raise CheckpointError(f"{root}: the experts disagree on their conditioning and label "
                              f"space: {sorted(kinds)}")
    conditioning, num_classes = kinds.pop()
    conventions = {network_convention(e.declaration.convention or "") for e in experts}
    if len(conventions) != 1:
        raise CheckpointError(f"{root}: the experts declare different conventions")
    settings = read_component_config(root)
    return DDM(
        expert_names=tuple(names), experts=tuple(e.forward for e in experts),
        latent_shape=latent_shape,
        expert_classes=tuple(tuple(e.declaration.classes) for e in experts),
        router=None if router is None or len(experts) == 1 else _routing(router, text_prior),
        encode=None if encoder is None else encoder.forward,
        decode=None if decoder is None else decoder.forward,
        null=None if encoder is None else encoder.forward([""]),
        num_classes=num_classes, conditioning=conditioning,
        grid=TimeGrid("flow-match" if isinstance(conventions.pop(), FlowMatchNetwork)
                      else "uniform"),
        **release_sampling(root, settings), source=root, paths=tuple(paths))


def _routing(router: Stage, text_prior: bool) -> ConditionedRouter:
    """A router stage as ``(x, t, cond) -> probabilities``: the label router network reads
    the rows' labels; a text router network sees no prompt, its text prior (unless
    ``text_prior`` is False) the prompts' pooled vectors."""
    network = router.forward
    if router.declaration.conditioning == LABELS:
        return lambda x, t, cond: network(x, t, cond.labels)
    return lambda x, t, cond: network(x, t, pooled_text(cond) if text_prior else None)


def _cluster_order(root: Path, experts: Sequence[Stage]) -> list[int]:
    """The experts' indices in the router network's output order: by their declared clusters
    (a label expert's partition index) where every one declares one, else as given."""
    clusters = [e.declaration.cluster for e in experts]
    if all(c is None for c in clusters) or len(experts) == 1:
        return list(range(len(experts)))
    if any(c is None for c in clusters):
        raise CheckpointError(f"{root}: some experts declare no cluster (partition index), "
                              f"others do: {clusters}")
    return sorted(range(len(experts)), key=lambda k: clusters[k])

