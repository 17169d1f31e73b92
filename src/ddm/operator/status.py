"""A DDMDeployment's status, computed (purely) from its spec and its Deployments' statuses.

Conditions follow the Kubernetes convention: ``lastTransitionTime`` changes only when a
condition's status does, so recomputing an unchanged state yields an equal status and the
operator writes nothing. ``Ready`` is ``SpecValid`` and ``ExpertsReady`` and ``RouterReady``.
An expert is ready when every replica it asks for (at least one) is ready.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping

from ddm.operator import names
from ddm.operator.spec import DDMSpec, SpecError

PHASES = ("Pending", "Progressing", "Ready", "Failed", "Invalid")


@dataclass(frozen=True)
class Replicas:
    """``desired`` from the spec, ``ready`` from the Deployment's status (0 when absent)."""

    desired: int
    ready: int

    @property
    def complete(self) -> bool:
        return self.desired >= 1 and self.ready >= self.desired


def ready_replicas(deployment: Mapping[str, Any] | None) -> int:
    """``status.readyReplicas`` of a live Deployment (None: it does not exist)."""
    if deployment is None:
        return 0
    return int((deployment.get("status") or {}).get("readyReplicas") or 0)


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def ready_status(spec: DDMSpec, meta: Mapping[str, Any], *,
                 deployments: Mapping[str, Mapping[str, Any]], previous: Mapping[str, Any],
                 now: str, failure: str | None = None) -> dict[str, Any]:
    """The status of a valid spec. ``deployments``: live child Deployments by name;
    ``failure``: why applying the children failed, if it did (phase Failed)."""
    owner, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
    experts = {
        e.name: Replicas(e.replicas,
                         ready_replicas(deployments.get(names.expert_name(owner, e.name))))
        for e in spec.experts
    }
    router = Replicas(spec.router.replicas,
                      ready_replicas(deployments.get(names.router_name(owner))))
    waiting = [f"{name} ({r.ready}/{r.desired} ready)" for name, r in experts.items()
               if not r.complete]
    ready_count = len(experts) - len(waiting)
    old = _by_type(previous)
    experts_ready = _condition(
        old, "ExpertsReady", not waiting, generation, now,
        ("AllExpertsReady", f"{ready_count}/{len(experts)} experts ready") if not waiting else
        ("ExpertsNotReady", f"waiting for {', '.join(waiting)}"))
    router_ready = _condition(
        old, "RouterReady", router.complete, generation, now,
        ("RouterReady" if router.complete else "RouterNotReady",
         f"{router.ready}/{router.desired} router replicas ready"))
    spec_valid = _condition(old, "SpecValid", True, generation, now, ("Valid", "spec is valid"))
    if failure:
        ready = _condition(old, "Ready", False, generation, now, ("ApplyFailed", failure))
    else:
        ready = _condition(old, "Ready", router.complete and not waiting, generation, now,
                           _ready_reason(experts_ready, router_ready, len(experts)))
    any_ready = router.ready > 0 or any(r.ready > 0 for r in experts.values())
    phase = ("Failed" if failure else "Ready" if ready["status"] == "True" else
             "Progressing" if any_ready else "Pending")
    return {
        "observedGeneration": generation,
        "phase": phase,
        "expertsReady": f"{ready_count}/{len(experts)}",
        "routerURL": names.router_url(owner, namespace),
        "router": {"replicas": router.desired, "readyReplicas": router.ready},
        "experts": [{"name": e.name, "accelerator": e.accelerator.describe(),
                     "replicas": experts[e.name].desired,
                     "readyReplicas": experts[e.name].ready} for e in spec.experts],
        "conditions": [ready, spec_valid, experts_ready, router_ready],
    }


def invalid_status(error: SpecError, meta: Mapping[str, Any], *, previous: Mapping[str, Any],
                   now: str) -> dict[str, Any]:
    """The status of an invalid spec: the children (left as they were) keep their fields."""
    generation = meta.get("generation")
    old = _by_type(previous)
    message = "; ".join(error.problems)
    kept = [old[t] for t in ("ExpertsReady", "RouterReady") if t in old]
    return {
        **{k: v for k, v in previous.items() if k in ("expertsReady", "routerURL", "router",
                                                        "experts")},
        "observedGeneration": generation,
        "phase": "Invalid",
        "conditions": [
            _condition(old, "Ready", False, generation, now, ("SpecInvalid", message)),
            _condition(old, "SpecValid", False, generation, now, ("Invalid", message)),
            *kept,
        ],
    }


def _ready_reason(experts: Mapping[str, Any], router: Mapping[str, Any], count: int
                  ) -> tuple[str, str]:
    if experts["status"] != "True":
        return experts["reason"], experts["message"]
    if router["status"] != "True":
        return router["reason"], router["message"]
    return "Ready", f"the router and {count} experts are ready"


def _by_type(status: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {c.get("type"): c for c in status.get("conditions") or [] if isinstance(c, Mapping)}


def _condition(previous: Mapping[str, Mapping[str, Any]], kind: str, ok: bool,
               generation: int | None, now: str, why: tuple[str, str]) -> dict[str, Any]:
    """One condition; keeps the previous ``lastTransitionTime`` when the status is unchanged."""
    status = "True" if ok else "False"
    before = previous.get(kind) or {}
    changed = before.get("status") != status
    return {
        "type": kind,
        "status": status,
        "reason": why[0],
        "message": why[1],
        "lastTransitionTime": now if changed else before.get("lastTransitionTime", now),
        "observedGeneration": generation,
    }
