"""The checkpoint fetcher's init container and the Secret its URIs travel in (pure builders).

A fetched checkpoint's URI is a tenant's input that may carry a secret (a pre-signed URL's
``X-Amz-Signature=...``), so it never appears in a child's spec: the operator writes every
fetched URI of a DDMDeployment into one Secret it owns (``<name>-checkpoints``, one key per
pod kind: ``router``, ``expert-<name>``), and the init container reads it from
``$DDM_CHECKPOINT_URI`` (``ddm fetch-checkpoint DEST``). Its command carries only what is not
secret: the pinned ``--sha256``, the ``--headers-file`` of the spec's ``credentialsSecret``
(that one key, mounted read-only with mode 0400 into the init container alone), and the
operator-wide ``--allow-network`` CIDRs. The pod template carries a hash of the URI
(``names.CHECKPOINT_HASH_ANNOTATION``), so a new URI rolls the pods as a new command would.

The checkpoint's emptyDir is capped at the fetcher's own byte cap (``FetchPolicy.max_bytes``,
the download and its extraction together).
"""

from __future__ import annotations

import base64
import hashlib
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
ROUTER_KEY = "router"


def expert_key(expert: str) -> str:
    """The key of ``expert``'s URI in the checkpoint Secret."""
    return f"expert-{expert}"


def fetched_uris(spec: DDMSpec) -> dict[str, str]:
    """Secret key -> URI of every checkpoint the DDM fetches (none: no Secret is needed)."""
    uris = {expert_key(e.name): e.checkpoint.uri for e in spec.experts
            if e.checkpoint.scheme in REMOTE_SCHEMES}
    router = spec.router.checkpoint
    if router is not None and router.scheme in REMOTE_SCHEMES:
        uris[ROUTER_KEY] = router.uri
    return uris


def build_checkpoint_secret(spec: DDMSpec, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The Secret holding the fetched URIs (no data when the DDM fetches nothing: the operator
    then creates none, and empties one left from an earlier spec)."""
    uris = fetched_uris(spec)
    owner = meta["name"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": names.checkpoint_secret_name(owner),
                     "namespace": meta["namespace"], "labels": names.labels(owner, "checkpoints")},
        "data": {key: base64.b64encode(uri.encode()).decode() for key, uri in uris.items()},
    }


def uri_digest(uri: str) -> str:
    """A short hash of ``uri`` for the pod template (rolls pods when it changes)."""
    return hashlib.sha256(uri.encode()).hexdigest()[:16]


def fetch_mount(checkpoint: CheckpointSource, options: FetchOptions, *, owner: str, key: str,
                volume: str, mount_path: str, fetcher: dict[str, Any],
                allow_networks: tuple[str, ...]) -> CheckpointMount:
    """The emptyDir, mounts and init container that fetch ``checkpoint`` to ``mount_path``.

    ``fetcher``: the init container without its command (the server's image and security
    context); ``key``: the URI's key in the checkpoint Secret.
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
    uri_env = {"name": ENV_URI, "valueFrom": {"secretKeyRef": {
        "name": names.checkpoint_secret_name(owner), "key": key}}}
    init = {**fetcher, "name": f"fetch-{volume}", "command": [*command, mount_path],
            "env": [*fetcher.get("env", []), uri_env], "volumeMounts": mounts}
    return CheckpointMount(
        path=mount_path, volumes=volumes,
        mounts=[{"name": volume, "mountPath": mount_path, "readOnly": True}],
        init_containers=[init])
