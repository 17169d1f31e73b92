"""kopf handlers: which events reconcile a DDMDeployment, and what an outcome means to kopf.

The work is in ``reconcile``; these are the triggers:

- the DDMDeployment created, updated or found at start-up (resume): a run whose outcome kopf
  sees: an invalid spec posts a Warning and ends in ``PermanentError`` (kopf retries only on the
  next change), a child that could not be applied posts a Warning and a ``TemporaryError``;
- any change to a child (Deployment, Service, ConfigMap, NetworkPolicy) or to a pod of its
  Deployments, all labelled ``managed-by: ddm-operator`` and watched with that server-side
  label selector: deleted or edited children come back within about a second, and the status
  follows the Deployments' readiness and the pods' failures (a crash loop, an image that
  cannot be pulled, a pod no node takes) as they change;
- a DDMTraining created, updated or resumed, or one of its Jobs changed (labelled as the
  children are): ``training_reconcile``, whose ticker also re-reads active trainings' progress.

Every watched object (the DDMDeployments, the children, the pods) also feeds the operator's
cache (``observed``, in ``memo.observed``) through an index handler: kopf runs index handlers
first for every event, and at start-up lists every indexed kind before any other handler runs,
so a run never finds the cache missing what the API server had when the operator started.
Deletions reach it through the event handlers (kopf calls no index handler for them).

The autoscaler (``scaler``) is one thread that the start-up handler starts in ``memo.scaler``;
a run whose spec has experts for it to scale hands it the DDMDeployment. There is no resync
timer: kopf lists everything again on start-up and after a watch fails, and a timer would make
kopf put a finalizer on every DDMDeployment, so that deleting one would hang whenever no
operator runs.
No deletion handler either: children carry ownerReferences, so the garbage collector removes
them, and kopf adds no finalizer. ``register`` puts the handlers
into a registry the caller makes (``kopf.OperatorRegistry``) and passes to ``kopf.run``:
importing this module registers nothing. ``ddm.operator.runner.run_operator`` does both, and
puts the API client (``memo.api_client``) and the reconciler (``memo.reconciler``) in kopf's
memo.

An API call that failed (the API server unreachable included: ``kube.KubeError``) ends a run
triggered by the DDMDeployment in a ``TemporaryError``, retried after ``RETRY_DELAY_S``; a run
triggered by a child's event is not retried by kopf, so its failure is only logged: the watch
that delivered the event re-lists after the outage, and that re-list triggers a run.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from ddm.deploy.spec import SpecError
from ddm.deploy.training_spec import PLURAL as TRAINING_PLURAL
from ddm.operator import names
from ddm.operator.client import connection_info
from ddm.operator.kube import KubeError
from ddm.operator.scaler import start_scaler, stop_scaler
from ddm.operator.status import pod_trouble
from ddm.operator.training_manifests import TRAINING_LABEL
from ddm.operator.training_reconcile import TrainingTicker

log = logging.getLogger("ddm.operator")
RETRY_DELAY_S = 30
#: After an API call failed without an answer (status 0: the server unreachable), retry soon.
UNREACHABLE_RETRY_DELAY_S = 5
_CRD = (names.GROUP, names.VERSION, names.PLURAL)
_TRAINING_CRD = (names.GROUP, names.VERSION, TRAINING_PLURAL)
_JOBS = ("batch", "v1", "jobs")
_OURS = {names.MANAGED_BY_LABEL: names.MANAGED_BY}


def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """The operator's own credentials (re-read on every login: tokens rotate)."""
    return connection_info(memo.api_client.configuration)


def reconcile(namespace: str, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    try:
        outcome = memo.reconciler.reconcile(namespace, name)
    except KubeError as error:  # writing its status failed
        raise _retry(error) from None
    if outcome is None:
        return
    if outcome.autoscaled:
        memo.scaler.watch(namespace, name)  # its scaler reads it afresh each pass
    _raise_for(body, outcome.spec_error, outcome.failure, "children left unchanged",
               "ApplyFailed")


def _retry(error: KubeError) -> kopf.TemporaryError:
    """A failed API call: retried soon when the server did not answer, later otherwise."""
    return kopf.TemporaryError(str(error), delay=UNREACHABLE_RETRY_DELAY_S if error.status == 0
                               else RETRY_DELAY_S)


def _raise_for(body: kopf.Body, spec_error: SpecError | None, failure: str | None, kept: str,
               failed: str) -> None:
    """What a run's outcome means to kopf: an invalid spec posts a Warning and ends in
    ``PermanentError`` (``kept``: what it left as it was); a failed write (reason ``failed``)
    in a ``TemporaryError``."""
    if spec_error is not None:
        message = "; ".join(spec_error.problems)
        kopf.warn(body, reason="InvalidSpec", message=message)
        raise kopf.PermanentError(f"invalid spec, {kept}: {message}")
    if failure is not None:
        kopf.warn(body, reason=failed, message=failure)
        raise kopf.TemporaryError(failure, delay=RETRY_DELAY_S)


def _observe(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Index handler: the cache keeps the object as this event shows it (nothing goes into
    kopf's own index)."""
    memo.observed.seen(body)


def _ddm_changed(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    """A deleted DDMDeployment leaves the cache (its children go with the garbage collector)."""
    if type == "DELETED":
        memo.observed.gone(body)


def _child_changed(namespace: str | None, labels: kopf.Labels, body: kopf.Body,
                   type: str | None, memo: kopf.Memo, **_: Any) -> None:
    """Reconcile the DDMDeployment whose child (or child's pod) changed or was deleted: the
    one its ``ddm.dev/deployment`` label names (pods are owned by ReplicaSets, not by it)."""
    if type == "DELETED":
        memo.observed.gone(body)
    owner = labels.get(names.DEPLOYMENT_LABEL)
    if owner and namespace is not None:
        try:
            memo.reconciler.reconcile(namespace, owner, coalesce=True)
        except KubeError as error:
            log.warning("%s/%s: %s (retried on the next event or re-list)", namespace, owner,
                        error)


def _pod_changed(namespace: str | None, labels: kopf.Labels, body: kopf.Body, type: str | None,
                 memo: kopf.Memo, **kwargs: Any) -> None:
    """A pod matters to the status only through its trouble (``status.pod_trouble``); its
    readiness reaches the status through its Deployment. So a pod event reconciles only when
    the pod is new, gone, or its trouble changed: a scheduler retrying a pod that fits no node
    rewrites the pod again and again and would otherwise cost a run each time."""
    uid = body["metadata"]["uid"]
    if type == "DELETED":
        memo.pod_troubles.pop(uid, None)
    else:
        trouble = pod_trouble([body])
        if uid in memo.pod_troubles and memo.pod_troubles[uid] == trouble:
            return
        memo.pod_troubles[uid] = trouble
    _child_changed(namespace=namespace, labels=labels, body=body, type=type, memo=memo,
                   **kwargs)


def reconcile_training(namespace: str, name: str, body: kopf.Body, memo: kopf.Memo,
                       **_: Any) -> None:
    """A DDMTraining created, updated or found at start-up: as for a DDMDeployment, an invalid
    spec ends in ``PermanentError``, a failed API call in a ``TemporaryError``."""
    try:
        outcome = memo.training_reconciler.reconcile(namespace, name)
    except KubeError as error:
        raise _retry(error) from None
    if outcome is None:
        return
    memo.training_ticker.track(namespace, name, outcome.active)
    _raise_for(body, outcome.spec_error, outcome.failure, "no job created", "CreateFailed")


def _job_changed(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any
                 ) -> None:
    """Reconcile the DDMTraining whose Job changed (it succeeded, failed, retried a pod, or
    was deleted): the one its ``ddm.dev/training`` label names."""
    owner = labels.get(TRAINING_LABEL)
    if not owner or namespace is None:
        return
    try:
        outcome = memo.training_reconciler.reconcile(namespace, owner)
    except KubeError as error:
        log.warning("%s/%s: %s (retried by the progress ticker)", namespace, owner, error)
        return
    memo.training_ticker.track(namespace, owner, outcome is not None and outcome.active)


def start_training_ticker(memo: kopf.Memo, **_: Any) -> None:
    """kopf's start-up: the thread that re-reads active trainings' progress."""
    memo.training_ticker = TrainingTicker(memo.training_reconciler)
    memo.training_ticker.start()


def stop_training_ticker(memo: kopf.Memo, **_: Any) -> None:
    """kopf's clean-up: the ticker's thread ends."""
    ticker = getattr(memo, "training_ticker", None)
    if ticker is not None:
        ticker.stop()


def register(registry: kopf.OperatorRegistry) -> None:
    """Register every handler of the operator in ``registry`` (pass it to ``kopf.run``)."""
    kopf.on.login(registry=registry)(login)
    kopf.on.startup(registry=registry)(start_scaler)
    kopf.on.cleanup(registry=registry)(stop_scaler)
    kopf.on.startup(registry=registry)(start_training_ticker)
    kopf.on.cleanup(registry=registry)(stop_training_ticker)
    for cause in (kopf.on.resume, kopf.on.create, kopf.on.update):
        cause(*_TRAINING_CRD, id="reconcile-training", registry=registry)(reconcile_training)
    kopf.on.event(*_JOBS, labels=_OURS, id="job-changed", registry=registry)(_job_changed)
    kopf.index(*_CRD, id="observe", registry=registry)(_observe)
    kopf.on.event(*_CRD, id="ddm-changed", registry=registry)(_ddm_changed)
    for cause in (kopf.on.resume, kopf.on.create, kopf.on.update):
        cause(*_CRD, id="reconcile", registry=registry)(reconcile)
    for resource in names.CHILD_RESOURCES:
        kopf.index(*resource, labels=_OURS, id="observe", registry=registry)(_observe)
        handler = _pod_changed if resource == names.POD_RESOURCE else _child_changed
        kopf.on.event(*resource, labels=_OURS, id="child-changed", registry=registry)(handler)
