"""The router's stages: a text DDM's text encoder, decoder and router network, run in the
router's process or (with ``ddm serve stage``, the stage pool) over the wire, behind one
interface.

:class:`StageCaller` is what the router's driver asks: ``encode`` once per request, ``decode``
once at the end, ``route`` at every step. :class:`LocalStages` answers it with stages loaded in
this process (:func:`ddm.models.stages.load_stage`), off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol, Sequence, TypeVar

import numpy as np

from ddm.models.stages import EncodedPrompts, Stage

__all__ = ["LocalStages", "StageCaller"]

_T = TypeVar("_T")
#: The stage roles a router calls.
TEXT_ENCODER, DECODER, ROUTER = "text_encoder", "decoder", "router"


class StageCaller(Protocol):
    """A text DDM's stages as the router's driver calls them; remote or in-process."""

    async def encode(self, prompts: Sequence[str]) -> EncodedPrompts: ...

    async def decode(self, latents: np.ndarray) -> np.ndarray: ...

    async def route(self, x: np.ndarray, t: np.ndarray) -> np.ndarray: ...


class LocalStages:
    """:class:`StageCaller` with stages loaded in the router's process; each call runs in a
    worker thread, one at a time per stage (a model is not called concurrently)."""

    def __init__(self, text_encoder: Stage | None = None, decoder: Stage | None = None,
                 router: Stage | None = None) -> None:
        self._stages = {TEXT_ENCODER: text_encoder, DECODER: decoder, ROUTER: router}
        self._locks = {role: asyncio.Lock() for role in self._stages}

    async def encode(self, prompts: Sequence[str]) -> EncodedPrompts:
        stage = self._stage(TEXT_ENCODER)
        assert stage.tokens_cut is not None, "a text encoder stage counts truncation"
        cut = stage.tokens_cut
        return await self._run(TEXT_ENCODER, lambda: EncodedPrompts(
            stage.forward(list(prompts)), cut(list(prompts))))

    async def decode(self, latents: np.ndarray) -> np.ndarray:
        stage = self._stage(DECODER)
        return await self._run(DECODER, lambda: stage.forward(latents))

    async def route(self, x: np.ndarray, t: np.ndarray) -> np.ndarray:
        stage = self._stage(ROUTER)
        return await self._run(ROUTER, lambda: stage.forward(x, t))

    def _stage(self, role: str) -> Stage:
        stage = self._stages[role]
        if stage is None:
            raise ValueError(f"this router has no {role} stage")
        return stage

    async def _run(self, role: str, work: Callable[[], _T]) -> _T:
        async with self._locks[role]:
            return await asyncio.to_thread(work)
