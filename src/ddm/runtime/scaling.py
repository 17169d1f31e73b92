"""Scale to zero in ``ddm up``: experts and pools with ``autoscaling.minReplicas: 0`` run on
demand.

Such an expert's (or pool's) processes are not started with the others. The supervisor polls
the router's ``GET /v1/demand`` (:mod:`ddm.serving.router.fleet.demand`) every ``POLL_INTERVAL_S``
and, per expert or pool, decides with the operator's rule (:func:`ddm.deploy.autoscaler.decide`
on the demand :meth:`~ddm.deploy.autoscaler.Scaled.demand` sums over a pool's experts, on at
most its one local process): its process starts when a generation waits for it (for any of a
pool's experts) or it had demand within its scale-down delay (the router counts demand before
rerouting, so with ``reroute`` a missing expert's demand starts it too), and stops once it has
had none for the delay (a process still starting counts as in demand: the delay runs from when
it can serve).
:func:`demand_of` reads one expert's entry; :class:`DemandPoller` only reads the router, as a
peer: a deadline, a capped body, and an answer it cannot read means "no change".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, TextIO

from ddm.deploy.autoscaler import Demand, History, Scaled, decide
from ddm.serving.http.fetch import FetchError, fetch_json

#: How often ``ddm up`` asks the router for its demand.
POLL_INTERVAL_S = 0.5
POLL_TIMEOUT_S = 2.0
MAX_DEMAND_BYTES = 1024 * 1024


@dataclass(frozen=True)
class OnDemand:
    """An expert or pool run on demand (``scaled``: its experts and ``autoscaling``) and its
    processes (supervisor names)."""

    scaled: Scaled
    processes: tuple[str, ...]

    @property
    def label(self) -> str:
        """How the log names it."""
        return f"pool {self.scaled.name}" if self.scaled.pool else self.scaled.name


def demand_of(entry: Any, since_s: float) -> Demand | None:
    """An expert's :class:`Demand` from its entry of ``/v1/demand``, ``since_s`` seconds after
    the previous reading (it was active if its last demand is no older); None when the entry
    is not one the router writes."""
    if not isinstance(entry, Mapping):
        return None
    rows, waiting, idle = entry.get("rows_per_s"), entry.get("waiting"), entry.get("idle_s")
    if not (_is_number(rows) and _is_number(waiting) and (idle is None or _is_number(idle))):
        return None
    if rows < 0 or waiting < 0:
        return None
    return Demand(float(rows), int(waiting), idle is not None and idle <= since_s)


class Scaler:
    """Starts and stops the on-demand experts' and pools' processes as their demand says, at
    most every
    ``POLL_INTERVAL_S`` (:meth:`tick` is called from the supervisor's loop); ``start``,
    ``stop``, ``running`` and ``ready`` act on one process by name. Counts ``cold_starts`` and
    says when a started expert is ready, so that its cold start shows in the log. An expert
    still starting counts as in demand, for at most its server's ready budget
    (``Scaled.ready_s``)."""

    def __init__(self, experts: tuple[OnDemand, ...], poller: DemandPoller,
                 start: Callable[[str], None], stop: Callable[[str], None],
                 running: Callable[[str], bool], ready: Callable[[str], bool],
                 out: TextIO) -> None:
        self._experts = experts
        self._poller = poller
        self._start, self._stop, self._running, self._ready = start, stop, running, ready
        self._out = out
        self._next_poll = 0.0
        self._last_read = float("-inf")  # the first reading counts any demand as recent
        self._histories: dict[str, History] = {}  # by Scaled.key
        self._warming: dict[str, float] = {}  # Scaled.key -> when scaled up, until ready
        self.cold_starts = 0

    @property
    def names(self) -> frozenset[str]:
        """The processes this scaler starts and stops (not started with the others)."""
        return frozenset(name for expert in self._experts for name in expert.processes)

    def tick(self) -> None:
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + POLL_INTERVAL_S
        self._report_ready(now)
        demand = self._poller.experts()
        if demand is None:
            return
        since, self._last_read = now - self._last_read, now
        for expert in self._experts:
            key = expert.scaled.key
            read = {name: demand_of(demand.get(name), since) for name in expert.scaled.experts}
            members = {name: seen for name, seen in read.items() if seen is not None}
            if len(members) < len(read):
                continue
            seen = expert.scaled.demand(members)
            if now - self._warming.get(key, float("-inf")) < expert.scaled.ready_s:
                # still starting: its delay counts once it can serve, or a cold start longer
                # than the delay (a rerouted step's demand) would stop it before it ever did
                seen = replace(seen, active=True)
            running = any(self._running(name) for name in expert.processes)
            # locally all of its processes or none (one for minReplicas 0)
            rules = replace(expert.scaled.rules, max_replicas=len(expert.processes))
            current = len(expert.processes) if running else 0
            history = self._histories.get(key, History())
            wanted, self._histories[key] = decide(rules, current, seen, history, now)
            if wanted > current:
                self.cold_starts += 1
                print(f"scaling {expert.label} up from zero: a generation needs it",
                      file=self._out, flush=True)
                self._warming[key] = now
                for name in expert.processes:
                    self._start(name)
            elif wanted < current:
                self._warming.pop(key, None)
                print(f"scaling {expert.label} to zero: no demand for "
                      f"{rules.scale_down_delay_s:g} s", file=self._out, flush=True)
                for name in expert.processes:
                    self._stop(name)

    def _report_ready(self, now: float) -> None:
        """Say which experts scaled up from zero have every process ready, and after how
        long (the cold start, as this runtime sees it)."""
        for expert in self._experts:
            since = self._warming.get(expert.scaled.key)
            if since is not None and all(self._ready(name) for name in expert.processes):
                del self._warming[expert.scaled.key]
                print(f"{expert.label} is ready ({now - since:.1f} s after scaling up from "
                      "zero)", file=self._out, flush=True)


def _is_number(value: Any) -> bool:
    """A finite JSON number (Python's ``json`` reads ``NaN`` and ``Infinity`` too)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


class DemandPoller:
    """Reads ``/v1/demand`` from the router at ``url`` (with the bearer token in
    ``token_file`` when auth is on)."""

    def __init__(self, url: str, token_file: Path | None) -> None:
        self._url = f"{url}/v1/demand"
        self._token_file = token_file

    def experts(self) -> Mapping[str, Any] | None:
        """Demand per expert, or None when the router did not answer usably."""
        token = (self._token_file.read_text().strip() if self._token_file is not None
                 else None)
        try:
            experts = fetch_json(self._url, deadline=POLL_TIMEOUT_S, cap=MAX_DEMAND_BYTES,
                                 token=token)["experts"]
        except (FetchError, KeyError, TypeError):
            return None
        return experts if isinstance(experts, Mapping) else None
