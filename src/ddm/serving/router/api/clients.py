"""Who a request comes from, how many generations each client may run at once, and how much
it may ask of the experts over time.

The router's capacity (``limits.max_concurrent`` generations) is shared by its clients; a
client may hold at most ``limits.max_concurrent_per_client`` of them, so one client cannot
take all of it (more get 429 naming the limit), and may ask for at most its budget of rows x
steps (:class:`ClientBudget`), so that a few huge generations cannot hold the router's slots
for minutes either. A client is its address:

- the TCP peer's address, unless the peer is inside router.yaml's ``trusted_proxies``
  (CIDRs, ``RouterConfigFile.trusted_networks``);
- behind a trusted proxy (an ingress controller, where every client shares the proxy's
  address), the right-most address of ``X-Forwarded-For`` that is not itself a trusted
  proxy. Each proxy appends the address it received the request from, so the entries to the
  right of the first untrusted one were written by proxies we trust, and everything to its
  left was written by the client, who may put anything there: reading the right-most
  untrusted entry, never the left-most, is what stops a client from choosing its own key.
  An entry that is not an address ends the walk at the address to its right (nothing vouches
  for it); a chain of trusted proxies only is keyed by its left-most address.

The peer address is uvicorn's ``scope["client"]`` as accepted (``ddm.serving.http.server`` turns
uvicorn's own proxy-header rewriting off, which would trust a loopback peer's header).
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Iterable
from dataclasses import dataclass

from ddm.checkpoints.destinations import Address, Network

#: The header a proxy appends the address it received a request from to (one header, or
#: several whose values join with commas).
FORWARDED_FOR = b"x-forwarded-for"


class ClientBusy(RuntimeError):
    """The client already runs as many generations as one client may, or its budget holds too
    little for this one now: ``retry_after_s`` says when it will (None: when one ends)."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class OverBudget(ValueError):
    """A generation costs more than a client's whole budget: it can never run (422)."""


def client_key(peer: str | None, forwarded_for: Iterable[bytes],
               trusted: tuple[Network, ...]) -> str:
    """The client a request counts against: ``peer`` (the TCP peer's address; None when the
    server does not know it) or, when ``peer`` is a trusted proxy, the right-most untrusted
    address of the ``X-Forwarded-For`` values ``forwarded_for`` (in header order)."""
    if peer is None:
        return "unknown"
    address = _address(peer)
    if address is None or not _inside(address, trusted):
        return str(address) if address is not None else peer
    entries = [entry.strip() for value in forwarded_for
               for entry in value.decode("latin-1").split(",")]
    key = address
    for entry in reversed(entries):
        if not entry:
            continue
        hop = _address(entry)
        if hop is None:  # not an address: nothing vouches for it or for what is left of it
            return str(key)
        key = hop
        if not _inside(hop, trusted):
            return str(hop)
    return str(key)


def _inside(address: Address, networks: tuple[Network, ...]) -> bool:
    return any(address in network for network in networks)


def _address(text: str) -> Address | None:
    """An address from ``1.2.3.4``, ``1.2.3.4:5678``, ``2001:db8::1`` or ``[2001:db8::1]:80``
    (proxies write ports and brackets differently); IPv4-mapped IPv6 as its IPv4 address."""
    text = text.strip()
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class ClientSlots:
    """Generations in flight per client, each client at most ``per_client``."""

    def __init__(self, per_client: int) -> None:
        if per_client < 1:
            raise ValueError(f"per_client must be >= 1, got {per_client}")
        self.per_client = per_client
        self._running: dict[str, int] = {}

    def running(self, client: str) -> int:
        return self._running.get(client, 0)

    def take(self, client: str) -> None:
        """Count a generation of ``client`` in, or refuse it naming the limit."""
        running = self.running(client)
        if running >= self.per_client:
            raise ClientBusy(
                f"client {client} has {running} generations in flight, the limit per client "
                f"is {self.per_client} (limits.max_concurrent_per_client); retry when one "
                "ends")
        self._running[client] = running + 1

    def release(self, client: str) -> None:
        running = self._running[client] - 1
        if running:
            self._running[client] = running
        else:
            del self._running[client]  # the table holds only clients with work in flight


@dataclass
class _Bucket:
    tokens: float
    at: float  # time.monotonic() when ``tokens`` was counted


class ClientBudget:
    """Per client, a token bucket of rows x steps (``ddm.sampling.loop.row_steps``): it holds
    at most ``capacity`` and refills at ``per_s`` a second; a generation is charged its cost
    before it runs. Time is passed in (``now``, monotonic seconds): no I/O, no clock here.
    Only clients whose bucket is not full are kept (a full one is the same as none), so the
    table stays as small as the clients active in the last ``capacity / per_s`` seconds."""

    def __init__(self, capacity: int, per_s: float) -> None:
        if capacity < 1 or not per_s > 0:
            raise ValueError(f"a budget needs capacity >= 1 and per_s > 0, got {capacity}, "
                             f"{per_s}")
        self.capacity, self.per_s = capacity, per_s
        self._buckets: dict[str, _Bucket] = {}
        self._sweep_at = _SWEEP_FIRST

    def held(self, client: str, now: float) -> float:
        """What ``client``'s bucket holds at ``now``."""
        bucket = self._buckets.get(client)
        if bucket is None:
            return float(self.capacity)
        return min(float(self.capacity), bucket.tokens + (now - bucket.at) * self.per_s)

    def charge(self, client: str, cost: int, now: float) -> None:
        """Take ``cost`` from ``client``'s bucket, or refuse naming the limit:
        :class:`OverBudget` if it exceeds the capacity, :class:`ClientBusy` with the seconds
        until the bucket holds it otherwise."""
        if cost > self.capacity:
            raise OverBudget(
                f"this generation costs {cost} rows x steps (images x steps, guided steps "
                f"twice), more than a client's whole budget of {self.capacity} "
                "(limits.client_row_steps); ask for fewer images or steps")
        held = self.held(client, now)
        if held < cost:
            wait = max(1, math.ceil((cost - held) / self.per_s))
            raise ClientBusy(
                f"client {client} has {math.floor(held)} of the {cost} rows x steps this "
                f"generation costs left in its budget (limits.client_row_steps "
                f"{self.capacity}, refilled at limits.client_row_steps_per_s {self.per_s:g}); "
                f"retry in {wait} s", wait)
        self._buckets[client] = _Bucket(held - cost, now)
        if len(self._buckets) >= self._sweep_at:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Forget the clients whose buckets are full again; sweep next at twice what is
        left (amortised O(1) per charge)."""
        for client in [c for c in self._buckets if self.held(c, now) >= self.capacity]:
            del self._buckets[client]
        self._sweep_at = max(_SWEEP_FIRST, 2 * len(self._buckets))

    def __len__(self) -> int:
        return len(self._buckets)


#: Clients kept before the first sweep of full buckets.
_SWEEP_FIRST = 1024
