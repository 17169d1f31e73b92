"""The ``missing_expert`` policy of ``router.yaml`` around each expert call of a generation.

An expert is missing when none of its replicas is usable (scaled to zero, or down). With
``fail`` a call goes to the pool as it is (which answers 503 once its deadline passes). With
``reroute``, a velocity call the loop can route elsewhere (``fallback``) is answered
:class:`~ddm.sampling.loop.Missing` at once when the expert is missing, or as soon as it becomes
so while the call is pending (a replica killed mid-step); the loop then reroutes its rows. With
``wait``, and for calls ``reroute`` cannot move, the generation waits up to ``wait_s`` for a
usable replica, then calls; a call that fails because the expert went missing meanwhile waits
again within the same ``wait_s``. What the generation waited is kept in its :class:`Held` and
the demand window (:mod:`ddm.serving.router.fleet.demand`) counts the waiting generations.

Only a generation with the DDM's own strategy (``sampling.strategy``) may wake an expert: a
client choosing another (``ensemble`` calls every expert at every step) is served by the
experts that are up under ``wait`` and ``reroute`` (under ``fail`` its call fails as any
other, with the pool's reason). Its velocity calls to a missing expert are rerouted
as with ``reroute``, a call that cannot be (no expert up serves the row's label, a delegated
chunk) is a 503 naming the rule, and it leaves no demand on a missing expert, so neither the
operator nor ``ddm up`` starts one for it (issue 35: one ``ensemble`` request per scale-down
delay kept every expert up).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import numpy as np

from ddm.deploy.router_config import MissingExpert, canonical_strategy
from ddm.serving.router.fleet.demand import DemandMeter
from ddm.serving.router.fleet.pool import ExpertPool
from ddm.serving.router.fleet.servers import ExpertUnavailable


@dataclass
class Held:
    """One generation's time held waiting for missing experts, in seconds, per expert;
    ``away()`` is what it steps out of meanwhile (its lockstep with other generations)."""

    waited_s: dict[str, float] = field(default_factory=dict)
    away: Callable[[], AbstractContextManager[None]] = nullcontext

    @property
    def total_s(self) -> float:
        return sum(self.waited_s.values())


class MissingExperts:
    """Applies the policy to calls to ``pool``'s experts; ``demand`` counts waits."""

    def __init__(self, config: MissingExpert, pool: ExpertPool, demand: DemandMeter,
                 strategy: str) -> None:
        self.config = config
        self._pool = pool
        self.demand = demand
        self._strategy = canonical_strategy(strategy)

    def wakes(self, strategy: str) -> bool:
        """Whether a generation with ``strategy`` may wake experts: the DDM's own only."""
        return canonical_strategy(strategy) == self._strategy

    def usable(self, expert: str) -> bool:
        """Whether ``expert`` has a replica ready now (it is not missing)."""
        return self._pool.usable(expert)

    def routed(self, rows: np.ndarray, weight: np.ndarray, wakes: bool) -> None:
        """Count one step's rows ``(K,)`` and weight ``(K,)`` per expert as demand; a
        generation that may not wake experts leaves none on a missing one."""
        if not wakes:
            up = np.array([self._pool.usable(name) for name in self.demand.experts])
            rows, weight = np.where(up, rows, 0), np.where(up, weight, 0)
        self.demand.routed(rows, weight)

    async def call(self, expert: str, send: Callable[[], Awaitable[np.ndarray]],
                   fallback: bool, held: Held, rows: int, wakes: bool) -> np.ndarray | None:
        """``send()``'s answer, or None when the call (of ``rows`` rows) may be rerouted and
        the expert is missing (policy ``reroute``, or a generation that may not ``wakes``
        experts)."""
        policy = self.config.policy
        if policy == "fail":  # nothing waits or reroutes: the pool's own answer, its reason
            return await send()
        if not wakes:
            return await self._without_waking(expert, send, fallback)
        if policy == "reroute" and fallback:
            out = await self._unless_missing(expert, send)
            if out is None:
                self.demand.rerouted(expert, rows)
            return out
        deadline = None
        while True:
            if not self._pool.usable(expert):
                deadline = deadline or time.monotonic() + self.config.wait_s
                await self._wait(expert, deadline, held)
            try:
                return await send()
            except ExpertUnavailable:
                if self._pool.usable(expert):  # failed for another reason than being missing
                    raise
                deadline = deadline or time.monotonic() + self.config.wait_s
                if time.monotonic() >= deadline:
                    raise

    async def _without_waking(self, expert: str, send: Callable[[], Awaitable[np.ndarray]],
                              fallback: bool) -> np.ndarray | None:
        out = await self._unless_missing(expert, send) if fallback else (
            await send() if self._pool.usable(expert) else None)
        if out is None and not fallback:
            raise ExpertUnavailable(
                expert, f"it has no ready replica, and only the DDM's own strategy "
                        f"({self._strategy}) starts one; the experts that are up cannot take "
                        f"these rows", f"no ready replica; only strategy {self._strategy} "
                                       f"starts one")
        return out

    async def _unless_missing(self, expert: str,
                              send: Callable[[], Awaitable[np.ndarray]]) -> np.ndarray | None:
        if not self._pool.usable(expert):
            return None
        call = asyncio.ensure_future(send())
        gone = asyncio.ensure_future(self._pool.wait_missing(expert))
        try:
            await asyncio.wait((call, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if call.done():
            try:
                return call.result()
            except ExpertUnavailable:
                return None
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        return None

    async def _wait(self, expert: str, deadline: float, held: Held) -> None:
        """Until a replica of ``expert`` is usable, or :class:`ExpertUnavailable` at
        ``deadline``."""
        started = time.monotonic()
        self.demand.wait_started(expert)
        try:
            with held.away():
                ready = await self._pool.wait_usable(expert, deadline - started)
        finally:
            ended = time.monotonic()
            self.demand.wait_ended(expert, ended - started)
            held.waited_s[expert] = held.waited_s.get(expert, 0.0) + ended - started
        if not ready:
            raise ExpertUnavailable(expert, f"no replica was ready within the "
                                            f"missing_expert.wait_s of {self.config.wait_s:g} s",
                                    f"no replica was ready within {self.config.wait_s:g} s")
