"""Private buckets: the clouds' standard credential chains, turned into request headers.

The fetcher reads ``s3://`` and ``gs://`` anonymously first, so public buckets need no SDK and
no credential lookup (which may probe a metadata server). When the store refuses (401/403),
the fetch looks its credentials up once, as the cloud's own SDK does, and signs every request
after that; the SDKs only find credentials and sign: the GET itself stays
``ddm.checkpoints.download.get``, with its destination checks, deadline, byte cap and
SHA-256.

- ``s3://``: botocore's default chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
  ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and the shared files, IRSA's
  ``AWS_WEB_IDENTITY_TOKEN_FILE`` + ``AWS_ROLE_ARN``, the ECS/EKS Pod Identity container
  endpoint, the instance profile); Signature V4 for the region of the URL
  (``AWS_REGION``/``AWS_DEFAULT_REGION``, else us-east-1). The extra ``ddm-operator[s3]``.
- ``gs://``: google-auth's application default credentials (``GOOGLE_APPLICATION_CREDENTIALS``,
  gcloud's, Workload Identity's metadata server) with the read-only storage scope, sent as a
  bearer token to the XML API. The extra ``ddm-operator[gcs]``.

The SDKs read their settings from the process's environment and files, as they do anywhere.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping

from ddm.checkpoints.download import FetchError

__all__ = ["StoreCredentials", "s3_region"]

#: The scope a fetch needs: reading objects.
GCS_READ_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
_EXTRAS = {"s3": "s3", "gs": "gcs"}
_CHAINS = {"s3": ("AWS's default credential chain (AWS_ACCESS_KEY_ID, AWS_PROFILE, "
                  "AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN, the instance profile)"),
           "gs": ("Google's application default credentials (GOOGLE_APPLICATION_CREDENTIALS, "
                  "Workload Identity)")}
_OTHER_WAYS = "or give --headers-file or a pre-signed https:// URL"


def s3_region(env: Mapping[str, str]) -> str | None:
    """The region an ``s3://`` URI is read from and signed for (None: the global endpoint)."""
    return env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None


class StoreCredentials:
    """The credentials of one fetch from one bucket scheme, looked up at the first refusal.

    ``look_up()`` consults the chain; ``sign(url)`` then returns the headers that authenticate
    a GET of ``url`` (computed per request: a SigV4 signature covers the path and the time).
    ``source`` names where they came from, for messages.
    """

    def __init__(self, scheme: str, env: Mapping[str, str], timeout_s: float) -> None:
        if scheme not in _EXTRAS:
            raise ValueError(f"no credential chain for {scheme}://")
        self.scheme = scheme
        self._env = env
        self._timeout_s = timeout_s
        self._signer: Callable[[str], dict[str, str]] | None = None
        self.source = ""

    @property
    def in_use(self) -> bool:
        """Whether the store refused an anonymous read and requests are now signed."""
        return self._signer is not None

    def look_up(self) -> None:
        """Find the credentials. Raises ``FetchError`` saying what to do: the extra to install
        when the SDK is absent, the chain's sources when it finds nothing."""
        try:
            self._signer, self.source = (_s3_signer(self._env) if self.scheme == "s3"
                                         else _gcs_signer(self._timeout_s))
        except _NoCredentials:
            raise FetchError(f"a private bucket: {_CHAINS[self.scheme]} found no credentials; "
                             f"{_OTHER_WAYS}") from None

    def sign(self, url: str) -> dict[str, str]:
        """Headers authenticating ``GET url``, after ``look_up``."""
        if self._signer is None:
            raise RuntimeError("sign() before look_up()")
        return self._signer(url)


def _missing_sdk(scheme: str, package: str) -> FetchError:
    return FetchError(f"a private bucket: signed {scheme}:// reads need {package}: pip install "
                      f"'ddm-operator[{_EXTRAS[scheme]}]'; {_OTHER_WAYS}")


def _chain_failed(chain: str, exc: Exception) -> FetchError:
    """An SDK's failure (a missing profile, STS or a token endpoint refusing): the SDK's
    exceptions are of many classes, and its words, cut, are the only account of why."""
    words = " ".join(str(exc).split())
    return FetchError(f"{chain} failed: {type(exc).__name__}"
                      + (f": {words[:300]}" if words else ""))


class _NoCredentials(Exception):
    """The chain found nothing."""


def _s3_signer(env: Mapping[str, str]) -> tuple[Callable[[str], dict[str, str]], str]:
    try:
        import botocore.session
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
    except ImportError:
        raise _missing_sdk("s3", "botocore") from None
    try:
        credentials = botocore.session.Session().get_credentials()
    except Exception as exc:  # a missing profile, an unreadable token, STS refusing the role
        raise _chain_failed("AWS's credential chain", exc) from None
    if credentials is None:
        raise _NoCredentials("no AWS credentials")
    region = s3_region(env) or "us-east-1"

    def sign(url: str) -> dict[str, str]:
        request = AWSRequest(method="GET", url=url)
        try:  # refreshable credentials (IRSA, instance profile) renew themselves here
            S3SigV4Auth(credentials.get_frozen_credentials(), "s3", region).add_auth(request)
        except Exception as exc:
            raise _chain_failed("AWS's credential chain", exc) from None
        return dict(request.headers.items())

    return sign, f"AWS credentials from {credentials.method}, signed for {region}"


def _gcs_signer(timeout_s: float) -> tuple[Callable[[str], dict[str, str]], str]:
    try:
        import google.auth
        import google.auth.exceptions
        from google.auth.transport.requests import Request
    except ImportError:
        raise _missing_sdk("gs", "google-auth") from None
    try:
        credentials, _ = google.auth.default(scopes=[GCS_READ_SCOPE])
    except google.auth.exceptions.DefaultCredentialsError as exc:
        if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):  # named, but unusable
            raise _chain_failed("Google's credentials", exc) from None
        raise _NoCredentials("no Google credentials") from None
    # the token endpoint is the SDK's peer: it gets the fetch's wait, not requests' 120 s
    request = functools.partial(Request(), timeout=timeout_s)

    def sign(url: str) -> dict[str, str]:
        if not credentials.valid:
            try:
                credentials.refresh(request)
            except Exception as exc:
                raise _chain_failed("Google's credentials", exc) from None
        return {"Authorization": f"Bearer {credentials.token}"}

    return sign, f"Google credentials ({type(credentials).__name__})"
