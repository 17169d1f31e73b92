"""Level-triggered reconciliation of one DDMDeployment: read it, converge its children, report.

Every trigger (the resource created, updated or resumed, a child or one of its pods changed
or deleted) runs the same ``reconcile(namespace, name)``, which reads the *current*
resource, so a late trigger never applies a stale spec. Runs for one resource are serialised,
and a trigger that finds a run already queued is dropped (that run will see its change).

Per child: absent -> apply (create); there but not controlled by this resource -> an error,
never overwritten; spec hash differs -> apply (update); hash equal -> a dry-run apply shows
whether someone edited it, and only then apply (restore). (Applying unconditionally would be
simpler, but on Kubernetes 1.20 even a no-op apply bumps the resourceVersion, so every apply
would trigger another run.) The dry run is skipped for a child whose resourceVersion is the one
this operator last wrote or checked: nothing changed it since, so a run triggered by a pod event
costs a handful of reads instead of a dry run per child. Children no longer wanted (a removed
expert, NetworkPolicies once the setting is off) are deleted. An invalid spec leaves every child
as it is.

Before writing anything, every child to create or update is applied as a dry run: a value the
API server refuses (one the spec's checks do not model, such as a malformed ``affinity``)
makes the spec invalid, reported like the spec's own problems, and no child is written, so a
DDM is never left half-created.

The operator's Secrets (the router's token when the spec names none, the URIs of fetched
checkpoints) are recognised without reading them: every write to one is a JSON patch whose
``test`` operations (``ownership_tests``: our labels and this resource as controller) make
the API server refuse a Secret the operator did not make. One of their names taken by such a
Secret is never used nor changed: the pods that would read it are not run and the status says
so. The token is created once and never read or rewritten; the URIs' Secret follows the spec.
The status reports the pods' troubles (``status.pod_trouble``): a pod event triggers a run.
"""

from __future__ import annotations

import logging
import secrets
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import kopf

from ddm.operator import names
from ddm.operator.access import build_router_token_secret, creates_token_secret, router_token
from ddm.operator.config import OperatorConfig
from ddm.operator.fetcher import build_checkpoint_secret
from ddm.operator.policy import policy_problems
from ddm.operator.kube import Kube, KubeError
from ddm.operator.manifests import build_children, with_spec_hash
from ddm.deploy.spec import DDMSpec, SpecError, parse_spec
from ddm.operator.status import invalid_status, now_rfc3339, ready_status

log = logging.getLogger("ddm.operator")


@dataclass(frozen=True)
class Outcome:
    """How a run ended: the spec's problems, or why some child could not be applied (the
    first such API error; the other children were still converged)."""

    spec_error: SpecError | None = None
    failure: str | None = None


class Reconciler:
    """Converges DDMDeployments; safe to call from many threads at once. ``post_event(body,
    reason=..., message=...)`` reports what it changed: kopf's ``kopf.info`` (which needs a
    running operator) by default.

    Every API failure is a ``KubeError`` (``kube``): one while converging a child is recorded
    and the other children go on; one reading the resource, listing its children or writing
    its status ends the run with that ``KubeError`` (the handler retries)."""

    def __init__(self, kube: Kube, config: OperatorConfig,
                 post_event: Callable[..., None] = kopf.info) -> None:
        self._kube, self._config, self._post_event = kube, config, post_event
        self._guard = threading.Lock()
        # One lock per resource, alive while some thread holds it: no entry outlives its use.
        self._locks: weakref.WeakValueDictionary[tuple[str, str], threading.Lock] = (
            weakref.WeakValueDictionary())
        self._queued: set[tuple[str, str]] = set()
        # Per DDMDeployment: child (kind, name) -> the resourceVersion last known to match the
        # desired state. Replaced by each run (so only live children are remembered).
        self._in_sync: dict[tuple[str, str], dict[tuple[str, str], str]] = {}

    def reconcile(self, namespace: str, name: str, *, coalesce: bool = False
                  ) -> Outcome | None:
        """One run for ``namespace/name``; None when it is gone, being deleted, or (with
        ``coalesce``) when a queued run will cover this trigger."""
        key = (namespace, name)
        with self._guard:
            if coalesce and key in self._queued:
                return None
            self._queued.add(key)
            lock = self._locks.get(key)
            if lock is None:
                lock = self._locks[key] = threading.Lock()
        with lock:
            with self._guard:
                self._queued.discard(key)
            return self._run(namespace, name)

    def _run(self, namespace: str, name: str) -> Outcome | None:
        body = self._kube.get_owner(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self._in_sync.pop((namespace, name), None)
            return None  # the garbage collector removes the children
        meta, previous = body["metadata"], body.get("status") or {}
        try:
            spec = parse_spec(body.get("spec"), allow_host_paths=self._config.allow_host_paths)
            outside = policy_problems(spec, self._config.allowed_images,
                                      self._config.allowed_checkpoint_sources)
            if outside:
                raise SpecError(outside)
        except SpecError as error:
            self._report(body, invalid_status(error, meta, previous=previous, now=now_rfc3339()))
            return Outcome(spec_error=error)
        desired = []
        for manifest in build_children(spec, meta, self._config):
            kopf.append_owner_reference(manifest, owner=body)
            desired.append(with_spec_hash(manifest))
        live = self._kube.list_children(namespace, name)
        refused = self._refused(desired, live)
        if refused:
            error = SpecError(refused)
            self._report(body, invalid_status(error, meta, previous=previous, now=now_rfc3339()))
            return Outcome(spec_error=error)
        actions: list[tuple[str, str]] = []
        errors: list[str] = []
        token = router_token(spec, meta, self._config)
        blocked: list[str] = []  # our Secrets' names, taken by Secrets that are not ours
        if creates_token_secret(spec, self._config):
            self._attempt(errors, actions, self._token_secret, body, blocked)
        self._attempt(errors, actions, self._checkpoint_secret, spec, body, blocked)
        if blocked:  # a pod that would read one is not run (an existing one is deleted below)
            desired = [m for m in desired if not _uses_secrets(m, blocked)]
        if token is not None and token.secret_name in blocked:
            token = None
        known, in_sync = self._in_sync.get((namespace, name), {}), {}
        for manifest in desired:
            self._attempt(errors, actions, self._converge, manifest,
                          live.get(_key(manifest)), meta["uid"], known, in_sync)
        self._in_sync[(namespace, name)] = in_sync
        wanted = {_key(m) for m in desired}
        for (kind, child), obj in live.items():
            if (kind, child) not in wanted and _controlled_by(obj, meta["uid"]):
                self._attempt(errors, actions, self._delete, kind, namespace, child)
        for reason, message in actions:
            log.info("%s/%s: %s", namespace, name, message)
            self._post_event(body, reason=reason, message=message)
        pods: list[dict[str, Any]] = []
        try:
            pods = self._kube.list_pods(namespace, name)
        except KubeError as error:
            errors.append(str(error))
        for error in errors:
            log.warning("%s/%s: %s", namespace, name, error)
        failure = errors[0] if errors else None
        deployments = {n: obj for (kind, n), obj in live.items() if kind == "Deployment"}
        self._report(body, ready_status(
            spec, meta, deployments=deployments, previous=previous, now=now_rfc3339(),
            failure=failure, pods=pods, token_secret=token.secret_name if token else None))
        return Outcome(failure=failure)

    def _refused(self, desired: list[dict[str, Any]],
                 live: Mapping[tuple[str, str], Mapping[str, Any]]) -> list[str]:
        """What the API server would refuse (HTTP 422) among the children to write."""
        refused = []
        for manifest in desired:
            current = live.get(_key(manifest))
            if current is not None and _spec_hash(current) == _spec_hash(manifest):
                continue
            try:
                self._kube.apply(manifest, dry_run=True)
            except KubeError as error:
                if error.status == 422:
                    kind, child = _key(manifest)
                    refused.append(f"spec: the API server refuses it as {kind} {child}: "
                                   f"{error.detail}")
        return refused

    def _token_secret(self, body: Mapping[str, Any], blocked: list[str]
                      ) -> tuple[str, str] | None:
        """Create the router's token Secret unless the operator's own is there already."""
        meta = body["metadata"]
        name = names.router_token_name(meta["name"])
        if self._own_secret(meta, name, blocked):
            return None
        secret = build_router_token_secret(meta, secrets.token_urlsafe(32))
        kopf.append_owner_reference(secret, owner=body)
        if self._kube.create_secret(secret):
            return "Created", f"Created Secret {name} (the router's bearer token)"
        return None  # created meanwhile: the next run checks whose it is

    def _checkpoint_secret(self, spec: DDMSpec, body: Mapping[str, Any], blocked: list[str]
                           ) -> tuple[str, str] | None:
        """Write the fetched checkpoints' URIs into the operator's own Secret (created only
        when there is a URI; emptied when none is left). An unchanged patch changes nothing
        on the server."""
        manifest = build_checkpoint_secret(spec, body["metadata"])
        name, data = manifest["metadata"]["name"], manifest["data"]
        if self._own_secret(body["metadata"], name, blocked,
                            [{"op": "add", "path": "/data", "value": data}]):
            return None
        if not data:
            return None
        kopf.append_owner_reference(manifest, owner=body)
        if self._kube.create_secret(manifest):
            return "Created", f"Created Secret {name} (the URIs of the checkpoints to fetch)"
        return None  # created meanwhile: the next run checks whose it is and writes it

    def _own_secret(self, owner: Mapping[str, Any], name: str, blocked: list[str],
                    changes: list[dict[str, Any]] | None = None) -> bool:
        """Whether the operator's Secret ``name`` of ``owner`` exists (then ``changes`` are
        made to it); False when absent. A ``KubeError`` (409) when a Secret of that name is
        there that the operator did not make for ``owner`` (``ownership_tests``): it is never
        used, nor changed."""
        held = self._kube.patch_own_secret(owner["namespace"], name, ownership_tests(owner),
                                           changes or [])
        if held is not False:
            return bool(held)
        blocked.append(name)
        raise KubeError(409, f"Secret {name} exists but the operator did not create it for this "
                             "DDMDeployment (it lacks the operator's labels or an owner "
                             "reference to this resource), so it is not used and nothing that "
                             "would read it runs; delete it, or name a Secret of yours in the "
                             "spec")

    def _converge(self, desired: dict[str, Any], live: Mapping[str, Any] | None, owner_uid: str,
                  known: Mapping[tuple[str, str], str], in_sync: dict[tuple[str, str], str]
                  ) -> tuple[str, str] | None:
        """Make one child match ``desired``; returns (reason, message), None if in sync.

        ``known``: the resourceVersions the previous run left in sync; ``in_sync`` collects
        this run's."""
        kind, meta = desired["kind"], desired["metadata"]
        what, key = f"{kind} {meta['name']}", _key(desired)
        if live is None:  # not among the labelled children; maybe there without our labels
            live = self._kube.get(kind, meta["namespace"], meta["name"])
        if live is None:
            in_sync[key] = _version(self._kube.apply(desired))
            return "Created", f"Created {what}"
        if not _controlled_by(live, owner_uid):
            raise KubeError(409, f"{what} already exists and belongs to something else; "
                                 "delete or rename it")
        if _spec_hash(live) != _spec_hash(desired):
            in_sync[key] = _version(self._kube.apply(desired))
            return "Updated", f"Updated {what}"
        if known.get(key) == _version(live):
            in_sync[key] = _version(live)  # untouched since it was last written or checked
            return None
        if _differs(live, self._kube.apply(desired, dry_run=True)):
            in_sync[key] = _version(self._kube.apply(desired))
            return "Restored", f"Restored {what} (it was changed outside the operator)"
        in_sync[key] = _version(live)
        return None

    @staticmethod
    def _attempt(errors: list[str], actions: list[tuple[str, str]],
                 step: Callable[..., tuple[str, str] | None], *args: Any) -> None:
        """Run one child's ``step``; its API error is recorded and the other children go on."""
        try:
            action = step(*args)
        except KubeError as error:
            errors.append(str(error))
            return
        if action:
            actions.append(action)

    def _delete(self, kind: str, namespace: str, name: str) -> tuple[str, str]:
        self._kube.delete(kind, namespace, name)
        return "Deleted", f"Deleted {kind} {name} (no longer wanted by the spec or settings)"

    def _report(self, body: Mapping[str, Any], status: dict[str, Any]) -> None:
        if status != body.get("status"):
            meta = body["metadata"]
            self._kube.write_status(meta["namespace"], meta["name"], status)


def _version(obj: Mapping[str, Any]) -> str:
    return obj["metadata"].get("resourceVersion", "")


def _key(manifest: Mapping[str, Any]) -> tuple[str, str]:
    return manifest["kind"], manifest["metadata"]["name"]


def _spec_hash(obj: Mapping[str, Any]) -> str | None:
    return (obj["metadata"].get("annotations") or {}).get(names.SPEC_HASH_ANNOTATION)


def _controlled_by(obj: Mapping[str, Any], owner_uid: str) -> bool:
    return any(ref.get("uid") == owner_uid and ref.get("controller")
               for ref in obj["metadata"].get("ownerReferences") or [])


def ownership_tests(owner: Mapping[str, Any]) -> dict[str, Any]:
    """JSON pointers and values that only a Secret the operator created for ``owner`` has:
    our labels naming ``owner``, and ``owner`` (by uid, which nobody can know before it
    exists) as its one controller. A Secret planted before the DDMDeployment was created,
    labels copied included, fails them."""
    return {f"/metadata/labels/{_pointer(names.MANAGED_BY_LABEL)}": names.MANAGED_BY,
            f"/metadata/labels/{_pointer(names.DEPLOYMENT_LABEL)}": owner["name"],
            "/metadata/ownerReferences/0/uid": owner["uid"],
            "/metadata/ownerReferences/0/controller": True}


def _pointer(key: str) -> str:
    """``key`` as one JSON-pointer segment (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def _uses_secrets(manifest: Mapping[str, Any], secret_names: list[str]) -> bool:
    """Whether a Deployment's pods would read one of ``secret_names`` (a volume or an env)."""
    if manifest["kind"] != "Deployment":
        return False
    pod = manifest["spec"]["template"]["spec"]
    used = {(v.get("secret") or {}).get("secretName") for v in pod.get("volumes", [])}
    for container in pod.get("initContainers", []) + pod["containers"]:
        used |= {((e.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
                 for e in container.get("env", [])}
    return bool(used & set(secret_names))


def _differs(live: Mapping[str, Any], preview: Mapping[str, Any]) -> bool:
    """Whether applying would change what the server stores (``preview``: a dry-run apply).

    When the object changed since ``live`` was listed (a controller wrote to it, say), the
    comparison would be meaningless: False, as that change's own event triggers a new run.
    """
    if live["metadata"].get("resourceVersion") != preview["metadata"].get("resourceVersion"):
        return False

    def essence(obj: Mapping[str, Any]) -> tuple[Any, ...]:
        meta = obj["metadata"]
        return (obj.get("spec"), obj.get("data"), meta.get("labels"), meta.get("annotations"),
                meta.get("ownerReferences"))
    return essence(live) != essence(preview)
