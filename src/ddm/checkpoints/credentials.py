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
  (``AWS_REGION``/``AWS_DEFAULT_REGION``, else us-east-1). A bucket elsewhere answers a
  request signed for the wrong region by naming its own (``x-amz-bucket-region``): the fetch
  re-signs for that region once (``resign_for``), at the same URL, as boto3's
  ``S3RegionRedirector`` does, so a stager off AWS needs no ``AWS_REGION``. The extra
  ``ddm-operator[s3]``.
- ``gs://``: google-auth's application default credentials (``GOOGLE_APPLICATION_CREDENTIALS``,
  gcloud's, Workload Identity's metadata server) with the read-only storage scope, sent as a
  bearer token to the XML API. The extra ``ddm-operator[gcs]``.

The SDKs read their settings from the process's environment and files, as they do anywhere.

A store credentials file (``--store-credentials-file``, the spec's ``storeCredentialsSecret``)
replaces the chain: the cluster outside AWS or GCP has no identity to give the stager, so the
tenant's Secret holds the cloud's own file, read with the SDK's own reader and nothing else
(no environment, no other file, no metadata server):

- ``s3://``: an AWS shared credentials file, its ``[default]`` profile
  (``aws_access_key_id``, ``aws_secret_access_key``, optionally ``aws_session_token``), read
  by botocore's ``SharedCredentialProvider``;
- ``gs://``: a service-account key (JSON), read by google-auth's service-account loader (not
  the generic one: an external-account file could make the stager run a program or call any
  URL); its ``token_uri`` is held to the fetcher's destination rules, as the store is.

Requests are signed from the first one: whoever gives keys says the bucket is private, and a
file that is not a credentials file is refused before anything is downloaded.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ddm.checkpoints.destinations import Network
from ddm.checkpoints.download import FetchError, check_hop

__all__ = ["CHAINS", "NoCredentials", "StoreCredentials", "gcs_credentials", "s3_credentials",
           "s3_region"]

#: The scope a fetch needs: reading objects.
GCS_READ_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
_EXTRAS = {"s3": "s3", "gs": "gcs"}
CHAINS = {"s3": ("AWS's default credential chain (AWS_ACCESS_KEY_ID, AWS_PROFILE, "
                  "AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN, the instance profile)"),
           "gs": ("Google's application default credentials (GOOGLE_APPLICATION_CREDENTIALS, "
                  "Workload Identity)")}
_OTHER_WAYS = "or give --headers-file, --store-credentials-file or a pre-signed https:// URL"
#: What a store credentials file must be, per scheme (for messages).
_FILES = {"s3": ("an AWS shared credentials file: a [default] section with aws_access_key_id "
                 "and aws_secret_access_key (and aws_session_token for temporary keys)"),
          "gs": ("a Google service-account key: JSON with type 'service_account', client_email, "
                 "private_key and token_uri")}


def s3_region(env: Mapping[str, str]) -> str | None:
    """The region an ``s3://`` URI is read from and signed for (None: the global endpoint)."""
    return env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None


class StoreCredentials:
    """The credentials of one fetch from one bucket scheme, looked up at the first refusal.

    ``look_up()`` consults the chain; ``sign(url)`` then returns the headers that authenticate
    a GET of ``url`` (computed per request: a SigV4 signature covers the path and the time).
    ``source`` names where they came from, for messages. ``file``: the store's own
    credentials file instead of the chain; ``networks``: the non-public networks the fetch may
    reach (a service-account key's token endpoint is held to them).
    """

    def __init__(self, scheme: str, env: Mapping[str, str], timeout_s: float,
                 file: Path | None = None, networks: Sequence[Network] = ()) -> None:
        if scheme not in _EXTRAS:
            raise ValueError(f"no credential chain for {scheme}://")
        self.scheme = scheme
        self._env = env
        self._timeout_s = timeout_s
        self._file = file
        self._networks = networks
        self._signer: Callable[[str], dict[str, str]] | None = None
        self._origin = ""
        self._region = ""  # s3:// only: the region requests are signed for
        self._resigned = False

    @property
    def in_use(self) -> bool:
        """Whether the store refused an anonymous read and requests are now signed."""
        return self._signer is not None

    @property
    def source(self) -> str:
        """Where the credentials came from (and, for S3, the region they sign for)."""
        return f"{self._origin}, signed for {self._region}" if self._region else self._origin

    def look_up(self, region: str | None = None) -> None:
        """Find the credentials. Raises ``FetchError`` saying what to do: the extra to install
        when the SDK is absent, the chain's sources when it finds nothing. ``region``: the
        bucket's region, when S3 named it in its refusal of the anonymous read."""
        try:
            if self.scheme == "s3":
                sign, self._origin = _s3_signer(self._file)
                self._region = region or s3_region(self._env) or "us-east-1"
                self._signer = lambda url: sign(url, self._region)
            else:
                self._signer, self._origin = _gcs_signer(self._timeout_s, self._file,
                                                         self._networks)
        except NoCredentials:
            raise FetchError(f"a private bucket: {CHAINS[self.scheme]} found no credentials; "
                             f"{_OTHER_WAYS}") from None

    def resign_for(self, region: str) -> bool:
        """Sign for ``region`` from now on: S3 named it as the bucket's after a signed request
        was refused. Once per fetch (a store that keeps naming regions is not followed round);
        False when not S3, already done, or ``region`` is the one signed for."""
        if self.scheme != "s3" or self._resigned or region == self._region:
            return False
        self._region, self._resigned = region, True
        return True

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


class NoCredentials(FetchError):
    """The chain found nothing; the message names what it looked at."""


def _not_a_credentials_file(scheme: str, file: Path) -> FetchError:
    """A store credentials file the SDK cannot read: its path and what it should be, never
    its content (nor the SDK's words, which may quote it)."""
    return FetchError(f"the store credentials file {file} is not {_FILES[scheme]}")


def _readable(file: Path) -> None:
    """Refuse a file that cannot be opened, saying why (the SDKs would say "not found")."""
    try:
        with open(file, "rb"):
            pass
    except OSError as exc:
        raise FetchError(f"cannot read the store credentials file {file}: "
                         f"{exc.strerror or type(exc).__name__}") from None


def s3_credentials(file: Path | None) -> tuple[Any, str]:
    """S3 credentials (botocore's, refreshable where the chain gives such) from the store's
    credentials ``file`` or, None, the default chain, and where they came from. Raises
    ``FetchError`` (no SDK, an unreadable file, a chain that failed) or ``NoCredentials``."""
    try:
        import botocore.session
        from botocore.credentials import SharedCredentialProvider
        from botocore.exceptions import BotoCoreError
    except ImportError:
        raise _missing_sdk("s3", "botocore") from None
    if file is not None:
        _readable(file)
        try:
            credentials = SharedCredentialProvider(str(file), "default").load()
        except BotoCoreError:  # not INI, or a key without its secret
            credentials = None
        if credentials is None:
            raise _not_a_credentials_file("s3", file)
        return credentials, f"AWS credentials from the file {file}"
    try:
        credentials = botocore.session.Session().get_credentials()
    except Exception as exc:  # a missing profile, an unreadable token, STS refusing the role
        raise _chain_failed("AWS's credential chain", exc) from None
    if credentials is None:
        raise NoCredentials(f"{CHAINS['s3']} found no credentials")
    return credentials, f"AWS credentials from {credentials.method}"


def _s3_signer(file: Path | None) -> tuple[Callable[[str, str], dict[str, str]], str]:
    """``sign(url, region)`` with the file's keys or the default chain's, and their origin."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest

    credentials, origin = s3_credentials(file)

    def sign(url: str, region: str) -> dict[str, str]:
        request = AWSRequest(method="GET", url=url)
        try:  # refreshable credentials (IRSA, instance profile) renew themselves here
            S3SigV4Auth(credentials.get_frozen_credentials(), "s3", region).add_auth(request)
        except Exception as exc:
            raise _chain_failed("AWS's credential chain", exc) from None
        return dict(request.headers.items())

    return sign, origin


def gcs_credentials(timeout_s: float, file: Path | None, networks: Sequence[Network],
                    scope: str = GCS_READ_SCOPE
                    ) -> tuple[Callable[[], str], str]:
    """``token()``: a valid bearer token for ``scope`` from the service-account key ``file``
    or, None, Google's application default credentials; and where they came from. Raises
    ``FetchError`` or ``NoCredentials``."""
    try:
        import google.auth
        import google.auth.exceptions
        from google.auth.transport.requests import Request
        from google.oauth2 import service_account
    except ImportError:
        raise _missing_sdk("gs", "google-auth") from None
    if file is not None:
        credentials = _service_account(file, service_account.Credentials, networks, scope)
        failed = _key_refused(file)
    else:
        try:
            credentials, _ = google.auth.default(scopes=[scope])
        except google.auth.exceptions.DefaultCredentialsError as exc:
            if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):  # named, but unusable
                raise _chain_failed("Google's credentials", exc) from None
            raise NoCredentials(f"{CHAINS['gs']} found no credentials") from None
        failed = functools.partial(_chain_failed, "Google's credentials")
    # the token endpoint is the SDK's peer: it gets the fetch's wait, not requests' 120 s
    request = functools.partial(Request(), timeout=timeout_s)

    def token() -> str:
        if not credentials.valid:
            try:
                credentials.refresh(request)
            except Exception as exc:
                raise failed(exc) from None
        return str(credentials.token)

    origin = f"the file {file}" if file is not None else f"({type(credentials).__name__})"
    return token, f"Google credentials {origin}"


def _gcs_signer(timeout_s: float, file: Path | None, networks: Sequence[Network]
                ) -> tuple[Callable[[str], dict[str, str]], str]:
    token, origin = gcs_credentials(timeout_s, file, networks)
    return (lambda url: {"Authorization": f"Bearer {token()}"}), origin


def _service_account(file: Path, loader: type, networks: Sequence[Network], scope: str
                     ) -> Any:
    """The service-account key in ``file``, scoped for reading; its token endpoint must be
    a destination the fetcher may reach (a tenant's key must not aim the stager elsewhere)."""
    _readable(file)
    try:
        info = json.loads(Path(file).read_text(encoding="utf-8"))
        if not isinstance(info, dict) or info.get("type") != "service_account":
            raise ValueError("not a service-account key")
        credentials = loader.from_service_account_info(info, scopes=[scope])
    except (ValueError, UnicodeError):  # JSONDecodeError, a missing field, a bad private key
        raise _not_a_credentials_file("gs", file) from None
    try:
        check_hop(str(info["token_uri"]), networks, pinned=False)
    except FetchError:
        raise FetchError(f"the store credentials file {file}: its token_uri is not a "
                         "destination the fetcher may reach (https, and a public address or "
                         "an allowed network)") from None
    return credentials


def _key_refused(file: Path) -> Callable[[Exception], FetchError]:
    """The token endpoint's refusal of a tenant's key: its type only, never its words (the
    endpoint is named by the file, so its answer is not shown)."""
    def failed(exc: Exception) -> FetchError:
        return FetchError(f"the token endpoint refused the service-account key in {file} "
                          f"({type(exc).__name__})")
    return failed
