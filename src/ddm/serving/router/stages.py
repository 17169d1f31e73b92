"""A text DDM's stages loaded in the router process (``router.yaml``'s ``text_encoder``,
``decoder`` or ``router_network`` given as ``{checkpoint: PATH}``), answering as the
:class:`~ddm.serving.router.remote.StageCaller` a stage on its own server answers as.

Small stages (CLIP's text model, a VAE decoder, Paris's router network) may live in the router
pod. Each runs in a thread (``asyncio.to_thread``), so that the event loop keeps serving other
generations while a model runs; the router network's concurrent calls merge into one forward
pass (:class:`~ddm.serving.router.remote.RouterNetwork`), as a label DDM's do.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ddm.serving.router.remote import Encoded, RouterNetwork

#: The roles a stage loaded in the router may play.
ROLES = ("text_encoder", "decoder", "router_network")


class InRouterStage:
    """One stage in this process; it answers the calls of its ``role`` only."""

    def __init__(self, role: str, model: Callable[..., object]) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown stage role {role!r}; known: {', '.join(ROLES)}")
        self.role = role
        self._model = model
        self._network = RouterNetwork(model) if role == "router_network" else None

    async def encode(self, prompts: Sequence[str]) -> Encoded:
        self._expect("text_encoder")
        return await asyncio.to_thread(self._encode, list(prompts))

    async def decode(self, latents: np.ndarray) -> np.ndarray:
        self._expect("decoder")
        return np.asarray(await asyncio.to_thread(self._model, latents), np.float32)

    async def route(self, x: np.ndarray, t: np.ndarray) -> np.ndarray:
        self._expect("router_network")
        assert self._network is not None
        return await self._network(x, t)

    async def close(self) -> None:
        """Cancel the router network's passes in flight (the router is stopping)."""
        if self._network is not None:
            await self._network.close()

    def _encode(self, prompts: list[str]) -> Encoded:
        conditioning = self._model(prompts)
        tokenizer = self._model.tokenizer  # type: ignore[attr-defined]
        limit = int(tokenizer.model_max_length)
        lengths = [len(ids) for ids in tokenizer(prompts, truncation=False).input_ids]
        return Encoded(conditioning, tuple(max(0, n - limit) for n in lengths))

    def _expect(self, role: str) -> None:
        if self.role != role:
            raise TypeError(f"the {self.role} stage was asked to act as the {role}")


def load_in_router(role: str, directory: str | Path) -> InRouterStage:
    """The stage of ``role`` from its component directory (safetensors only: loading runs
    no code), on the router's CPU."""
    directory = Path(directory)
    if role == "text_encoder":
        from ddm.models.stages import ClipTextEncoder

        return InRouterStage(role, ClipTextEncoder(directory, directory))
    if role == "decoder":
        from ddm.models.stages import VaeDecoder

        return InRouterStage(role, VaeDecoder(directory))
    if role == "router_network":
        from ddm.models.paris_ddm import _router_probabilities  # until load_stage lands
        from ddm.models.paris_loading import load_paris_router

        probs = _router_probabilities(load_paris_router(directory))
        return InRouterStage(role, lambda x, t: probs(x, t, None))  # type: ignore[arg-type]
    raise ValueError(f"unknown stage role {role!r}; known: {', '.join(ROLES)}")
