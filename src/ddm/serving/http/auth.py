"""Optional bearer-token authentication for the router's API (``auth: {token_file: PATH}``)
and for the experts' (``ddm serve expert --auth-token-file``: the same per-DDM token, which
the router sends them).

When on, every ``/v1/*`` request needs ``Authorization: Bearer <token>``; the probes
(``/healthz``, ``/readyz``), ``/metrics``, the web page at ``/`` (which asks for the token
itself) and the API docs stay open. The token is compared in constant time
(``hmac.compare_digest``), never logged and never echoed: a refusal says only what is wrong
(no header, another scheme, a token that does not match).

The token lives in a file, a Kubernetes Secret mounted into the pod. The kubelet replaces
such files in place when the Secret changes, so the file is re-read whenever its
modification time, size or inode changes: one ``stat`` per request.
"""

from __future__ import annotations

import hmac
import logging
import os
import re
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from ddm.serving.http.server import header, send_json

logger = logging.getLogger(__name__)

#: Paths that need the token: the API, and the data the web page fetches.
PROTECTED_PREFIX = "/v1/"
CHALLENGE = b'Bearer realm="ddm"'
MISSING = "missing Authorization header; send Authorization: Bearer <token>"
WRONG_SCHEME = "the Authorization scheme must be Bearer"
BAD_TOKEN = "bad token"
#: RFC 6750's b64token: what ``secrets.token_urlsafe`` (the operator's tokens) makes.
_TOKEN = re.compile(rb"[A-Za-z0-9\-._~+/]+=*")


class TokenFileError(ValueError):
    """The token file cannot serve as a token: missing, unreadable or empty."""


class TokenFile:
    """The token in ``path`` (surrounding whitespace stripped), re-read when the file changes.

    A file that becomes unreadable or empty after start-up keeps the last good token (and is
    logged once), so that a Secret being rotated never opens the API nor locks everyone out.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        #: The file's (mtime, size, inode) and the token read from it, replaced as one: an
        #: expert's event loops (:mod:`ddm.serving.http.server`) call :meth:`token` from two
        #: threads, and a stamp kept apart from its token could pair a newer file's stamp with an
        #: older read's token, which would then never be re-read.
        self._state: tuple[tuple[int, int, int], bytes] = self._read()
        self._warned = False

    def token(self) -> bytes:
        """The current token, re-read if the file changed since the last call."""
        state = self._state
        try:
            stat = os.stat(self.path)
            if (stat.st_mtime_ns, stat.st_size, stat.st_ino) != state[0]:
                self._state = state = self._read()
                self._warned = False
        except (OSError, TokenFileError) as error:
            if not self._warned:
                logger.warning("keeping the previous API token: %s", error)
                self._warned = True
        return state[1]

    def _read(self) -> tuple[tuple[int, int, int], bytes]:
        """The file's stamp and its token."""
        try:
            stat = os.stat(self.path)
            token = self.path.read_bytes().strip()
        except OSError as error:
            raise TokenFileError(f"auth.token_file {self.path}: {error.strerror}") from None
        if not token:
            raise TokenFileError(f"auth.token_file {self.path} is empty")
        if not _TOKEN.fullmatch(token):  # it goes into headers sent to the experts
            raise TokenFileError(f"auth.token_file {self.path} is not a bearer token (letters, "
                                 f"digits and -._~+/, then any '=')")
        return (stat.st_mtime_ns, stat.st_size, stat.st_ino), token


def check_authorization(header: bytes | None, token: bytes) -> str | None:
    """None when ``header`` (the raw ``Authorization`` value) carries ``token``, else what is
    wrong, in words that never include the header's value."""
    if header is None:
        return MISSING
    scheme, _, credentials = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return WRONG_SCHEME
    if not hmac.compare_digest(credentials.strip(), token):
        return BAD_TOKEN
    return None


class BearerAuth:
    """ASGI middleware refusing ``/v1/*`` requests without the token with a 401."""

    def __init__(self, app: ASGIApp, tokens: TokenFile) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIX):
            await self.app(scope, receive, send)
            return
        problem = check_authorization(header(scope, b"authorization"), self.tokens.token())
        if problem is None:
            await self.app(scope, receive, send)
            return
        # RFC 6750: only a presented token that fails gets an error code in the challenge.
        challenge = CHALLENGE + b', error="invalid_token"' if problem == BAD_TOKEN else CHALLENGE
        await send_json(send, 401, {"detail": problem}, [(b"www-authenticate", challenge)])
