"""The few Kubernetes API calls the operator makes, on plain dicts (the builders' currency).

Children are written with server-side apply (field manager ``ddm-operator``, forced): fields
the operator stops setting are removed, fields others own (the Deployment controller's
annotations, a Service's allocated clusterIP, ``kubectl rollout restart``) are kept, and fields
it owns but someone edited are taken back. A child is created with a plain create when the
reconcile needs no dry run of it first (``create`` answers 409 when its name is taken, which
an apply would not), and its fields are then recorded as applied (``own_as_applied``) before
the first apply to it.

Secrets: the operator creates its own (the tokens, the fetched checkpoints' URIs), immutable,
and nothing else: RBAC grants ``create`` on Secrets and no other verb, so it never reads,
changes or deletes one (the garbage collector removes them with their DDMDeployment).

Every failure is a ``KubeError``: an answer with an error status, and equally a call that got
no answer (connection refused or reset, a timeout, TLS broken off: whatever urllib3 or the
socket raises), with status 0. So a reconcile records it like any refused call and goes on,
never stopping half way on an exception nobody expected. Every call has a deadline.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable, Mapping

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ddm.operator import names
from ddm.operator.training_manifests import TRAINER_API_VERSION

#: kind -> (API class, the method suffix in ``{verb}_namespaced_{suffix}``).
CHILD_KINDS = {
    "Deployment": (client.AppsV1Api, "deployment"),
    "Service": (client.CoreV1Api, "service"),
    "ConfigMap": (client.CoreV1Api, "config_map"),
    "NetworkPolicy": (client.NetworkingV1Api, "network_policy"),
}
TRAINJOB_PLURAL = "trainjobs"
#: A log read takes at most this many bytes (a peer is never trusted to be small).
LOG_LIMIT_BYTES = 64 * 1024
_APPLY = "application/apply-patch+yaml"
_MERGE = "application/merge-patch+json"
_JSON_PATCH = "application/json-patch+json"
#: Seconds to connect to the API server, and to wait for its answer to one call.
REQUEST_TIMEOUT_S = (5.0, 30.0)
#: What the client raises when no answer came: urllib3's errors (MaxRetryError after its own
#: retries, ProtocolError, timeouts, TLS errors) and the socket's (OSError: ConnectionError,
#: TimeoutError, ssl.SSLError).
TRANSPORT_ERRORS = (urllib3.exceptions.HTTPError, OSError)


class KubeError(RuntimeError):
    """An API call failed; ``status`` is the HTTP status (404, 409, 422, ...), 0 when the API
    server did not answer."""

    def __init__(self, status: int, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail or message  #: the API server's own message


def _error(what: str, error: Exception) -> KubeError:
    if not isinstance(error, ApiException):
        detail = f"the API server did not answer ({type(error).__name__}: {error})"
        return KubeError(0, f"{what}: {detail}", detail)
    detail = error.reason or ""
    try:
        detail = json.loads(error.body or "{}").get("message", detail)
    except ValueError:
        pass
    return KubeError(int(error.status or 0), f"{what}: {detail} (HTTP {error.status})", detail)


def _call(what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``method(*args, **kwargs)`` with a deadline; every failure as a ``KubeError``."""
    try:
        return method(*args, _request_timeout=REQUEST_TIMEOUT_S, **kwargs)
    except (ApiException, *TRANSPORT_ERRORS) as error:
        raise _error(what, error) from None


class Kube:
    """Typed-client calls returning JSON dicts; every failure becomes a ``KubeError``."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self._custom = client.CustomObjectsApi(api_client)
        self._core = client.CoreV1Api(api_client)
        self._apis = {kind: cls(api_client) for kind, (cls, _) in CHILD_KINDS.items()}
        self._batch = client.BatchV1Api(api_client)

    def _child_call(self, kind: str, verb: str, what: str, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self._apis[kind], f"{verb}_namespaced_{CHILD_KINDS[kind][1]}")
        return _json(_call(what, method, *args, _preload_content=False, **kwargs))

    def get_owner(self, namespace: str, name: str, plural: str = names.PLURAL
                  ) -> dict[str, Any] | None:
        """The DDMDeployment (or the ``plural`` resource of ddm.dev), or None when it is
        gone."""
        try:
            return _json(_call(f"reading {plural} {namespace}/{name}",
                               self._custom.get_namespaced_custom_object, names.GROUP,
                               names.VERSION, namespace, plural, name,
                               _preload_content=False))
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    def write_status(self, namespace: str, name: str, status: Mapping[str, Any],
                     plural: str = names.PLURAL) -> dict[str, Any] | None:
        """Merge ``status`` into the DDMDeployment's (or the ``plural`` resource's); the stored
        object, None when it is gone."""
        try:
            return _json(_call(f"writing the status of {namespace}/{name}",
                               self._custom.patch_namespaced_custom_object_status, names.GROUP,
                               names.VERSION, namespace, plural, name,
                               {"status": dict(status)}, _content_type=_MERGE,
                               _preload_content=False))
        except KubeError as error:
            if error.status != 404:  # deleted meanwhile: nothing left to report on
                raise
            return None

    def list_pods(self, namespace: str, owner: str) -> list[dict[str, Any]]:
        """The pods of ``owner``'s Deployments (they carry its labels)."""
        selector = (f"{names.DEPLOYMENT_LABEL}={owner},"
                    f"{names.MANAGED_BY_LABEL}={names.MANAGED_BY}")
        return _json(_call(f"listing the pods of {owner}", self._core.list_namespaced_pod,
                           namespace, label_selector=selector, _preload_content=False)
                     ).get("items", [])

    def list_labelled(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        """The Jobs, TrainJobs or Pods (``kind``) of ``namespace`` matching ``selector``; no
        TrainJobs (an empty list) where Kubeflow Trainer is not installed."""
        what = f"listing the {kind}s labelled {selector}"
        if kind == "Job":
            method: Callable[..., Any] = self._batch.list_namespaced_job
        elif kind == "Pod":
            method = self._core.list_namespaced_pod
        else:
            group, version = _group_version(TRAINER_API_VERSION)
            method = functools.partial(self._custom.list_namespaced_custom_object, group,
                                       version, plural=TRAINJOB_PLURAL)
        try:
            return _json(_call(what, method, namespace, label_selector=selector,
                               _preload_content=False)).get("items", [])
        except KubeError as error:
            if kind == "TrainJob" and error.status == 404:  # the CRD is not installed
                return []
            raise

    def create_object(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Create a Job, a TrainJob or a DDMDeployment (a ``KubeError`` 409 when its name is
        taken: nothing is changed)."""
        kind, meta = manifest["kind"], manifest["metadata"]
        what = f"creating {kind} {meta['name']}"
        if kind == "Job":
            return _json(_call(what, self._batch.create_namespaced_job, meta["namespace"],
                               dict(manifest), field_manager=names.MANAGED_BY,
                               _preload_content=False))
        group, version = _group_version(manifest["apiVersion"])
        plural = names.PLURAL if kind == names.KIND else TRAINJOB_PLURAL
        return _json(_call(what, self._custom.create_namespaced_custom_object, group, version,
                           meta["namespace"], plural, dict(manifest),
                           field_manager=names.MANAGED_BY, _preload_content=False))

    def log_tail(self, namespace: str, pod: str, container: str, lines: int) -> str:
        """The last ``lines`` lines of a container's log ('' when it has none yet)."""
        try:
            response = _call(f"reading the log of {pod}/{container}",
                             self._core.read_namespaced_pod_log, pod, namespace,
                             container=container, tail_lines=lines, limit_bytes=LOG_LIMIT_BYTES,
                             _preload_content=False)
            return (response.data or b"").decode("utf-8", "replace")
        except KubeError as error:
            if error.status in (400, 404):  # not started yet, or gone
                return ""
            raise

    def create_secret(self, manifest: Mapping[str, Any]) -> bool:
        """Create a Secret unless one of that name exists (never read, never updated);
        True when this call created it."""
        meta = manifest["metadata"]
        try:
            _call(f"creating Secret {meta['name']}", self._core.create_namespaced_secret,
                  meta["namespace"], dict(manifest), _preload_content=False)
        except KubeError as error:
            if error.status == 409:
                return False
            raise
        return True

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Create a child (a ``KubeError`` 409 when its name is taken: nothing is changed).
        The fields are recorded as the operator's with operation ``Update``:
        :meth:`own_as_applied` makes them its applied ones before it applies to the child."""
        kind, meta = manifest["kind"], manifest["metadata"]
        return self._child_call(kind, "create", f"creating {kind} {meta['name']}",
                                meta["namespace"], dict(manifest),
                                field_manager=names.MANAGED_BY)

    def own_as_applied(self, live: Mapping[str, Any]) -> dict[str, Any]:
        """``live`` (a child the operator created with :meth:`create`) with the fields it
        created recorded as applied by it, as though server-side apply had created it: its
        later applies then remove what they no longer set (created fields would otherwise stay
        with their creator for good). Sent only if needed, with ``live``'s resourceVersion as a
        precondition (a ``KubeError`` 409 if it changed since)."""
        meta = live["metadata"]
        fields = meta.get("managedFields") or []
        if not any(_created_by_operator(entry) for entry in fields):
            return dict(live)
        upgraded = [{**entry, "operation": "Apply"} if _created_by_operator(entry) else entry
                    for entry in fields]
        patch = [{"op": "test", "path": "/metadata/resourceVersion",
                  "value": meta["resourceVersion"]},
                 {"op": "replace", "path": "/metadata/managedFields", "value": upgraded}]
        return self._child_call(live["kind"], "patch", f"taking {live['kind']} {meta['name']} "
                                "as applied", meta["name"], meta["namespace"], patch,
                                _content_type=_JSON_PATCH)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One child by name, or None when there is none."""
        try:
            return self._child_call(kind, "read", f"reading {kind} {name}", name, namespace)
        except KubeError as error:
            if error.status == 404:
                return None
            raise

    def apply(self, manifest: Mapping[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        """Server-side apply ``manifest``; with ``dry_run`` the server only says what it would
        store. A ``metadata.resourceVersion`` in it is a precondition: a ``KubeError`` 409 if
        the child changed since."""
        kind, meta = manifest["kind"], manifest["metadata"]
        extra = {"dry_run": "All"} if dry_run else {}
        return self._child_call(
            kind, "patch", f"applying {kind} {meta['name']}", meta["name"], meta["namespace"],
            dict(manifest), field_manager=names.MANAGED_BY, force=True, _content_type=_APPLY,
            **extra)

    def apply_replicas(self, namespace: str, name: str, replicas: int, manager: str
                       ) -> dict[str, Any]:
        """Server-side apply of a Deployment's ``spec.replicas`` alone, as field manager
        ``manager`` (forced): it then owns that field, so applies of the rest of the
        Deployment that leave it out (the operator's) keep its value."""
        body = {"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"replicas": replicas}}
        return self._child_call("Deployment", "patch", f"scaling Deployment {name}", name,
                                namespace, body, field_manager=manager, force=True,
                                _content_type=_APPLY)

    def delete(self, kind: str, namespace: str, name: str, uid: str) -> None:
        """Delete the child of that name if it is still the object ``uid`` (another of the
        same name, made since, is left alone); nothing when it is gone."""
        try:
            self._child_call(kind, "delete", f"deleting {kind} {name}", name, namespace,
                             body={"preconditions": {"uid": uid}},
                             propagation_policy="Background")
        except KubeError as error:
            if error.status not in (404, 409):  # gone, or another object by now
                raise


def _group_version(api_version: str) -> tuple[str, str]:
    group, _, version = api_version.partition("/")
    return group, version


def _created_by_operator(entry: Mapping[str, Any]) -> bool:
    """Whether a ``managedFields`` entry holds the fields :meth:`Kube.create` set."""
    return entry.get("manager") == names.MANAGED_BY and entry.get("operation") == "Update"


def _json(response: Any) -> dict[str, Any]:
    """The JSON body of an unparsed (``_preload_content=False``) response."""
    try:
        return json.loads(response.data or b"{}")
    except (ValueError, *TRANSPORT_ERRORS) as error:  # cut off while reading the body
        raise KubeError(0, f"the API server's answer was cut off or malformed: {error}") from None
