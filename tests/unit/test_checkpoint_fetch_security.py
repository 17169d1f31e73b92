"""The checkpoint fetcher under a hostile URI or store: real HTTP(S) servers on loopback.

The stand-ins for what a fetcher inside a cluster must never reach (the cloud metadata
service, the node's loopback) are listening sockets on 127.0.0.2 and ::1; "no connection
reached it" means the kernel queued none on them (a completed handshake waits in the backlog
even unaccepted). The store itself is on 127.0.0.1, allowed explicitly as an on-prem store is.
"""

from __future__ import annotations

import hashlib
import io
import ipaddress
import json
import socket
import ssl
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ddm.checkpoints.destinations import (METADATA_ADDRESSES, METADATA_HOSTS, REFUSED,
                                          DestinationRefused, check_addresses, is_allowed,
                                          parse_networks, resolve)
from ddm.checkpoints.download import check_hop
from ddm.checkpoints.fetch import (FetchError, FetchPolicy, fetch_checkpoint, parse_sha256,
                                   read_headers_file)
from ddm.checkpoints.format import CONFIG_FILE, WEIGHTS_FILE, load_checkpoint
from ddm.checkpoints.uri import redact_uri
from ddm.cli import main

STORE = parse_networks(["127.0.0.1/32"])
FAST = FetchPolicy(timeout_s=5.0, attempts=2, backoff_s=0.01, allowed_networks=STORE)
#: The CLI runs here: its termination message goes to a temporary file, never the host's /dev.
pytestmark = pytest.mark.usefixtures("termination_log")
SECRET = "SIGd41d8cd98f00b204e9800998ecf8427e"
PRESIGNED = f"?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIA&X-Amz-Signature={SECRET}"
EVERYTHING = parse_networks(["0.0.0.0/0", "::/0"])


# -- redact_uri: the one function every message, event and status shows URIs through ----------

@pytest.mark.parametrize("uri, shown", [
    (f"https://b.s3.amazonaws.com/m/x.tar.gz{PRESIGNED}", "https://b.s3.amazonaws.com/m/x.tar.gz"),
    (f"https://user:{SECRET}@store:8443/m/x#{SECRET}", "https://store:8443/m/x"),
    (f"https://{SECRET}@[::1]:9/x", "https://[::1]:9/x"),
    (f"https://a@b:{SECRET}@h/x", "https://h/x"),
    (f"https://h?sig={SECRET}", "https://h"),
    (f"https://h/p#{SECRET}?q", "https://h/p"),
    ("s3://bucket/key/x.tar.gz", "s3://bucket/key/x.tar.gz"),
    ("gs://bucket/key", "gs://bucket/key"),
    ("pvc://claim/sub/dir", "pvc://claim/sub/dir"),
    ("image:///models/expert", "image:///models/expert"),
    (f"not a uri?{SECRET}", "not a uri"),
])
def test_redact_uri_drops_query_fragment_and_userinfo_and_keeps_the_object(uri, shown):
    assert redact_uri(uri) == shown
    assert SECRET not in redact_uri(uri)
    assert redact_uri(redact_uri(uri)) == shown  # idempotent: safe to apply twice


# -- destinations: the address rules, as pure functions ----------------------------------------

def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.0.0.2", "::1", "0.0.0.0", "::", "10.1.2.3", "172.16.0.1", "192.168.1.1",
    "100.64.0.1", "198.18.0.1", "192.0.2.1", "169.254.1.1", "fe80::1", "fe80::1%lo", "fc00::1",
    "224.0.0.1", "ff02::1", "255.255.255.255",
    "::ffff:127.0.0.1", "::ffff:10.0.0.1",  # IPv4-mapped
    "::a9fe:a9fe", "::7f00:1",               # IPv4-compatible 169.254.169.254, 127.0.0.1
    "2002:a9fe:a9fe::1", "2002:7f00:1::1",   # 6to4
    "64:ff9b::a9fe:a9fe", "64:ff9b::a00:1",  # NAT64
])
def test_non_public_addresses_are_refused_unless_allowed(address):
    assert not is_allowed(_ip(address), ())


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2001:4860:4860::8888",
                                     "2606:4700:4700::1111"])
def test_public_addresses_are_allowed(address):
    assert is_allowed(_ip(address), ())


@pytest.mark.parametrize("address", sorted(map(str, METADATA_ADDRESSES))
                         + ["::ffff:169.254.169.254", "64:ff9b::a9fe:a9fe"])
def test_metadata_addresses_stay_refused_whatever_is_allowed(address):
    assert not is_allowed(_ip(address), EVERYTHING)


def test_an_allowed_network_opens_exactly_itself():
    store = parse_networks(["10.0.3.7/32"])
    assert is_allowed(_ip("10.0.3.7"), store)
    assert is_allowed(_ip("::ffff:10.0.3.7"), store)
    assert not is_allowed(_ip("10.0.3.8"), store)
    assert check_addresses([_ip("10.0.3.7")], store).explicitly_allowed
    assert not check_addresses([_ip("8.8.8.8")], store).explicitly_allowed


def test_a_name_with_one_private_address_among_public_ones_is_refused_whole():
    with pytest.raises(DestinationRefused, match=REFUSED):
        check_addresses([_ip("8.8.8.8"), _ip("10.0.0.1")], ())


@pytest.mark.parametrize("cidr, problem", [
    ("10.0.0.1/8", "has host bits set"),
    ("store.local", "does not appear to be an IPv4 or IPv6 network")])
def test_allowed_networks_are_cidrs(cidr, problem):
    with pytest.raises(ValueError, match=rf"{cidr!r} is not an address or a CIDR.*{problem}"):
        parse_networks([cidr])


@pytest.mark.parametrize("host", sorted(METADATA_HOSTS) + ["METADATA.Google.Internal."])
def test_metadata_names_are_refused_before_any_lookup(host):
    with pytest.raises(DestinationRefused):
        resolve(host, 80, EVERYTHING)


@pytest.mark.parametrize("host", ["localhost", "127.1", "2130706433", "[::1]"])
def test_names_and_numeric_forms_are_judged_by_what_they_resolve_to(host):
    with pytest.raises(DestinationRefused):
        resolve(host, 80, ())
    assert resolve(host, 80, parse_networks(["127.0.0.0/8", "::1/128"])).explicitly_allowed


def test_a_host_allowed_by_name_may_be_private_but_never_metadata():
    """The DDM's stager: a Service name whose address the operator cannot know in advance."""
    stager = resolve("LocalHost.", 80, (), {"localhost"})
    assert stager.explicitly_allowed and stager.addresses
    with pytest.raises(DestinationRefused):
        resolve("localhost.evil.test", 80, (), {"localhost"})
    for metadata in ("metadata.google.internal", "169.254.169.254"):
        with pytest.raises(DestinationRefused):
            resolve(metadata, 80, (), {metadata})
    assert check_hop("http://localhost:8070/expert-a", (), pinned=False,
                     hosts=frozenset({"localhost"}))


# -- check_hop: what may be fetched, decided before any connection -----------------------------

def test_plain_http_to_a_public_host_needs_a_pin():
    with pytest.raises(FetchError, match=r"http://8.8.8.8/m.tar.gz: plain http is refused "
                                         r"unless the download is pinned \(--sha256\)"):
        check_hop("http://8.8.8.8/m.tar.gz", (), pinned=False)
    assert check_hop("http://8.8.8.8/m.tar.gz", (), pinned=True)[1].addresses == (_ip("8.8.8.8"),)
    assert check_hop("https://8.8.8.8/m.tar.gz", (), pinned=False)


@pytest.mark.parametrize("url, problem", [
    (f"https://user:{SECRET}@8.8.8.8/m.tar.gz", "credentials in a URL are refused"),
    ("ftp://8.8.8.8/m.tar.gz", "only http"),
    ("https://8.8.8.8:99999/m", "not a valid URL"),
])
def test_hops_that_are_not_plain_urls_are_refused(url, problem):
    with pytest.raises(FetchError, match=problem) as caught:
        check_hop(url, (), pinned=True)
    assert SECRET not in str(caught.value)


# -- loopback servers: the store, and sentinels that must see no connection --------------------

class Store:
    """A loopback HTTP(S) store: ``files`` by path, ``redirects`` (path -> Location),
    ``trickle`` paths (a slow body or slow headers); records each request's path and headers
    and counts connections."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.redirects: dict[str, str] = {}
        self.trickle: dict[str, str] = {}
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.connections = 0
        self.release = threading.Event()
        self.url = ""
        self.port = 0


def _store_handler(store: Store) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            store.requests.append((self.path, dict(self.headers)))
            path = self.path.partition("?")[0]
            if path in store.redirects:
                self.send_response(302)
                self.send_header("Location", store.redirects[path])
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif store.trickle.get(path) == "body":
                self.send_response(200)
                self.send_header("Content-Length", str(1 << 20))
                self.end_headers()
                self._drip(b"x")
            elif store.trickle.get(path) == "headers":
                self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                self._drip(b"X-Slow: y\r\n")
            elif path in store.files:
                body = store.files[path]
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_error(404)

        def _drip(self, data: bytes) -> None:
            """A byte every 20 ms until the test ends: each read is quick, the whole never."""
            try:
                while not store.release.wait(0.02):
                    self.wfile.write(data[:1])
                    self.wfile.flush()
                    data = data[1:] + data[:1]
            except OSError:
                pass

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


class _CountingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], store: Store,
                 context: ssl.SSLContext | None) -> None:
        self.store, self.context = store, context
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, _store_handler(store))

    def verify_request(self, request: object, client_address: object) -> bool:
        self.store.connections += 1
        return True

    def get_request(self) -> tuple[socket.socket, object]:
        sock, address = super().get_request()
        if self.context is not None:
            sock = self.context.wrap_socket(sock, server_side=True)
        return sock, address


@pytest.fixture
def serve() -> Iterator[Callable[..., Store]]:
    """Start stores (``serve(context=None, host="127.0.0.1")``); stopped when the test ends."""
    started: list[tuple[_CountingServer, threading.Thread]] = []

    def start(context: ssl.SSLContext | None = None, host: str = "127.0.0.1") -> Store:
        store = Store()
        server = _CountingServer((host, 0), store, context)
        store.port = server.server_address[1]
        netloc = f"[{host}]" if ":" in host else host
        store.url = f"{'https' if context else 'http'}://{netloc}:{store.port}"
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                  daemon=True)
        thread.start()
        started.append((server, thread))
        return store

    yield start
    for server, thread in started:
        server.store.release.set()
        server.shutdown()
        server.server_close()
        thread.join()


class Sentinel:
    """A listening socket standing in for a metadata service or a node-local port."""

    def __init__(self, host: str) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(8)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.netloc = f"[{host}]:{self.port}" if family == socket.AF_INET6 else \
            f"{host}:{self.port}"

    def connections(self) -> int:
        count = 0
        while True:
            try:
                peer, _ = self.sock.accept()
            except BlockingIOError:
                return count
            peer.close()
            count += 1


@pytest.fixture
def sentinels() -> Iterator[dict[str, Sentinel]]:
    made = {"127.0.0.2": Sentinel("127.0.0.2"), "::1": Sentinel("::1")}
    yield made
    for sentinel in made.values():
        sentinel.sock.close()


@pytest.fixture
def archive(smoke_expert_checkpoint) -> bytes:
    """The smoke checkpoint as a .tar.gz."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            tar.add(smoke_expert_checkpoint / name, arcname=name)
    return buffer.getvalue()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- destinations on the wire ------------------------------------------------------------------

def test_a_loopback_store_is_refused_without_a_connection_unless_allowed(serve, archive,
                                                                         tmp_path):
    store = serve()
    store.files["/m.tar.gz"] = archive
    uri = f"{store.url}/m.tar.gz"
    policy = FetchPolicy(timeout_s=5.0, attempts=2, backoff_s=0.01)
    with pytest.raises(FetchError) as caught:
        fetch_checkpoint(uri, tmp_path / "expert", policy)
    assert str(caught.value) == f"{uri}: could not fetch {uri}: {REFUSED}"
    assert store.connections == 0 and not (tmp_path / "expert").exists()
    fetch_checkpoint(uri, tmp_path / "expert", FAST)
    assert load_checkpoint(tmp_path / "expert").meta.name == "smoke-torch"


def test_an_ipv6_store_is_reached_at_the_address_checked(serve, archive, tmp_path):
    store = serve(host="::1")
    store.files["/m.tar.gz"] = archive
    with pytest.raises(FetchError, match=REFUSED):
        fetch_checkpoint(f"{store.url}/m.tar.gz", tmp_path / "refused", FAST)
    policy = FetchPolicy(timeout_s=5.0, attempts=1, allowed_networks=parse_networks(["::1"]))
    fetch_checkpoint(f"{store.url}/m.tar.gz", tmp_path / "expert", policy)
    [(_, sent)] = store.requests
    assert sent["Host"] == f"[::1]:{store.port}" and store.connections == 1


@pytest.mark.parametrize("location", [
    "http://{v4}/latest/meta-data/iam/security-credentials/",
    "http://{v6}/computeMetadata/v1/instance/service-accounts/default/token",
    "http://[::ffff:127.0.0.2]:{v4port}/latest/meta-data/iam/",  # IPv4-mapped
    "http://2130706434:{v4port}/latest/meta-data/iam/",           # 127.0.0.2 as one number
    "http://169.254.169.254/latest/meta-data/iam/",
    "http://[fd00:ec2::254]/latest/meta-data/iam/",
    "http://metadata.google.internal/computeMetadata/v1/",
    "https://{v4}/latest/meta-data/iam/",
])
def test_a_redirect_to_loopback_link_local_or_metadata_is_refused_without_a_connection(
        serve, sentinels, tmp_path, location):
    store = serve()
    v4, v6 = sentinels["127.0.0.2"], sentinels["::1"]
    target = location.format(v4=v4.netloc, v6=v6.netloc, v4port=v4.port) + f"?token={SECRET}"
    store.redirects["/m.tar.gz"] = target
    uri = f"{store.url}/m.tar.gz{PRESIGNED}"
    # even with the link-local and ULA ranges allowed, metadata stays out of reach
    policy = FetchPolicy(timeout_s=5.0, attempts=2, backoff_s=0.01, allowed_networks=(
        *STORE, *parse_networks(["169.254.0.0/16", "fd00::/8"])))
    started = time.monotonic()
    with pytest.raises(FetchError) as caught:
        fetch_checkpoint(uri, tmp_path / "expert", policy)
    message = str(caught.value)
    assert message == f"{store.url}/m.tar.gz: could not fetch {redact_uri(target)}: {REFUSED}"
    assert SECRET not in message
    assert v4.connections() == 0 and v6.connections() == 0
    assert len(store.requests) == 1  # refused, not retried
    assert time.monotonic() - started < FAST.timeout_s  # never waited on a connection


def test_refusals_read_the_same_whether_something_listens_or_not(serve, sentinels, tmp_path):
    """No port-scan oracle: an open port, a closed one and a metadata address look alike."""
    store = serve()
    closed = socket.socket()
    closed.bind(("127.0.0.2", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    messages = set()
    for target in (f"http://{sentinels['127.0.0.2'].netloc}/x", f"http://127.0.0.2:{closed_port}/x",
                   "http://169.254.169.254/x", "http://10.255.0.1:22/x"):
        store.redirects["/m.tar.gz"] = target
        with pytest.raises(FetchError) as caught:
            fetch_checkpoint(f"{store.url}/m.tar.gz", tmp_path / "expert", FAST)
        messages.add(str(caught.value).replace(target, "TARGET"))
    assert messages == {f"{store.url}/m.tar.gz: could not fetch TARGET: {REFUSED}"}
    assert sentinels["127.0.0.2"].connections() == 0


def test_redirects_within_the_rules_are_followed_and_capped(serve, archive, tmp_path):
    store = serve()
    store.files["/blobs/m.tar.gz"] = archive
    store.redirects["/m.tar.gz"] = "/blobs/m.tar.gz"  # relative, same host
    fetch_checkpoint(f"{store.url}/m.tar.gz", tmp_path / "expert", FAST)
    assert [path for path, _ in store.requests] == ["/m.tar.gz", "/blobs/m.tar.gz"]

    store.requests.clear()
    store.redirects["/loop.tar.gz"] = f"{store.url}/loop.tar.gz"
    with pytest.raises(FetchError, match=r"/loop.tar.gz: more than 5 redirects"):
        fetch_checkpoint(f"{store.url}/loop.tar.gz", tmp_path / "loop", FAST)
    assert len(store.requests) == 6  # the request and five redirects, not retried


def test_credentials_go_to_the_store_and_not_to_where_it_redirects(serve, archive, tmp_path):
    store, elsewhere = serve(), serve()
    elsewhere.files["/m.tar.gz"] = archive
    store.redirects["/m.tar.gz"] = f"{elsewhere.url}/m.tar.gz"
    secret = tmp_path / "headers"
    secret.write_text(f"# from a Secret\nAuthorization: Bearer {SECRET}\n\nX-Tenant: t1\n")
    headers = read_headers_file(secret)
    assert headers == {"Authorization": f"Bearer {SECRET}", "X-Tenant": "t1"}
    fetch_checkpoint(f"{store.url}/m.tar.gz", tmp_path / "expert", FAST, headers=headers)
    [(_, sent)] = store.requests
    [(_, forwarded)] = elsewhere.requests
    assert sent["Authorization"] == f"Bearer {SECRET}" and sent["X-Tenant"] == "t1"
    assert "Authorization" not in forwarded and "X-Tenant" not in forwarded
    assert forwarded["Host"] == f"127.0.0.1:{elsewhere.port}"


@pytest.mark.parametrize("line, problem", [
    (f"Authorization Bearer {SECRET}", "line 2: is not 'Name: value'"),
    (f"Host: {SECRET}", "line 2: sets Host, which the fetcher sets itself"),
    (f"X-Token: {SECRET}\x01", "line 2: has a control or non-ASCII character in its value"),
    (f"X-Token: {SECRET}\u2019", "line 2: has a control or non-ASCII character in its value"),
])
def test_a_bad_headers_file_names_the_line_and_never_the_value(tmp_path, line, problem):
    path = tmp_path / "headers"
    path.write_text(f"X-Ok: 1\n{line}\n")
    with pytest.raises(FetchError, match=problem) as caught:
        read_headers_file(path)
    assert SECRET not in str(caught.value)


def test_credentials_in_the_uri_are_refused_without_a_connection(serve, tmp_path):
    store = serve()
    uri = f"http://user:{SECRET}@127.0.0.1:{store.port}/m.tar.gz"
    with pytest.raises(FetchError, match="credentials in a URL are refused") as caught:
        fetch_checkpoint(uri, tmp_path / "expert", FAST)
    assert SECRET not in str(caught.value) and store.connections == 0


# -- pinned bytes ------------------------------------------------------------------------------

def test_a_pinned_archive_is_checked_against_the_bytes_received(serve, archive, tmp_path):
    store = serve()
    store.files["/m.tar.gz"] = archive
    fetch_checkpoint(f"{store.url}/m.tar.gz", tmp_path / "a", FAST,
                     sha256=f"sha256:{_sha(archive).upper()}")
    other = "0" * 64
    with pytest.raises(FetchError, match=rf"/m.tar.gz: sha256 {_sha(archive)} does not match "
                                         rf"the pinned {other}"):
        fetch_checkpoint(f"{store.url}/m.tar.gz", tmp_path / "b", FAST, sha256=other)
    assert not (tmp_path / "b").exists()
    assert len(store.requests) == 2  # a mismatch is not retried


def test_a_directory_is_pinned_by_its_config_which_pins_the_weights(
        serve, smoke_expert_checkpoint, tmp_path):
    """A config rewritten in transit (other classes, same weights) passes the checkpoint's own
    checksum; only the pin catches it."""
    store = serve()
    config = (smoke_expert_checkpoint / CONFIG_FILE).read_bytes()
    store.files["/d/weights.safetensors"] = (smoke_expert_checkpoint / WEIGHTS_FILE).read_bytes()
    forged = json.loads(config)
    forged["classes"] = [5, 6, 7, 8, 9]
    store.files["/d/config.json"] = json.dumps(forged).encode()
    fetch_checkpoint(f"{store.url}/d", tmp_path / "unpinned", FAST)
    assert load_checkpoint(tmp_path / "unpinned").meta.classes == (5, 6, 7, 8, 9)
    with pytest.raises(FetchError, match=r"/d/config.json: sha256 .* does not match the pinned"):
        fetch_checkpoint(f"{store.url}/d", tmp_path / "pinned", FAST, sha256=_sha(config))
    assert not (tmp_path / "pinned").exists()
    assert [p for p, _ in store.requests][-1] == "/d/config.json"  # weights never downloaded
    store.files["/d/config.json"] = config
    fetch_checkpoint(f"{store.url}/d", tmp_path / "pinned", FAST, sha256=_sha(config))
    assert load_checkpoint(tmp_path / "pinned").meta.classes == (0, 1, 2, 3, 4)


@pytest.mark.parametrize("pin", ["abc", "sha1:" + "0" * 40, "g" * 64])
def test_a_malformed_pin_is_named(pin):
    with pytest.raises(FetchError, match="the pinned sha256 must be 64 hexadecimal digits"):
        parse_sha256(pin)


# -- bounds: the whole download's deadline, the archive's entries -----------------------------

@pytest.mark.parametrize("trickle", ["body", "headers"])
def test_the_deadline_bounds_the_whole_download_not_each_read(serve, tmp_path, trickle):
    store = serve()
    store.trickle["/m.tar.gz"] = trickle
    policy = FetchPolicy(timeout_s=30.0, deadline_s=0.5, attempts=5, backoff_s=0.01,
                         allowed_networks=STORE)
    started = time.monotonic()
    with pytest.raises(FetchError, match=r"/m.tar.gz: the download did not finish by its "
                                         "deadline"):
        fetch_checkpoint(f"{store.url}/m.tar.gz", tmp_path / "expert", policy)
    # every read got a byte within 20 ms: only the deadline could end it, long before one
    # per-read timeout (30 s)
    assert time.monotonic() - started < 5.0
    assert len(store.requests) == 1 and not (tmp_path / "expert").exists()


def test_an_archive_with_too_many_entries_is_refused(serve, tmp_path):
    store = serve()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for index in range(FAST.max_entries + 1):
            tar.addfile(tarfile.TarInfo(f"f{index}"), io.BytesIO(b""))
    store.files["/many.tar.gz"] = buffer.getvalue()
    with pytest.raises(FetchError, match=rf"holds more than {FAST.max_entries} entries"):
        fetch_checkpoint(f"{store.url}/many.tar.gz", tmp_path / "expert", FAST)
    assert list(tmp_path.iterdir()) == []


# -- TLS: https on loopback with a private CA --------------------------------------------------

@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (the test's own CA)."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
                    "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def test_https_is_verified_and_a_pinned_http_store_may_redirect_to_it(
        serve, archive, certificate, tmp_path, monkeypatch):
    cert, key = certificate
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    secure, plain = serve(context), serve()
    secure.files["/m.tar.gz"] = archive
    uri = f"{secure.url}/m.tar.gz"
    with pytest.raises(FetchError, match=r"TLS certificate not trusted.*SSL_CERT_FILE"):
        fetch_checkpoint(uri, tmp_path / "untrusted", FAST)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    fetch_checkpoint(uri, tmp_path / "trusted", FAST)
    plain.redirects["/m.tar.gz"] = uri
    fetch_checkpoint(f"{plain.url}/m.tar.gz", tmp_path / "redirected", FAST,
                     sha256=_sha(archive))
    assert load_checkpoint(tmp_path / "redirected").meta.name == "smoke-torch"


# -- a secret in the URI is never shown ------------------------------------------------------

def test_a_presigned_signature_appears_in_no_output_and_no_termination_message(
        serve, archive, tmp_path, capsys, termination_log, monkeypatch):
    store = serve()
    store.files["/m.tar.gz"] = archive
    store.redirects["/away.tar.gz"] = f"http://169.254.169.254/x?{SECRET}"
    allow = ["--allow-network", "127.0.0.1/32"]
    runs = [
        [f"{store.url}/missing.tar.gz{PRESIGNED}", str(tmp_path / "a"), *allow],  # HTTP 404
        [f"{store.url}/away.tar.gz{PRESIGNED}", str(tmp_path / "b"), *allow],     # refused
        [f"{store.url}/m.tar.gz{PRESIGNED}", str(tmp_path / "c")],                # not allowed
        [f"{store.url}/m .tar.gz{PRESIGNED}", str(tmp_path / "d"), *allow],       # not a URI
        [f"{store.url}/m.tar.gz{PRESIGNED}", str(tmp_path / "e"), *allow, "--sha256", "0" * 64],
        [f"{store.url}/m.tar.gz{PRESIGNED}", str(tmp_path / "f"), *allow],        # fetched
    ]
    statuses = []
    for args in runs:
        termination_log.unlink(missing_ok=True)
        statuses.append(main(["fetch-checkpoint", *args]))
        captured = capsys.readouterr()
        shown = captured.out + captured.err + (termination_log.read_text()
                                               if termination_log.exists() else "")
        assert SECRET not in shown and "X-Amz-Credential" not in shown, shown
        assert shown.strip(), args
    assert statuses == [1, 1, 1, 1, 1, 0]  # failures (exit 1), then the success
    assert load_checkpoint(tmp_path / "f").meta.name == "smoke-torch"
    # the URI from the environment (a Secret), not the command line
    monkeypatch.setenv("DDM_CHECKPOINT_URI", f"{store.url}/m.tar.gz{PRESIGNED}")
    assert main(["fetch-checkpoint", str(tmp_path / "g"), *allow]) == 0
    assert capsys.readouterr().out == f"fetched {store.url}/m.tar.gz into {tmp_path / 'g'}\n"
    assert any(SECRET in path for path, _ in store.requests)  # the store did get the signature
