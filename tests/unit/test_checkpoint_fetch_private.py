"""Private buckets: ``ddm fetch-checkpoint`` signs with the clouds' standard credential chains.

S3 is moto's server on loopback, with its IAM checks on: an anonymous read is refused, a
SigV4 signature is verified against the access key's secret, and the identity's policy must
allow the read. GCS is a loopback server playing Google's token endpoint and the XML API,
reached through a service-account key file as Workload Identity's tokens would be.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ddm.checkpoints.destinations import parse_networks
from ddm.cli import main
from ddm.checkpoints.fetch import FetchError, FetchPolicy, fetch_checkpoint
from ddm.checkpoints.format import CONFIG_FILE, WEIGHTS_FILE, load_checkpoint
from tests.support.s3_store import moto_auth, moto_server

pytest.importorskip("moto", reason="moto[server] is in the dev extra")

POLICY = FetchPolicy(timeout_s=10.0, attempts=2, backoff_s=0.01,
                     allowed_networks=parse_networks(["127.0.0.1/32"]))
ALLOW_LOOPBACK = ["--allow-network", "127.0.0.1/32"]
BUCKET = "private-checkpoints"
ACCOUNT = "123456789012"
READ_POLICY = json.dumps({"Version": "2012-10-17", "Statement": [{
    "Effect": "Allow", "Action": "s3:GetObject", "Resource": f"arn:aws:s3:::{BUCKET}/*"}]})


@dataclass(frozen=True)
class S3Store:
    """moto's server at ``url`` with one bucket; ``key_id``/``secret`` may read it, and so may
    ``role_arn``, whose temporary credentials (as STS issues them) are ``role_credentials``."""

    url: str
    key_id: str
    secret: str
    role_arn: str
    role_credentials: dict[str, str]


@pytest.fixture(scope="module")
def s3_store(smoke_expert_checkpoint: Path) -> Iterator[S3Store]:
    """A private bucket holding the smoke checkpoint, an IAM user and a role that may read
    it; authentication is enforced once they exist (moto's ``reset-auth``)."""
    with moto_server() as (url, client):
        iam, s3 = client("iam"), client("s3")
        iam.create_user(UserName="fetcher")
        key = iam.create_access_key(UserName="fetcher")["AccessKey"]
        iam.put_user_policy(UserName="fetcher", PolicyName="read", PolicyDocument=READ_POLICY)
        role = iam.create_role(RoleName="ddm-fetcher", AssumeRolePolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{
                "Effect": "Allow",
                "Principal": {"Federated": f"arn:aws:iam::{ACCOUNT}:oidc-provider/"
                                           "oidc.eks.example"},
                "Action": "sts:AssumeRoleWithWebIdentity"}]}))["Role"]
        iam.put_role_policy(RoleName="ddm-fetcher", PolicyName="read", PolicyDocument=READ_POLICY)
        issued = client("sts").assume_role(RoleArn=role["Arn"], RoleSessionName="irsa")
        role_credentials = {name: issued["Credentials"][name]
                            for name in ("AccessKeyId", "SecretAccessKey", "SessionToken")}
        s3.create_bucket(Bucket=BUCKET)
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            s3.put_object(Bucket=BUCKET, Key=f"smoke/{name}",
                          Body=(smoke_expert_checkpoint / name).read_bytes())
        moto_auth(url, "0")
        yield S3Store(url, key["AccessKeyId"], key["SecretAccessKey"], role["Arn"],
                      role_credentials)


def _assert_smoke(dest: Path, source: Path) -> None:
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (dest / name).read_bytes() == (source / name).read_bytes(), name
    assert load_checkpoint(dest).meta.name == "smoke-torch"


@pytest.fixture
def aws_env(s3_store: S3Store, no_cloud_credentials, monkeypatch) -> S3Store:
    """The store as a pod sees it: its endpoint in the environment, no credentials yet."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_store.url)
    return s3_store


def test_a_private_bucket_is_read_with_keys_from_the_environment(
        aws_env, smoke_expert_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", aws_env.key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws_env.secret)
    dest = fetch_checkpoint(f"s3://{BUCKET}/smoke", tmp_path / "expert", POLICY)
    _assert_smoke(dest, smoke_expert_checkpoint)


def _aws_credentials_file(path: Path, key_id: str, secret: str, token: str | None = None
                          ) -> Path:
    """An AWS shared credentials file, as ``aws configure`` writes it."""
    lines = ["[default]", f"aws_access_key_id = {key_id}", f"aws_secret_access_key = {secret}"]
    path.write_text("\n".join(lines + ([f"aws_session_token = {token}"] if token else [])) + "\n")
    return path


@pytest.mark.parametrize("keys", ["user", "role"])
def test_a_private_bucket_is_read_with_keys_from_a_credentials_file(
        s3_store, no_cloud_credentials, smoke_expert_checkpoint, tmp_path, keys, monkeypatch,
        termination_log):
    """``storeCredentialsSecret`` on a cluster outside AWS: the shared credentials file the
    Secret mounts, named on the command line; no AWS_* credential variable, and the default
    shared file points nowhere. An IAM user's keys, or temporary ones with a session token."""
    role = s3_store.role_credentials
    key_id, secret, token = ((s3_store.key_id, s3_store.secret, None) if keys == "user" else
                             (role["AccessKeyId"], role["SecretAccessKey"], role["SessionToken"]))
    credentials = _aws_credentials_file(tmp_path / "credentials", key_id, secret, token)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_store.url)  # where moto is, not a credential
    assert not any(name.startswith(("AWS_ACCESS", "AWS_SECRET", "AWS_SESSION", "AWS_ROLE",
                                    "AWS_WEB", "AWS_PROFILE")) for name in os.environ)
    assert main(["fetch-checkpoint", f"s3://{BUCKET}/smoke", str(tmp_path / "expert"),
                 "--store-credentials-file", str(credentials), *ALLOW_LOOPBACK]) == 0
    _assert_smoke(tmp_path / "expert", smoke_expert_checkpoint)


def test_a_wrong_key_in_the_file_names_the_file_as_the_keys_origin(aws_env, tmp_path):
    credentials = _aws_credentials_file(tmp_path / "credentials", aws_env.key_id, "wrong")
    with pytest.raises(FetchError, match=rf"HTTP 403 Forbidden \(the store refused the signed "
                                         rf"request: AWS credentials from the file "
                                         rf"{credentials}, signed for us-east-1"):
        fetch_checkpoint(f"s3://{BUCKET}/smoke", tmp_path / "expert", POLICY,
                         credentials_file=credentials)


SECRET_WORDS = "do-not-show-this-secret"


@pytest.mark.parametrize("scheme, content, expected", [
    ("s3", json.dumps({"type": "service_account", "private_key": SECRET_WORDS}),
     "an AWS shared credentials file: a [default] section with aws_access_key_id"),
    ("s3", f"[default]\naws_access_key_id = {SECRET_WORDS}\n",
     "an AWS shared credentials file"),
    ("s3", f"[prod]\naws_access_key_id = a\naws_secret_access_key = {SECRET_WORDS}\n",
     "an AWS shared credentials file"),
    ("gs", f"[default]\naws_secret_access_key = {SECRET_WORDS}\n",
     "a Google service-account key: JSON with type 'service_account'"),
    ("gs", json.dumps({"type": "external_account", "credential_source": {
        "url": f"http://169.254.169.254/{SECRET_WORDS}"}}), "a Google service-account key"),
    ("gs", json.dumps({"type": "service_account", "client_email": "a@b", "token_uri":
                       "https://oauth2.googleapis.com/token", "private_key": SECRET_WORDS}),
     "a Google service-account key"),
])
def test_a_file_that_is_not_the_stores_credentials_file_is_refused_before_any_read(
        scheme, content, expected, tmp_path, no_cloud_credentials):
    """Named with what it should be, never quoted; nothing is downloaded (the URI's host does
    not even resolve: the file is checked first)."""
    pytest.importorskip("google.auth", reason="google-auth is in the gcs extra")
    credentials = tmp_path / "credentials"
    credentials.write_text(content)
    with pytest.raises(FetchError) as refused:
        fetch_checkpoint(f"{scheme}://{BUCKET}/smoke", tmp_path / "expert", POLICY,
                         credentials_file=credentials)
    message = str(refused.value)
    assert message.startswith(f"{scheme}://{BUCKET}/smoke: the store credentials file "
                              f"{credentials} is not {expected}")
    assert SECRET_WORDS not in message
    assert not (tmp_path / "expert").exists()


def test_a_missing_file_and_a_uri_that_is_not_a_bucket_are_refused_naming_why(tmp_path):
    with pytest.raises(FetchError, match=rf"cannot read the store credentials file "
                                         rf"{tmp_path}/absent: No such file"):
        fetch_checkpoint(f"s3://{BUCKET}/smoke", tmp_path / "expert", POLICY,
                         credentials_file=tmp_path / "absent")
    with pytest.raises(FetchError, match=r"^https://store.example/m.tar.gz: "
                                         r"--store-credentials-file is for s3:// and gs:// "
                                         r"URIs, not https://"):
        fetch_checkpoint("https://store.example/m.tar.gz", tmp_path / "expert", POLICY,
                         credentials_file=tmp_path / "absent")
    with pytest.raises(FetchError, match=r"give --headers-file or --store-credentials-file, "
                                         r"not both"):
        fetch_checkpoint(f"s3://{BUCKET}/smoke", tmp_path / "expert", POLICY,
                         headers={"Authorization": "Bearer x"},
                         credentials_file=tmp_path / "absent")


class StsStand:
    """AWS STS: answers AssumeRoleWithWebIdentity with ``credentials`` and keeps what was
    asked. (moto's STS fails this unsigned call while it checks auth, so the role's
    credentials were issued by moto before, and this stand hands them out.)"""

    def __init__(self, credentials: dict[str, str]) -> None:
        self.credentials = credentials
        self.asked: list[dict[str, list[str]]] = []
        self.url = ""


class _Answering(BaseHTTPRequestHandler):
    """A loopback stand's handler: whole answers, no log."""

    def _answer(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def _sts_handler(stand: StsStand) -> type[BaseHTTPRequestHandler]:
    class Handler(_Answering):
        def do_POST(self) -> None:
            form = self.rfile.read(int(self.headers["Content-Length"])).decode()
            stand.asked.append(urllib.parse.parse_qs(form))
            expires = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600))
            fields = "".join(f"<{k}>{v}</{k}>" for k, v in stand.credentials.items())
            body = (f'<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/'
                    f'2011-06-15/"><AssumeRoleWithWebIdentityResult><Credentials>{fields}'
                    f"<Expiration>{expires}</Expiration></Credentials>"
                    "</AssumeRoleWithWebIdentityResult></AssumeRoleWithWebIdentityResponse>"
                    ).encode()
            self._answer(200, body, "text/xml")

    return Handler


@contextlib.contextmanager
def _serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A loopback HTTP server with ``handler`` for the ``with`` block; yields its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class RegionalStand:
    """S3 as a bucket in ``region`` answers (moto signs-checks but accepts any region, so it
    never names one): anonymous reads 403; a request signed for another region ``status``
    with ``x-amz-bucket-region`` (S3's 400 AuthorizationHeaderMalformed, its 301
    PermanentRedirect, a 403), and a ``Location`` at ``elsewhere`` that must never be
    followed; signed for ``region``, the object. ``named``: the region each answer names
    (None: ``region``, else a function of the region signed for). ``signed``: the region each
    request was signed for (None: anonymous)."""

    def __init__(self, files: dict[str, bytes], status: int, elsewhere: str = "",
                 region: str = "eu-west-1") -> None:
        self.files, self.status, self.elsewhere, self.region = files, status, elsewhere, region
        self.named = lambda signed_for: region
        self.signed: list[str | None] = []


_SCOPE = re.compile(r"Credential=[^/]+/\d{8}/([^/]+)/s3/aws4_request")


def _regional_handler(stand: RegionalStand) -> type[BaseHTTPRequestHandler]:
    class Handler(_Answering):
        def do_GET(self) -> None:
            scope = _SCOPE.search(self.headers.get("Authorization", ""))
            region = scope.group(1) if scope else None
            stand.signed.append(region)
            if region is None:
                self._answer(403, b"")
            elif region != stand.region:
                self.send_response(stand.status)
                self.send_header("x-amz-bucket-region", stand.named(region))
                self.send_header("Location", f"{stand.elsewhere}{self.path}")
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self._answer(200, stand.files[self.path])

    return Handler


@pytest.fixture
def elsewhere() -> Iterator[tuple[str, list[str]]]:
    """A loopback server that must never be asked: its URL, and the paths it was asked for."""
    asked: list[str] = []

    class Handler(_Answering):
        def do_GET(self) -> None:
            asked.append(self.path)
            self._answer(500, b"")

    with _serving(Handler) as url:
        yield url, asked


@pytest.mark.parametrize("status", [400, 301, 403])
def test_a_bucket_in_another_region_is_re_signed_for_the_region_s3_names(
        status, elsewhere, no_cloud_credentials, smoke_expert_checkpoint, tmp_path,
        monkeypatch):
    """A stager off AWS with keys and no AWS_REGION signs for us-east-1; the bucket in
    eu-west-1 names its region and the fetch signs for it, at the same URL: the answer's
    Location (another host) is never followed."""
    other, asked_elsewhere = elsewhere
    stand = RegionalStand({f"/{BUCKET}/smoke/{name}": (smoke_expert_checkpoint / name).read_bytes()
                           for name in (CONFIG_FILE, WEIGHTS_FILE)}, status, other)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    with _serving(_regional_handler(stand)) as url:
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        dest = fetch_checkpoint(f"s3://{BUCKET}/smoke", tmp_path / "expert", POLICY)
    _assert_smoke(dest, smoke_expert_checkpoint)
    assert stand.signed == [None, "us-east-1", "eu-west-1", "eu-west-1"]
    assert asked_elsewhere == []


def test_a_store_that_keeps_naming_other_regions_is_re_signed_for_once(
        no_cloud_credentials, tmp_path, monkeypatch):
    stand = RegionalStand({}, 400)
    stand.named = lambda signed_for: "eu-west-1" if signed_for == "us-east-1" else "ap-south-1"
    stand.region = "eu-central-1"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    with _serving(_regional_handler(stand)) as url:
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        with pytest.raises(FetchError, match=r"HTTP 400 Bad Request \(the store refused the "
                                             r"signed request: AWS credentials from env, "
                                             r"signed for eu-west-1"):
            fetch_checkpoint(f"s3://{BUCKET}/smoke", tmp_path / "expert", POLICY)
    assert stand.signed == [None, "us-east-1", "eu-west-1"]


def test_irsa_web_identity_is_exchanged_for_the_roles_credentials(
        aws_env, smoke_expert_checkpoint, tmp_path, monkeypatch):
    """What EKS's pod identity webhook sets: a projected token file and the role's ARN. The
    chain trades the token at STS for temporary credentials (with a session token), which
    sign the reads."""
    stand = StsStand(aws_env.role_credentials)
    token = tmp_path / "token"
    token.write_text("eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2VydmljZWFjY291bnQifQ.c2ln")
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token))
    monkeypatch.setenv("AWS_ROLE_ARN", aws_env.role_arn)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    with _serving(_sts_handler(stand)) as sts:
        monkeypatch.setenv("AWS_ENDPOINT_URL_STS", sts)
        dest = fetch_checkpoint(f"s3://{BUCKET}/smoke", tmp_path / "dest" / "expert", POLICY)
    _assert_smoke(dest, smoke_expert_checkpoint)
    [asked] = stand.asked
    assert asked["Action"] == ["AssumeRoleWithWebIdentity"]
    assert asked["RoleArn"] == [aws_env.role_arn]
    assert asked["WebIdentityToken"] == [token.read_text()]


def test_a_wrong_secret_is_the_stores_403_naming_where_the_keys_came_from(
        aws_env, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", aws_env.key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(FetchError, match=rf"^s3://{BUCKET}/smoke: .*HTTP 403 Forbidden \(the "
                                         r"store refused the signed request: AWS credentials "
                                         r"from env, signed for us-east-1"):
        fetch_checkpoint(f"s3://{BUCKET}/smoke", tmp_path / "expert", POLICY)
    assert list(tmp_path.iterdir()) == []


def test_no_credentials_anywhere_says_what_the_chain_looked_at(aws_env, tmp_path):
    with pytest.raises(FetchError, match=r"HTTP 403 Forbidden \(a private bucket: AWS's default "
                                         r"credential chain .*found no credentials; or give "
                                         r"--headers-file"):
        fetch_checkpoint(f"s3://{BUCKET}/smoke", tmp_path / "expert", POLICY)


def test_the_byte_cap_holds_for_signed_reads(aws_env, smoke_expert_checkpoint, tmp_path,
                                             monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", aws_env.key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws_env.secret)
    cap = (smoke_expert_checkpoint / CONFIG_FILE).stat().st_size + 1000
    small = FetchPolicy(**{**POLICY.__dict__, "max_bytes": cap})
    with pytest.raises(FetchError, match=r"weights.safetensors is \d+ bytes, over the \d+-byte "
                                         r"limit left for this checkpoint"):
        fetch_checkpoint(f"s3://{BUCKET}/smoke", tmp_path / "expert", small)
    assert list(tmp_path.iterdir()) == []


def test_without_the_sdk_a_refusal_names_the_extra(aws_env, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", aws_env.key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws_env.secret)
    monkeypatch.setitem(sys.modules, "botocore", None)  # import botocore fails
    with pytest.raises(FetchError, match=r"HTTP 403 Forbidden \(a private bucket: signed s3:// "
                                         r"reads need botocore: pip install "
                                         r"'ddm-operator\[s3\]'"):
        fetch_checkpoint(f"s3://{BUCKET}/smoke", tmp_path / "expert", POLICY)


# -- GCS: a token from a service-account key, as a bearer of the XML API ----------------------

class GoogleStand:
    """Token endpoint (``POST /token``) and bucket (``GET /BUCKET/KEY``) in one server."""

    TOKEN = "ya29.loopback-token"

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.grants: list[str] = []
        self.url = ""
        self.key_file = Path()


def _google_handler(stand: GoogleStand) -> type[BaseHTTPRequestHandler]:
    class Handler(_Answering):
        def do_POST(self) -> None:
            form = self.rfile.read(int(self.headers["Content-Length"])).decode()
            stand.grants.append(form)
            self._answer(200, json.dumps({"access_token": GoogleStand.TOKEN,
                                          "expires_in": 3600,
                                          "token_type": "Bearer"}).encode(), "application/json")

        def do_GET(self) -> None:
            if self.headers.get("Authorization") != f"Bearer {GoogleStand.TOKEN}":
                self._answer(401, b"")
            elif self.path in stand.files:
                self._answer(200, stand.files[self.path])
            else:
                self._answer(404, b"")

    return Handler


@pytest.fixture
def google(smoke_expert_checkpoint, no_cloud_credentials, monkeypatch, tmp_path
           ) -> Iterator[GoogleStand]:
    pytest.importorskip("google.auth", reason="google-auth is in the gcs extra")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    stand = GoogleStand({f"/{BUCKET}/smoke/{name}": (smoke_expert_checkpoint / name).read_bytes()
                         for name in (CONFIG_FILE, WEIGHTS_FILE)})
    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()).decode()
    with _serving(_google_handler(stand)) as stand.url:
        stand.key_file = tmp_path / "key.json"
        stand.key_file.write_text(json.dumps({
            "type": "service_account", "project_id": "ddm", "private_key_id": "1",
            "private_key": pem, "client_email": "fetcher@ddm.iam.gserviceaccount.com",
            "client_id": "1", "token_uri": f"{stand.url}/token"}))
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", stand.url)
        yield stand


def _assert_one_read_only_grant(stand: GoogleStand) -> None:
    assert len(stand.grants) == 1  # one token for the whole fetch, asked for reading only
    assertion = urllib.parse.parse_qs(stand.grants[0])["assertion"][0]
    claims = json.loads(base64.urlsafe_b64decode(assertion.split(".")[1] + "=="))
    assert claims["scope"] == "https://www.googleapis.com/auth/devstorage.read_only"


def test_a_private_gcs_bucket_is_read_with_googles_default_credentials(
        google, smoke_expert_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(google.key_file))
    dest = fetch_checkpoint(f"gs://{BUCKET}/smoke", tmp_path / "expert", POLICY)
    _assert_smoke(dest, smoke_expert_checkpoint)
    _assert_one_read_only_grant(google)


def test_a_private_gcs_bucket_is_read_with_a_service_account_key_file(
        google, smoke_expert_checkpoint, tmp_path, termination_log):
    """``storeCredentialsSecret`` on a cluster outside GCP: the key file, named on the command
    line, signs from the first read; no GOOGLE_APPLICATION_CREDENTIALS."""
    assert main(["fetch-checkpoint", f"gs://{BUCKET}/smoke", str(tmp_path / "expert"),
                 "--store-credentials-file", str(google.key_file), *ALLOW_LOOPBACK]) == 0
    _assert_smoke(tmp_path / "expert", smoke_expert_checkpoint)
    _assert_one_read_only_grant(google)


def test_a_key_files_token_endpoint_is_held_to_the_destination_rules(google, tmp_path):
    """A tenant's key names its token endpoint: outside the networks the fetch may reach
    (here: loopback, not allowed), the stager never posts to it."""
    with pytest.raises(FetchError, match=r"its token_uri is not a destination the fetcher may "
                                         r"reach"):
        fetch_checkpoint(f"gs://{BUCKET}/smoke", tmp_path / "expert",
                         FetchPolicy(timeout_s=10.0), credentials_file=google.key_file)
    assert google.grants == []


def test_without_google_auth_a_refusal_names_the_extra(google, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "google.auth", None)
    with pytest.raises(FetchError, match=r"HTTP 401 Unauthorized \(a private bucket: signed gs:// "
                                         r"reads need google-auth: pip install "
                                         r"'ddm-operator\[gcs\]'"):
        fetch_checkpoint(f"gs://{BUCKET}/smoke", tmp_path / "expert", POLICY)
