"""Upload a finished checkpoint to an object store, in the form the fetcher reads back.

A DDMTraining whose output is ``s3://BUCKET/PREFIX`` or ``gs://BUCKET/PREFIX`` trains on a
volume and uploads each finished checkpoint (``ddm train ... --upload URI``, rank 0):

- the checkpoint directory becomes one ``.tar.gz`` of its regular files at the archive's root
  (sorted, owner and times zeroed: the same files give the same bytes), which
  ``ddm fetch-checkpoint`` extracts and verifies (``ddm.checkpoints.archive``);
- an old marker ``URI.tar.gz.json`` is deleted first, the archive goes to ``URI.tar.gz``, then
  its new marker (``format``, ``sha256``, ``size``), last: a marker is only ever beside the
  whole archive it describes. ``ddm train-all``'s DDMDeployment pins that sha256 (the
  operator's, which does not read the store, is unpinned: the archive's ``config.json`` still
  checks the weights). The same record is written beside the checkpoint on the volume
  (``OUT.uploaded.json``): ``ddm train-all`` skips a job that has it;
- an archive over the fetcher's byte cap is refused before anything is sent (no DDM could
  fetch it).

The store is reached as the fetcher reaches it: the endpoint from ``resolve_url``
(``AWS_ENDPOINT_URL[_S3]``, ``STORAGE_EMULATOR_HOST``) held to its destination rules
(``check_hop``; ``$DDM_FETCH_ALLOW_NETWORKS`` for a store on a private network), and the
credentials of the cloud's chain or of the store's own credentials file
(``ddm.checkpoints.credentials``; a DDMTraining's ``storeCredentialsSecret``), never
anonymous. S3 through botocore (PutObject; a multipart upload above ``multipart_bytes``,
aborted on failure), GCS through google-auth and requests (PUT and DELETE on the XML API, the
replies streamed: an error's text is read up to ``ERROR_TEXT_BYTES``).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit

from ddm.checkpoints.credentials import (
    CHAINS,
    NoCredentials,
    gcs_credentials,
    s3_credentials,
    s3_region,
)
from ddm.checkpoints.destinations import Network, parse_networks
from ddm.checkpoints.download import FetchError, check_hop
from ddm.checkpoints.fetch import resolve_url
from ddm.checkpoints.uri import (
    BUCKET_SCHEMES,
    FETCH_ALLOW_NETWORKS_ENV,
    FETCH_MAX_BYTES,
    archive_uri,
    parse_checkpoint,
    redact_uri,
)

__all__ = ["MARKER_SUFFIX", "UploadError", "Uploaded", "read_uploaded", "upload_checkpoint"]

#: The marker beside the archive in the store, written last.
MARKER_SUFFIX = ".json"
#: The same record beside the checkpoint on the volume, once the upload is complete.
RECORD_SUFFIX = ".uploaded.json"
FORMAT = "ddm-upload/1"
#: The scope an upload needs: writing objects.
GCS_WRITE_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
#: Above this, S3 gets a multipart upload of ``PART_BYTES`` parts (PutObject takes 5 GiB).
MULTIPART_BYTES = 256 << 20
PART_BYTES = 64 << 20
#: Bytes of a store's error reply read for the message (the rest is never read).
ERROR_TEXT_BYTES = 4096
_CHUNK = 1 << 20


class UploadError(RuntimeError):
    """A checkpoint could not be uploaded; the message names the (redacted) URI and why."""


@dataclass(frozen=True)
class Uploaded:
    """A complete upload: the archive's URI, its SHA-256 (hex) and size in bytes."""

    uri: str
    sha256: str
    size: int

    def record(self) -> dict[str, Any]:
        return {"format": FORMAT, "uri": self.uri, "sha256": self.sha256, "size": self.size}


def read_uploaded(checkpoint: str | os.PathLike) -> Uploaded | None:
    """The record of ``checkpoint``'s complete upload (None: not uploaded, or unreadable)."""
    path = Path(checkpoint)
    try:
        record = json.loads(path.with_name(path.name + RECORD_SUFFIX).read_text())
        if record.get("format") != FORMAT:
            return None
        return Uploaded(str(record["uri"]), str(record["sha256"]), int(record["size"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def upload_checkpoint(checkpoint: str | os.PathLike, uri: str, *,
                      credentials_file: str | os.PathLike | None = None,
                      env: Mapping[str, str] | None = None, timeout_s: float = 60.0,
                      max_bytes: int = FETCH_MAX_BYTES,
                      multipart_bytes: int = MULTIPART_BYTES) -> Uploaded:
    """Upload the checkpoint directory ``checkpoint`` to ``uri`` (``s3://`` or ``gs://``):
    its archive, then the marker; record it beside the checkpoint. Raises ``UploadError``."""
    environ = os.environ if env is None else env
    try:
        source = parse_checkpoint(uri)
    except ValueError as exc:
        raise UploadError(str(exc)) from None
    if source.scheme not in BUCKET_SCHEMES:
        raise UploadError(f"{redact_uri(uri)}: uploads go to "
                          f"{' or '.join(f'{s}://BUCKET/PREFIX' for s in BUCKET_SCHEMES)}")
    target = archive_uri(uri)
    try:
        networks = parse_networks(environ.get(FETCH_ALLOW_NETWORKS_ENV, "").split(","))
        file = None if credentials_file is None else Path(credentials_file)
        directory = Path(checkpoint)
        with tempfile.TemporaryFile(dir=directory.parent) as archive:
            sha256, size = _write_archive(directory, archive)
            if size > max_bytes:
                raise UploadError(f"the archive of {directory} is {size} bytes, over the "
                                  f"fetcher's {max_bytes}-byte cap: no DDM could fetch it")
            uploaded = Uploaded(target, sha256, size)
            marker = json.dumps({key: value for key, value in uploaded.record().items()
                                 if key != "uri"}, indent=1).encode()
            writer = (_S3Writer if source.scheme == "s3" else _GCSWriter)(
                target, environ, networks, file, timeout_s, multipart_bytes)
            writer.delete(target + MARKER_SUFFIX)  # an old marker never sits by a new archive
            writer.put(target, archive, size)
            writer.put(target + MARKER_SUFFIX, io.BytesIO(marker), len(marker))
    except (FetchError, OSError) as exc:
        raise UploadError(f"{redact_uri(target)}: {exc}") from None
    except UploadError as exc:
        raise UploadError(f"{redact_uri(target)}: {exc}") from None
    directory.with_name(directory.name + RECORD_SUFFIX).write_text(
        json.dumps(uploaded.record(), indent=1))
    return uploaded


def _write_archive(directory: Path, out: BinaryIO) -> tuple[str, int]:
    """``directory``'s regular files, sorted, as a reproducible ``.tar.gz`` in ``out``;
    its SHA-256 and size."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.is_symlink())
    if not files:
        raise UploadError(f"{directory} holds no checkpoint files")
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0) as zipped, \
            tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            info = tarfile.TarInfo(path.name)
            info.size, info.mode = path.stat().st_size, 0o644
            with open(path, "rb") as data:
                tar.addfile(info, data)
    digest, size = hashlib.sha256(), out.tell()
    out.seek(0)
    while chunk := out.read(_CHUNK):
        digest.update(chunk)
    out.seek(0)
    return digest.hexdigest(), size


def _bucket_key(uri: str) -> tuple[str, str]:
    parts = urlsplit(uri)
    return parts.netloc, parts.path.lstrip("/")


class _S3Writer:
    """PutObject (multipart above ``multipart_bytes``) and DeleteObject (nothing to delete is
    no error) with the chain's or the file's keys."""

    def __init__(self, uri: str, env: Mapping[str, str], networks: tuple[Network, ...],
                 file: Path | None, timeout_s: float, multipart_bytes: int) -> None:
        import botocore.session
        from botocore.config import Config

        check_hop(resolve_url(uri, env), networks, pinned=False)
        try:
            credentials, self.origin = s3_credentials(file)
        except NoCredentials:
            raise UploadError(f"{CHAINS['s3']} found no credentials; give the training's "
                              "storeCredentialsSecret (an AWS shared credentials file)"
                              ) from None
        frozen = credentials.get_frozen_credentials()
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None
        self.client = botocore.session.Session().create_client(
            "s3", region_name=s3_region(env) or "us-east-1", endpoint_url=endpoint,
            aws_access_key_id=frozen.access_key, aws_secret_access_key=frozen.secret_key,
            aws_session_token=frozen.token,
            config=Config(connect_timeout=timeout_s, read_timeout=timeout_s,
                          retries={"max_attempts": 5, "mode": "standard"}))
        self.multipart_bytes = multipart_bytes

    def put(self, uri: str, body: BinaryIO, size: int) -> None:
        bucket, key = _bucket_key(uri)
        with self._refused("s3:PutObject"):
            if size <= self.multipart_bytes:
                self.client.put_object(Bucket=bucket, Key=key, Body=body, ContentLength=size)
                return
            upload = self.client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
            try:
                parts = []
                for number in range(1, -(-size // PART_BYTES) + 1):
                    answer = self.client.upload_part(Bucket=bucket, Key=key, UploadId=upload,
                                                     PartNumber=number,
                                                     Body=body.read(PART_BYTES))
                    parts.append({"PartNumber": number, "ETag": answer["ETag"]})
                self.client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload,
                                                      MultipartUpload={"Parts": parts})
            except BaseException:
                self.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
                raise

    def delete(self, uri: str) -> None:
        bucket, key = _bucket_key(uri)
        with self._refused("s3:DeleteObject"):
            self.client.delete_object(Bucket=bucket, Key=key)

    @contextmanager
    def _refused(self, action: str) -> Iterator[None]:
        """botocore's errors as an ``UploadError`` naming the keys' origin and ``action``."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as exc:
            error = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            raise UploadError(f"the store refused the upload (HTTP {status} "
                              f"{error.get('Code', '')}) with {self.origin}; check that this "
                              f"identity may {action} here") from None
        except BotoCoreError as exc:
            raise UploadError(f"the upload failed: {type(exc).__name__}") from None


class _GCSWriter:
    """PUT and DELETE (nothing to delete is no error) on the XML API with a read-write token
    of the chain or the key file; the same methods as :class:`_S3Writer`."""

    def __init__(self, uri: str, env: Mapping[str, str], networks: tuple[Network, ...],
                 file: Path | None, timeout_s: float, multipart_bytes: int) -> None:
        self.env, self.networks, self.timeout_s = env, networks, timeout_s
        check_hop(resolve_url(uri, env), networks, pinned=False)
        try:
            self.token, self.origin = gcs_credentials(timeout_s, file, networks,
                                                      GCS_WRITE_SCOPE)
        except NoCredentials:
            raise UploadError(f"{CHAINS['gs']} found no credentials; give the training's "
                              "storeCredentialsSecret (a service-account key)") from None

    def put(self, uri: str, body: BinaryIO, size: int) -> None:
        self._send("PUT", uri, (200,), data=body, headers={
            "Content-Length": str(size), "Content-Type": "application/octet-stream"})

    def delete(self, uri: str) -> None:
        self._send("DELETE", uri, (204, 404))

    def _send(self, method: str, uri: str, ok: tuple[int, ...], **request: Any) -> None:
        """One request, its reply streamed: at most ``ERROR_TEXT_BYTES`` of an error's body
        are read, for the message (a store is not trusted to answer small)."""
        import requests

        url = resolve_url(uri, self.env)
        check_hop(url, self.networks, pinned=False)
        headers = {"Authorization": f"Bearer {self.token()}", "Accept-Encoding": "identity",
                   **request.pop("headers", {})}
        try:
            with requests.request(method, url, timeout=self.timeout_s, allow_redirects=False,
                                  stream=True, headers=headers, **request) as answer:
                if answer.status_code in ok:
                    return
                said = answer.raw.read(ERROR_TEXT_BYTES, decode_content=False)
        except requests.RequestException as exc:
            raise UploadError(f"the upload failed: {type(exc).__name__}") from None
        text = " ".join(said.decode("utf-8", "replace").split())
        raise UploadError(f"the store refused the upload (HTTP {answer.status_code}) with "
                          f"{self.origin}; check that this identity may create and delete "
                          f"objects here" + (f"; it said: {text}" if text else ""))
