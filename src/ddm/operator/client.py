"""The operator's credentials: one Kubernetes API client, and kopf's login from the same
credentials (in a pod its service account, else a kubeconfig)."""

from __future__ import annotations

from pathlib import Path

import kopf
from kubernetes import client, config


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
