"""One HTTP(S) GET of a checkpoint file: hop by hop, each to addresses checked first.

``urllib`` resolves names itself, follows redirects anywhere and honours proxy variables, so
the fetcher speaks ``http.client`` over sockets it connects itself:

- every hop (the URL, then each redirect, at most ``max_redirects``) is checked before any
  connection: ``https``, or ``http`` when the bytes are pinned (``pinned``) or the host is
  inside an explicitly allowed network; no ``user:password@``; its host resolved once and
  judged by ``ddm.checkpoints.destinations``; the connection goes to those addresses, with
  TLS verified against the host's name (``SSL_CERT_FILE`` adds a private CA);
- ``headers`` (credentials) go to the first URL's origin only, never to a redirect elsewhere;
- the whole GET ends by ``deadline`` (``time.monotonic()``): a watchdog shuts the socket down
  then, so neither a trickling body nor trickled headers outlive it; ``timeout_s`` bounds
  each wait for bytes;
- the body is streamed to ``out`` with a byte ``limit`` and its SHA-256 computed on the way;
- messages show URLs through ``redact_uri`` and never the server's own words (reason phrases,
  bodies): a status is shown with its standard phrase;
- S3's answer to a request signed for the wrong region (a 301, 400 or 403 naming the bucket's
  region in ``x-amz-bucket-region``, as boto3's ``S3RegionRedirector`` reads it) is a
  ``Refused`` carrying that region, never a redirect followed to another host: the caller
  re-signs for it (``ddm.checkpoints.fetch``).
"""

from __future__ import annotations

import hashlib
import http.client
import re
import socket
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import BinaryIO
from urllib.parse import SplitResult, urljoin, urlsplit

from ddm.checkpoints.destinations import Destination, DestinationRefused, Network, resolve
from ddm.checkpoints.uri import redact_uri

REDIRECTS = frozenset({301, 302, 303, 307, 308})
#: S3's header naming a bucket's region, and the answers that carry it to a request signed for
#: another region (301 PermanentRedirect, 400 AuthorizationHeaderMalformed, 403).
BUCKET_REGION_HEADER = "x-amz-bucket-region"
WRONG_REGION_STATUSES = frozenset({301, 400, 403})
#: What a region looks like (``eu-west-1``, ``us-gov-west-1``): anything else is ignored.
_REGION = re.compile(r"^[a-z]{2}(-[a-z0-9]+){1,3}$")
USER_AGENT = "ddm-fetch-checkpoint"
NOT_FOUND_HINT = ("nothing at this URL: the URI names a checkpoint directory (with config.json "
                  "and weights.safetensors) or a .tar.gz of one")
PRIVATE_HINT = ("the store refused these credentials or needs some: give a headers file "
                "(--headers-file) or a pre-signed https:// URL of a .tar.gz of the checkpoint")
_CHUNK = 1 << 20
#: URLs in messages are cut to this many characters (a redirect's Location is the server's).
_SHOWN = 240


class FetchError(RuntimeError):
    """A checkpoint could not be fetched; the message names the (redacted) URI and why."""


class Retryable(FetchError):
    """A transient failure (5xx, 429, a refused, dropped or timed-out connection)."""


class Refused(FetchError):
    """The store answered 401 or 403, or S3 named the bucket's region: ``refusal`` is the
    status line without a hint; ``region``: the bucket's region S3 named, else None."""

    def __init__(self, message: str, refusal: str, region: str | None = None) -> None:
        super().__init__(message)
        self.refusal = refusal
        self.region = region


@dataclass(frozen=True)
class Received:
    """What a GET wrote: ``size`` bytes whose SHA-256 is ``sha256`` (hex)."""

    size: int
    sha256: str


def shown(url: str) -> str:
    """``url`` as messages show it: redacted, and cut if long."""
    text = redact_uri(url)
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


def get(url: str, out: BinaryIO, *, limit: int, deadline: float, timeout_s: float,
        networks: Sequence[Network], pinned: bool, max_redirects: int,
        headers: Mapping[str, str], hosts: frozenset[str] = frozenset()) -> Received:
    """GET ``url`` into ``out`` (see the module docstring); raises ``FetchError``."""
    origin = _origin(urlsplit(url))
    for _ in range(max_redirects + 1):
        parts, destination = check_hop(url, networks, pinned, hosts)
        sent = dict(headers) if _origin(parts) == origin else {}
        location = _exchange(url, parts, destination, out, sent, limit, deadline, timeout_s)
        if isinstance(location, Received):
            return location
        url = location
    raise FetchError(f"{shown(url)}: more than {max_redirects} redirects")


def check_hop(url: str, networks: Sequence[Network], pinned: bool,
              hosts: frozenset[str] = frozenset()) -> tuple[SplitResult, Destination]:
    """What may be fetched: ``url``'s parts and checked addresses, or ``FetchError``. It only
    resolves the host (an IP literal not even that): nothing connects before it answers.
    ``hosts``: names allowed whatever they resolve to (``destinations.resolve``)."""
    try:
        parts = urlsplit(url)
        port = _port(parts)
    except ValueError:
        raise FetchError(f"{shown(url)}: not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError(f"{shown(url)}: only http(s) URLs with a host are fetched")
    if parts.username is not None or parts.password is not None:
        raise FetchError(f"{shown(url)}: credentials in a URL are refused; give them in a "
                         "headers file (--headers-file) from a Secret")
    try:
        destination = resolve(parts.hostname, port, networks, hosts)
    except DestinationRefused as exc:
        raise FetchError(f"could not fetch {shown(url)}: {exc}") from None
    if parts.scheme == "http" and not (pinned or destination.explicitly_allowed):
        raise FetchError(f"{shown(url)}: plain http is refused unless the download is pinned "
                         "(--sha256) or its host is allowed (--allow-network, --allow-host)")
    return parts, destination


def _exchange(url: str, parts: SplitResult, destination: Destination, out: BinaryIO,
              headers: Mapping[str, str], limit: int, deadline: float, timeout_s: float
              ) -> Received | str:
    """One request on a fresh connection: the body received, or the next URL to try."""
    sock = _connect(url, parts, destination, deadline, timeout_s)
    expired = threading.Event()
    watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), _cut, args=(sock, expired))
    watchdog.daemon = True
    watchdog.start()
    connection = http.client.HTTPConnection(parts.hostname, _port(parts), timeout=timeout_s)
    connection.sock = sock  # already connected to a checked address: never resolved again
    late = FetchError(f"{shown(url)}: the download did not finish by its deadline")
    try:
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        connection.request("GET", path, headers={
            "Host": parts.netloc, "User-Agent": USER_AGENT, "Accept-Encoding": "identity",
            **headers})
        response = connection.getresponse()
        region = bucket_region(response.status, response.getheader(BUCKET_REGION_HEADER))
        if region is not None:
            line = _status_line(url, response.status)
            raise Refused(f"{line} (the bucket is in {region})", line, region)
        if response.status in REDIRECTS:
            location = response.getheader("Location")
            if not location:
                raise FetchError(f"{shown(url)}: HTTP {response.status} without a Location")
            outcome: Received | str = urljoin(url, location.strip()).partition("#")[0]
        elif response.status != 200:
            raise _status_error(url, response.status)
        else:
            outcome = _stream(url, response, out, limit)
    except (OSError, http.client.HTTPException, Retryable) as exc:
        if expired.is_set():
            raise late from None
        if isinstance(exc, Retryable):
            raise
        raise Retryable(f"{shown(url)}: download interrupted ({_reason(exc)})") from None
    finally:
        watchdog.cancel()
        connection.close()
    if expired.is_set():  # a cut socket reads as an end: headers or a body may look complete
        raise late
    return outcome


def _connect(url: str, parts: SplitResult, destination: Destination, deadline: float,
             timeout_s: float) -> socket.socket:
    port = _port(parts)
    problem: OSError | None = None
    for address in destination.addresses:
        wait = min(timeout_s, deadline - time.monotonic())
        if wait <= 0:
            raise FetchError(f"{shown(url)}: the download did not finish by its deadline")
        try:
            sock = socket.create_connection((str(address), port), timeout=wait)
        except OSError as exc:
            problem = exc
            continue
        if parts.scheme != "https":
            return sock
        try:
            return ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
        except ssl.SSLCertVerificationError as exc:
            sock.close()
            raise FetchError(f"{shown(url)}: TLS certificate not trusted "
                             f"({exc.verify_message}); SSL_CERT_FILE names a private CA"
                             ) from None
        except OSError as exc:
            sock.close()
            problem = exc
    raise Retryable(f"{shown(url)}: cannot connect ({_reason(problem)})")


def _stream(url: str, response: http.client.HTTPResponse, out: BinaryIO, limit: int
            ) -> Received:
    declared = response.getheader("Content-Length")
    expected = int(declared) if declared is not None and declared.isdigit() else None
    if expected is not None and expected > limit:
        raise FetchError(f"{shown(url)} is {expected} bytes, over the {limit}-byte limit left "
                         "for this checkpoint")
    digest, size = hashlib.sha256(), 0
    while chunk := response.read1(_CHUNK):  # one socket read at most: the deadline holds
        size += len(chunk)
        if size > limit:
            raise FetchError(f"{shown(url)}: more than the {limit}-byte limit left for this "
                             "checkpoint")
        digest.update(chunk)
        try:
            out.write(chunk)
        except OSError as exc:  # the local disk (full, read-only): not the network's fault
            raise FetchError(f"cannot write the download to disk ({_reason(exc)})") from None
    # http.client ends a body cut short like a complete one when read in chunks: count.
    if expected is not None and size != expected:
        raise Retryable(f"{shown(url)}: download interrupted (got {size} of {expected} bytes)")
    return Received(size, digest.hexdigest())


def bucket_region(status: int, header: str | None) -> str | None:
    """The bucket's region an S3 answer names (``x-amz-bucket-region`` on a 301, 400 or 403),
    or None: no such answer, or a value that is not a region (a peer's words, never shown)."""
    value = (header or "").strip()
    return value if status in WRONG_REGION_STATUSES and _REGION.match(value) else None


def _status_line(url: str, status: int) -> str:
    """``URL: HTTP 403 Forbidden``: the standard phrase, never the server's."""
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
    return f"{shown(url)}: HTTP {status} {phrase}".rstrip()


def _status_error(url: str, status: int) -> FetchError:
    text = _status_line(url, status)
    if status >= 500 or status == 429:
        return Retryable(text)
    if status in (401, 403):
        return Refused(f"{text} ({PRIVATE_HINT})", text)
    return FetchError(text + (f" ({NOT_FOUND_HINT})" if status == 404 else ""))


def _port(parts: SplitResult) -> int:
    return parts.port or (443 if parts.scheme == "https" else 80)


def _origin(parts: SplitResult) -> tuple[str, str, int | None]:
    try:
        return parts.scheme, (parts.hostname or ""), parts.port
    except ValueError:
        return parts.scheme, "", None


def _reason(exc: BaseException | None) -> str:
    """A short reason without the peer's words."""
    if isinstance(exc, socket.timeout):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__


def _cut(sock: socket.socket, expired: threading.Event) -> None:
    """The deadline: wake whatever read is blocked on ``sock`` (the base class's shutdown, not
    an SSL socket's, which would unwrap) and say so: what was read since is not trusted."""
    expired.set()
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass
