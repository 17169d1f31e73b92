"""Where a checkpoint comes from, and how a pod finds it at one fixed path.

- ``pvc://CLAIM[/SUB/PATH]``: the claim, mounted read-only (at ``SUB/PATH`` with a subPath).
- ``image:///ABS/PATH``: already inside the image; nothing is mounted.
- ``http(s)://...``, ``s3://BUCKET/KEY``, ``gs://BUCKET/KEY``: an init container runs
  ``ddm fetch-checkpoint URI DEST`` into an emptyDir, so the server starts from local files.
- ``file:///ABS/PATH``: a hostPath volume. It exposes the node's own files to the pod, so the
  operator refuses it unless it was started with host paths allowed (single-node clusters).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

URI_PATTERN = (
    r"^(pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/[^/\s]+)*/?|(image|file)://(/[^/\s]+)+/?"
    r"|https?://[^/\s]+(/\S*)?|(s3|gs)://[a-z0-9][-a-z0-9._]*[a-z0-9](/\S*)?)$"
)
MAX_URI_LENGTH = 1024
REMOTE_SCHEMES = ("http", "https", "s3", "gs")
#: The CLI command the init container runs (``ddm fetch-checkpoint URI DEST``).
FETCH_COMMAND = ("ddm", "fetch-checkpoint")


@dataclass(frozen=True)
class CheckpointSource:
    """Where a checkpoint comes from (a parsed checkpoint URI; the files themselves are
    ``ddm.checkpoints.format.Checkpoint``): ``location`` is the claim or host, ``path`` the
    path in it."""

    uri: str
    scheme: str
    location: str
    path: str


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


def checkpoint_mount(checkpoint: CheckpointSource, *, volume: str, mount_path: str,
                     fetcher: dict[str, Any]) -> CheckpointMount:
    """Volumes, mounts and init containers that put ``checkpoint`` at ``mount_path``.

    ``fetcher`` is the init container to run for remote URIs, without its command: the same
    image and security context as the server, so the fetch runs as the same non-root user.
    """
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
    if scheme == "file":
        return CheckpointMount(
            path=mount_path,
            volumes=[{"name": volume, "hostPath": {"path": checkpoint.path, "type": "Directory"}}],
            mounts=[read_only])
    assert scheme in REMOTE_SCHEMES, scheme
    fetch = {
        **fetcher,
        "name": f"fetch-{volume}",
        "command": [*FETCH_COMMAND, checkpoint.uri, mount_path],
        "volumeMounts": [*fetcher.get("volumeMounts", []),
                         {"name": volume, "mountPath": mount_path}],
    }
    return CheckpointMount(
        path=mount_path,
        volumes=[{"name": volume, "emptyDir": {}}],
        mounts=[read_only],
        init_containers=[fetch])


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
