"""``fetch_json``: every small JSON read has a deadline and a cap, against a real HTTP server
on loopback that answers too much, too slowly, with an error or with something else than
JSON; ``ddm sample --router``'s reads (``router_info``) go through it."""

from __future__ import annotations

import http.server
import json
import threading
from typing import Callable, Iterator

import pytest

from ddm.serving.http.fetch import FetchError, fetch_json
from ddm.serving.router.api.client import MAX_INFO_BYTES, router_info

#: What the hostile peer offers: far over any cap.
HUGE_BYTES = 100 * 1024 * 1024
_MIB = b"a" * (1024 * 1024)

Handler = Callable[[http.server.BaseHTTPRequestHandler], None]


class _Peer:
    """A loopback HTTP server answering every request with ``handler``; ``sent`` counts the
    body bytes it managed to write, ``done`` is set once its answer ended."""

    def __init__(self, handler: Handler) -> None:
        self.sent = 0
        self.done = threading.Event()
        self.release = threading.Event()  # a stalled answer waits for it
        self.seen: list[dict[str, str]] = []
        peer = self

        class _Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                peer.seen.append(dict(self.headers))
                try:
                    handler(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client stopped reading: what the cap is for
                finally:
                    peer.done.set()

            do_POST = do_GET  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stream(self, request: http.server.BaseHTTPRequestHandler, total: int) -> None:
        """A JSON string of ``total`` bytes, closing the connection to end it (no length)."""
        request.wfile.write(b'{"x": "')
        while self.sent < total:
            request.wfile.write(_MIB)
            self.sent += len(_MIB)
        request.wfile.write(b'"}')

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[[Handler], _Peer]]:
    peers: list[_Peer] = []

    def start(handler: Handler) -> _Peer:
        peers.append(_Peer(handler))
        return peers[-1]

    yield start
    for peer in peers:
        peer.close()


def _head(request: http.server.BaseHTTPRequestHandler, status: int = 200,
          length: int | None = None) -> None:
    request.send_response(status)
    request.send_header("Content-Type", "application/json")
    if length is not None:
        request.send_header("Content-Length", str(length))
    else:
        request.send_header("Connection", "close")
    request.end_headers()


def test_a_100_mib_reply_stops_at_the_cap_with_an_error_naming_it(serve) -> None:
    peer = serve(lambda r: (_head(r), peer.stream(r, HUGE_BYTES)))
    with pytest.raises(FetchError, match=f"over the {MAX_INFO_BYTES}-byte cap"):
        router_info(peer.url)
    assert peer.done.wait(30)
    assert peer.sent < HUGE_BYTES  # the client hung up near the cap, not at the end


def test_a_declared_100_mib_reply_is_refused_before_its_body_is_read(serve) -> None:
    peer = serve(lambda r: (_head(r, length=HUGE_BYTES + 9), peer.stream(r, HUGE_BYTES)))
    with pytest.raises(FetchError, match=f"declared a reply of {HUGE_BYTES + 9} bytes, over "
                                         "the 1024-byte cap"):
        fetch_json(peer.url + "/v1/info", deadline=30, cap=1024)
    assert peer.done.wait(30)
    assert peer.sent < HUGE_BYTES


def test_a_reply_that_stalls_ends_at_the_deadline(serve) -> None:
    def stall(request: http.server.BaseHTTPRequestHandler) -> None:
        _head(request, length=100)
        request.wfile.write(b"{")
        request.wfile.flush()
        peer.release.wait(60)

    peer = serve(stall)
    with pytest.raises(FetchError, match="did not answer within 0.5 s"):
        fetch_json(peer.url + "/readyz", deadline=0.5, cap=1024)


def test_errors_name_the_status_and_the_peers_detail_and_json_is_checked(serve) -> None:
    def answer(request: http.server.BaseHTTPRequestHandler) -> None:
        body = (json.dumps({"detail": "labels: 12 is not a class"}).encode()
                if request.path == "/refused" else b"<html>" if request.path == "/page"
                else json.dumps({"ok": True}).encode())
        _head(request, 422 if request.path == "/refused" else 200, len(body))
        request.wfile.write(body)

    peer = serve(answer)
    with pytest.raises(FetchError, match="/refused answered 422: labels: 12 is not a class") \
            as refused:
        fetch_json(peer.url + "/refused", deadline=30, cap=1024, body={"labels": [12]})
    assert refused.value.status == 422
    with pytest.raises(FetchError, match="/page sent a reply that is not JSON"):
        fetch_json(peer.url + "/page", deadline=30, cap=1024)
    assert fetch_json(peer.url + "/ok", deadline=30, cap=1024, token="t0k") == {"ok": True}
    assert peer.seen[-1]["Authorization"] == "Bearer t0k"


def test_an_unreachable_peer_and_a_bad_url_are_named() -> None:
    with pytest.raises(FetchError, match="could not be reached"):
        fetch_json("http://127.0.0.1:9/v1/info", deadline=5, cap=1024)  # discard: closed
    with pytest.raises(FetchError, match="is not an http:// or https:// URL"):
        fetch_json("file:///etc/passwd", deadline=5, cap=1024)
