"""Level-triggered reconciliation of one DDMDeployment: read it, converge its children, report.

Every trigger (the resource created, updated or resumed, a child or one of its pods changed
or deleted) runs the same ``reconcile(namespace, name)``. Runs for one resource are
serialised, and a trigger that finds a run already queued is dropped (that run will see its
change). A run reads nothing from the API server: the resource, its children and their pods
come from the watches' cache (``observed.Observed``), which kopf fills before any handler
runs, every event updates before its handler runs, and every write of the operator updates
with the server's answer. So a run sends only the writes that something differs calls for,
and a run that finds everything in sync (the common case: a Deployment's status or a pod
changed) sends nothing but a status that changed.

A cached copy can be behind the API server, never ahead of what it says, and nothing is
written on its word alone: an update, a restore and the deletion of a child carry the copy's
resourceVersion (or uid) as a precondition, so a stale copy makes the write fail (a conflict,
not an error: the change that made it stale has its own event, which runs this again), never
overwrite or delete something newer.

Per child: absent -> create; there but not controlled by this resource -> an error, never
overwritten; spec hash differs -> apply (update); hash equal -> a dry-run apply shows whether
someone edited it, and only then apply (restore). (Applying unconditionally would be simpler,
but on Kubernetes 1.20 even a no-op apply bumps the resourceVersion, so every apply would
trigger another run.) The dry run is skipped for a child whose generation (or resourceVersion)
and metadata are those this operator last wrote or checked (``_fingerprint``). Children no
longer wanted (a removed expert, NetworkPolicies once the setting is off) are deleted. An
invalid spec leaves every child as it is.

Before writing anything, every Deployment to create or update is applied as a dry run: a value
the API server refuses (one the spec's checks do not model, such as a malformed ``affinity``:
the Deployments carry the spec's free-form values; the Services, ConfigMaps and
NetworkPolicies only what the operator makes) makes the spec invalid, reported like the spec's
own problems, and no child is written, so a DDM is never left half-created. A child absent
from the cache may still be there without the operator's labels: the Deployment's dry run says
so (it answers a resourceVersion), the others are created with a plain create, which answers
409 when the name is taken (never overwriting); either way the child is then read by name and
refused unless it is this resource's.

The operator's Secrets (the tokens, the URIs of fetched checkpoints) are immutable and named
after what they hold (``names``), so the operator only ever creates them: ``create``
answering 409 means one of that name is there already. A URI's Secret is named after the
DDMDeployment's uid and the URI, so that one is the operator's own. A token Secret's name
(from the uid) is known once the resource exists, so whether the one there is the operator's
is decided by the status, which lists the token Secrets the operator created
(``status.tokenSecrets``): one there that it did not create is never used, the pods that would
read it are not run, and the status says so. Secrets no longer wanted stay until the garbage
collector removes them with the DDMDeployment (the old ReplicaSets a rollback needs still
name them): the operator needs no verb on Secrets but ``create``.
The status reports the pods' troubles (``status.pod_trouble``): a pod event triggers a run.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import kopf

from ddm.operator import names
from ddm.operator.access import TOKEN_COMPONENT, router_token
from ddm.operator.children import checked_spec, desired_children
from ddm.operator.config import OperatorConfig
from ddm.operator.kube import CHILD_KINDS, Kube, KubeError
from ddm.operator.observed import Observed
from ddm.operator.scaler import operator_scaled
from ddm.deploy.spec import SpecError
from ddm.operator.status import invalid_status, now_rfc3339, ready_status, reconciled_part

log = logging.getLogger("ddm.operator")


class _Stopped(Exception):
    """The operator is stopping (:meth:`Reconciler.stop`): the run ends where it is."""


@dataclass(frozen=True)
class Outcome:
    """How a run ended: the spec's problems, or why some child could not be applied (the
    first such API error; the other children were still converged); ``autoscaled``: whether
    the operator's scaler has experts of it to scale."""

    spec_error: SpecError | None = None
    failure: str | None = None
    autoscaled: bool = False


class Reconciler:
    """Converges DDMDeployments; safe to call from many threads at once. ``observed``: what
    the watches show (the resources, their children and pods); ``post_event(body,
    reason=..., message=...)`` reports what it changed: kopf's ``kopf.info`` (which needs a
    running operator) by default.

    Every API failure is a ``KubeError`` (``kube``): one while converging a child is recorded
    and the other children go on; one writing the status ends the run with that ``KubeError``
    (the handler retries)."""

    def __init__(self, kube: Kube, config: OperatorConfig, observed: Observed,
                 post_event: Callable[..., None] = kopf.info) -> None:
        self._kube, self._config, self._post_event = kube, config, post_event
        self._observed = observed
        self._guard = threading.Lock()
        # One lock per resource, alive while some thread holds it: no entry outlives its use.
        self._locks: weakref.WeakValueDictionary[tuple[str, str], threading.Lock] = (
            weakref.WeakValueDictionary())
        self._queued: set[tuple[str, str]] = set()
        # Per DDMDeployment: child (kind, name) -> the resourceVersion last known to match the
        # desired state. Replaced by each run (so only live children are remembered).
        self._in_sync: dict[tuple[str, str], dict[tuple[str, str], _Fingerprint]] = {}
        self._stopping = threading.Event()

    def stop(self) -> None:
        """The operator is stopping: runs not started yet end at once, a run under way ends
        before its next API request (each child is written whole, and the next start's run,
        which reads everything afresh, converges the rest)."""
        self._stopping.set()

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
            try:
                return self._run(namespace, name)
            except _Stopped:
                return None  # resumable: the next start's run converges what is left

    def _between_requests(self) -> None:
        """Raise :class:`_Stopped` if the operator is stopping: a run ends between two API
        requests, never half way through writing a child."""
        if self._stopping.is_set():
            raise _Stopped()

    def _run(self, namespace: str, name: str) -> Outcome | None:
        self._between_requests()
        body = self._observed.get(names.KIND, namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self._in_sync.pop((namespace, name), None)
            return None  # the garbage collector removes the children
        meta, previous = body["metadata"], body.get("status") or {}
        try:
            spec = checked_spec(body.get("spec"), name, self._config)
        except SpecError as error:
            self._report(body, invalid_status(error, meta, previous=previous, now=now_rfc3339()))
            return Outcome(spec_error=error)
        desired = desired_children(spec, body, self._config, _new_token)
        secrets_wanted = [m for m in desired if m["kind"] == "Secret"]
        desired = [m for m in desired if m["kind"] != "Secret"]
        live = self._observed.owned(namespace, name, CHILD_KINDS)
        refused, previews = self._refused(desired, live)
        if refused:
            error = SpecError(refused)
            self._report(body, invalid_status(error, meta, previous=previous, now=now_rfc3339()))
            return Outcome(spec_error=error)
        actions: list[tuple[str, str]] = []
        errors: list[str] = []
        token = router_token(spec, meta, self._config)
        blocked: list[str] = []  # our Secrets' names, taken by Secrets that are not ours
        made = list(previous.get("tokenSecrets") or [])  # the token Secrets we created
        for secret in secrets_wanted:
            self._attempt(errors, actions, self._create_secret, secret, made, blocked)
        if blocked:  # a pod that would read one is not run (an existing one is deleted below)
            desired = [m for m in desired if not _uses_secrets(m, blocked)]
        if token is not None and token.secret_name in blocked:
            token = None
        known, in_sync = self._in_sync.get((namespace, name), {}), {}
        for manifest in desired:
            self._between_requests()
            self._attempt(errors, actions, self._converge, manifest,
                          live.get(_key(manifest)), previews.get(_key(manifest)),
                          meta["uid"], known, in_sync)
        self._in_sync[(namespace, name)] = in_sync
        wanted = {_key(m) for m in desired}
        for (kind, child), obj in live.items():
            if (kind, child) not in wanted and _controlled_by(obj, meta["uid"]):
                self._attempt(errors, actions, self._delete, obj)
        for reason, message in actions:
            log.info("%s/%s: %s", namespace, name, message)
        for reason, message in _summaries(actions):  # one Event per reason and run
            self._post_event(body, reason=reason, message=message)
        for error in errors:
            log.warning("%s/%s: %s", namespace, name, error)
        failure = errors[0] if errors else None
        # As written: a Deployment this run changed is reported by the API server's answer
        # (a generation its controller has not seen), not as the rolled-out one it replaced.
        deployments = {n: obj for (_, n), obj in self._observed.owned(
            namespace, name, ("Deployment",)).items()}
        pods = list(self._observed.owned(namespace, name, ("Pod",)).values())
        self._report(body, ready_status(
            spec, meta, deployments=deployments, previous=previous, now=now_rfc3339(),
            failure=failure, pods=pods, token_secret=token.secret_name if token else None,
            token_secrets=made))
        return Outcome(failure=failure, autoscaled=bool(operator_scaled(spec)))

    def _refused(self, desired: list[dict[str, Any]],
                 live: Mapping[tuple[str, str], Mapping[str, Any]]
                 ) -> tuple[list[str], dict[tuple[str, str], dict[str, Any]]]:
        """What the API server would refuse (HTTP 422) among the Deployments to write, and what
        it would store for each of the others (its dry-run answer, by child)."""
        refused, previews = [], {}
        for manifest in desired:
            current = live.get(_key(manifest))
            if manifest["kind"] != "Deployment" or (
                    current is not None and _spec_hash(current) == _spec_hash(manifest)):
                continue
            self._between_requests()
            try:
                previews[_key(manifest)] = self._kube.apply(manifest, dry_run=True)
            except KubeError as error:
                if error.status == 422:
                    kind, child = _key(manifest)
                    refused.append(f"spec: the API server refuses it as {kind} {child}: "
                                   f"{error.detail}")
        return refused, previews

    def _create_secret(self, secret: dict[str, Any], made: list[str], blocked: list[str]
                       ) -> tuple[str, str] | None:
        """Create one of the operator's Secrets unless it is there. A token Secret there that
        the status does not list among those the operator created (``made``, to which one
        created now is added) was planted: a ``KubeError`` (409), and its name is ``blocked``."""
        name = secret["metadata"]["name"]
        token = secret["metadata"]["labels"][names.COMPONENT_LABEL] == TOKEN_COMPONENT
        if self._kube.create_secret(secret):
            if token:
                made.append(name)
            return "Created", f"Created Secret {name}"
        if not token or name in made:
            return None
        blocked.append(name)
        raise KubeError(409, f"Secret {name} exists but the operator did not create it for this "
                             "DDMDeployment, so it is not used and nothing that would read it "
                             "runs; delete it (the operator then creates its own)")

    def _converge(self, desired: dict[str, Any], live: Mapping[str, Any] | None,
                  preview: Mapping[str, Any] | None, owner_uid: str,
                  known: Mapping[tuple[str, str], _Fingerprint],
                  in_sync: dict[tuple[str, str], _Fingerprint]) -> tuple[str, str] | None:
        """Make one child match ``desired``; returns (reason, message), None if in sync.

        ``preview``: the dry-run answer for it, if :meth:`_refused` made one; ``known``: the
        children the previous run left in sync; ``in_sync`` collects this run's."""
        kind, meta = desired["kind"], desired["metadata"]
        what, key = f"{kind} {meta['name']}", _key(desired)
        if live is None:
            live = self._create(desired, preview, in_sync)
            if live is None:
                return "Created", f"Created {what}"
        if not _controlled_by(live, owner_uid):
            raise KubeError(409, f"{what} already exists and belongs to something else; "
                                 "delete or rename it")
        if _spec_hash(live) != _spec_hash(desired):
            return self._write(desired, live, in_sync, ("Updated", f"Updated {what}"))
        if known.get(key) == _fingerprint(live, desired):
            in_sync[key] = _fingerprint(live, desired)  # untouched since last written or checked
            return None
        try:
            preview = self._kube.apply(_at_version(desired, live), dry_run=True)
        except KubeError as error:
            if error.status == 409:  # changed since it was cached: its own event runs this
                return None
            raise
        if _differs(live, preview):
            return self._write(desired, live, in_sync, (
                "Restored", f"Restored {what} (it was changed outside the operator)"))
        in_sync[key] = _fingerprint(live, desired)
        return None

    def _create(self, desired: dict[str, Any], preview: Mapping[str, Any] | None,
                in_sync: dict[tuple[str, str], _Fingerprint]) -> dict[str, Any] | None:
        """Create a child absent from the cache; None once created, else the object of that
        name that is there (to be checked and converged as a live child)."""
        kind, meta = desired["kind"], desired["metadata"]
        if kind != "Deployment":
            try:
                return self._wrote(desired, self._kube.create(desired), in_sync)
            except KubeError as error:
                if error.status != 409:
                    raise
        elif preview is not None and not _version(preview):
            # The dry run would create it: nothing of that name is there.
            return self._wrote(desired, self._kube.apply(desired), in_sync)
        # There, yet not among the cached children: without our labels, or not cached yet.
        live = self._kube.get(kind, meta["namespace"], meta["name"])
        if live is not None:
            self._observed.seen(live)
            return live
        if kind != "Deployment":
            raise KubeError(409, f"{kind} {meta['name']} was deleted while it was being "
                                 "created; it is created on the next run")
        return self._wrote(desired, self._kube.apply(desired), in_sync)

    def _write(self, desired: dict[str, Any], live: Mapping[str, Any],
               in_sync: dict[tuple[str, str], _Fingerprint], action: tuple[str, str]
               ) -> tuple[str, str] | None:
        """Apply ``desired`` over ``live`` (as cached: a precondition); None if the child
        changed since it was cached (its own event runs this again)."""
        try:
            current = self._kube.own_as_applied(live)
            self._wrote(desired, self._kube.apply(_at_version(desired, current)), in_sync)
        except KubeError as error:
            if error.status == 409:
                return None
            raise
        return action

    def _wrote(self, desired: Mapping[str, Any], stored: dict[str, Any],
               in_sync: dict[tuple[str, str], _Fingerprint]) -> None:
        """Remember what the API server stored for a child the operator wrote."""
        self._observed.seen(stored)
        in_sync[_key(desired)] = _fingerprint(stored, desired)

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

    def _delete(self, child: Mapping[str, Any]) -> tuple[str, str]:
        kind, meta = child["kind"], child["metadata"]
        self._kube.delete(kind, meta["namespace"], meta["name"], meta["uid"])
        self._observed.gone(child)
        return "Deleted", (f"Deleted {kind} {meta['name']} (no longer wanted by the spec or "
                           "settings)")

    def _report(self, body: Mapping[str, Any], status: dict[str, Any]) -> None:
        if status != reconciled_part(body.get("status")):
            meta = body["metadata"]
            stored = self._kube.write_status(meta["namespace"], meta["name"], status)
            if stored is not None:
                self._observed.seen(stored)


def _version(obj: Mapping[str, Any]) -> str:
    return obj["metadata"].get("resourceVersion", "")


def _at_version(desired: Mapping[str, Any], live: Mapping[str, Any]) -> dict[str, Any]:
    """``desired`` to apply only over ``live`` as it is: its resourceVersion a precondition."""
    return {**desired, "metadata": {**desired["metadata"], "resourceVersion": _version(live)}}


#: What says a child is as the operator last wrote or checked it (:func:`_fingerprint`).
_Fingerprint = tuple[str, str]


def _fingerprint(obj: Mapping[str, Any], desired: Mapping[str, Any]) -> _Fingerprint:
    """A child's ``metadata.generation`` (moved only by a change to its spec), or its
    resourceVersion where it has no generation (ConfigMaps, Services), with a digest of the
    values of the labels and annotations the operator sets (``desired``'s) and of its
    ownerReferences. A Deployment whose status alone the controller wrote, or that got an
    annotation of someone else's (the controller's ``deployment.kubernetes.io/revision``),
    keeps its fingerprint, so that the run its change triggers costs no dry run for it."""
    meta, ours = obj["metadata"], desired["metadata"]
    generation = meta.get("generation")
    owned = [{key: (meta.get(field) or {}).get(key) for key in ours.get(field) or {}}
             for field in ("labels", "annotations")]
    return (f"generation {generation}" if generation is not None else _version(obj),
            json.dumps([*owned, meta.get("ownerReferences")], sort_keys=True))


def _summaries(actions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """One (reason, message) per reason, naming every child it concerns: a DDM's creation
    posts one Event, not one per child (each is an API request)."""
    by_reason: dict[str, list[str]] = {}
    for reason, message in actions:
        by_reason.setdefault(reason, []).append(message)
    return [(reason, messages[0] if len(messages) == 1 else "; ".join(messages))
            for reason, messages in by_reason.items()]


def _key(manifest: Mapping[str, Any]) -> tuple[str, str]:
    return manifest["kind"], manifest["metadata"]["name"]


def _spec_hash(obj: Mapping[str, Any]) -> str | None:
    return (obj["metadata"].get("annotations") or {}).get(names.SPEC_HASH_ANNOTATION)


def _controlled_by(obj: Mapping[str, Any], owner_uid: str) -> bool:
    return any(ref.get("uid") == owner_uid and ref.get("controller")
               for ref in obj["metadata"].get("ownerReferences") or [])


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
    """Whether applying would change what the server stores (``preview``: a dry-run apply of
    the same version of the object as ``live``)."""

    def essence(obj: Mapping[str, Any]) -> tuple[Any, ...]:
        meta = obj["metadata"]
        return (obj.get("spec"), obj.get("data"), meta.get("labels"), meta.get("annotations"),
                meta.get("ownerReferences"))
    return essence(live) != essence(preview)


def _new_token() -> str:
    """A fresh random bearer token (256 bits)."""
    return secrets.token_urlsafe(32)
