"""Where a checkpoint comes from, and how a pod finds it at one fixed path.

- ``pvc://CLAIM[/SUB/PATH]``: the claim, mounted read-only (at ``SUB/PATH`` with a subPath).
- ``image:///ABS/PATH``: already inside the image; nothing is mounted.
- ``http(s)://...``, ``s3://BUCKET/KEY``, ``gs://BUCKET/KEY``: the DDM's checkpoint stager
  runs ``ddm fetch-checkpoint URI DEST``, and an init container copies the verified
  checkpoint from it into an emptyDir, so the server starts from local files.
- ``file:///ABS/PATH``: a hostPath volume. It exposes the node's own files to the pod, so the
  operator refuses it unless it was started with host paths allowed (single-node clusters).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

#: A claim's URI (pvc://CLAIM[/SUB/PATH]) and the absolute path after image:// or file://: the
#: parts of ``URI_PATTERN`` that a DDMTraining's volumes (a claim or a host path) take too.
CLAIM_URI = r"pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/[^/\s]+)*/?"
ABSOLUTE_PATH = r"(/[^/\s]+)+/?"
#: An object store's URI (s3://BUCKET[/KEY], gs://BUCKET[/KEY]).
BUCKET_URI = r"(s3|gs)://[a-z0-9][-a-z0-9._]*[a-z0-9](/\S*)?"
URI_PATTERN = (
    rf"^({CLAIM_URI}|(image|file)://{ABSOLUTE_PATH}"
    rf"|https?://[^/\s]+(/\S*)?|{BUCKET_URI})$"
)
MAX_URI_LENGTH = 1024
REMOTE_SCHEMES = ("http", "https", "s3", "gs")
#: Object stores whose own credentials file a fetch may sign with (``storeCredentialsSecret``).
BUCKET_SCHEMES = ("s3", "gs")
#: A fetched URI ending so names an archive of the checkpoint; any other, its directory.
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
#: What ``ddm.checkpoints.upload`` writes: a checkpoint uploaded to URI is read from
#: ``archive_uri(URI)``.
UPLOAD_SUFFIX = ARCHIVE_SUFFIXES[0]
#: A checkpoint whose URI is in a key of the user's Secret (the spec's
#: ``uriFrom.secretKeyRef``): fetched like the remote ones, by a fetch step that reads the
#: Secret itself; the operator never sees the URI. Shown as ``secret://NAME/KEY``.
SECRET_SCHEME = "secret"
FETCHED_SCHEMES = (*REMOTE_SCHEMES, SECRET_SCHEME)
#: The fetcher's default byte cap (downloaded and extracted together); an admin may lower it
#: (``--max-bytes``, the operator's ``DDM_FETCH_MAX_BYTES``).
FETCH_MAX_BYTES = 16 << 30
#: The environment ``ddm fetch-checkpoint`` reads in place of its arguments: the URI (from a
#: Secret, so a pre-signed URL stays out of the pod's spec), the pin, the store's headers file,
#: and the networks and byte cap an admin allowed (the operator has the last two in its own
#: environment under the same names, from the chart, and passes them on to its fetch steps).
CHECKPOINT_URI_ENV = "DDM_CHECKPOINT_URI"
CHECKPOINT_SHA256_ENV = "DDM_CHECKPOINT_SHA256"
FETCH_HEADERS_FILE_ENV = "DDM_FETCH_HEADERS_FILE"
FETCH_ALLOW_NETWORKS_ENV = "DDM_FETCH_ALLOW_NETWORKS"
FETCH_MAX_BYTES_ENV = "DDM_FETCH_MAX_BYTES"
#: The CLI command the init container runs (``ddm fetch-checkpoint URI DEST``).
FETCH_COMMAND = ("ddm", "fetch-checkpoint")
#: The command of the DDM's checkpoint stager (``ddm serve-checkpoints ROOT``) and its port.
SERVE_COMMAND = ("ddm", "serve-checkpoints")
STAGER_PORT = 8070


def staged_path(key: str) -> str:
    """The stager's URL path of the checkpoint staged under ``key`` (a directory URI)."""
    return f"/{key}"


@dataclass(frozen=True)
class CheckpointSource:
    """Where a checkpoint comes from (a parsed checkpoint URI; the files themselves are
    ``ddm.checkpoints.format.Checkpoint``): ``location`` is the claim or host, ``path`` the
    path in it."""

    uri: str
    scheme: str
    location: str
    path: str


def secret_checkpoint(name: str, key: str) -> CheckpointSource:
    """The checkpoint whose URI is ``key`` of the Secret ``name`` (``SECRET_SCHEME``)."""
    return CheckpointSource(f"{SECRET_SCHEME}://{name}/{key}", SECRET_SCHEME, name, key)


def parse_checkpoint(uri: str) -> CheckpointSource:
    """Parse and check ``uri``; raises ``ValueError`` saying what is wrong with it."""
    if not isinstance(uri, str) or len(uri) > MAX_URI_LENGTH or not re.match(URI_PATTERN, uri):
        raise ValueError(
            f"{uri!r} is not a checkpoint URI; use pvc://CLAIM[/SUB/PATH], image:///ABS/PATH, "
            "http(s)://..., s3://BUCKET/KEY, gs://BUCKET/KEY or file:///ABS/PATH")
    parts = urlsplit(uri)
    path = parts.path.rstrip("/")
    decoded = unquote(path).replace("\\", "/")  # as a store may read it: %2e, %2f, '\\'
    if ".." in decoded.split("/"):
        raise ValueError(f"{uri!r}: '..' is not allowed in a checkpoint path (nor encoded)")
    return CheckpointSource(uri, parts.scheme, parts.netloc, path)


@dataclass(frozen=True)
class CheckpointMount:
    """What a pod needs so its server reads the checkpoint at ``path``."""

    path: str
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)


def checkpoint_mount(checkpoint: CheckpointSource, *, volume: str, mount_path: str
                     ) -> CheckpointMount:
    """Volumes and mounts that put a local (pvc, image, file) ``checkpoint`` at ``mount_path``
    (a fetched one is copied from the DDM's stager: ``ddm.operator.fetcher``)."""
    scheme = checkpoint.scheme
    if scheme == "image":
        return CheckpointMount(path=checkpoint.path)
    read_only = {"name": volume, "mountPath": mount_path, "readOnly": True}
    if scheme == "pvc":
        sub_path = checkpoint.path.strip("/")
        claim = {"claimName": checkpoint.location, "readOnly": True}
        return CheckpointMount(
            path=mount_path,
            volumes=[{"name": volume, "persistentVolumeClaim": claim}],
            mounts=[{**read_only, "subPath": sub_path} if sub_path else read_only])
    assert scheme == "file", scheme
    return CheckpointMount(
        path=mount_path,
        volumes=[{"name": volume, "hostPath": {"path": checkpoint.path, "type": "Directory"}}],
        mounts=[read_only])


def archive_uri(uri: str) -> str:
    """Where a checkpoint uploaded to ``uri`` is read from: its archive."""
    return uri.rstrip("/") + UPLOAD_SUFFIX


def redact_uri(uri: str) -> str:
    """``uri`` as it may be shown anywhere (logs, errors, events, status, a pod's command).

    The query, the fragment and any ``user:password@`` are dropped: a pre-signed URL's
    signature (``X-Amz-Signature=...``) or a token lives there. Scheme, host, port and path
    stay, so the message still says which object. Text that is not a URL keeps everything
    before its first ``?`` or ``#``, with anything up to an ``@`` in its authority dropped.
    """
    text = str(uri).split("#", 1)[0].split("?", 1)[0]
    scheme, separator, rest = text.partition("://")
    if not separator:
        return text
    authority, slash, path = rest.partition("/")
    return f"{scheme}://{authority.rpartition('@')[2]}{slash}{path}"
