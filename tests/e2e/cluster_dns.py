"""Cluster DNS for the end-to-end tests (TEST SCAFFOLDING, never part of the product).

The dev cluster has no CoreDNS, so `tests/e2e/node_agent.py` runs this small server on a
local address of its own (port 53, UDP and TCP) and points every pod's ``/etc/resolv.conf``
at it. It answers A queries the way CoreDNS's ``kubernetes`` plugin does, from the API:

* ``<service>.<namespace>.svc.cluster.local`` -> the ready addresses of the Service's
  Endpoints. For a headless Service that is what CoreDNS answers; for a ClusterIP Service
  CoreDNS would answer the cluster IP, but nothing here routes cluster IPs (there is no
  kube-proxy), so it answers the ready endpoints too, as if the client balanced itself;
* an unknown Service, or any other name in the cluster domain -> NXDOMAIN;
* ``static`` names (the agent's ``kubernetes.default.svc.cluster.local``) -> their address;
* names outside the cluster domain -> REFUSED: nothing outside can be reached from the test
  machine, so there is no upstream to forward to.

Other query types for a name that exists (AAAA, SRV, ...) get an empty NOERROR answer, so
resolvers that ask A and AAAA together still use the A answer. Answers are read through a
cache of ``ttl_s`` seconds (also the records' TTL), so a Service's new endpoints show within
about that long.
"""

from __future__ import annotations

import json
import socketserver
import struct
import threading
import time
from collections.abc import Mapping
from typing import Self

from kubernetes import client
from kubernetes.client.exceptions import ApiException

TYPE_A, CLASS_IN = 1, 1
NOERROR, FORMERR, SERVFAIL, NXDOMAIN, REFUSED = 0, 1, 2, 3, 5


class _TcpServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True  # rebinding over connections in TIME_WAIT from the last run


class ClusterDns:
    """A DNS server for the cluster domain on ``address:port``; a context manager.

    ``with ClusterDns(api_client, "127.0.0.2") as dns: ...`` serves until the block ends.
    Binding fails with ``OSError`` when the address is taken, so a caller can try another.
    """

    def __init__(self, api_client: client.ApiClient, address: str, *, port: int = 53,
                 domain: str = "cluster.local", ttl_s: int = 1,
                 static: Mapping[str, str] | None = None) -> None:
        self.address, self.port, self.domain, self.ttl_s = address, port, domain.strip("."), ttl_s
        self._core = client.CoreV1Api(api_client)
        self._static = {name.lower().strip("."): ip for name, ip in (static or {}).items()}
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
            def handle(self) -> None:  # RFC 1035 4.2.2: each message after a 2-byte length
                while header := self.rfile.read(2):
                    reply = answer(self.rfile.read(struct.unpack("!H", header)[0]))
                    if reply is None:
                        return
                    self.wfile.write(struct.pack("!H", len(reply)) + reply)

        # No SO_REUSEADDR on the UDP socket: on Linux it would let a second server share the
        # port, and a taken address must fail to bind.
        self._servers: list[socketserver.BaseServer] = [
            socketserver.ThreadingUDPServer((address, port), Udp)]
        try:
            self._servers.append(_TcpServer((address, port), Tcp))
        except OSError:
            self._servers[0].server_close()
            raise
        for server in self._servers:
            server.daemon_threads = True  # type: ignore[attr-defined]
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Self:
        for server in self._servers:
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
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
        if name in self._static:
            return [self._static[name]]
        suffix = f".svc.{self.domain}"
        if not (name == self.domain or name.endswith("." + self.domain)):
            raise LookupError(f"{name} is outside the cluster domain {self.domain}")
        parts = name[: -len(suffix)].split(".") if name.endswith(suffix) else []
        if len(parts) != 2:
            return None
        service, namespace = parts
        return self._endpoints(namespace, service)

    def _endpoints(self, namespace: str, service: str) -> list[str] | None:
        key = (namespace, service)
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None and cached[0] > time.monotonic():
            return cached[1]
        addresses: list[str] | None
        try:
            self._core.read_namespaced_service(service, namespace, _preload_content=False)
            endpoints = json.loads(self._core.read_namespaced_endpoints(
                service, namespace, _preload_content=False).data)
            addresses = sorted({a["ip"] for subset in endpoints.get("subsets") or []
                                for a in subset.get("addresses") or []})
        except ApiException as error:
            if error.status != 404:
                raise
            addresses = None  # no such Service, or (just created) no Endpoints object yet
        with self._lock:
            self._cache[key] = (time.monotonic() + self.ttl_s, addresses)
        return addresses

    def answer(self, query: bytes) -> bytes | None:
        """The reply to one DNS message (None: not a query worth answering)."""
        try:
            ident, flags, qdcount = struct.unpack("!HHH", query[:6])
            name, end = _read_name(query, 12)
            qtype, qclass = struct.unpack("!HH", query[end:end + 4])
        except (struct.error, ValueError, IndexError):
            return None
        question = query[12:end + 4]
        if flags & 0x8000 or qdcount != 1:  # a response, or several questions
            return _reply(ident, flags, FORMERR, question, [], 0)
        try:
            addresses = self.resolve(name)
        except LookupError:
            return _reply(ident, flags, REFUSED, question, [], 0)
        except Exception:  # noqa: BLE001 - the API failed: SERVFAIL, so the client retries
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

