"""Scale to zero in ``ddm up``: experts with ``autoscaling.minReplicas: 0`` run on demand.

Such an expert's processes are not started with the others. The supervisor polls the router's
``GET /v1/demand`` (:mod:`ddm.serving.router.demand`) every ``POLL_INTERVAL_S`` and, per expert,
starts its processes when a generation waits for it or it had demand within its scale-down
delay (the router counts demand before rerouting, so with ``reroute`` a missing expert's
demand starts it too), and stops them once it has had none for the delay. The decision is
:func:`wanted`, pure; :class:`DemandPoller` only reads the router, as a peer: a deadline, a
capped body, and an answer it cannot read means "no change".
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, TextIO

#: How often ``ddm up`` asks the router for its demand.
POLL_INTERVAL_S = 0.5
POLL_TIMEOUT_S = 2.0
MAX_DEMAND_BYTES = 1024 * 1024


@dataclass(frozen=True)
class OnDemand:
    """An expert run on demand: its processes (supervisor names) and the scale-down delay."""

    expert: str
    processes: tuple[str, ...]
    scale_down_delay_s: float


def wanted(demand: Any, delay_s: float) -> bool | None:
    """Whether an expert with ``demand`` (its entry of ``/v1/demand``) should run: a
    generation waits for it, or its last demand is less than ``delay_s`` old; None when the
    entry is not one the router writes."""
    if not isinstance(demand, Mapping):
        return None
    waiting, idle = demand.get("waiting"), demand.get("idle_s")
    if not _is_number(waiting) or not (idle is None or _is_number(idle)):
        return None
    return waiting > 0 or (idle is not None and idle < delay_s)


class Scaler:
    """Starts and stops the on-demand experts' processes as their demand says, at most every
    ``POLL_INTERVAL_S`` (:meth:`tick` is called from the supervisor's loop); ``start``,
    ``stop`` and ``running`` act on one process by name. Counts ``cold_starts``."""

    def __init__(self, experts: tuple[OnDemand, ...], poller: DemandPoller,
                 start: Callable[[str], None], stop: Callable[[str], None],
                 running: Callable[[str], bool], out: TextIO) -> None:
        self._experts = experts
        self._poller = poller
        self._start, self._stop, self._running = start, stop, running
        self._out = out
        self._next_poll = 0.0
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
        demand = self._poller.experts()
        if demand is None:
            return
        for expert in self._experts:
            want = wanted(demand.get(expert.expert), expert.scale_down_delay_s)
            running = any(self._running(name) for name in expert.processes)
            if want and not running:
                self.cold_starts += 1
                print(f"scaling {expert.expert} up from zero: a generation needs it",
                      file=self._out, flush=True)
                for name in expert.processes:
                    self._start(name)
            elif want is False and running:
                print(f"scaling {expert.expert} to zero: no demand for "
                      f"{expert.scale_down_delay_s:g} s", file=self._out, flush=True)
                for name in expert.processes:
                    self._stop(name)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class DemandPoller:
    """Reads ``/v1/demand`` from the router at ``url`` (with the bearer token in
    ``token_file`` when auth is on)."""

    def __init__(self, url: str, token_file: Path | None) -> None:
        self._url = f"{url}/v1/demand"
        self._token_file = token_file

    def experts(self) -> Mapping[str, Any] | None:
        """Demand per expert, or None when the router did not answer usably."""
        request = urllib.request.Request(self._url)
        if self._token_file is not None:
            token = self._token_file.read_text().strip()
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=POLL_TIMEOUT_S) as answer:
                body = answer.read(MAX_DEMAND_BYTES + 1)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return None
        if len(body) > MAX_DEMAND_BYTES:
            return None
        try:
            experts = json.loads(body)["experts"]
        except (ValueError, KeyError, TypeError, RecursionError):
            return None
        return experts if isinstance(experts, Mapping) else None
