"""The dev cluster's DNS server for pods: Service names, answered from the API server.

Debian has no CoreDNS. Debian's dnsmasq would need a second process to feed it the Services
and to reload it on every change; this small server is one process that asks the API server
directly, which is simpler and as correct for what the dev cluster needs. It answers A queries
the way CoreDNS's ``kubernetes`` plugin does:

* ``<service>.<namespace>.svc.<domain>`` -> the Service's cluster IP; for a headless Service
  (``clusterIP: None``), the ready addresses of its Endpoints;
* any other name in the cluster domain, or an unknown Service -> NXDOMAIN;
* names outside the cluster domain -> REFUSED: the dev cluster has no upstream resolver.

Other query types for a name that exists (AAAA, SRV, ...) get an empty NOERROR answer, so
resolvers that ask A and AAAA together use the A answer. Answers are cached for ``ttl_s``
seconds (also the records' TTL), so a Service's new endpoints show within about that long.
It listens on UDP and TCP port 53 of the host's end of the real node's veth, the address the
kubelet gives pods as their nameserver (``--cluster-dns``).

Run as ``python -m ddm_devcluster.dns --listen IP --server URL --token-file F --ca-file F``.
"""

from __future__ import annotations

import argparse
import signal
import socketserver
import struct
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from ddm_devcluster.api import Api, ApiError

TYPE_A, CLASS_IN = 1, 1
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, REFUSED = 0, 1, 2, 3, 5
MAX_TCP_MESSAGE = 4096  # queries are a few dozen bytes; a bigger one is not a query
TCP_READ_TIMEOUT_S = 5.0


class _TcpServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True  # rebinding over connections in TIME_WAIT from the last run
    daemon_threads = True


class _UdpServer(socketserver.ThreadingUDPServer):
    daemon_threads = True


class ClusterDns:
    """A DNS server for the cluster domain on ``address:port``; a context manager."""

    def __init__(self, api: Api, address: str, *, port: int = 53,
                 domain: str = "cluster.local", ttl_s: int = 1) -> None:
        self.address, self.port, self.domain, self.ttl_s = address, port, domain.strip("."), ttl_s
        self._api = api
        self._cache: dict[tuple[str, str], tuple[float, list[str] | None]] = {}
        self._lock = threading.Lock()
        answer = self.answer

        class Udp(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                data, sock = self.request
                reply = answer(data)
                if reply is not None:
                    sock.sendto(reply, self.client_address)

        class Tcp(socketserver.StreamRequestHandler):
            timeout = TCP_READ_TIMEOUT_S

            def handle(self) -> None:  # RFC 1035 4.2.2: each message after a 2-byte length
                while header := self.rfile.read(2):
                    length = struct.unpack("!H", header)[0]
                    if length > MAX_TCP_MESSAGE:
                        return
                    reply = answer(self.rfile.read(length))
                    if reply is None:
                        return
                    self.wfile.write(struct.pack("!H", len(reply)) + reply)

        self._servers: list[socketserver.BaseServer] = [_UdpServer((address, port), Udp)]
        try:
            self._servers.append(_TcpServer((address, port), Tcp))
        except OSError:
            self._servers[0].server_close()
            raise
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Self:
        for server in self._servers:
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                      name=f"cluster-dns-{self.address}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *_: object) -> None:
        for server in self._servers:
            if self._threads:
                server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join(5)

    # ------------------------------------------------------------------------- answers

    def resolve(self, name: str) -> list[str] | None:
        """The IPv4 addresses of ``name`` (None: no such name; raises LookupError outside the
        cluster domain)."""
        name = name.lower().strip(".")
        if not (name == self.domain or name.endswith("." + self.domain)):
            raise LookupError(f"{name} is outside the cluster domain {self.domain}")
        suffix = f".svc.{self.domain}"
        parts = name[: -len(suffix)].split(".") if name.endswith(suffix) else []
        if len(parts) != 2:
            return None
        service, namespace = parts
        return self._service_addresses(namespace, service)

    def _service_addresses(self, namespace: str, service: str) -> list[str] | None:
        key = (namespace, service)
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        # Lists with a field selector: the role CoreDNS uses (system:kube-dns) may list and
        # watch Services and Endpoints, not get them.
        selector = f"?fieldSelector=metadata.name%3D{service}"
        base = f"/api/v1/namespaces/{namespace}"
        services = self._api.request("GET", f"{base}/services{selector}", timeout_s=5)["items"]
        addresses: list[str] | None
        if not services:
            addresses = None
        elif services[0]["spec"].get("clusterIP") not in (None, "", "None"):
            addresses = [services[0]["spec"]["clusterIP"]]
        else:
            endpoints = self._api.request("GET", f"{base}/endpoints{selector}",
                                          timeout_s=5)["items"]
            addresses = sorted({a["ip"] for e in endpoints for subset in e.get("subsets") or []
                                for a in subset.get("addresses") or []})
        with self._lock:
            self._cache[key] = (time.monotonic() + self.ttl_s, addresses)
        return addresses

    def answer(self, query: bytes) -> bytes | None:
        """The reply to one DNS message (None: not a query worth answering)."""
        try:
            ident, flags, qdcount = struct.unpack("!HHH", query[:6])
            name, end = _read_name(query, 12)
            qtype, qclass = struct.unpack("!HH", query[end:end + 4])
        except (struct.error, ValueError, IndexError, UnicodeDecodeError):
            return None
        question = query[12:end + 4]
        if flags & 0x8000 or qdcount != 1:  # a response, or several questions
            return _reply(ident, flags, FORMERR, question, [], 0)
        try:
            addresses = self.resolve(name)
        except LookupError:
            return _reply(ident, flags, REFUSED, question, [], 0)
        except ApiError:  # the API failed: SERVFAIL, so the client retries
            return _reply(ident, flags, SERVFAIL, question, [], 0)
        if addresses is None:
            return _reply(ident, flags, NXDOMAIN, question, [], 0)
        wanted = addresses if qtype == TYPE_A and qclass == CLASS_IN else []
        return _reply(ident, flags, NOERROR, question, wanted, self.ttl_s)


def _read_name(message: bytes, offset: int) -> tuple[str, int]:
    """The (uncompressed) question name at ``offset`` and the offset just past it."""
    labels = []
    while True:
        length = message[offset]
        if length & 0xC0:
            raise ValueError("compressed names are not expected in a question")
        offset += 1
        if length == 0:
            return ".".join(labels), offset
        labels.append(message[offset:offset + length].decode("ascii"))
        offset += length


def _reply(ident: int, query_flags: int, rcode: int, question: bytes, addresses: list[str],
           ttl_s: int) -> bytes:
    # QR=1, the query's opcode and RD, AA=1 (authoritative for the cluster domain), RA=0.
    flags = 0x8000 | (query_flags & 0x7900) | 0x0400 | rcode
    header = struct.pack("!HHHHHH", ident, flags, 1 if question else 0, len(addresses), 0, 0)
    answers = b"".join(
        struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, ttl_s, 4) + bytes(map(int, ip.split(".")))
        for ip in addresses)  # 0xC00C: a pointer to the question's name
    return header + question + answers


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m ddm_devcluster.dns", description=__doc__)
    parser.add_argument("--listen", required=True, help="IPv4 address to serve on (port 53)")
    parser.add_argument("--port", type=int, default=53)
    parser.add_argument("--server", required=True, help="the API server's URL")
    parser.add_argument("--token-file", type=Path, required=True)
    parser.add_argument("--ca-file", type=Path, required=True)
    parser.add_argument("--domain", default="cluster.local")
    args = parser.parse_args(argv)
    api = Api(args.server, args.token_file.read_text().strip(), args.ca_file)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with ClusterDns(api, args.listen, port=args.port, domain=args.domain):
        print(f"cluster DNS for {args.domain} on {args.listen}:{args.port}", flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
