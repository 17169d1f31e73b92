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
from ddm.operator.kube import Kube, KubeError
from ddm.deploy.spec import SpecError
from ddm.operator.status import invalid_status, now_rfc3339, ready_status, reconciled_part

log = logging.getLogger("ddm.operator")


class _Stopped(Exception):
    """The operator is stopping (:meth:`Reconciler.stop`): the run ends where it is."""


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
        body = self._kube.get_owner(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self._in_sync.pop((namespace, name), None)
            return None  # the garbage collector removes the children
        meta, previous = body["metadata"], body.get("status") or {}
        try:
            spec = checked_spec(body.get("spec"), self._config)
        except SpecError as error:
            self._report(body, invalid_status(error, meta, previous=previous, now=now_rfc3339()))
            return Outcome(spec_error=error)
        desired = desired_children(spec, body, self._config, _new_token)
        secrets_wanted = [m for m in desired if m["kind"] == "Secret"]
        desired = [m for m in desired if m["kind"] != "Secret"]
        self._between_requests()
        live = self._kube.list_children(namespace, name)
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
                self._attempt(errors, actions, self._delete, kind, namespace, child)
        for reason, message in actions:
            log.info("%s/%s: %s", namespace, name, message)
        for reason, message in _summaries(actions):  # one Event per reason and run
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
            failure=failure, pods=pods, token_secret=token.secret_name if token else None,
            token_secrets=made))
        return Outcome(failure=failure)

    def _refused(self, desired: list[dict[str, Any]],
                 live: Mapping[tuple[str, str], Mapping[str, Any]]
                 ) -> tuple[list[str], dict[tuple[str, str], dict[str, Any]]]:
        """What the API server would refuse (HTTP 422) among the children to write, and what
        it would store for each of the others (its dry-run answer, by child)."""
        refused, previews = [], {}
        for manifest in desired:
            current = live.get(_key(manifest))
            if current is not None and _spec_hash(current) == _spec_hash(manifest):
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
        if live is None and (preview is None or _version(preview)):
            # Not among the labelled children, yet maybe there without our labels: a dry run
            # that would create it answers no resourceVersion, so only then is it surely absent.
            live = self._kube.get(kind, meta["namespace"], meta["name"])
        if live is None:
            in_sync[key] = _fingerprint(self._kube.apply(desired))
            return "Created", f"Created {what}"
        if not _controlled_by(live, owner_uid):
            raise KubeError(409, f"{what} already exists and belongs to something else; "
                                 "delete or rename it")
        if _spec_hash(live) != _spec_hash(desired):
            in_sync[key] = _fingerprint(self._kube.apply(desired))
            return "Updated", f"Updated {what}"
        if known.get(key) == _fingerprint(live):
            in_sync[key] = _fingerprint(live)  # untouched since it was last written or checked
            return None
        preview = self._kube.apply(desired, dry_run=True)
        if _version(preview) != _version(live):
            # Changed since it was listed (a controller wrote its status, say): the comparison
            # would be meaningless, and that change's own event runs this again. Nothing is
            # remembered as in sync meanwhile, or an edit made before it would stay for good.
            return None
        if _differs(live, preview):
            in_sync[key] = _fingerprint(self._kube.apply(desired))
            return "Restored", f"Restored {what} (it was changed outside the operator)"
        in_sync[key] = _fingerprint(live)
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
        if status != reconciled_part(body.get("status")):
            meta = body["metadata"]
            self._kube.write_status(meta["namespace"], meta["name"], status)


def _version(obj: Mapping[str, Any]) -> str:
    return obj["metadata"].get("resourceVersion", "")


#: What says a child is as the operator last wrote or checked it (:func:`_fingerprint`).
_Fingerprint = tuple[str, str]


def _fingerprint(obj: Mapping[str, Any]) -> _Fingerprint:
    """A child's ``metadata.generation`` (moved only by a change to its spec) and a digest of
    its labels, annotations and ownerReferences; its resourceVersion where it has no
    generation (ConfigMaps, Services). A Deployment whose status alone the controller wrote
    keeps its fingerprint, so that the run its change triggers costs no dry run for it."""
    meta = obj["metadata"]
    generation = meta.get("generation")
    return (f"generation {generation}" if generation is not None else _version(obj),
            json.dumps([meta.get("labels"), meta.get("annotations"),
                        meta.get("ownerReferences")], sort_keys=True))


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
