"""Start the operator: credentials, kopf's settings (all explicit), and ``kopf.run``.

``run_operator`` is what ``ddm operator`` and the operator image (``operator/main.py``) call.
Tests call it in a thread with a ``stop_flag``.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from pathlib import Path
from typing import Sequence

import kopf
from kubernetes import client, config

from ddm.operator import names
from ddm.operator.config import OperatorConfig
from ddm.operator.kube import Kube
from ddm.operator.reconcile import Reconciler

#: Workers for the (synchronous) handlers: runs for different DDMDeployments go in parallel.
MAX_WORKERS = 8


def load_client(kubeconfig: str | Path | None = None) -> client.ApiClient:
    """An API client: the pod's service account in a cluster, else ``kubeconfig`` (default:
    ``$KUBECONFIG`` or ``~/.kube/config``)."""
    configuration = client.Configuration()
    if kubeconfig is None:
        try:
            config.load_incluster_config(client_configuration=configuration)
            return client.ApiClient(configuration)
        except config.ConfigException:
            pass
    config.load_kube_config(config_file=None if kubeconfig is None else str(kubeconfig),
                            client_configuration=configuration)
    return client.ApiClient(configuration)


def connection_info(configuration: client.Configuration) -> kopf.ConnectionInfo:
    """kopf's credentials from the client's (the token re-read through its refresh hook)."""
    header = (configuration.get_api_key_with_prefix("BearerToken")
              or configuration.get_api_key_with_prefix("authorization"))
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        scheme=scheme or None,
        token=token or None,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


def operator_settings() -> kopf.OperatorSettings:
    """kopf's settings, every choice written down."""
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
    settings.execution.max_workers = MAX_WORKERS
    return settings


def run_operator(namespaces: Sequence[str] | None = None, *, standalone: bool = True,
                 liveness_port: int | None = 8081, kubeconfig: str | Path | None = None,
                 operator_config: OperatorConfig | None = None, configure_logging: bool = True,
                 stop_flag: threading.Event | None = None,
                 ready_flag: threading.Event | None = None) -> None:
    """Run until Ctrl-C or SIGTERM (or ``stop_flag``, from another thread).

    ``namespaces``: the namespaces (or globs like ``team-*``) to serve; None or empty: the whole
    cluster. ``standalone``: no kopf peering (one replica, no KopfPeering resources needed).
    ``liveness_port``: serve ``/healthz`` there (None: no probe endpoint).
    ``operator_config``: default from the environment (``OperatorConfig.from_env``).
    """
    if configure_logging:
        kopf.configure(verbose=False, log_format=kopf.LogFormat.FULL)
        # kopf logs every handler success at INFO (one line per child event); the reconciler
        # logs what it changes, so kopf's per-object lines are kept to warnings and errors.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    api_client = load_client(kubeconfig)
    importlib.import_module("ddm.operator.handlers")  # registers the handlers with kopf
    reconciler = Reconciler(Kube(api_client),
                            operator_config or OperatorConfig.from_env(os.environ))
    kopf.run(
        settings=operator_settings(),
        standalone=standalone,
        clusterwide=not namespaces,
        namespaces=list(namespaces or ()),
        liveness_endpoint=(None if liveness_port is None
                           else f"http://0.0.0.0:{liveness_port}/healthz"),
        memo=kopf.Memo(api_client=api_client, reconciler=reconciler),
        stop_flag=stop_flag,
        ready_flag=ready_flag,
    )
