"""An S3 bucket on loopback (moto's server, its IAM checks on) with a writer and a reader,
for the tests that upload checkpoints and data and read them back."""

from __future__ import annotations

import contextlib
import json
import logging
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Bucket:
    """moto at ``url`` holding ``name``; ``writer`` may do anything in it, ``reader`` only
    read (each an access key id and secret)."""

    url: str
    name: str
    writer: tuple[str, str]
    reader: tuple[str, str]

    def credentials_file(self, path: Path, keys: tuple[str, str]) -> Path:
        """``keys`` as an AWS shared credentials file (what a storeCredentialsSecret holds)."""
        path.write_text(f"[default]\naws_access_key_id = {keys[0]}\n"
                        f"aws_secret_access_key = {keys[1]}\n")
        return path


def _policy(bucket: str, actions: list[str]) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Action": actions, "Resource": [f"arn:aws:s3:::{bucket}",
                                                           f"arn:aws:s3:::{bucket}/*"]}]})


@contextlib.contextmanager
def moto_server() -> Iterator[tuple[str, Callable[[str], Any]]]:
    """moto's server on loopback: its URL, and a client of a service with its admin keys (for
    setting up, before ``moto_auth`` turns the checks on); the checks are off again after."""
    import botocore.session
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    session = botocore.session.Session()

    def client(service: str) -> Any:
        return session.create_client(service, endpoint_url=url, region_name="us-east-1",
                                     aws_access_key_id="admin", aws_secret_access_key="admin")

    try:
        yield url, client
    finally:
        moto_auth(url, "inf")
        server.stop()


@contextlib.contextmanager
def moto_bucket(name: str, objects: dict[str, bytes] | None = None) -> Iterator[Bucket]:
    """A private bucket ``name`` holding ``objects`` (key -> bytes); signatures and IAM are
    checked from the moment it is yielded. One name per test process."""
    with moto_server() as (url, client):
        iam, s3 = client("iam"), client("s3")
        keys = {}
        for role, actions in (("writer", ["s3:*"]), ("reader", ["s3:GetObject"])):
            user = f"{name}-{role}"  # moto's servers in one process share their accounts
            iam.create_user(UserName=user)
            key = iam.create_access_key(UserName=user)["AccessKey"]
            iam.put_user_policy(UserName=user, PolicyName=role,
                                PolicyDocument=_policy(name, actions))
            keys[role] = (key["AccessKeyId"], key["SecretAccessKey"])
        s3.create_bucket(Bucket=name)
        for key_name, data in (objects or {}).items():
            s3.put_object(Bucket=name, Key=key_name, Body=data)
        moto_auth(url, "0")
        yield Bucket(url, name, keys["writer"], keys["reader"])


def moto_auth(url: str, unauthenticated_requests: str) -> None:
    """moto checks signatures and IAM after this many more requests (``inf``: never)."""
    request = urllib.request.Request(f"{url}/moto-api/reset-auth", method="POST",
                                     data=unauthenticated_requests.encode(),
                                     headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        assert answer.status == 200
