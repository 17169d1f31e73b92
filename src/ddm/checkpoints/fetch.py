"""``ddm fetch-checkpoint URI DEST``: download a checkpoint, verify it, and put it at DEST.

The operator's init container runs this (``ddm.checkpoints.uri.FETCH_COMMAND``) so that a
server starts from local files. Where a checkpoint can come from:

- ``http(s)://HOST/PATH``: the checkpoint directory (``PATH/config.json`` and
  ``PATH/weights.safetensors`` are fetched), or a ``.tar.gz``/``.tgz``/``.tar`` of it (the two
  files at the archive's root or in one top-level directory). A pre-signed URL (a private
  object) works in the archive form.
- ``s3://BUCKET/KEY`` through ``https://BUCKET.s3.amazonaws.com/KEY`` (``s3.REGION`` when
  ``AWS_REGION`` is set), or ``$AWS_ENDPOINT_URL_S3``/``$AWS_ENDPOINT_URL``/BUCKET/KEY.
- ``gs://BUCKET/KEY`` through ``https://storage.googleapis.com/BUCKET/KEY``, or
  ``$STORAGE_EMULATOR_HOST``/BUCKET/KEY.

Requests are anonymous: s3:// and gs:// reach public objects only. A private bucket needs a
``pvc://`` checkpoint or a pre-signed ``https://`` URL of an archive.

Each file is streamed to disk with a timeout, bounded retries with exponential back-off on 5xx,
429 and connection errors, and a size limit on everything downloaded or extracted. Archives are
extracted member by member: only regular files and directories, no absolute paths, no ``..``.
The result is checked with the checkpoint module's own loader (config and weights' SHA-256)
before it is moved into place: DEST holds the complete checkpoint or nothing new. DEST may be
absent (created by one rename) or an existing directory (an emptyDir mount point, which cannot
be renamed): the checkpoint is staged inside it, and its ``config.json`` is moved in last.
"""

from __future__ import annotations

import http.client
import os
import shutil
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO
from urllib.parse import quote, urlsplit, urlunsplit

from ddm.checkpoints.format import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, load_checkpoint
from ddm.checkpoints.uri import REMOTE_SCHEMES, parse_checkpoint

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")
#: Staging directories start with this; a later run removes those an interrupted run left.
STAGING_PREFIX = ".ddm-fetch-"
NOT_FOUND_HINT = ("nothing at this URL: the URI names a checkpoint directory (with config.json "
                  "and weights.safetensors) or a .tar.gz of one")
PRIVATE_HINT = ("anonymous requests reach public objects only: for a private bucket use a pvc:// "
                "checkpoint or a pre-signed https:// URL of a .tar.gz of the checkpoint")
_CHUNK = 1 << 20
#: What a flaky network or server raises (``HTTPError`` is a ``URLError``: caught before).
_CONNECTION_ERRORS = (urllib.error.URLError, ConnectionError, TimeoutError,
                      http.client.HTTPException)


class FetchError(RuntimeError):
    """A checkpoint could not be fetched; the message names the URI and the reason."""


@dataclass(frozen=True)
class FetchPolicy:
    """Limits of one fetch: per-request ``timeout_s``, ``attempts`` per file (the waits between
    them are ``backoff_s``, doubling), and ``max_bytes`` downloaded plus extracted in all."""

    timeout_s: float = 60.0
    attempts: int = 5
    backoff_s: float = 1.0
    max_bytes: int = 16 << 30


class _Retryable(Exception):
    """A transient failure (5xx, 429, a dropped or timed-out connection): try again."""


def fetch_checkpoint(uri: str, dest: str | os.PathLike, policy: FetchPolicy = FetchPolicy(),
                     env: Mapping[str, str] | None = None) -> Path:
    """Fetch the checkpoint at ``uri`` into ``dest`` and return ``dest``.

    ``env`` supplies the endpoint overrides (default ``os.environ``). Raises ``FetchError``;
    on any failure ``dest`` is left as it was (absent, or without a new checkpoint).
    """
    try:
        checkpoint = parse_checkpoint(uri)
    except ValueError as exc:
        raise FetchError(str(exc)) from None
    if checkpoint.scheme not in REMOTE_SCHEMES:
        raise FetchError(f"{uri}: fetch-checkpoint downloads {', '.join(REMOTE_SCHEMES)} URIs; "
                         f"a {checkpoint.scheme}:// checkpoint is mounted, not fetched")
    target = Path(dest)
    base_url = resolve_url(uri, os.environ if env is None else env)
    try:
        staging = _staging_dir(uri, target)
        try:
            ready = _download_checkpoint(uri, base_url, staging, policy)
            try:
                load_checkpoint(ready)
            except CheckpointError as exc:
                raise FetchError(f"{uri}: the downloaded checkpoint failed verification: {exc}"
                                 ) from None
            _install(ready, target, staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:  # the destination's disk: full, read-only, no permission
        raise FetchError(f"{uri}: cannot write {target}: {exc}") from None
    return target


def resolve_url(uri: str, env: Mapping[str, str]) -> str:
    """The HTTP(S) URL that serves ``uri`` (s3:// and gs:// go through their HTTPS endpoints)."""
    parts = urlsplit(uri)
    if parts.scheme in ("http", "https"):
        return uri
    bucket, key = parts.netloc, quote(parts.path.lstrip("/"), safe="/~")
    if parts.scheme == "s3":
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        if endpoint:
            return f"{endpoint.rstrip('/')}/{bucket}/{key}"
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        host = f"{bucket}.s3.{region}.amazonaws.com" if region else f"{bucket}.s3.amazonaws.com"
        return f"https://{host}/{key}"
    if parts.scheme == "gs":
        emulator = env.get("STORAGE_EMULATOR_HOST")
        if emulator:
            origin = emulator if "://" in emulator else f"http://{emulator}"
            return f"{origin.rstrip('/')}/{bucket}/{key}"
        return f"https://storage.googleapis.com/{bucket}/{key}"
    raise FetchError(f"{uri}: scheme {parts.scheme!r} cannot be fetched")


def _staging_dir(uri: str, target: Path) -> Path:
    """A fresh directory on DEST's file system: beside DEST, or inside it if it exists."""
    if target.exists() and not target.is_dir():
        raise FetchError(f"{uri}: destination {target} exists and is not a directory")
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{target.name}{STAGING_PREFIX}", dir=target.parent))
    for leftover in target.glob(f"{STAGING_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    others = sorted(p.name for p in target.iterdir())
    if others and not (target / CONFIG_FILE).is_file():
        raise FetchError(f"{uri}: destination {target} is not empty and holds no checkpoint "
                         f"({', '.join(others[:5])}); refusing to overwrite it")
    return Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=target))


def _download_checkpoint(uri: str, base_url: str, staging: Path, policy: FetchPolicy) -> Path:
    """Download (and extract) into ``staging``; return the directory holding the checkpoint."""
    parts = urlsplit(base_url)
    budget = policy.max_bytes
    if parts.path.endswith(ARCHIVE_SUFFIXES):
        archive = staging / "archive"
        budget -= _download(uri, base_url, archive, budget, policy)
        root = staging / "checkpoint"
        _extract(uri, archive, root, budget)
        archive.unlink()
        return _checkpoint_root(uri, root)
    root = staging / "checkpoint"
    root.mkdir()
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        url = urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{name}"))
        budget -= _download(uri, url, root / name, budget, policy)
    return root


def _download(uri: str, url: str, target: Path, limit: int, policy: FetchPolicy) -> int:
    """Stream ``url`` to ``target`` with retries; returns the bytes written."""
    problem = ""
    for attempt in range(policy.attempts):
        if attempt:
            time.sleep(policy.backoff_s * 2 ** (attempt - 1))
        try:
            return _download_once(uri, url, target, limit, policy.timeout_s)
        except _Retryable as exc:
            problem = str(exc)
    raise FetchError(f"{uri}: {_redact(url)}: {problem} (gave up after {policy.attempts} "
                     "attempts)")


def _download_once(uri: str, url: str, target: Path, limit: int, timeout_s: float) -> int:
    request = urllib.request.Request(url, headers={"User-Agent": "ddm-fetch-checkpoint"})
    try:
        response = urllib.request.urlopen(request, timeout=timeout_s)
    except urllib.error.HTTPError as exc:
        exc.close()
        status = f"HTTP {exc.code} {exc.reason}"
        if exc.code >= 500 or exc.code == 429:
            raise _Retryable(status) from None
        hint = {404: NOT_FOUND_HINT, 401: PRIVATE_HINT, 403: PRIVATE_HINT}.get(exc.code)
        raise FetchError(f"{uri}: {_redact(url)}: {status}" + (f" ({hint})" if hint else "")
                         ) from None
    except _CONNECTION_ERRORS as exc:
        raise _Retryable(f"cannot connect ({getattr(exc, 'reason', exc)})") from None
    with response:
        declared = response.headers.get("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise FetchError(f"{uri}: {_redact(url)} is {int(declared)} bytes, over the "
                             f"{limit}-byte limit left for this checkpoint")
        try:
            with open(target, "wb") as out:
                written = _copy(response, out, limit, f"{uri}: {_redact(url)}")
        except _CONNECTION_ERRORS as exc:  # reset or timed out mid-body
            raise _Retryable(f"download interrupted ({exc!r})") from None
    # http.client ends a body cut short like a complete one when read in chunks: count.
    if declared is not None and declared.isdigit() and written != int(declared):
        raise _Retryable(f"download interrupted (got {written} of {declared} bytes)")
    return written


def _copy(source: BinaryIO, out: BinaryIO, limit: int, what: str) -> int:
    written = 0
    while chunk := source.read(_CHUNK):
        written += len(chunk)
        if written > limit:
            raise FetchError(f"{what}: more than the {limit}-byte limit left for this checkpoint")
        out.write(chunk)
    return written


def _extract(uri: str, archive: Path, root: Path, limit: int) -> None:
    """Extract regular files and directories only, each strictly inside ``root``."""
    root.mkdir()
    try:
        with tarfile.open(archive, mode="r:*") as tar:
            for member in tar:
                relative = _member_path(uri, member)
                path = root.joinpath(*relative.parts)
                if member.isdir():
                    path.mkdir(parents=True, exist_ok=True)
                    continue
                path.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None, member.name  # a regular file always has data
                with source, open(path, "xb") as out:
                    limit -= _copy(source, out, limit, f"{uri}: archive member {member.name}")
    except (tarfile.TarError, EOFError) as exc:
        raise FetchError(f"{uri}: not a readable tar archive ({exc})") from None
    except FileExistsError:
        raise FetchError(f"{uri}: the archive holds a file twice") from None


def _member_path(uri: str, member: tarfile.TarInfo) -> PurePosixPath:
    """The member's relative path, or a ``FetchError`` if it is a link, a device or escapes."""
    if not (member.isfile() or member.isdir()):
        kind = "link" if member.issym() or member.islnk() else "special file"
        raise FetchError(f"{uri}: archive member {member.name!r} is a {kind}; only regular "
                         "files and directories are extracted")
    path = PurePosixPath(member.name)
    if path.is_absolute() or ".." in path.parts:
        raise FetchError(f"{uri}: archive member {member.name!r} would be written outside the "
                         "checkpoint directory")
    return path


def _checkpoint_root(uri: str, root: Path) -> Path:
    """The extracted checkpoint: the archive's root, or its one top-level directory."""
    if (root / CONFIG_FILE).is_file():
        return root
    entries = list(root.iterdir())
    if len(entries) == 1 and (entries[0] / CONFIG_FILE).is_file():
        return entries[0]
    raise FetchError(f"{uri}: the archive holds no checkpoint ({CONFIG_FILE} at its root or in "
                     "its one top-level directory)")


def _install(ready: Path, target: Path, staging: Path) -> None:
    """Move the verified checkpoint in ``ready`` to ``target``.

    A missing ``target`` appears in one rename. An existing one (a mount point, ``staging``
    inside it) loses its old ``config.json`` first and gets the new one last, so a checkpoint
    is never half there with a config that claims it whole.
    """
    if not target.exists():
        ready.rename(target)
        return
    (target / CONFIG_FILE).unlink(missing_ok=True)
    for old in target.iterdir():
        if old == staging:
            continue
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
    for new in sorted(ready.iterdir(), key=lambda p: p.name == CONFIG_FILE):
        new.rename(target / new.name)


def _redact(url: str) -> str:
    """``url`` without its query and credentials: a pre-signed URL's signature stays secret."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))
