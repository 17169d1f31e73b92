"""A real in-process :class:`~ddm.serving.router.fleet.remote.ExpertCaller`: a text DDM's experts
guided against CLIP of the empty prompt, as an expert server guides them, so that the router's
driver runs against real models without HTTP."""

from __future__ import annotations

import asyncio

import numpy as np

from ddm.conditioning import Conditioning
from ddm.models.ddm import DDM
from ddm.sampling.guidance import guided
from ddm.sampling.solvers import iterate


class GuidedExperts:
    """``ddm``'s experts by name, each guided per row as its ``Conditioning`` says."""

    def __init__(self, ddm: DDM) -> None:
        self._velocities = {name: guided(expert, ddm.null)
                            for name, expert in zip(ddm.expert_names, ddm.experts)}

    async def velocity(self, expert: str, x: np.ndarray, t: np.ndarray,
                       cond: Conditioning) -> np.ndarray:
        return await asyncio.to_thread(self._velocities[expert], x, t, cond)

    async def integrate(self, expert: str, x: np.ndarray, cond: Conditioning,
                        grid: np.ndarray, solver: str) -> np.ndarray:
        def walk() -> np.ndarray:
            state = x
            for _, state in iterate(self._velocities[expert], x, cond, grid, solver):
                pass
            return state

        return await asyncio.to_thread(walk)
