"""``ddm serve-checkpoints ROOT``: the DDM's checkpoint stager hands out what it fetched.

The stager's init containers fetch (``ddm fetch-checkpoint``) and verify each remote
checkpoint of a DDM into ``ROOT/<key>``; then this server hands each to the DDM's serving
pods, read-only, as ``GET /<key>.tar`` (``uri.staged_path``): an uncompressed tar of the
checkpoint directory's regular files, which their own ``ddm fetch-checkpoint`` extracts and
verifies again. It never loads a model and never writes; only the stager's pod may reach the
checkpoint stores, so the serving pods need no way out of the cluster
(``ddm.operator.stager``).

Each connection gets ``TIMEOUT_S`` per wait and one request (HTTP/1.0: the end of the body is
the end of the connection, so a cut transfer leaves a truncated tar, which extraction refuses).
"""

from __future__ import annotations

import io
import re
import tarfile
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ddm.checkpoints.format import CONFIG_FILE

#: Seconds a client may take for each read or write before its connection is dropped.
TIMEOUT_S = 60
_PATH = re.compile(r"^/([a-z0-9][-a-z0-9]*)\.tar$")


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
            directory = root / found.group(1) if found else None
            if directory is None or not (directory / CONFIG_FILE).is_file():
                self.send_error(HTTPStatus.NOT_FOUND)
                return
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "application/x-tar")
            self.end_headers()
            if body:
                _write_tar(directory, self.wfile)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def _write_tar(directory: Path, out: io.BufferedIOBase) -> None:
    """The checkpoint's regular files (the fetcher wrote them; nothing else is there)."""
    with tarfile.open(fileobj=out, mode="w|") as tar:
        for file in sorted(directory.iterdir()):
            if file.is_file() and not file.is_symlink():
                tar.add(file, arcname=file.name, recursive=False)


def serve_checkpoints(root: Path, host: str, port: int) -> None:
    """Serve until interrupted (SIGTERM ends the process through the CLI)."""
    if not root.is_dir():
        raise FileNotFoundError(f"no staged checkpoints at {root}")
    with make_server(root, host, port) as server:
        server.serve_forever()
