"""Who a router request counts against (its client key), and the per-client generation slots.

The key must be one a client cannot choose: its peer address, or, only from a trusted proxy,
the right-most address of X-Forwarded-For that no trusted proxy wrote.
"""

from __future__ import annotations

import ipaddress

import pytest

from ddm.serving.router.clients import ClientBusy, ClientSlots, client_key

INGRESS = (ipaddress.ip_network("10.0.0.0/24"), ipaddress.ip_network("fd00::/64"))


@pytest.mark.parametrize("peer, forwarded, key", [
    # No trusted proxy in the way: the peer, whatever it claims.
    ("192.0.2.10", [b"198.51.100.1"], "192.0.2.10"),
    ("192.0.2.10", [], "192.0.2.10"),
    # From the ingress: the address it received the request from (the right-most entry).
    ("10.0.0.5", [b"198.51.100.1"], "198.51.100.1"),
    # A client's own X-Forwarded-For is to the left of what the ingress appended: ignored.
    ("10.0.0.5", [b"1.1.1.1, 2.2.2.2, 198.51.100.1"], "198.51.100.1"),
    ("10.0.0.5", [b"1.1.1.1", b"198.51.100.1"], "198.51.100.1"),  # several headers
    # Two trusted hops: skipped right to left.
    ("10.0.0.5", [b"7.7.7.7, 198.51.100.1, 10.0.0.9"], "198.51.100.1"),
    # Ports, brackets and IPv4-mapped IPv6 name the same address.
    ("10.0.0.5", [b"198.51.100.1:4711"], "198.51.100.1"),
    ("10.0.0.5", [b"[2001:db8::7]:443"], "2001:db8::7"),
    ("::ffff:10.0.0.5", [b"198.51.100.1"], "198.51.100.1"),
    ("fd00::3", [b"2001:db8::7"], "2001:db8::7"),
    # Garbage ends the walk at the hop to its right; no header: the proxy itself.
    ("10.0.0.5", [b"not-an-address, 10.0.0.7"], "10.0.0.7"),
    ("10.0.0.5", [b"unknown"], "10.0.0.5"),
    ("10.0.0.5", [], "10.0.0.5"),
    ("10.0.0.5", [b" , ,"], "10.0.0.5"),
    # Only trusted hops: the left-most of them.
    ("10.0.0.5", [b"10.0.0.8, 10.0.0.7"], "10.0.0.8"),
    (None, [b"198.51.100.1"], "unknown"),
])
def test_the_key_is_the_right_most_address_no_trusted_proxy_wrote(
        peer: str | None, forwarded: list[bytes], key: str) -> None:
    assert client_key(peer, forwarded, INGRESS) == key


def test_without_trusted_proxies_the_header_is_never_read() -> None:
    assert client_key("10.0.0.5", [b"198.51.100.1"], ()) == "10.0.0.5"
    assert client_key("127.0.0.1", [b"198.51.100.1"], ()) == "127.0.0.1"


def test_each_client_gets_its_own_slots_and_the_refusal_names_the_limit() -> None:
    slots = ClientSlots(per_client=2)
    for _ in range(2):
        slots.take("a")
    with pytest.raises(ClientBusy, match=r"client a has 2 generations in flight, the limit per "
                                         r"client is 2 \(limits.max_concurrent_per_client\)"):
        slots.take("a")
    slots.take("b")  # another client is not affected
    slots.release("a")
    slots.take("a")
    assert (slots.running("a"), slots.running("b")) == (2, 1)
    for client in ("a", "a", "b"):
        slots.release(client)
    assert slots.running("a") == 0 and not slots._running  # no entry left per idle client
    with pytest.raises(ValueError, match="per_client must be >= 1"):
        ClientSlots(0)
