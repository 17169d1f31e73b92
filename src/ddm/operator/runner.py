"""Start the operator: credentials, kopf's settings (all explicit), and ``kopf.run``.

``run_operator`` is what ``ddm operator`` and the operator image (``operator/main.py``) call.
Tests call it in a thread with a ``stop_flag``, or run ``ddm operator`` as a process.

Which namespaces it serves comes from ``DDM_WATCH_NAMESPACES`` (the Helm chart sets it) unless
the caller names them: a comma-separated list of namespace names, or empty for the whole
cluster. With a list, every watch and request is namespaced, so the operator needs RBAC only
in those namespaces (a Role each) and no cluster-scoped permission at all.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import threading
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import kopf

from ddm.operator import names
from ddm.operator.client import load_client
from ddm.operator.config import OperatorConfig
from ddm.operator.handlers import register
from ddm.operator.kube import Kube
from ddm.operator.observed import Observed
from ddm.operator.reconcile import Reconciler
from ddm.operator.training_reconcile import TrainingReconciler

#: How often the waiting thread looks at ``stop_flag`` (signals wake it at once).
STOP_POLL_S = 0.2
#: Seconds from SIGTERM to the process's exit, at most: well within Kubernetes' default grace
#: period (30 s), so that a rollout never SIGKILLs the operator.
SHUTDOWN_S = 8.0
#: Workers for the (synchronous) handlers: runs for different DDMDeployments go in parallel.
MAX_WORKERS = 8
#: The namespaces to serve, comma-separated; empty or unset: the whole cluster.
WATCH_NAMESPACES_ENV = "DDM_WATCH_NAMESPACES"
#: A namespace name is a DNS-1123 label.
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def watched_namespaces(env: Mapping[str, str]) -> tuple[str, ...]:
    """The namespaces listed in ``$DDM_WATCH_NAMESPACES``; () (the whole cluster) when it is
    unset or blank. Raises ValueError naming the first malformed entry."""
    text = env.get(WATCH_NAMESPACES_ENV, "")
    if not text.strip():
        return ()
    return checked_namespaces((part.strip() for part in text.split(",")),
                              f"{WATCH_NAMESPACES_ENV}={text!r}")


def checked_namespaces(namespaces: Iterable[str], source: str) -> tuple[str, ...]:
    """``namespaces`` if each is a namespace name, listed once; else a ValueError that says
    which entry of ``source`` is wrong.

    Names, not globs such as ``team-*``: RBAC is granted per namespace, and kopf would have to
    list every namespace of the cluster to expand a glob.
    """
    found: list[str] = []
    for position, namespace in enumerate(namespaces, start=1):
        if not namespace:
            raise ValueError(f"{source}: entry {position} is empty")
        if not _NAMESPACE.fullmatch(namespace):
            raise ValueError(
                f"{source}: entry {position} {namespace!r} is not a namespace name (at most 63 "
                "lowercase letters, digits and '-', starting and ending with a letter or digit)")
        if namespace in found:
            raise ValueError(f"{source}: namespace {namespace!r} is listed twice")
        found.append(namespace)
    return tuple(found)


def operator_settings(*, clusterwide: bool = True) -> kopf.OperatorSettings:
    """kopf's settings, every choice written down; ``clusterwide``: serving every namespace,
    not a list of them."""
    settings = kopf.OperatorSettings()
    # kopf's bookkeeping (handler progress, the last handled spec) goes in annotations under
    # ddm.dev/: the status belongs to the operator, and the CRD's structural schema would
    # prune kopf's default status.kopf field anyway.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.GROUP, key="last-handled-configuration")
    # Only used if a deletion handler is ever added; there is none, so kopf adds no finalizer
    # and deleting a DDMDeployment never waits for the operator.
    settings.persistence.finalizer = f"{names.GROUP}/finalizer"
    # Events only from explicit kopf.info/warn calls, not from every log line.
    settings.posting.enabled = True
    settings.posting.loggers = False
    settings.posting.level = logging.INFO
    # Watch only the operator's own children (server-side filter): none of the cluster's other
    # Deployments, Services or ConfigMaps is listed or kept in memory.
    ours = f"{names.MANAGED_BY_LABEL}={names.MANAGED_BY}"
    for resource in names.CHILD_RESOURCES:
        settings.watching.label_selectors[resource] = ours
    # Reconnect watches every few minutes, so a silently dropped connection is noticed.
    settings.watching.server_timeout = 240
    settings.watching.client_timeout = 270
    settings.watching.connect_timeout = 15
    settings.networking.request_timeout = 60
    # When the API server goes away, every kopf request (a watch reconnecting included) retries
    # after these pauses; it then gives up (a watch starts over at once). kopf's default
    # (1, 1, 2, 3, 5, 8, 13, 21) rides out the same ~55 s, but a server back during a 21 s pause
    # would wait that long to be noticed: capped at 5 s, the operator acts within about 5 s of
    # the server's return (tests/integration/test_operator_faults.py measures it).
    settings.networking.error_backoffs = (1, 1, 2, 3, 5, 5, 5, 5, 5, 5, 5, 5, 5)
    # A handler that raises anything but kopf's own errors is retried after this. In ours that
    # is a call that failed before the per-child steps (reading the DDMDeployment or listing its
    # children), most often because the API server is unreachable: retry soon, not after
    # kopf's default 60 s.
    settings.execution.default_backoff = 5
    settings.execution.max_workers = MAX_WORKERS
    # Serving a list of namespaces, kopf would otherwise list and watch every Namespace and
    # CustomResourceDefinition of the cluster (to expand globs, and to notice CRDs installed
    # later), which needs cluster-scoped RBAC the namespaced install does not grant. Without it
    # kopf serves exactly the listed namespaces and the resources found at start-up: the chart
    # installs the CRD before the operator starts.
    settings.scanning.disabled = not clusterwide
    return settings


def run_operator(namespaces: Sequence[str] | None = None, *, standalone: bool = True,
                 liveness_port: int | None = 8081, kubeconfig: str | Path | None = None,
                 operator_config: OperatorConfig | None = None, configure_logging: bool = True,
                 stop_flag: threading.Event | None = None,
                 ready_flag: threading.Event | None = None) -> None:
    """Run until Ctrl-C or SIGTERM (or ``stop_flag``, from another thread).

    ``namespaces``: the namespaces to serve (names; empty: the whole cluster); None: those in
    ``$DDM_WATCH_NAMESPACES``. ``standalone``: no kopf peering (one replica, no KopfPeering
    resources needed).
    ``liveness_port``: serve ``/healthz`` there (None: no probe endpoint).
    ``operator_config``: default from the environment (``OperatorConfig.from_env``).
    """
    served = (watched_namespaces(os.environ) if namespaces is None
              else checked_namespaces(namespaces, "the namespaces to watch"))
    if configure_logging:
        kopf.configure(verbose=False, log_format=kopf.LogFormat.FULL)
        # kopf logs every handler success at INFO (one line per child event); the reconciler
        # logs what it changes, so kopf's per-object lines are kept to warnings and errors.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        # One access line per liveness probe (every 10 s in the chart) would drown the rest.
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    api_client = load_client(kubeconfig)
    registry = kopf.OperatorRegistry()
    register(registry)
    observed = Observed()
    config = operator_config or OperatorConfig.from_env(os.environ)
    reconciler = Reconciler(Kube(api_client), config, observed)
    stopping = threading.Event()  # kopf's stop flag, set by stop() alone

    def stop(*_: object) -> None:
        reconciler.stop()  # first: the runs under way end before their next request
        stopping.set()

    operator = threading.Thread(name="kopf", target=functools.partial(
        kopf.run,
        registry=registry,
        settings=operator_settings(clusterwide=not served),
        standalone=standalone,
        clusterwide=not served,
        namespaces=list(served),
        liveness_endpoint=(None if liveness_port is None
                           else f"http://0.0.0.0:{liveness_port}/healthz"),
        memo=kopf.Memo(api_client=api_client, reconciler=reconciler, observed=observed,
                       pod_troubles={},
                       training_reconciler=TrainingReconciler(Kube(api_client), config)),
        stop_flag=stopping,
        ready_flag=ready_flag,
    ))
    # kopf runs in a thread of its own, where it leaves signals alone: SIGTERM and SIGINT
    # (or ``stop_flag``) come here, so that they stop the reconciler before kopf. Left to
    # kopf, they would stop its tasks while the handlers' threads ran every queued
    # reconcile to its end: well past the pod's grace period, then a SIGKILL.
    def signalled(*_: object) -> None:
        stop()
        # The process is being stopped (a pod's SIGTERM): it exits within SHUTDOWN_S even if
        # kopf's own shutdown (thousands of per-object tasks under load) or an API request in
        # flight takes longer. Nothing is lost: every run is resumable.
        watchdog = threading.Timer(SHUTDOWN_S, _exit_now)
        watchdog.daemon = True  # a quick exit does not wait for it
        watchdog.start()

    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signalled)
    operator.start()
    while operator.is_alive():
        if stop_flag is not None and stop_flag.is_set():
            stop()
        operator.join(STOP_POLL_S)


def _exit_now() -> None:
    """End the process at once (the watchdog of a signalled shutdown), saying why."""
    logging.getLogger("ddm.operator").warning(
        "still stopping %.0f s after the signal: exiting now (every reconcile is resumable: the "
        "next start converges what is left)", SHUTDOWN_S)
    logging.shutdown()
    os._exit(0)
