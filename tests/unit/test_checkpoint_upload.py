"""Uploading a trained checkpoint to a store, and reading it back as any store checkpoint.

S3 is moto's server on loopback with its IAM checks on (a writer, and a reader that may not
write); GCS a loopback server playing Google's token endpoint and the XML API's PUT.
"""

from __future__ import annotations

import base64
import json
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from ddm.checkpoints.fetch import FetchPolicy, fetch_checkpoint
from ddm.checkpoints.destinations import parse_networks
from ddm.checkpoints.format import CONFIG_FILE, WEIGHTS_FILE
from ddm.checkpoints import upload
from ddm.checkpoints.upload import (
    ERROR_TEXT_BYTES,
    UploadError,
    read_uploaded,
    upload_checkpoint,
)
from tests.support.s3_store import Bucket, moto_bucket
from tests.unit.test_checkpoint_fetch_private import _Answering, _serving

pytest.importorskip("moto", reason="moto[server] is in the dev extra")

POLICY = FetchPolicy(timeout_s=10.0, attempts=2, backoff_s=0.01,
                     allowed_networks=parse_networks(["127.0.0.1/32"]))


@pytest.fixture(scope="module")
def bucket() -> Iterator[Bucket]:
    with moto_bucket("trained") as made:
        yield made


@pytest.fixture
def store(bucket, no_cloud_credentials, monkeypatch) -> Bucket:
    """The bucket as a training pod sees it: its endpoint, loopback allowed, no keys yet."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", bucket.url)
    monkeypatch.setenv("DDM_FETCH_ALLOW_NETWORKS", "127.0.0.1/32")
    return bucket


def _copy(source: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        (dest / name).write_bytes((source / name).read_bytes())
    return dest


def _read_back(store: Bucket, uri: str, sha256: str, dest: Path) -> None:
    """As a DDM's stager reads it, with the reader's keys (a storeCredentialsSecret)."""
    keys = store.credentials_file(dest.with_name("reader-keys"), store.reader)
    fetch_checkpoint(uri, dest, POLICY, sha256=sha256, credentials_file=keys)


@pytest.mark.parametrize("multipart_bytes", [1 << 30, 0], ids=["put-object", "multipart"])
def test_an_upload_is_the_archive_then_its_marker_and_reads_back_pinned(
        store, smoke_expert_checkpoint, tmp_path, multipart_bytes):
    checkpoint = _copy(smoke_expert_checkpoint, tmp_path / "experts" / "smoke")
    keys = store.credentials_file(tmp_path / "aws", store.writer)
    uploaded = upload_checkpoint(checkpoint, f"s3://{store.name}/run/{multipart_bytes}/smoke",
                                 credentials_file=keys, multipart_bytes=multipart_bytes)
    assert uploaded.uri == f"s3://{store.name}/run/{multipart_bytes}/smoke.tar.gz"
    assert read_uploaded(checkpoint) == uploaded
    # the same files make the same archive: a rerun's upload is the same object
    again = upload_checkpoint(checkpoint, f"s3://{store.name}/run/again/smoke",
                              credentials_file=keys)
    assert again.sha256 == uploaded.sha256
    import botocore.session

    s3 = botocore.session.Session().create_client(
        "s3", endpoint_url=store.url, region_name="us-east-1",
        aws_access_key_id=store.reader[0], aws_secret_access_key=store.reader[1])
    marker = s3.get_object(Bucket=store.name, Key=f"run/{multipart_bytes}/smoke.tar.gz.json")
    assert json.loads(marker["Body"].read()) == {"format": "ddm-upload/1",
                                                 "sha256": uploaded.sha256,
                                                 "size": uploaded.size}
    dest = tmp_path / "fetched"
    _read_back(store, uploaded.uri, uploaded.sha256, dest)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (dest / name).read_bytes() == (checkpoint / name).read_bytes()


def test_no_credentials_names_what_the_chain_looked_at(store, smoke_expert_checkpoint,
                                                       tmp_path):
    checkpoint = _copy(smoke_expert_checkpoint, tmp_path / "smoke")
    with pytest.raises(UploadError) as caught:
        upload_checkpoint(checkpoint, f"s3://{store.name}/nobody/smoke")
    message = str(caught.value)
    assert message.startswith(f"s3://{store.name}/nobody/smoke.tar.gz: ")
    assert "AWS_ACCESS_KEY_ID, AWS_PROFILE" in message and "found no credentials" in message
    assert "storeCredentialsSecret" in message
    assert read_uploaded(checkpoint) is None


def test_a_bucket_that_answers_403_is_refused_naming_the_keys_origin(
        store, smoke_expert_checkpoint, tmp_path):
    checkpoint = _copy(smoke_expert_checkpoint, tmp_path / "smoke")
    keys = store.credentials_file(tmp_path / "aws", store.reader)  # may read, not write
    with pytest.raises(UploadError, match=r"refused the upload \(HTTP 403 AccessDenied\) with "
                                          rf"AWS credentials from the file {keys}"):
        upload_checkpoint(checkpoint, f"s3://{store.name}/denied/smoke", credentials_file=keys)
    assert read_uploaded(checkpoint) is None


def test_an_archive_over_the_fetchers_cap_is_refused_before_any_request(
        store, smoke_expert_checkpoint, tmp_path):
    checkpoint = _copy(smoke_expert_checkpoint, tmp_path / "smoke")
    with pytest.raises(UploadError, match="over the fetcher's 1000-byte cap"):
        upload_checkpoint(checkpoint, f"s3://{store.name}/big/smoke", max_bytes=1000)


def test_a_store_on_a_network_not_allowed_is_refused(store, smoke_expert_checkpoint, tmp_path,
                                                     monkeypatch):
    monkeypatch.delenv("DDM_FETCH_ALLOW_NETWORKS")
    checkpoint = _copy(smoke_expert_checkpoint, tmp_path / "smoke")
    with pytest.raises(UploadError, match="does not resolve to an allowed address"):
        upload_checkpoint(checkpoint, f"s3://{store.name}/private/smoke",
                          credentials_file=store.credentials_file(tmp_path / "aws",
                                                                  store.writer))


# -- GCS: a read-write token from a service-account key, then PUTs to the XML API ------------

class GoogleWrites:
    """Token endpoint (``POST /token``) and bucket (``PUT /BUCKET/KEY``) in one server."""

    TOKEN = "ya29.loopback-write-token"

    def __init__(self) -> None:
        self.grants: list[str] = []
        self.objects: dict[str, bytes] = {}  # in the order written
        self.deleted: list[str] = []
        self.refuse = False
        self.error_body = b""  # what a refusal says
        self.refused = threading.Event()  # set once a refusal's answer is sent, or cut off
        self.error_sent_whole: bool | None = None


def _handler(stand: GoogleWrites) -> type[BaseHTTPRequestHandler]:
    class Handler(_Answering):
        def do_POST(self) -> None:
            stand.grants.append(self.rfile.read(int(self.headers["Content-Length"])).decode())
            self._answer(200, json.dumps({"access_token": GoogleWrites.TOKEN,
                                          "expires_in": 3600, "token_type": "Bearer"}).encode(),
                         "application/json")

        def do_PUT(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if not self._refused():
                stand.objects[self.path] = body
                self._answer(200, b"")

        def do_DELETE(self) -> None:
            if not self._refused():
                stand.deleted.append(self.path)
                self._answer(204 if stand.objects.pop(self.path, None) is not None else 404,
                             b"")

        def _refused(self) -> bool:
            if not stand.refuse and self.headers.get("Authorization") == \
                    f"Bearer {GoogleWrites.TOKEN}":
                return False
            try:
                self._answer(403, stand.error_body, "application/xml")
                stand.error_sent_whole = True
            except OSError:  # the client read what it wanted and closed
                stand.error_sent_whole = False
            finally:
                stand.refused.set()
            return True

    return Handler


@pytest.fixture
def google(no_cloud_credentials, monkeypatch, tmp_path) -> Iterator[tuple[GoogleWrites, Path]]:
    pytest.importorskip("google.auth", reason="google-auth is in the gcs extra")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    stand = GoogleWrites()
    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()).decode()
    with _serving(_handler(stand)) as url:
        key = tmp_path / "key.json"
        key.write_text(json.dumps({
            "type": "service_account", "project_id": "ddm", "private_key_id": "1",
            "private_key": pem, "client_email": "trainer@ddm.iam.gserviceaccount.com",
            "client_id": "1", "token_uri": f"{url}/token"}))
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
        monkeypatch.setenv("DDM_FETCH_ALLOW_NETWORKS", "127.0.0.1/32")
        yield stand, key


def test_a_gcs_upload_puts_the_archive_then_the_marker_with_a_write_token(
        google, smoke_expert_checkpoint, tmp_path):
    stand, key = google
    checkpoint = _copy(smoke_expert_checkpoint, tmp_path / "smoke")
    uploaded = upload_checkpoint(checkpoint, "gs://trained/run/smoke", credentials_file=key)
    assert list(stand.objects) == ["/trained/run/smoke.tar.gz", "/trained/run/smoke.tar.gz.json"]
    assert stand.deleted == ["/trained/run/smoke.tar.gz.json"]  # the old marker, first
    assert json.loads(stand.objects["/trained/run/smoke.tar.gz.json"])["sha256"] == \
        uploaded.sha256
    assertion = urllib.parse.parse_qs(stand.grants[0])["assertion"][0]
    claims = json.loads(base64.urlsafe_b64decode(assertion.split(".")[1] + "=="))
    assert claims["scope"] == "https://www.googleapis.com/auth/devstorage.read_write"
    assert read_uploaded(checkpoint) == uploaded


def test_a_gcs_bucket_that_answers_403_leaves_no_marker(google, smoke_expert_checkpoint,
                                                        tmp_path):
    stand, key = google
    stand.refuse = True
    checkpoint = _copy(smoke_expert_checkpoint, tmp_path / "smoke")
    with pytest.raises(UploadError, match=r"refused the upload \(HTTP 403\) with Google "
                                          rf"credentials the file {key}"):
        upload_checkpoint(checkpoint, "gs://trained/run/smoke", credentials_file=key)
    assert stand.objects == {} and read_uploaded(checkpoint) is None


def test_a_gcs_error_reply_is_read_only_as_far_as_its_text_needs(google,
                                                                 smoke_expert_checkpoint,
                                                                 tmp_path):
    # A store answering 64 MiB to a refusal: the upload reads a few KiB for the message,
    # then closes; the stand sees its answer cut off.
    stand, key = google
    stand.refuse = True
    stand.error_body = b"<Error><Code>AccessDenied</Code></Error>" + b"x" * (64 << 20)
    checkpoint = _copy(smoke_expert_checkpoint, tmp_path / "smoke")
    with pytest.raises(UploadError) as caught:
        upload_checkpoint(checkpoint, "gs://trained/run/smoke", credentials_file=key)
    message = str(caught.value)
    assert "refused the upload (HTTP 403)" in message
    assert "it said: <Error><Code>AccessDenied</Code></Error>xxx" in message
    assert len(message) < ERROR_TEXT_BYTES + 400
    assert stand.refused.wait(30)
    assert stand.error_sent_whole is False


def test_a_reupload_deletes_the_old_marker_before_the_new_archive(store,
                                                                  smoke_expert_checkpoint,
                                                                  tmp_path, monkeypatch):
    import botocore.session

    checkpoint = _copy(smoke_expert_checkpoint, tmp_path / "smoke")
    keys = store.credentials_file(tmp_path / "aws", store.writer)
    uri = f"s3://{store.name}/rerun/smoke"
    first = upload_checkpoint(checkpoint, uri, credentials_file=keys)
    s3 = botocore.session.Session().create_client(
        "s3", endpoint_url=store.url, region_name="us-east-1",
        aws_access_key_id=store.reader[0], aws_secret_access_key=store.reader[1])
    marker = "rerun/smoke.tar.gz.json"
    assert json.loads(s3.get_object(Bucket=store.name, Key=marker)["Body"].read())[
        "sha256"] == first.sha256
    (checkpoint / CONFIG_FILE).write_text((checkpoint / CONFIG_FILE).read_text() + " ")
    markers_seen = []  # at each write: the marker the store holds, if any
    put = upload._S3Writer.put

    def watched(writer, target, body, size):
        try:
            said = json.loads(s3.get_object(Bucket=store.name, Key=marker)["Body"].read())
            markers_seen.append((target, said["sha256"]))
        except s3.exceptions.NoSuchKey:
            markers_seen.append((target, None))
        return put(writer, target, body, size)

    monkeypatch.setattr(upload._S3Writer, "put", watched)
    second = upload_checkpoint(checkpoint, uri, credentials_file=keys)
    assert second.sha256 != first.sha256
    assert markers_seen == [(second.uri, None), (second.uri + ".json", None)]
    assert json.loads(s3.get_object(Bucket=store.name, Key=marker)["Body"].read())[
        "sha256"] == second.sha256
