"""Where the checkpoint fetcher may connect: public addresses, and networks an admin allows.

The fetcher runs inside the cluster with a pod's network identity, so a URI a tenant writes
(or a redirect a store answers) must not make it a proxy to what only the cluster reaches: the
cloud metadata service (the node's credentials), loopback, link-local, private networks, the
cluster's Services. A host is judged AFTER DNS resolution, on every address it resolves to,
and the fetcher then connects to those checked addresses and never resolves the name again
(DNS cannot rebind between the check and the connection).

- Public unicast addresses are allowed (``is_global`` and not multicast). An IPv6 address that
  carries an IPv4 one (mapped ``::ffff:a.b.c.d``, compatible ``::a.b.c.d``, 6to4, Teredo, NAT64
  ``64:ff9b::/96``) is judged by that IPv4 address too.
- Any other address only inside a network allowed explicitly (``--allow-network CIDR``: the
  on-prem store, e.g. ``10.0.3.7/32``; loopback for tests), or as the address of a host
  allowed by name (``--allow-host NAME``: the DDM's checkpoint stager, a Service whose
  address the operator cannot know in advance).
- The cloud metadata endpoints never, whatever is allowed: their names are refused before any
  lookup, their addresses after it.

A refusal says one thing whatever its cause (private, link-local, metadata, or no such name),
so the fetcher's errors, which reach the DDM's status, cannot map the cluster's network.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Names of cloud metadata services (GCE, AWS); lower case, no trailing dot.
METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata.goog", "metadata",
                            "instance-data", "instance-data.ec2.internal"})
#: Their addresses: AWS/GCP/Azure/OpenStack IMDS, AWS IPv6 IMDS, ECS task and EKS pod identity
#: agents, Alibaba, Oracle Cloud, Azure's wire server (a public address).
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "fd00:ec2::254", "169.254.170.2", "169.254.170.23", "fd00:ec2::23",
    "100.100.100.200", "192.0.0.192", "168.63.129.16"))
_NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
#: Every address: what a host allowed by name may resolve to (metadata still refused).
_EVERYWHERE = (ipaddress.ip_network("0.0.0.0/0"), ipaddress.ip_network("::/0"))
#: The one message of every refused destination (see the module's docstring).
REFUSED = "the host does not resolve to an allowed address"


class DestinationRefused(Exception):
    """A destination the fetcher does not connect to. Its text is always ``REFUSED``."""

    def __init__(self) -> None:
        super().__init__(REFUSED)


@dataclass(frozen=True)
class Destination:
    """A host's checked addresses; ``explicitly_allowed``: all are in an allowed network."""

    addresses: tuple[Address, ...]
    explicitly_allowed: bool


def parse_networks(cidrs: Iterable[str]) -> tuple[Network, ...]:
    """``10.0.3.7/32``, ``127.0.0.1`` (one address), ``fd00::/64``...; ``ValueError`` naming
    the bad entry. Host bits must be zero (``10.0.0.1/8`` is refused as ambiguous)."""
    networks = []
    for cidr in cidrs:
        text = cidr.strip()
        if not text:
            continue
        try:
            networks.append(ipaddress.ip_network(text))
        except ValueError as exc:
            raise ValueError(f"allowed network {text!r} is not an address or a CIDR ({exc})"
                             ) from None
    return tuple(networks)


def is_public(address: Address) -> bool:
    """A global unicast address, including any IPv4 address it carries."""
    if not address.is_global or address.is_multicast:
        return False
    return all(is_public(inner) for inner in _embedded_ipv4(address))


def is_metadata(address: Address) -> bool:
    """A cloud metadata address, as itself or carried in an IPv6 address."""
    unscoped = ipaddress.ip_address(str(address).split("%", 1)[0])
    return unscoped in METADATA_ADDRESSES or any(
        inner in METADATA_ADDRESSES for inner in _embedded_ipv4(address))


def in_networks(address: Address, networks: Sequence[Network]) -> bool:
    """``address`` (or the IPv4 address an IPv4-mapped one carries) is inside ``networks``."""
    candidates = [address]
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        candidates.append(address.ipv4_mapped)
    return any(a.version == n.version and a in n for a in candidates for n in networks)


def is_allowed(address: Address, networks: Sequence[Network]) -> bool:
    """The rule of the module: never metadata; public, or inside an allowed network."""
    return not is_metadata(address) and (is_public(address) or in_networks(address, networks))


def check_addresses(addresses: Sequence[Address], networks: Sequence[Network]) -> Destination:
    """All of a host's addresses allowed, or ``DestinationRefused``: a name with one private
    address among public ones is refused whole (a rebinding trick looks exactly like that)."""
    if not addresses or not all(is_allowed(a, networks) for a in addresses):
        raise DestinationRefused()
    explicit = all(in_networks(a, networks) for a in addresses)
    return Destination(tuple(dict.fromkeys(addresses)), explicit)


def normal_host(host: str) -> str:
    """A host as it is compared: lower case, no brackets, no trailing dot."""
    return host.strip("[]").rstrip(".").lower()


def resolve(host: str, port: int, networks: Sequence[Network],
            hosts: Iterable[str] = ()) -> Destination:
    """Resolve ``host`` once and check every address (``DestinationRefused``, same text for a
    name that does not resolve). ``host`` is a URL's host: a name or an IP literal; a name in
    ``hosts`` (``normal_host`` form) may resolve to any address but a metadata one."""
    name = normal_host(host)
    if name in METADATA_HOSTS:
        raise DestinationRefused()
    if name in hosts:
        networks = _EVERYWHERE
    try:
        return check_addresses([ipaddress.ip_address(name)], networks)
    except ValueError:
        pass  # a name (or a legacy numeric form such as 2130706433: getaddrinfo parses it)
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise DestinationRefused() from None
    return check_addresses([ipaddress.ip_address(info[4][0]) for info in infos], networks)


def _embedded_ipv4(address: Address) -> list[ipaddress.IPv4Address]:
    if not isinstance(address, ipaddress.IPv6Address):
        return []
    inner = [address.ipv4_mapped, address.sixtofour]
    if address.teredo:
        inner.extend(address.teredo)
    low32 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if address in _IPV4_COMPATIBLE or any(address in net for net in _NAT64):
        inner.append(low32)
    return [a for a in inner if a is not None]
