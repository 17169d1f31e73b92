"""A text DDM's stages loaded in the router process (``router.yaml``'s ``text_encoder``,
``decoder`` or ``router_network`` given as ``{checkpoint: PATH}``), answering as the
:class:`~ddm.serving.router.remote.StageCaller` a stage on its own server answers as.

Small stages (CLIP's text model, a VAE decoder, Paris's router network) may live in the router
pod. Each is a stage checkpoint loaded by its declared role
(:func:`ddm.models.stages.load_stage`) and runs in a thread (``asyncio.to_thread``), so that
the event loop keeps serving other generations while a model runs; the router network's
concurrent calls merge into one forward pass
(:class:`~ddm.serving.router.remote.RouterNetwork`), as a label DDM's do.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ddm.serving.router.remote import Encoded, RouterNetwork

if TYPE_CHECKING:
    from ddm.models.stages import Stage

#: ``router.yaml``'s name of each stage placed in the router -> the role its checkpoint
#: declares (``_ddm.role``).
ROLES = {"text_encoder": "text_encoder", "decoder": "decoder", "router_network": "router"}


class InRouterStage:
    """One stage in this process; it answers the calls of its role only."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self._network = RouterNetwork(stage.forward) if stage.role == "router" else None

    @property
    def convention(self) -> str | None:
        """The time convention a router network declares (``ours``, ``flow-match-N``)."""
        return self.stage.declaration.convention

    async def encode(self, prompts: Sequence[str]) -> Encoded:
        self._expect("text_encoder")
        return await asyncio.to_thread(self._encode, list(prompts))

    async def decode(self, latents: np.ndarray) -> np.ndarray:
        self._expect("decoder")
        return np.asarray(await asyncio.to_thread(self.stage.forward, latents), np.float32)

    async def route(self, x: np.ndarray, t: np.ndarray) -> np.ndarray:
        self._expect("router")
        assert self._network is not None
        return await self._network(x, t)

    async def close(self) -> None:
        """Cancel the router network's passes in flight (the router is stopping)."""
        if self._network is not None:
            await self._network.close()

    def _encode(self, prompts: list[str]) -> Encoded:
        assert self.stage.tokens_cut is not None, "a text encoder stage counts what it cuts"
        cut = self.stage.tokens_cut(prompts)
        return Encoded(self.stage.forward(prompts), tuple(int(n) for n in cut))

    def _expect(self, role: str) -> None:
        if self.stage.role != role:
            raise TypeError(f"the {self.stage.role} stage was asked to act as the {role}")


def load_in_router(name: str, directory: str | Path, precision: str | None = None
                   ) -> InRouterStage:
    """``router.yaml``'s stage ``name`` from its stage checkpoint (safetensors only: loading
    runs no code), its weights cast to ``precision`` (None: as stored), on the router's CPU;
    a checkpoint of another role is refused naming both."""
    from ddm.checkpoints.format import CheckpointError
    from ddm.models.stages import load_stage

    if name not in ROLES:
        raise ValueError(f"unknown stage {name!r}; known: {', '.join(ROLES)}")
    stage = load_stage(directory, precision)
    if stage.role != ROLES[name]:
        raise CheckpointError(f"{directory} declares the role {stage.role!r}; router.yaml's "
                              f"{name} needs a {ROLES[name]!r} checkpoint")
    return InRouterStage(stage)
