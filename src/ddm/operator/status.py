"""A DDMDeployment's status, computed (purely) from its spec, its Deployments' statuses and
its pods.

Conditions follow the Kubernetes convention: ``lastTransitionTime`` changes only when a
condition's status does, so recomputing an unchanged state yields an equal status and the
operator writes nothing. ``Ready`` is ``SpecValid`` and ``ExpertsReady`` and ``RouterReady``,
and ``StagesReady`` for a DDM with stages in pods of their own (text encoder, decoder, router
network placed ``separate``), each reported under ``stages`` as experts are, and
``PoolsReady`` for a DDM with pools (``spec.pools``), each reported under ``pools``; a pooled
expert is as ready as its pool.
An expert (or pool) is ready when every replica it asks for (at least one) is ready and
runs its current spec (an update still rolling out holds it back, with how far it got); an
autoscaled one asks for what the scaler last set on its Deployment (``ddm.operator.scaler``),
and is ready at zero too. When one is not,
its pods say why (``pod_trouble``): a container that keeps failing (with its exit status and
termination message: an expert that cannot load its checkpoint writes the reason there, a pool
whose members do not fit its memory says so), an image that cannot be pulled, a pod no node can
take; the status repeats it per expert (per pool) and in the ExpertsReady (or RouterReady,
StagesReady, PoolsReady) message.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping, Sequence

from ddm.checkpoints.uri import FETCHED_SCHEMES
from ddm.operator import names
from ddm.deploy.crd import PHASES as PHASES
from ddm.deploy.spec import DDMSpec, ExpertSpec, PoolSpec, SpecError

#: The phases by name (the conditions' types and reasons are other strings).
PENDING_PHASE, PROGRESSING_PHASE, READY_PHASE, FAILED_PHASE, INVALID_PHASE = PHASES

#: A container waiting for one of these will not start by itself.
FAILING_WAITING_REASONS = frozenset({
    "CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError"})
#: Characters of a termination message kept (its last line: a traceback ends with the error).
MAX_DETAIL = 400


@dataclass(frozen=True)
class Trouble:
    """Why a pod is not running: a short ``reason`` (CrashLoopBackOff, Unschedulable, ...) and
    a sentence naming the container and what it said."""

    reason: str
    message: str


def pod_trouble(pods: Sequence[Mapping[str, Any]]) -> Trouble | None:
    """Why the first (by name) of ``pods`` that cannot run cannot; None if none says so.

    Pods being deleted are left out: they belong to a rollout that has moved on.
    """
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        if pod["metadata"].get("deletionTimestamp"):
            continue
        status = pod.get("status") or {}
        for field, what in (("initContainerStatuses", "init container"),
                            ("containerStatuses", "container")):
            for container in status.get(field) or []:
                trouble = _container_trouble(container, what)
                if trouble:
                    return trouble
        for condition in status.get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                reason = condition.get("reason") or "Unschedulable"
                return Trouble(reason, f"pod {pod['metadata']['name']} cannot be scheduled: "
                                       f"{capped_last_line(condition.get('message') or reason)}")
    return None


def _container_trouble(container: Mapping[str, Any], what: str) -> Trouble | None:
    state, last = container.get("state") or {}, container.get("lastState") or {}
    waiting = state.get("waiting") or {}
    failed = state.get("terminated") or {}
    if failed and failed.get("exitCode", 0) == 0:
        failed = {}  # an init container that finished its work
    if waiting.get("reason") not in FAILING_WAITING_REASONS and not failed:
        return None
    name, restarts = container.get("name", "?"), int(container.get("restartCount") or 0)
    ended = failed or last.get("terminated") or {}
    reason = waiting.get("reason") or failed.get("reason") or "Error"
    if not ended:  # never ran: the image, or the container's configuration
        return Trouble(reason, f"{what} {name}: {reason}: "
                               f"{capped_last_line(waiting.get('message') or 'no message')}")
    said = capped_last_line(ended.get("message") or ended.get("reason") or "no message")
    times = "time" if restarts == 1 else "times"
    return Trouble(reason, f"{what} {name} restarted {restarts} {times}; last exit "
                           f"{ended.get('exitCode', '?')}: {said}")


def capped_last_line(text: str) -> str:
    """The last non-empty line of ``text``, cut to ``MAX_DETAIL`` characters."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    return last if len(last) <= MAX_DETAIL else last[:MAX_DETAIL - 3] + "..."


def pods_by_owner(owner: str, pods: Sequence[Mapping[str, Any]]
                  ) -> dict[str | None, list[Mapping[str, Any]]]:
    """The pods of ``owner``'s Deployments by expert name (None: the router's; a stage's
    under :func:`stage_key`, a pool's under :func:`pool_key`)."""
    grouped: dict[str | None, list[Mapping[str, Any]]] = {}
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        if labels.get(names.DEPLOYMENT_LABEL) != owner:
            continue
        component = labels.get(names.COMPONENT_LABEL)
        if component == "expert" and labels.get(names.EXPERT_LABEL):
            grouped.setdefault(labels[names.EXPERT_LABEL], []).append(pod)
        elif component == "stage" and labels.get(names.STAGE_LABEL):
            grouped.setdefault(stage_key(labels[names.STAGE_LABEL]), []).append(pod)
        elif component == "pool" and labels.get(names.POOL_LABEL):
            grouped.setdefault(pool_key(labels[names.POOL_LABEL]), []).append(pod)
        elif component == "router":
            grouped.setdefault(None, []).append(pod)
    return grouped


def pool_key(pool: str) -> str:
    """A pool's key among the experts' names (which cannot hold a ``/``)."""
    return f"pool/{pool}"


def stage_key(role: str) -> str:
    """A stage's key among the experts' names (which cannot hold a ``/``)."""
    return f"stage/{role}"


def stager_trouble(owner: str, pods: Sequence[Mapping[str, Any]]) -> Trouble | None:
    """Why ``owner``'s checkpoint stager cannot serve (a fetch step failing), as the reason
    of the pods that copy from it."""
    trouble = pod_trouble([p for p in pods if (p["metadata"].get("labels") or {}).get(
        names.COMPONENT_LABEL) == "stager" and p["metadata"]["labels"].get(
        names.DEPLOYMENT_LABEL) == owner])
    return None if trouble is None else Trouble(trouble.reason,
                                                f"checkpoint stager: {trouble.message}")


@dataclass(frozen=True)
class Replicas:
    """``desired`` from the spec (an autoscaled expert's: from its Deployment, ``scaled``),
    ``ready`` from the Deployment's status (0 when absent); ``updating``: how far the
    Deployment is from running its current pod template on every replica
    (:func:`update_pending`), None once it does."""

    desired: int
    ready: int
    scaled: bool = False
    updating: str | None = None

    @property
    def complete(self) -> bool:
        return ((self.scaled or self.desired >= 1) and self.ready >= self.desired
                and self.updating is None)

    def describe(self) -> str:
        """``ready/desired ready``, and the update under way if one is."""
        return f"{self.ready}/{self.desired} ready" + (f", {self.updating}" if self.updating
                                                       else "")


def deployment_replicas(desired: int, deployment: Mapping[str, Any] | None,
                        scaled: bool = False) -> Replicas:
    """A server's replicas: ``desired`` against what its live Deployment (None: none yet)
    reports."""
    return Replicas(desired, ready_replicas(deployment), scaled, update_pending(deployment))


def server_replicas(server: ExpertSpec | PoolSpec, deployment: Mapping[str, Any] | None
                    ) -> Replicas:
    """An expert's or a pool's replicas: fixed by its spec, or, autoscaled, as its Deployment
    has them (its ``minReplicas`` until the Deployment exists)."""
    if server.autoscaling is None:
        return deployment_replicas(server.replicas, deployment)
    desired = (server.autoscaling.min_replicas if deployment is None
               else int(deployment["spec"].get("replicas", 1)))
    return deployment_replicas(desired, deployment, scaled=True)


def ready_replicas(deployment: Mapping[str, Any] | None) -> int:
    """``status.readyReplicas`` of a live Deployment (None: it does not exist)."""
    if deployment is None:
        return 0
    return int((deployment.get("status") or {}).get("readyReplicas") or 0)


def update_pending(deployment: Mapping[str, Any] | None) -> str | None:
    """Why a live Deployment is not yet running its current pod template on every replica,
    in a few words; None when it is (or does not exist). Its old replicas may still serve,
    but a DDM is ready only once its spec runs everywhere, not while an update is stuck (a
    new pod no node can take, or one that cannot load its checkpoint). Pending: a change its
    controller has not seen while the replica count is as it was (a change of the count alone,
    the scaler's, is followed by ready against desired), or replicas of an older template
    still running. A replica that is gone and not yet replaced counts against ready."""
    if deployment is None:
        return None
    status = deployment.get("status") or {}
    running = int(status.get("replicas") or 0)
    wanted = (deployment.get("spec") or {}).get("replicas")
    unseen = int(deployment.get("metadata", {}).get("generation") or 0) > int(
        status.get("observedGeneration") or 0)
    if unseen and (wanted is None or int(wanted) == running):
        return "update not yet observed"
    old = running - int(status.get("updatedReplicas") or 0)
    if old > 0:
        return f"{old} old replica{'s' if old > 1 else ''} left"
    return None


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


#: The status fields the scaler writes (``ddm.operator.scaler``). The reconcile's status leaves
#: them out, so its merge patch keeps what the scaler wrote last: a reconcile that copied them from
#: the body it was handed wrote back a stale demand over a newer one.
SCALER_FIELDS = frozenset({"demand"})


def reconciled_part(status: Mapping[str, Any] | None) -> dict[str, Any]:
    """``status`` without the scaler's fields: what a reconcile compares its own status with."""
    return {k: v for k, v in (status or {}).items() if k not in SCALER_FIELDS}


def ready_status(spec: DDMSpec, meta: Mapping[str, Any], *,
                 deployments: Mapping[str, Mapping[str, Any]], previous: Mapping[str, Any],
                 now: str, failure: str | None = None, pods: Sequence[Mapping[str, Any]] = (),
                 token_secret: str | None = None, token_secrets: Sequence[str] = ()
                 ) -> dict[str, Any]:
    """The status of a valid spec. ``deployments``: live child Deployments by name;
    ``failure``: why applying the children failed, if it did (phase Failed); ``pods``: the
    pods of the children, which say why a replica is not ready; ``token_secret``: the Secret
    holding the router's token (its name only), when the router requires one;
    ``token_secrets``: the token Secrets the operator has created for this resource."""
    owner, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
    pools = {p.name: p for p in spec.pools}
    pooled = {pool_key(p.name): server_replicas(p, deployments.get(names.pool_name(owner, p.name)))
              for p in spec.pools}
    # A pooled expert is as ready as its pool's Deployment, and has its pool's pods.
    experts = {e.name: server_replicas(e, deployments.get(names.expert_name(owner, e.name)))
               if e.pool is None else pooled[pool_key(e.pool)] for e in spec.experts}
    separate = {role: stage for role, stage in spec.stages.items() if stage.separate}
    stages = {stage_key(role): deployment_replicas(
        stage.replicas, deployments.get(names.stage_name(owner, role)))
        for role, stage in separate.items()}
    router = deployment_replicas(spec.router.replicas,
                                 deployments.get(names.router_name(owner)))
    grouped = pods_by_owner(owner, pods)
    grouped.update({e.name: grouped.get(pool_key(e.pool), []) for e in spec.experts if e.pool})
    troubles = {name: pod_trouble(grouped.get(name, [])) for name, r in
                [*experts.items(), *stages.items(), *pooled.items(), (None, router)]
                if not r.complete}
    stager = stager_trouble(owner, pods)
    checkpoints = {None: [spec.router.checkpoint], **{e.name: [e.checkpoint] for e in spec.experts},
                   **{stage_key(role): [stage.checkpoint] for role, stage in separate.items()},
                   **{pool_key(p): [m.checkpoint for m in spec.members(p).values()]
                      for p in pools}}
    for name in troubles:  # the pods that copy from the stager wait on it: its reason is theirs
        if stager is not None and any(checkpoint is not None and (
                checkpoint.scheme in FETCHED_SCHEMES) for checkpoint in checkpoints[name]):
            troubles[name] = stager
    # A pool's trouble is told once, naming the pool and its experts, not once per member.
    failing = [f"expert {e.name}: {experts[e.name].describe()}: "
               f"{troubles[e.name].message}" for e in spec.experts
               if e.pool is None and troubles.get(e.name)]
    for name in pools:
        held = [e.name for e in spec.experts if e.pool == name]
        if held and troubles.get(pool_key(name)):
            line = _replicas_line(pooled[pool_key(name)], troubles[pool_key(name)])
            failing.append(f"pool {name} (experts {', '.join(held)}): {line}")
    waiting = [f"{name} ({r.describe()})" for name, r in experts.items()
               if not r.complete and not troubles.get(name)]
    ready_count = sum(r.complete for r in experts.values())
    old = conditions_by_type(previous)
    experts_ready = build_condition(
        old, "ExpertsReady", ready_count == len(experts), generation, now,
        ("AllExpertsReady", f"{ready_count}/{len(experts)} experts ready")
        if ready_count == len(experts) else
        ("ExpertsNotReady", "; ".join(failing + ([f"waiting for {', '.join(waiting)}"]
                                                 if waiting else []))))
    router_trouble = troubles.get(None)
    router_ready = build_condition(
        old, "RouterReady", router.complete, generation, now,
        ("RouterReady" if router.complete else "RouterNotReady",
         f"{router.ready}/{router.desired} router replicas ready"
         + (f", {router.updating}" if router.updating else "")
         + (f": {router_trouble.message}" if router_trouble else "")))
    stage_conditions = [_servers_condition(old, "Stages", "stage(s)", {
        key.removeprefix("stage/"): (r, troubles.get(key)) for key, r in stages.items()},
        generation, now)] if stages else []
    pool_conditions = [_servers_condition(old, "Pools", "pool(s)", {
        f"pool {name}": (pooled[pool_key(name)], troubles.get(pool_key(name))) for name in pools},
        generation, now)] if pools else []
    spec_valid = build_condition(old, "SpecValid", True, generation, now,
                                 ("Valid", "spec is valid"))
    if failure:
        ready = build_condition(old, "Ready", False, generation, now, ("ApplyFailed", failure))
    else:
        ready = build_condition(old, "Ready", router.complete and ready_count == len(experts)
                                and all(r.complete for r in [*stages.values(), *pooled.values()]),
                                generation, now,
                                _ready_reason(experts_ready, router_ready, len(experts),
                                              *stage_conditions, *pool_conditions))
    any_ready = router.ready > 0 or any(r.ready > 0 for r in [*experts.values(),
                                                              *stages.values(),
                                                              *pooled.values()])
    phase = (FAILED_PHASE if failure else READY_PHASE if ready["status"] == "True" else
             PROGRESSING_PHASE if any_ready else PENDING_PHASE)
    return {
        "observedGeneration": generation,
        "phase": phase,
        "expertsReady": f"{ready_count}/{len(experts)}",
        "expertReplicas": ", ".join(f"{name} {r.ready}/{r.desired}"
                                    for name, r in experts.items()),
        "routerURL": names.router_url(owner, namespace),
        **({"routerTokenSecret": token_secret} if token_secret else {}),
        **({"tokenSecrets": list(token_secrets)} if token_secrets else {}),
        "router": {"replicas": router.desired, "readyReplicas": router.ready,
                   **_why(router_trouble)},
        "experts": [{"name": e.name, "accelerator": (
                        pools[e.pool].accelerator if e.pool else e.accelerator).describe(),
                     "replicas": experts[e.name].desired,
                     "readyReplicas": experts[e.name].ready, **_why(troubles.get(e.name))}
                    for e in spec.experts],
        **({"stages": [{"name": role, "placement": stage.placement,
                        "accelerator": stage.accelerator.describe(),
                        "replicas": stages[stage_key(role)].desired,
                        "readyReplicas": stages[stage_key(role)].ready,
                        **_why(troubles.get(stage_key(role)))}
                       for role, stage in separate.items()]} if stages else {}),
        **({"pools": [{"name": name, "accelerator": pool.accelerator.describe(),
                       "members": list(spec.members(name)),
                       "replicas": pooled[pool_key(name)].desired,
                       "readyReplicas": pooled[pool_key(name)].ready,
                       **_why(troubles.get(pool_key(name)))}
                      for name, pool in pools.items()]} if pools else {}),
        "conditions": [ready, spec_valid, experts_ready, router_ready, *stage_conditions,
                       *pool_conditions],
    }


def _replicas_line(replicas: Replicas, trouble: Trouble | None) -> str:
    """``ready/desired ready`` (and the update under way), and why not where the pods
    say."""
    return replicas.describe() + (f": {trouble.message}" if trouble else "")


def _servers_condition(old: Mapping[str, Mapping[str, Any]], kind: str, what: str,
                       servers: Mapping[str, tuple[Replicas, Trouble | None]],
                       generation: int | None, now: str) -> dict[str, Any]:
    """``StagesReady`` or ``PoolsReady`` (``kind``): all of ``servers`` (by the name the
    message gives them: their replicas and their pods' trouble) ready, or which are not and
    why."""
    if all(r.complete for r, _ in servers.values()):
        return build_condition(old, f"{kind}Ready", True, generation, now,
                               (f"All{kind}Ready", f"{len(servers)} {what} ready"))
    return build_condition(old, f"{kind}Ready", False, generation, now,
                           (f"{kind}NotReady", "; ".join(
                               f"{name}: {_replicas_line(r, trouble)}"
                               for name, (r, trouble) in servers.items() if not r.complete)))


def _why(trouble: Trouble | None) -> dict[str, str]:
    return {"reason": trouble.reason, "message": trouble.message} if trouble else {}


def invalid_status(error: SpecError, meta: Mapping[str, Any], *, previous: Mapping[str, Any],
                   now: str) -> dict[str, Any]:
    """The status of an invalid spec: the children (left as they were) keep their fields."""
    generation = meta.get("generation")
    old = conditions_by_type(previous)
    message = "; ".join(error.problems)
    kept = [old[t] for t in ("ExpertsReady", "RouterReady", "StagesReady", "PoolsReady")
            if t in old]
    return {
        **{k: v for k, v in previous.items() if k in ("expertsReady", "routerURL", "router",
                                                        "experts", "stages", "pools",
                                                        "routerTokenSecret", "tokenSecrets")},
        "observedGeneration": generation,
        "phase": INVALID_PHASE,
        "conditions": [
            build_condition(old, "Ready", False, generation, now, ("SpecInvalid", message)),
            build_condition(old, "SpecValid", False, generation, now, ("Invalid", message)),
            *kept,
        ],
    }


def _ready_reason(experts: Mapping[str, Any], router: Mapping[str, Any], count: int,
                  *stages: Mapping[str, Any]) -> tuple[str, str]:
    for condition in (experts, router, *stages):
        if condition["status"] != "True":
            return condition["reason"], condition["message"]
    return "Ready", f"the router and {count} experts are ready"


def conditions_by_type(status: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """``status``'s conditions by their ``type`` (the ``previous`` of :func:`build_condition`)."""
    return {c.get("type"): c for c in status.get("conditions") or [] if isinstance(c, Mapping)}


def build_condition(previous: Mapping[str, Mapping[str, Any]], kind: str, ok: bool,
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
