"""``ddm serve-checkpoints ROOT``: the DDM's checkpoint stager hands out what it fetched.

The stager's init containers fetch (``ddm fetch-checkpoint``) and verify each remote
checkpoint of a DDM into ``ROOT/<key>``; then this server hands each to the DDM's serving pods,
read-only, as a checkpoint directory URI (``uri.staged_path``: ``GET /<key>/config.json``,
``/<key>/weights.safetensors``, an exported program), which their own ``ddm fetch-checkpoint``
copies and verifies again. Only regular files directly in a staged checkpoint are served, with
their length; no listing, no link, nothing hidden. It never loads a model and never writes;
only the stager's pod may reach the checkpoint stores, so the serving pods need no way out of
the cluster (``ddm.operator.fetcher``).

Each connection gets ``TIMEOUT_S`` per wait and one request.
"""

from __future__ import annotations

import os
import re
import shutil
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ddm.checkpoints.format import CONFIG_FILE

_CHUNK = 1 << 20
#: Seconds a client may take for each read or write before its connection is dropped.
TIMEOUT_S = 60
_PATH = re.compile(r"^/([a-z0-9][-a-z0-9]*)/([A-Za-z0-9_][-A-Za-z0-9_.]*)$")


def make_server(root: Path, host: str, port: int) -> ThreadingHTTPServer:
    """A server (not yet serving) of the checkpoints under ``root``."""

    class Handler(BaseHTTPRequestHandler):
        timeout = TIMEOUT_S
        server_version = "ddm-stager"
        sys_version = ""

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, *, body: bool) -> None:
            found = _PATH.match(self.path)
            file = root.joinpath(*found.groups()) if found else None
            if file is None or file.is_symlink() or not file.is_file() or not (
                    file.parent / CONFIG_FILE).is_file():
                self.send_error(HTTPStatus.NOT_FOUND)
                return
            with open(file, "rb") as source:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(os.fstat(source.fileno()).st_size))
                self.end_headers()
                if body:
                    shutil.copyfileobj(source, self.wfile, _CHUNK)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def serve_checkpoints(root: Path, host: str, port: int) -> None:
    """Serve until interrupted (SIGTERM ends the process through the CLI)."""
    if not root.is_dir():
        raise FileNotFoundError(f"no staged checkpoints at {root}")
    with make_server(root, host, port) as server:
        server.serve_forever()
