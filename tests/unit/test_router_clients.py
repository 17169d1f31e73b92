"""Who a router request counts against (its client key), the per-client generation slots, and
the per-client budget of rows x steps (a token bucket, on a clock the tests pass in).

The key must be one a client cannot choose: its peer address, or, only from a trusted proxy,
the right-most address of X-Forwarded-For that no trusted proxy wrote.
"""

from __future__ import annotations

import ipaddress

import pytest

from ddm.serving.router.api.clients import (ClientBudget, ClientBusy, ClientSlots, OverBudget,
                                            client_key)

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


def test_a_budget_is_charged_refills_at_its_rate_and_says_when_it_will_hold_enough() -> None:
    budget = ClientBudget(capacity=100, per_s=10.0)
    budget.charge("a", 60, now=0.0)
    budget.charge("b", 100, now=0.0)  # each client has its own
    with pytest.raises(ClientBusy, match=r"client a has 40 of the 60 rows x steps .* "
                                         r"\(limits.client_row_steps 100, refilled at "
                                         r"limits.client_row_steps_per_s 10\); retry in 2 s"
                       ) as refused:
        budget.charge("a", 60, now=0.0)
    assert refused.value.retry_after_s == 2  # 20 missing at 10 a second
    assert budget.held("a", now=1.5) == 55.0
    budget.charge("a", 60, now=2.0)  # 40 + 2 s x 10 = 60: exactly enough
    assert budget.held("a", now=2.0) == 0.0
    assert budget.held("a", now=1000.0) == 100.0  # never more than the capacity


def test_a_generation_larger_than_the_whole_budget_is_refused_naming_the_limit() -> None:
    with pytest.raises(OverBudget, match=r"costs 101 rows x steps .* whole budget of 100 "
                                         r"\(limits.client_row_steps\)"):
        ClientBudget(capacity=100, per_s=1.0).charge("a", 101, now=0.0)
    for capacity, per_s in ((0, 1.0), (1, 0.0), (1, float("nan"))):
        with pytest.raises(ValueError, match="a budget needs capacity >= 1 and per_s > 0"):
            ClientBudget(capacity, per_s)


def test_the_budget_forgets_clients_whose_buckets_are_full_again() -> None:
    """Any number of clients (a /64 of IPv6 addresses) leaves only the recent ones kept."""
    budget = ClientBudget(capacity=10, per_s=1.0)
    for i in range(5000):
        budget.charge(f"client-{i}", 10, now=float(i))  # each refilled 10 s later
    assert len(budget) <= 1024
    assert budget.held("client-4999", now=4999.0) == 0.0
