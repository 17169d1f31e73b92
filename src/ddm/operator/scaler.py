"""The operator's autoscaler: reads the routers' demand and sets autoscaled experts' and pools'
replicas.

One thread for the whole operator (not a kopf timer per DDMDeployment: kopf puts a finalizer
on every resource a timer or daemon serves, and deleting one would then hang whenever no
operator runs). A successful reconcile :meth:`Scaler.watch`\\ es its DDMDeployment; every
``SCALE_INTERVAL_S`` (and at once when woken) the thread, for each one watched: reads it (gone,
or nothing with ``autoscaling``: no longer watched), scrapes its ready router pods'
``/metrics`` (:mod:`ddm.operator.demand`), decides the replicas of each autoscaled expert and
pool (:func:`ddm.deploy.autoscaler.decide`, pure; a pool's demand is the sum of its member
experts', :meth:`~ddm.deploy.autoscaler.Scaled.demand`) and applies ``spec.replicas`` of its
Deployment as field manager ``FIELD_MANAGER``, and writes ``status.demand``.

The Deployment builder leaves ``replicas`` out of an autoscaled expert's or pool's Deployment
(``ddm.operator.manifests``), and this scaler owns the field by server-side apply, so a
reconcile never resets what it set. A new Deployment starts at Kubernetes' default of one
replica until the scaler's first pass, woken by the reconcile that created it. Without a
readable router the scaler changes nothing (no demand known is not zero demand).

What the scaler started from zero counts as in demand until one of its replicas is ready
(for at most ``PULL_S`` and its server's ready budget), as ``ddm up``'s scaler does: its
scale-down delay runs from when it can serve. Otherwise, under ``reroute``, a cold start
longer than the delay was ended, unready, one delay after the rerouted steps that had started
it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Callable, Collection, Mapping

from ddm.deploy.plan import plan_deployment
from ddm.deploy.spec import DDMSpec, SpecError, parse_spec
from ddm.operator import names
from ddm.deploy.autoscaler import Demand, History, Scaled, decide
from ddm.deploy.autoscaling import OPERATOR_SCALER
from ddm.deploy.limits import PULL_S
from ddm.operator.demand import DemandRates, RouterReading, scrape
from ddm.operator.kube import Kube, KubeError

log = logging.getLogger("ddm.operator.scaler")
#: How often each watched DDMDeployment's demand is read and its experts scaled.
SCALE_INTERVAL_S = 2.0
#: The field manager owning autoscaled experts' ``spec.replicas``.
FIELD_MANAGER = "ddm-autoscaler"
#: ``status.demand`` is rewritten at most this often unless a replica count or a waiting
#: count changed (each write is an API call and a watch event).
STATUS_INTERVAL_S = 15.0

Scrape = Callable[[str, Collection[str]], "RouterReading | None"]


@dataclass
class _Tracked:
    """What the scaler keeps per DDMDeployment between passes."""

    rates: DemandRates = field(default_factory=DemandRates)
    histories: dict[str, History] = field(default_factory=dict)  # by Scaled.key
    claimed: set[str] = field(default_factory=set)  # Deployment uids whose replicas we own
    starting: dict[str, float] = field(default_factory=dict)  # Scaled.key -> from zero at
    status_key: tuple[Any, ...] = ()
    status_at: float = float("-inf")


def operator_scaled(spec: DDMSpec) -> tuple[Scaled, ...]:
    """The experts and pools of ``spec`` this scaler scales, with their settings."""
    return tuple(s for s in plan_deployment(spec).autoscaled if s.rules.scaler == OPERATOR_SCALER)


class Scaler:
    """Scales the autoscaled experts and pools of the DDMDeployments it watches (see the
    module)."""

    def __init__(self, kube: Kube, *, scrape_metrics: Scrape = scrape,
                 clock: Callable[[], float] = time.monotonic,
                 interval_s: float = SCALE_INTERVAL_S) -> None:
        self._kube, self._scrape, self._clock = kube, scrape_metrics, clock
        self._interval_s = interval_s
        self._guard = threading.Lock()
        self._tracked: dict[tuple[str, str], _Tracked] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, namespace: str, name: str) -> None:
        """Scale ``namespace/name``'s experts and pools from now on (a no-op when it has
        none)."""
        with self._guard:
            self._tracked.setdefault((namespace, name), _Tracked())
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ddm-autoscaler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._interval_s)
            self._wake.clear()
            with self._guard:
                keys = list(self._tracked)
            for key in keys:
                if self._stop.is_set():
                    return
                try:
                    keep = self.scale(*key)
                except KubeError as error:
                    log.warning("%s/%s: %s (retried in %g s)", *key, error, self._interval_s)
                    keep = True
                except Exception:  # one DDM's surprise must not end scaling for the others
                    log.exception("%s/%s: scaling failed", *key)
                    keep = True
                if not keep:
                    with self._guard:
                        self._tracked.pop(key, None)

    def scale(self, namespace: str, name: str) -> bool:
        """One pass for ``namespace/name``; False when there is nothing left to scale."""
        with self._guard:
            tracked = self._tracked.setdefault((namespace, name), _Tracked())
        body = self._kube.get_owner(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return False
        try:
            spec = parse_spec(body.get("spec"), allow_host_paths=True)
        except SpecError:
            return True  # the reconcile reports it; a fixed spec is scaled again
        scaled = operator_scaled(spec)
        if not scaled:
            return False
        experts = [expert for unit in scaled for expert in unit.experts]
        routers = [pod for pod in self._kube.list_pods(namespace, name) if _ready_router(pod)]
        readings = {}
        for pod in routers:
            url = f"http://{pod['status']['podIP']}:{names.METRICS_PORT}/metrics"
            reading = self._scrape(url, experts)
            if reading is not None:
                readings[pod["metadata"]["uid"]] = reading
        tracked.rates.forget_except([pod["metadata"]["uid"] for pod in routers])
        if not readings:
            log.debug("%s/%s: no router's metrics readable; replicas left as they are",
                      namespace, name)
            return True
        now = self._clock()
        by_expert = tracked.rates.observe(now, readings, experts)
        demand = {unit.key: unit.demand(by_expert) for unit in scaled}
        decided = {unit.key: self._scale(namespace, name, unit, demand[unit.key], tracked, now)
                   for unit in scaled}
        self._report(body, tracked, scaled, demand, decided, f"{len(readings)}/{len(routers)}",
                     now)
        return True

    def _scale(self, namespace: str, owner: str, unit: Scaled, demand: Demand,
               tracked: _Tracked, now: float) -> int | None:
        """Decide and apply one expert's or pool's replicas; None when its Deployment is not
        there."""
        deployment = self._kube.get("Deployment", namespace, (
            names.pool_name(owner, unit.name) if unit.pool else names.expert_name(owner,
                                                                                  unit.name)))
        if deployment is None:
            return None  # the reconcile creates it
        key = unit.key
        current = int(deployment["spec"].get("replicas", 1))
        ready = int((deployment.get("status") or {}).get("readyReplicas") or 0)
        history = tracked.histories.get(key)
        if history is None:  # serving replicas keep a whole delay after the operator starts
            history = History.start(now) if ready > 0 else History()
        if ready > 0 or current == 0:
            tracked.starting.pop(key, None)
        elif now - tracked.starting.get(key, float("-inf")) < PULL_S + unit.ready_s:
            demand = replace(demand, active=True)  # still starting: its delay waits for it
        wanted, tracked.histories[key] = decide(unit.rules, current, demand, history, now)
        if current == 0 and wanted > 0:
            tracked.starting[key] = now
        uid = deployment["metadata"]["uid"]
        if wanted != current or uid not in tracked.claimed:
            self._kube.apply_replicas(namespace, deployment["metadata"]["name"], wanted,
                                      FIELD_MANAGER)
            tracked.claimed.add(uid)
            if wanted != current:
                log.info("%s/%s: %s %s scaled %d -> %d (%.3g rows/s, %d waiting)",
                         namespace, owner, "pool" if unit.pool else "expert", unit.name,
                         current, wanted, demand.rows_per_s, demand.waiting)
        return wanted

    def _report(self, body: Mapping[str, Any], tracked: _Tracked, scaled: tuple[Scaled, ...],
                demand: Mapping[str, Demand], decided: Mapping[str, int | None], routers: str,
                now: float) -> None:
        """``status.demand``, written when a count changed or ``STATUS_INTERVAL_S`` passed:
        the experts under ``experts``, the pools (with their member experts) under ``pools``."""
        key = (routers, tuple((k, decided[k], demand[k].waiting) for k in decided))
        if key == tracked.status_key and now - tracked.status_at < STATUS_INTERVAL_S:
            return
        entries: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for unit in scaled:
            replicas, seen = decided[unit.key], demand[unit.key]
            history = tracked.histories.get(unit.key)
            last = history.last_demand if history is not None else None
            entries[unit.pool].append({
                "name": unit.name, **({"experts": list(unit.experts)} if unit.pool else {}),
                "rowsPerSecond": round(seen.rows_per_s, 3), "waiting": seen.waiting,
                **({"desiredReplicas": replicas} if replicas is not None else {}),
                **({"idleSeconds": int(now - last)} if last is not None else {})})
        status = {"observedAt": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                  "routers": routers, "experts": entries[False],
                  **({"pools": entries[True]} if entries[True] else {})}
        meta = body["metadata"]
        self._kube.write_status(meta["namespace"], meta["name"], {"demand": status})
        tracked.status_key, tracked.status_at = key, now


def _ready_router(pod: Mapping[str, Any]) -> bool:
    labels = pod["metadata"].get("labels") or {}
    status = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or [])
    return labels.get(names.COMPONENT_LABEL) == "router" and ready and bool(status.get("podIP"))


def start_scaler(memo: Any, **_: Any) -> None:
    """kopf's start-up: the scaler over the operator's API client, in ``memo.scaler``."""
    memo.scaler = Scaler(Kube(memo.api_client))
    memo.scaler.start()


def stop_scaler(memo: Any, **_: Any) -> None:
    """kopf's clean-up: the scaler's thread ends."""
    scaler = getattr(memo, "scaler", None)
    if scaler is not None:
        scaler.stop()
