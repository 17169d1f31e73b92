"""The checkpoint stager's fetch steps and the Secrets their URIs travel in (pure builders).

A fetched checkpoint's URI is a tenant's input that may carry a secret (a pre-signed URL's
``X-Amz-Signature=...``), so it never appears in a child's spec: the operator writes each
fetched URI into a Secret of its own (``names.checkpoint_secret_name``: named after the URI's
digest, immutable, created once and never read back, owned by the DDMDeployment), or the spec
names the user's own Secret (``checkpoint.uriFrom.secretKeyRef``, which the operator never
reads); the fetch step reads it from ``$DDM_CHECKPOINT_URI`` (``ddm fetch-checkpoint DEST``).
Its command carries only what is not secret: the pinned ``--sha256``, the ``--headers-file``
of the spec's ``credentialsSecret`` or the ``--store-credentials-file`` of its
``storeCredentialsSecret`` (that one key, mounted read-only with mode 0400 into that step
alone), the operator-wide ``--allow-network`` CIDRs and ``--max-bytes`` cap. A new URI is
a new Secret name and a new staged name, so it rolls the stager and the pods that copy from
it; the pod templates also carry the URI's digest (``names.CHECKPOINT_HASH_ANNOTATION``).

The fetch steps run in the DDM's checkpoint stager, never in a serving pod: only the stager's
pod may reach the stores. Each step has requests and limits (``FETCH_RESOURCES``), and requests
as much ephemeral storage as it may write: the cap.
"""

from __future__ import annotations

import base64
from typing import Any, Mapping

from ddm.checkpoints.declared import PLAN_NAMES, ROUTER
from ddm.checkpoints.uri import (
    ARCHIVE_SUFFIXES,
    CHECKPOINT_URI_ENV,
    FETCH_COMMAND,
    FETCHED_SCHEMES,
    SECRET_SCHEME,
    SERVE_COMMAND,
    STAGER_PORT,
    CheckpointSource,
    staged_path,
)
from ddm.deploy.spec import DDMSpec, FetchOptions
from ddm.operator import names

#: A fetch step's CPU and memory: ``ddm fetch-checkpoint`` streams to disk and checks a
#: checkpoint in constant memory (about 40 MiB resident; tests/unit/test_checkpoint_fetch.py
#: bounds it at 128 MiB with 256 MiB of weights).
FETCH_RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi"},
                   "limits": {"cpu": "1", "memory": "256Mi"}}
#: Where the fetcher reads the store's HTTP headers (the credentials Secret's one key).
CREDENTIALS_DIR = "/var/run/secrets/ddm/checkpoint-credentials"
CREDENTIALS_FILE = f"{CREDENTIALS_DIR}/headers"
#: Where it reads the store's own credentials file (the storeCredentialsSecret's one key).
STORE_CREDENTIALS_DIR = "/var/run/secrets/ddm/store-credentials"
STORE_CREDENTIALS_FILE = f"{STORE_CREDENTIALS_DIR}/credentials"
#: The key of the URI in its Secret.
URI_KEY = "uri"
ROUTER_KEY = "router"


def expert_key(expert: str) -> str:
    """Whose checkpoint: ``router`` or ``expert-<name>`` (part of its Secret's name)."""
    return f"expert-{expert}"


def stage_key(role: str) -> str:
    """A text encoder's or decoder's checkpoint: ``stage-<role>`` (the router network's is the
    router's, ``ROUTER_KEY``)."""
    return f"stage-{role}"


def fetched(spec: DDMSpec) -> list[tuple[str, CheckpointSource, FetchOptions]]:
    """(whose key, checkpoint, options) of every checkpoint the DDM fetches."""
    found = [(expert_key(e.name), e.checkpoint, e.fetch) for e in spec.experts
             if e.checkpoint.scheme in FETCHED_SCHEMES]
    router = spec.router.checkpoint
    if router is not None and router.scheme in FETCHED_SCHEMES:
        found.append((ROUTER_KEY, router, spec.router.fetch))
    found += [(stage_key(role), stage.checkpoint, stage.fetch)
              for role, stage in spec.stages.items()
              if role != PLAN_NAMES[ROUTER] and stage.checkpoint.scheme in FETCHED_SCHEMES]
    return found


def fetched_uris(spec: DDMSpec) -> dict[str, str]:
    """Pod key (``ROUTER_KEY``, ``expert_key``) -> URI of every checkpoint the DDM fetches from
    a URI in its spec (a URI in the user's Secret stays there)."""
    return {key: checkpoint.uri for key, checkpoint, _ in fetched(spec)
            if checkpoint.scheme != SECRET_SCHEME}


def staged_key(key: str, checkpoint: CheckpointSource) -> str:
    """Where the stager keeps ``checkpoint`` (``key`` and the URI's hash): a serving pod of a
    new URI never copies what a stager of the old one still serves."""
    return f"{key}-{names.digest(checkpoint.uri)}"


def checkpoint_secret(meta: Mapping[str, Any], key: str, uri: str) -> str:
    """The name of the Secret holding ``uri``, fetched for the pod ``key``."""
    return names.checkpoint_secret_name(meta["name"], meta["uid"], key, uri)


def build_checkpoint_secrets(spec: DDMSpec, meta: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One immutable Secret per fetched URI in the spec (none when the DDM fetches nothing)."""
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


def fetch_resources(max_bytes: int) -> dict[str, dict[str, str]]:
    """``FETCH_RESOURCES`` with the ephemeral storage of ``max_bytes`` requested."""
    return {"requests": {**FETCH_RESOURCES["requests"], "ephemeral-storage": str(max_bytes)},
            "limits": dict(FETCH_RESOURCES["limits"])}


def fetch_step(checkpoint: CheckpointSource, options: FetchOptions, *,
               meta: Mapping[str, Any], key: str, dest: str, base: dict[str, Any],
               allow_networks: tuple[str, ...], max_bytes: int
               ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The init container that fetches ``checkpoint`` to ``dest``, and the volumes it needs
    (its credentials). ``base``: the container without its name and command (image, security
    context, the volume ``dest`` is on); ``key``: whose checkpoint (its URI in the Secret
    ``checkpoint_secret`` names), unless the URI is in the user's Secret (``SECRET_SCHEME``:
    ``location`` and ``path`` name it)."""
    assert checkpoint.scheme in FETCHED_SCHEMES, checkpoint.scheme
    command = [*FETCH_COMMAND]
    if options.sha256:
        command += ["--sha256", options.sha256]
    volumes, mounts = [], list(base.get("volumeMounts", []))
    mounted = ((options.credentials, "credentials", "--headers-file", CREDENTIALS_FILE),
               (options.store_credentials, "store-credentials", "--store-credentials-file",
                STORE_CREDENTIALS_FILE))
    for secret, volume_prefix, flag, file in mounted:
        if secret is None:
            continue
        volume, (directory, _, name) = f"{volume_prefix}-{key}", file.rpartition("/")
        command += [flag, file]
        volumes.append({"name": volume, "secret": {
            "secretName": secret.name, "defaultMode": 0o400,
            "items": [{"key": secret.key, "path": name}]}})
        mounts.append({"name": volume, "mountPath": directory, "readOnly": True})
    for network in allow_networks:
        command += ["--allow-network", network]
    command += ["--max-bytes", str(max_bytes)]
    held = ({"name": checkpoint.location, "key": checkpoint.path}
            if checkpoint.scheme == SECRET_SCHEME
            else {"name": checkpoint_secret(meta, key, checkpoint.uri), "key": URI_KEY})
    uri_env = {"name": CHECKPOINT_URI_ENV, "valueFrom": {"secretKeyRef": held}}
    step = {**base, "name": f"fetch-{key}", "command": [*command, dest],
            "env": [*base.get("env", []), uri_env], "volumeMounts": mounts,
            "resources": fetch_resources(max_bytes)}
    return step, volumes


def copy_step(checkpoint: CheckpointSource, options: FetchOptions, *, key: str, owner: str,
              namespace: str, cluster_domain: str, dest: str, base: dict[str, Any],
              max_bytes: int) -> dict[str, Any]:
    """A serving pod's init container: copies ``checkpoint`` from the stager Service (the
    directory it staged) into ``dest``, allowed to reach that one name (``--allow-host``) and
    nothing else, and verifies it as the stager did. The spec's pin goes with it when it pins
    a directory's ``config.json``, the very file the stager serves (an archive's pin covers
    bytes the stager no longer holds)."""
    host = names.stager_host(owner, namespace, cluster_domain)
    url = f"http://{host}:{STAGER_PORT}{staged_path(staged_key(key, checkpoint))}"
    pin = (["--sha256", options.sha256] if options.sha256 and checkpoint.scheme != SECRET_SCHEME
           and not checkpoint.path.endswith(ARCHIVE_SUFFIXES) else [])
    return {**base, "name": "copy-checkpoint",
            "command": [*FETCH_COMMAND, url, dest, *pin, "--allow-host", host,
                        "--max-bytes", str(max_bytes)],
            "resources": fetch_resources(max_bytes)}


def serve_step(root: str, base: dict[str, Any], staged_bytes: int) -> dict[str, Any]:
    """The stager's one container: serves what its fetch steps left under ``root``,
    read-only; ready once it listens (after every fetch step succeeded)."""
    return {**base, "name": "stager",
            "command": [*SERVE_COMMAND, root, "--port", str(STAGER_PORT)],
            "ports": [{"name": "http", "containerPort": STAGER_PORT, "protocol": "TCP"}],
            "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 5},
            "livenessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 10},
            "resources": fetch_resources(staged_bytes)}
