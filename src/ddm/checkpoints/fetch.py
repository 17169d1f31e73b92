"""``ddm fetch-checkpoint URI DEST``: download a checkpoint, verify it, and put it at DEST.

The DDM's checkpoint stager runs this (``ddm.checkpoints.uri.FETCH_COMMAND``), and each of the
DDM's pods to copy its checkpoint from the stager, so that a server starts from local files.
Where a checkpoint can come from:

- ``http(s)://HOST/PATH``: the checkpoint directory (``PATH/config.json``,
  ``PATH/weights.safetensors`` and the exported program that config.json names are fetched;
  for a stage checkpoint, the files its ``_ddm.files`` lists), or a ``.tar.gz``/``.tgz``/
  ``.tar`` of it (the files at the archive's root or in one top-level directory).
- ``s3://BUCKET/KEY`` through ``https://BUCKET.s3.amazonaws.com/KEY`` (``s3.REGION`` when
  ``AWS_REGION`` is set), or ``$AWS_ENDPOINT_URL_S3``/``$AWS_ENDPOINT_URL``/BUCKET/KEY.
- ``gs://BUCKET/KEY`` through ``https://storage.googleapis.com/BUCKET/KEY``, or
  ``$STORAGE_EMULATOR_HOST``/BUCKET/KEY.
- Both anonymously first; a private bucket (401/403) through the cloud's standard credential
  chain, signed (``ddm.checkpoints.credentials``; for the bucket's region once S3 names it),
  unless a headers file gives credentials;
  or signed from the start with the store's own credentials file (``credentials_file``,
  ``--store-credentials-file``: an AWS shared credentials file, a Google service-account key).

The URI is a tenant's input and the fetcher runs inside the cluster, so (``download`` and
``destinations`` carry this out):

- Destinations: public addresses only, judged after DNS resolution and connected to as
  checked; loopback, link-local, private and other non-public networks only when allowed
  explicitly (``allowed_networks``, ``--allow-network CIDR``; or one host by name,
  ``allowed_hosts``, ``--allow-host``: the DDM's stager); cloud metadata never. Every
  redirect (at most ``max_redirects``) is checked the same way before any connection to it.
  A refused destination gets one message whatever the cause: errors reach the DDM's status
  and must not map the cluster's network.
- ``https``; plain ``http`` only when the download is pinned or the host is in an allowed
  network.
- A pinned SHA-256 (``--sha256``) of the bytes received: the archive for an archive URI, the
  ``config.json`` for a directory URI (it records the weights' SHA-256, which the loader
  checks, so one pin covers both). Unpinned, the checkpoint's own checksum only proves the
  files agree with each other, not where they came from.
- Credentials never in the URI (a URI with ``user:password@`` is refused): HTTP headers from a
  file a Secret mounts (``--headers-file``, ``read_headers_file``), sent to the store's origin
  only. A pre-signed URL works too; it may come from ``$DDM_CHECKPOINT_URI`` (a Secret) rather
  than the command line.
- URIs are shown through ``redact_uri`` (no query, fragment or userinfo) in every message.

Each file is streamed to disk with a timeout per wait, bounded retries with exponential
back-off on 5xx, 429 and connection errors, one deadline for the whole fetch, and a size limit
on everything downloaded or extracted. Archives are extracted member by member, at most
``max_entries`` (``ddm.checkpoints.archive``): only regular files and directories, no absolute
paths, no ``..``, each header checked before ``tarfile`` processes it, every decompressed byte
counted. The result is checked in constant memory (``verify.verify_checkpoint``: config,
SHA-256s streamed, the safetensors header; no weight is loaded) before it is moved into
place: DEST holds the complete checkpoint or nothing new. DEST may be absent (created by one
rename) or an existing directory (an emptyDir mount point, which cannot be renamed): the
checkpoint is staged inside it, and its ``config.json`` is moved in last.

The same fetcher brings other files (a DDMTraining's MNIST): ``Contents`` says which file a
directory URI starts from (the one a pin covers), which follow, and how the whole is checked;
``CHECKPOINT``, the default, is the above.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from ddm.checkpoints.archive import extract_archive
from ddm.checkpoints.destinations import Network
from ddm.checkpoints.credentials import StoreCredentials, s3_region
from ddm.checkpoints.download import FetchError, Received, Refused, Retryable, get, shown
from ddm.checkpoints.destinations import normal_host
from ddm.checkpoints.format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    program_file_name,
    read_meta,
)
from ddm.checkpoints.uri import (
    ARCHIVE_SUFFIXES,
    BUCKET_SCHEMES,
    FETCH_MAX_BYTES,
    REMOTE_SCHEMES,
    parse_checkpoint,
    redact_uri,
)
from ddm.checkpoints.declared import declared_files, read_declaration
from ddm.checkpoints.verify import verify_checkpoint

__all__ = ["CHECKPOINT", "Contents", "FetchError", "FetchPolicy", "fetch_checkpoint",
           "parse_sha256", "read_headers_file", "resolve_url"]

#: Staging directories start with this; a later run removes those an interrupted run left.
STAGING_PREFIX = ".ddm-fetch-"
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
#: Headers the fetcher sets itself; a headers file may not replace them.
_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})


@dataclass(frozen=True)
class FetchPolicy:
    """Limits of one fetch.

    ``timeout_s`` bounds each wait for bytes; ``deadline_s`` the whole fetch (every file,
    attempt, redirect and back-off). ``attempts`` per file, the waits between them
    ``backoff_s``, doubling. ``max_bytes`` downloaded plus extracted in all, ``max_entries``
    in an archive, ``max_redirects`` per request. ``allowed_networks``: non-public networks
    the fetcher may reach (see ``ddm.checkpoints.destinations``); empty, public hosts only;
    ``allowed_hosts``: names that may resolve to any address but a metadata one.
    """

    timeout_s: float = 60.0
    deadline_s: float = 3600.0  # an hour
    attempts: int = 5
    backoff_s: float = 1.0
    max_bytes: int = FETCH_MAX_BYTES
    max_entries: int = 64
    max_redirects: int = 5
    allowed_networks: tuple[Network, ...] = ()
    allowed_hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Contents:
    """What a fetch brings: ``what`` (for messages); ``first``, the file a directory URI
    starts from (the pin covers it; an archive holds it at its root or in its one top-level
    directory; an install moves it last); ``files(root)``, the others, once ``first`` is in
    ``root``; ``verify(root)``, the check of the whole before it is installed (raising
    ``CheckpointError`` or ``ValueError`` saying why)."""

    what: str
    first: str
    files: Callable[[Path], list[str]]
    verify: Callable[[Path], object]


@dataclass(frozen=True)
class _Fetch:
    """One fetch's settings, as the download of each file needs them. ``credentials``: a
    bucket's chain, consulted if the store refuses an anonymous read (None: no chain)."""

    policy: FetchPolicy
    deadline: float
    pinned: bool
    headers: Mapping[str, str]
    credentials: StoreCredentials | None = None


def fetch_checkpoint(uri: str, dest: str | os.PathLike, policy: FetchPolicy = FetchPolicy(),
                     env: Mapping[str, str] | None = None, *, sha256: str | None = None,
                     headers: Mapping[str, str] | None = None,
                     credentials_file: str | os.PathLike | None = None,
                     contents: Contents | None = None) -> Path:
    """Fetch the checkpoint at ``uri`` into ``dest`` and return ``dest``.

    ``sha256`` pins the bytes (``parse_sha256``): of the archive for an archive URI, of
    ``config.json`` for a directory URI. ``headers`` (credentials, ``read_headers_file``) go to
    the store's origin only. ``credentials_file``: an ``s3://`` or ``gs://`` store's own
    credentials file, which signs every read (``ddm.checkpoints.credentials``); not with
    ``headers``. ``env`` supplies the endpoint overrides and the region (default
    ``os.environ``). ``contents``: what is fetched (default a checkpoint, ``CHECKPOINT``).
    Raises ``FetchError`` whose message starts with the redacted URI; on any failure ``dest``
    is left as it was (absent, or without a new checkpoint).
    """
    try:
        return _fetch(uri, Path(dest), policy, os.environ if env is None else env,
                      None if sha256 is None else parse_sha256(sha256), headers or {},
                      None if credentials_file is None else Path(credentials_file),
                      contents or CHECKPOINT)
    except FetchError as exc:
        raise FetchError(f"{redact_uri(uri)}: {exc}") from None


def parse_sha256(text: str) -> str:
    """A pinned SHA-256: 64 hex digits, optionally ``sha256:``-prefixed; lower case."""
    digest = text.strip().lower().removeprefix("sha256:")
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise FetchError(f"the pinned sha256 must be 64 hexadecimal digits (optionally "
                         f"'sha256:' first), got {len(digest)} characters")
    return digest


def read_headers_file(path: str | os.PathLike) -> dict[str, str]:
    """HTTP headers from ``path`` (a mounted Secret key): ``Name: value`` per line, blank
    lines and ``#`` comments skipped. Errors name the line, never a value."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeError) as exc:
        raise FetchError(f"cannot read the headers file {path}: {exc}") from None
    headers: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, colon, value = line.partition(":")
        name, value = name.strip(), value.strip()
        problem = ("is not 'Name: value'" if not colon or not _HEADER_NAME.match(name)
                   else f"sets {name}, which the fetcher sets itself"
                   if name.lower() in _OWN_HEADERS
                   else "has a control or non-ASCII character in its value"
                   if any(not 32 <= ord(c) < 127 for c in value) else "")
        if problem:
            raise FetchError(f"headers file {path}, line {number}: {problem}")
        headers[name] = value
    return headers


def _fetch(uri: str, target: Path, policy: FetchPolicy, env: Mapping[str, str],
           sha256: str | None, headers: Mapping[str, str], credentials_file: Path | None,
           contents: Contents) -> Path:
    try:
        checkpoint = parse_checkpoint(uri)
    except ValueError as exc:  # its message quotes the URI whole: the prefix shows it redacted
        reason = str(exc).replace(f"{uri!r}: ", "").replace(f"{uri!r} ", "")
        unsafe = uri in reason or repr(uri)[1:-1] in reason
        raise FetchError("is not a checkpoint URI" if unsafe else reason) from None
    if checkpoint.scheme not in REMOTE_SCHEMES:
        raise FetchError(f"fetch-checkpoint downloads {', '.join(REMOTE_SCHEMES)} URIs; "
                         f"a {checkpoint.scheme}:// checkpoint is mounted, not fetched")
    base_url = resolve_url(uri, env)
    chain = (StoreCredentials(checkpoint.scheme, env, policy.timeout_s, credentials_file,
                              policy.allowed_networks)
             if checkpoint.scheme in BUCKET_SCHEMES and not headers else None)
    if credentials_file is not None:
        if headers:
            raise FetchError("give --headers-file or --store-credentials-file, not both")
        if chain is None:
            raise FetchError(f"--store-credentials-file is for "
                             f"{' and '.join(f'{s}://' for s in BUCKET_SCHEMES)} URIs, not "
                             f"{checkpoint.scheme}://")
        chain.look_up()  # sign from the first request; a bad file is refused before any read
    fetch = _Fetch(policy, time.monotonic() + policy.deadline_s, sha256 is not None, headers,
                   chain)
    try:
        staging = _staging_dir(target, contents)
        try:
            ready = _download_checkpoint(base_url, staging, fetch, sha256, contents)
            try:
                contents.verify(ready)
            except (CheckpointError, ValueError) as exc:
                raise FetchError(f"the downloaded {contents.what} failed verification: {exc}"
                                 ) from None
            _install(ready, target, staging, contents.first)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:  # the destination's disk: full, read-only, no permission
        raise FetchError(f"cannot write {target}: {exc}") from None
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
        region = s3_region(env)
        host = f"{bucket}.s3.{region}.amazonaws.com" if region else f"{bucket}.s3.amazonaws.com"
        return f"https://{host}/{key}"
    if parts.scheme == "gs":
        emulator = env.get("STORAGE_EMULATOR_HOST")
        if emulator:
            origin = emulator if "://" in emulator else f"http://{emulator}"
            return f"{origin.rstrip('/')}/{bucket}/{key}"
        return f"https://storage.googleapis.com/{bucket}/{key}"
    raise FetchError(f"scheme {parts.scheme!r} cannot be fetched")


def _staging_dir(target: Path, contents: Contents) -> Path:
    """A fresh directory on DEST's file system: beside DEST, or inside it if it exists."""
    if target.exists() and not target.is_dir():
        raise FetchError(f"destination {target} exists and is not a directory")
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{target.name}{STAGING_PREFIX}", dir=target.parent))
    for leftover in target.glob(f"{STAGING_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)
    others = sorted(p.name for p in target.iterdir())
    if others and not (target / contents.first).is_file():
        raise FetchError(f"destination {target} is not empty and holds no {contents.what} "
                         f"({', '.join(others[:5])}); refusing to overwrite it")
    return Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=target))


def _download_checkpoint(base_url: str, staging: Path, fetch: _Fetch, sha256: str | None,
                         contents: Contents) -> Path:
    """Download (and extract) into ``staging``; return the directory holding the checkpoint.

    The pin covers the archive, or a directory's ``config.json``, fetched first: it records
    the weights' SHA-256, which ``verify_checkpoint`` checks, so one pin covers both files.
    """
    parts = urlsplit(base_url)
    budget = fetch.policy.max_bytes
    root = staging / "checkpoint"
    if parts.path.endswith(ARCHIVE_SUFFIXES):
        archive = staging / "archive"
        budget -= _download(base_url, archive, budget, fetch, sha256).size
        extract_archive(archive, root, budget, fetch.policy.max_entries)
        archive.unlink()
        return _checkpoint_root(root, contents)
    root.mkdir()

    def file_url(name: str) -> str:
        return urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{name}"))

    budget -= _download(file_url(contents.first), root / contents.first, budget, fetch,
                        sha256).size
    for name in contents.files(root):
        budget -= _download(file_url(name), root / name, budget, fetch, None).size
    return root


def _directory_files(root: Path) -> list[str]:
    """What a directory's ``config.json`` says it holds besides itself: a stage checkpoint's
    ``_ddm.files``; ours, the weights and the exported program it names, if any."""
    declared = read_declaration(root)
    if declared is None:
        return [WEIGHTS_FILE, *_program_file(root)]
    try:
        return sorted(declared_files(root, declared))
    except ValueError as exc:
        raise FetchError(f"the downloaded checkpoint failed verification: {exc}") from None


def _program_file(root: Path) -> list[str]:
    """The exported program a directory's ``config.json`` names, if any (fetched too)."""
    try:
        meta = read_meta(root)
    except CheckpointError as exc:
        raise FetchError(f"the downloaded checkpoint failed verification: {exc}") from None
    return [program_file_name(meta)] if meta.model.kind == "exported" else []


def _download(url: str, target: Path, limit: int, fetch: _Fetch, sha256: str | None
              ) -> Received:
    """GET ``url`` into ``target`` with retries, within the fetch's deadline; check the pin.

    A refusal of an anonymous read from a bucket is answered once, at once, by signing with
    the fetch's credentials; every later request of the fetch is signed from the start.
    """
    policy, problem, attempt = fetch.policy, "", 0
    while attempt < policy.attempts:
        if attempt:
            pause = policy.backoff_s * 2 ** (attempt - 1)
            if time.monotonic() + pause >= fetch.deadline:
                break
            time.sleep(pause)
        try:
            with open(target, "wb") as out:
                received = get(url, out, limit=limit, deadline=fetch.deadline,
                               timeout_s=policy.timeout_s, networks=policy.allowed_networks,
                               pinned=fetch.pinned, max_redirects=policy.max_redirects,
                               headers=_headers(url, fetch),
                               hosts=frozenset(map(normal_host, policy.allowed_hosts)))
        except Retryable as exc:
            problem, attempt = str(exc), attempt + 1
            continue
        except Refused as exc:
            _answer_refusal(exc, fetch.credentials)
            continue  # now signed; not an attempt: the store has not failed
        if sha256 is not None and received.sha256 != sha256:
            raise FetchError(f"{shown(url)}: sha256 {received.sha256} does not match the pinned "
                             f"{sha256}")
        return received
    if attempt == policy.attempts:
        raise FetchError(f"{problem} (gave up after {policy.attempts} attempts)")
    raise FetchError(f"{problem} (gave up: the {policy.deadline_s:g} s deadline of the whole "
                     "download leaves no time for another attempt)")


def _headers(url: str, fetch: _Fetch) -> Mapping[str, str]:
    """The headers of one request: the headers file's, or a signature once one is needed."""
    credentials = fetch.credentials
    return credentials.sign(url) if credentials is not None and credentials.in_use \
        else fetch.headers


def _answer_refusal(refused: Refused, credentials: StoreCredentials | None) -> None:
    """Start signing after a bucket refused an anonymous read; otherwise say why it failed."""
    if credentials is None:
        raise refused
    if credentials.in_use:
        if refused.region is not None and credentials.resign_for(refused.region):
            return  # S3 named the bucket's region: signed for it from now on, same URL
        raise FetchError(f"{refused.refusal} (the store refused the signed request: "
                         f"{credentials.source}; check the key, the identity's access to "
                         "this object and the region)") from None
    try:
        credentials.look_up(refused.region)
    except FetchError as exc:
        raise FetchError(f"{refused.refusal} ({exc})") from None


def _checkpoint_root(root: Path, contents: Contents) -> Path:
    """The extracted checkpoint: the archive's root, or its one top-level directory."""
    if (root / contents.first).is_file():
        return root
    entries = list(root.iterdir())
    if len(entries) == 1 and (entries[0] / contents.first).is_file():
        return entries[0]
    raise FetchError(f"the archive holds no {contents.what} ({contents.first} at its root or "
                     "in its one top-level directory)")


def _install(ready: Path, target: Path, staging: Path, last: str) -> None:
    """Move the verified checkpoint in ``ready`` to ``target``.

    A missing ``target`` appears in one rename. An existing one (a mount point, ``staging``
    inside it) loses its old ``last`` (``config.json``) first and gets the new one last, so a
    checkpoint is never half there with a config that claims it whole.
    """
    if not target.exists():
        ready.rename(target)
        return
    (target / last).unlink(missing_ok=True)
    for old in target.iterdir():
        if old == staging:
            continue
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
    for new in sorted(ready.iterdir(), key=lambda p: p.name == last):
        new.rename(target / new.name)


#: A checkpoint directory: ``config.json``, then what it names; checked in constant memory.
CHECKPOINT = Contents("checkpoint", CONFIG_FILE, _directory_files, verify_checkpoint)
