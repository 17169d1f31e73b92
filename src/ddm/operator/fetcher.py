"""The checkpoint fetcher's init container and the Secrets its URIs travel in (pure builders).

A fetched checkpoint's URI is a tenant's input that may carry a secret (a pre-signed URL's
``X-Amz-Signature=...``), so it never appears in a child's spec: the operator writes each
fetched URI into a Secret of its own (``names.checkpoint_secret_name``: named after the URI's
digest, immutable, created once and never read back, owned by the DDMDeployment), and the
init container reads it from ``$DDM_CHECKPOINT_URI`` (``ddm fetch-checkpoint DEST``). Its
command carries only what is not secret: the pinned ``--sha256``, the ``--headers-file`` of the
spec's ``credentialsSecret`` (that one key, mounted read-only with mode 0400 into the init
container alone), and the operator-wide ``--allow-network`` CIDRs. A new URI is a new Secret
name in the pod template, so it rolls the pods as a new command would; the pod template also
carries the URI's digest (``names.CHECKPOINT_HASH_ANNOTATION``).

The checkpoint's emptyDir is capped at the fetcher's own byte cap (``FetchPolicy.max_bytes``,
the download and its extraction together).
"""

from __future__ import annotations

import base64
from typing import Any, Mapping

from ddm.checkpoints.uri import FETCH_COMMAND, REMOTE_SCHEMES, CheckpointMount, CheckpointSource
from ddm.deploy.spec import DDMSpec, FetchOptions
from ddm.operator import names

# ``ddm.checkpoints.fetch`` declares these two; it imports NumPy (through the checkpoint
# format), which the operator must not, so they are repeated here and a unit test
# (tests/unit/test_manifests.py) keeps them equal.
#: The fetcher's byte cap (``FetchPolicy.max_bytes``): the checkpoint emptyDir's sizeLimit.
FETCH_MAX_BYTES = 16 << 30
FETCH_SIZE_LIMIT = str(FETCH_MAX_BYTES)
#: The variable the fetcher reads its URI from (``fetch.ENV_URI``).
ENV_URI = "DDM_CHECKPOINT_URI"
#: Where the fetcher reads the store's HTTP headers (the credentials Secret's one key).
CREDENTIALS_DIR = "/var/run/secrets/ddm/checkpoint-credentials"
CREDENTIALS_FILE = f"{CREDENTIALS_DIR}/headers"
#: The key of the URI in its Secret.
URI_KEY = "uri"
ROUTER_KEY = "router"


def expert_key(expert: str) -> str:
    """Which pod fetches: ``router`` or ``expert-<name>`` (part of its Secret's name)."""
    return f"expert-{expert}"


def fetched_uris(spec: DDMSpec) -> dict[str, str]:
    """Pod key (``ROUTER_KEY``, ``expert_key``) -> URI of every checkpoint the DDM fetches."""
    uris = {expert_key(e.name): e.checkpoint.uri for e in spec.experts
            if e.checkpoint.scheme in REMOTE_SCHEMES}
    router = spec.router.checkpoint
    if router is not None and router.scheme in REMOTE_SCHEMES:
        uris[ROUTER_KEY] = router.uri
    return uris


def checkpoint_secret(meta: Mapping[str, Any], key: str, uri: str) -> str:
    """The name of the Secret holding ``uri``, fetched by the pod ``key``."""
    return names.checkpoint_secret_name(meta["name"], meta["uid"], key, uri)


def build_checkpoint_secrets(spec: DDMSpec, meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One immutable Secret per fetched URI (none when the DDM fetches nothing)."""
    owner = meta["name"]
    return [{
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "immutable": True,
        "metadata": {"name": checkpoint_secret(meta, key, uri), "namespace": meta["namespace"],
                     "labels": names.labels(owner, "checkpoints")},
        "data": {URI_KEY: base64.b64encode(uri.encode()).decode()},
    } for key, uri in fetched_uris(spec).items()]


def fetch_mount(checkpoint: CheckpointSource, options: FetchOptions, *, secret: str,
                volume: str, mount_path: str, fetcher: dict[str, Any],
                allow_networks: tuple[str, ...]) -> CheckpointMount:
    """The emptyDir, mounts and init container that fetch ``checkpoint`` to ``mount_path``.

    ``fetcher``: the init container without its command (the server's image and security
    context); ``secret``: the Secret holding the URI (``checkpoint_secret``).
    """
    assert checkpoint.scheme in REMOTE_SCHEMES, checkpoint.scheme
    command = [*FETCH_COMMAND]
    if options.sha256:
        command += ["--sha256", options.sha256]
    volumes = [{"name": volume, "emptyDir": {"sizeLimit": FETCH_SIZE_LIMIT}}]
    mounts = [*fetcher.get("volumeMounts", []), {"name": volume, "mountPath": mount_path}]
    credentials = options.credentials
    if credentials is not None:
        command += ["--headers-file", CREDENTIALS_FILE]
        volumes.append({"name": f"{volume}-credentials", "secret": {
            "secretName": credentials.name, "defaultMode": 0o400,
            "items": [{"key": credentials.key, "path": "headers"}]}})
        mounts.append({"name": f"{volume}-credentials", "mountPath": CREDENTIALS_DIR,
                       "readOnly": True})
    for network in allow_networks:
        command += ["--allow-network", network]
    uri_env = {"name": ENV_URI, "valueFrom": {"secretKeyRef": {"name": secret, "key": URI_KEY}}}
    init = {**fetcher, "name": f"fetch-{volume}", "command": [*command, mount_path],
            "env": [*fetcher.get("env", []), uri_env], "volumeMounts": mounts}
    return CheckpointMount(
        path=mount_path, volumes=volumes,
        mounts=[{"name": volume, "mountPath": mount_path, "readOnly": True}],
        init_containers=[init])
