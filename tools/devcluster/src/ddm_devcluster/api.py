"""A minimal Kubernetes REST client (stdlib only) for bringing the dev cluster up.

`ddm-dev-cluster up` must work without the ``kubernetes`` package (the operator extra), and it
needs only a handful of calls: health checks, create, get and merge-patch.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.client import HTTPResponse
from pathlib import Path
from typing import Any


class ApiError(RuntimeError):
    """A non-2xx answer; ``status`` is the HTTP code (0 when the server could not be reached)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status


@dataclass(frozen=True)
class Api:
    """Where the API server is and how to authenticate (a bearer token, TLS checked by CA)."""

    server: str
    token: str
    ca_file: Path

    def _open(self, method: str, path: str, body: Any, content_type: str,
              timeout_s: float) -> HTTPResponse:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server + path, data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.token}")
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", content_type)
        context = ssl.create_default_context(cafile=str(self.ca_file))
        try:
            return urllib.request.urlopen(request, timeout=timeout_s, context=context)
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")
            try:
                detail = json.loads(detail).get("message", detail)
            except ValueError:
                pass
            raise ApiError(error.code, detail) from None
        except (urllib.error.URLError, OSError) as error:
            raise ApiError(0, f"{self.server} unreachable: {error}") from None

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        timeout_s: float = 10.0,
    ) -> Any:
        """One call; returns the decoded JSON body (or the text, for /readyz and friends)."""
        with self._open(method, path, body, content_type, timeout_s) as response:
            raw = response.read().decode()
        try:
            return json.loads(raw)
        except ValueError:
            return raw

    def merge_patch(self, path: str, body: Any) -> Any:
        """PATCH with a JSON merge patch (lists in ``body`` replace lists on the server)."""
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")
