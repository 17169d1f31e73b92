"""Upload a finished checkpoint to an object store, in the form the fetcher reads back.

A DDMTraining whose output is ``s3://BUCKET/PREFIX`` or ``gs://BUCKET/PREFIX`` trains on a
volume and uploads each finished checkpoint (``ddm train ... --upload URI``, rank 0):

- the checkpoint directory becomes one ``.tar.gz`` of its regular files at the archive's root
  (sorted, owner and times zeroed: the same files give the same bytes), which
  ``ddm fetch-checkpoint`` extracts and verifies (``ddm.checkpoints.archive``);
- the archive goes to ``URI.tar.gz``, then its marker ``URI.tar.gz.json`` (``format``,
  ``sha256``, ``size``), last: a marker is only ever beside a whole archive, and the
  DDMDeployment made from the outputs pins that sha256. The same record is written beside the
  checkpoint on the volume (``OUT.uploaded.json``): ``ddm train-all`` skips a job that has it;
- an archive over the fetcher's byte cap is refused before anything is sent (no DDM could
  fetch it).

The store is reached as the fetcher reaches it: the endpoint from ``resolve_url``
(``AWS_ENDPOINT_URL[_S3]``, ``STORAGE_EMULATOR_HOST``) held to its destination rules
(``check_hop``; ``$DDM_FETCH_ALLOW_NETWORKS`` for a store on a private network), and the
credentials of the cloud's chain or of the store's own credentials file
(``ddm.checkpoints.credentials``; a DDMTraining's ``storeCredentialsSecret``), never
anonymous. S3 through botocore (PutObject; a multipart upload above ``multipart_bytes``,
aborted on failure), GCS through google-auth and requests (a PUT to the XML API).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Mapping
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
from ddm.checkpoints.fetch import ENV_ALLOW_NETWORKS, resolve_url
from ddm.checkpoints.uri import (
    BUCKET_SCHEMES,
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
        networks = parse_networks(environ.get(ENV_ALLOW_NETWORKS, "").split(","))
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
            put = _s3_put if source.scheme == "s3" else _gcs_put
            put(target, archive, size, environ, networks, file, timeout_s, multipart_bytes)
            put(target + MARKER_SUFFIX, io.BytesIO(marker), len(marker), environ, networks,
                file, timeout_s, multipart_bytes)
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


def _s3_put(uri: str, body: BinaryIO, size: int, env: Mapping[str, str],
            networks: tuple[Network, ...], file: Path | None, timeout_s: float,
            multipart_bytes: int) -> None:
    """PutObject (multipart above ``multipart_bytes``) with the chain's or the file's keys."""
    import botocore.session
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    check_hop(resolve_url(uri, env), networks, pinned=False)
    try:
        credentials, origin = s3_credentials(file)
    except NoCredentials:
        raise UploadError(f"{CHAINS['s3']} found no credentials; give the training's "
                          "storeCredentialsSecret (an AWS shared credentials file)") from None
    frozen = credentials.get_frozen_credentials()
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None
    client = botocore.session.Session().create_client(
        "s3", region_name=s3_region(env) or "us-east-1", endpoint_url=endpoint,
        aws_access_key_id=frozen.access_key, aws_secret_access_key=frozen.secret_key,
        aws_session_token=frozen.token,
        config=Config(connect_timeout=timeout_s, read_timeout=timeout_s,
                      retries={"max_attempts": 5, "mode": "standard"}))
    bucket, key = _bucket_key(uri)
    try:
        if size <= multipart_bytes:
            client.put_object(Bucket=bucket, Key=key, Body=body, ContentLength=size)
            return
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        try:
            parts = []
            for number in range(1, -(-size // PART_BYTES) + 1):
                data = body.read(PART_BYTES)
                answer = client.upload_part(Bucket=bucket, Key=key, UploadId=upload,
                                            PartNumber=number, Body=data)
                parts.append({"PartNumber": number, "ETag": answer["ETag"]})
            client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload,
                                             MultipartUpload={"Parts": parts})
        except BaseException:
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)
            raise
    except ClientError as exc:
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        raise UploadError(f"the store refused the upload (HTTP {status} "
                          f"{error.get('Code', '')}) with {origin}; check that this "
                          "identity may s3:PutObject here") from None
    except BotoCoreError as exc:
        raise UploadError(f"the upload failed: {type(exc).__name__}") from None


def _gcs_put(uri: str, body: BinaryIO, size: int, env: Mapping[str, str],
             networks: tuple[Network, ...], file: Path | None, timeout_s: float,
             multipart_bytes: int) -> None:
    """One PUT to the XML API with a read-write token of the chain or the key file."""
    import requests

    url = resolve_url(uri, env)
    check_hop(url, networks, pinned=False)
    try:
        token, origin = gcs_credentials(timeout_s, file, networks, GCS_WRITE_SCOPE)
    except NoCredentials:
        raise UploadError(f"{CHAINS['gs']} found no credentials; give the training's "
                          "storeCredentialsSecret (a service-account key)") from None
    try:
        answer = requests.put(url, data=body, timeout=timeout_s, allow_redirects=False,
                              headers={"Authorization": f"Bearer {token()}",
                                       "Content-Length": str(size),
                                       "Content-Type": "application/octet-stream"})
    except requests.RequestException as exc:
        raise UploadError(f"the upload failed: {type(exc).__name__}") from None
    if answer.status_code != 200:
        raise UploadError(f"the store refused the upload (HTTP {answer.status_code}) with "
                          f"{origin}; check that this identity may create objects here")
