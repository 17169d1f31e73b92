"""The router's one HTTP client (expert calls and probes) against real servers on loopback.

A uvicorn server (as the experts run it) for the ordinary exchange; small asyncio servers that
answer exactly the bytes a case needs (chunked bodies, ``Connection: close``, closing idle
connections, garbage, silence) for the rest.
"""

from __future__ import annotations

import asyncio
import socket
import time
import tracemalloc
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddm.serving.http.server import build_server
from ddm.serving.http.client import HttpClient, HttpClientError, ReplyTooLarge
from ddm.serving.http.polling import WARM_AFTER

CT = "application/octet-stream"
#: Reply caps for the ordinary cases: far above what they answer.
CAPS = {"max_reply_bytes": 1 << 20, "max_error_bytes": 4096}
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def echo_app(scope, receive, send) -> None:
    """Answers a POST with its body and the client's port, so reuse shows."""
    if scope["type"] != "http":
        return
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    reply = f"{scope['client'][1]}:".encode() + body
    await send({"type": "http.response.start", "status": 201,
                "headers": [(b"content-length", str(len(reply)).encode())]})
    await send({"type": "http.response.body", "body": reply})


@asynccontextmanager
async def uvicorn_echo() -> AsyncIterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    async with uvicorn_serving(echo_app, sock):
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@asynccontextmanager
async def uvicorn_serving(app, sock: socket.socket) -> AsyncIterator[None]:
    """``app`` served on the bound ``sock`` as the experts serve, until the block ends."""
    host, port = sock.getsockname()[:2]
    server = build_server(app, host, port, log_level="warning")
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield
    finally:
        server.should_exit = True
        await task


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    async with server:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    return await reader.readexactly(length)


def answer(status: int, body: bytes, *extra: bytes) -> bytes:
    return (f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n".encode()
            + b"".join(e + b"\r\n" for e in extra) + b"\r\n" + body)


def run(scenario: Callable[[HttpClient], Awaitable]) -> object:
    async def main():
        client = HttpClient(keep_alive_s=60.0)
        try:
            return await scenario(client)
        finally:
            client.close()

    return asyncio.run(main())


def test_posts_reuse_one_kept_alive_connection():
    async def scenario(client: HttpClient):
        async with uvicorn_echo() as endpoint:
            return [await client.post(endpoint, "/v1/velocity", b"x" * n, CT, 5.0, 1.0, **CAPS)
                    for n in (0, 3, 70000)]

    replies = run(scenario)
    ports = {reply.body.split(b":")[0] for reply in replies}
    assert [r.status for r in replies] == [201] * 3 and len(ports) == 1
    assert [len(r.body.split(b":", 1)[1]) for r in replies] == [0, 3, 70000]


def test_concurrent_posts_get_their_own_replies_on_separate_connections():
    async def scenario(client: HttpClient):
        async with uvicorn_echo() as endpoint:
            return await asyncio.gather(*(client.post(endpoint, "/", str(i).encode(), CT, 5.0,
                                                      1.0, **CAPS) for i in range(8)))

    replies = run(scenario)
    assert [r.body.split(b":")[1] for r in replies] == [str(i).encode() for i in range(8)]


def test_probes_get_on_the_calls_connection_and_their_replies_are_capped_whatever_the_status():
    """A probe (``GET``, no body) and an expert call share one kept-alive connection; a
    probe's reply over its cap is refused, a 503's as a 200's."""
    requests: list[bytes] = []

    async def handler(reader, writer):
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                requests.append(head.split(b"\r\n")[0])
                if head.startswith(b"POST"):
                    await reader.readexactly(1)
                    writer.write(answer(200, b"v"))
                elif b"/big" in head:
                    writer.write(answer(503, b"x" * 100))
                else:
                    writer.write(answer(200, b"ready"))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection

    async def scenario(client: HttpClient):
        async with raw_server(handler) as endpoint:
            ready = await client.get(endpoint, "/readyz", 5.0, 1.0, max_reply_bytes=64)
            call = await client.post(endpoint, "/v1/velocity", b"x", CT, 5.0, 1.0, **CAPS)
            with pytest.raises(ReplyTooLarge, match="over the 64"):
                await client.get(endpoint, "/big", 5.0, 1.0, max_reply_bytes=64)
            return ready, call

    ready, call = run(scenario)
    assert (ready.status, ready.body, call.body) == (200, b"ready", b"v")
    assert requests == [b"GET /readyz HTTP/1.1", b"POST /v1/velocity HTTP/1.1",
                        b"GET /big HTTP/1.1"]


def test_chunked_replies_are_reassembled():
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        await writer.drain()
        await reader.read()

    async def scenario(client: HttpClient):
        async with raw_server(handler) as endpoint:
            return await client.post(endpoint, "/", b"", CT, 5.0, 1.0, **CAPS)

    assert run(scenario).body == b"abcde"


def test_connection_close_and_connections_the_server_drops_are_followed():
    """A reply with ``Connection: close`` retires its connection; a kept connection the server
    closes as the next request goes out (its idle timeout) costs a reconnection, not an error."""
    connections = []

    async def handler(reader, writer):
        connections.append(writer)
        drop_next = False
        while True:
            try:
                body = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            if drop_next:
                writer.close()
                return
            close = body == b"close"
            writer.write(answer(200, body, *([b"Connection: close"] if close else [])))
            await writer.drain()
            if close:
                writer.close()
                return
            drop_next = body == b"drop-next"

    async def scenario(client: HttpClient):
        async with raw_server(handler) as endpoint:
            return [(await client.post(endpoint, "/", body, CT, 5.0, 1.0, **CAPS)).body
                    for body in (b"close", b"drop-next", b"after-drop", b"kept")]

    assert run(scenario) == [b"close", b"drop-next", b"after-drop", b"kept"]
    assert len(connections) == 3  # close; drop-next (dropped); after-drop and kept


@pytest.mark.parametrize("reply, message", [
    (b"NOT HTTP AT ALL\r\n\r\n", "malformed HTTP response"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "connection closed by the server"),
])
def test_garbage_and_cut_replies_are_client_errors(reply, message):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(reply)
        await writer.drain()
        writer.close()

    async def scenario(client: HttpClient):
        async with raw_server(handler) as endpoint:
            with pytest.raises(HttpClientError, match=message):
                await client.post(endpoint, "/", b"x", CT, 5.0, 1.0, **CAPS)

    run(scenario)


def test_a_reply_cut_short_on_a_kept_connection_is_not_sent_again():
    """Only a connection closed before any reply byte is retried: a request the server began
    to answer may have been served."""
    requests = []

    async def handler(reader, writer):
        while True:
            body = await read_request(reader)
            requests.append(body)
            if body == b"cut":
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
                await writer.drain()
                writer.close()
                return
            writer.write(answer(200, body))
            await writer.drain()

    async def scenario(client: HttpClient):
        async with raw_server(handler) as endpoint:
            await client.post(endpoint, "/", b"first", CT, 5.0, 1.0, **CAPS)
            with pytest.raises(HttpClientError, match="connection closed by the server"):
                await client.post(endpoint, "/", b"cut", CT, 5.0, 1.0, **CAPS)

    run(scenario)
    assert requests == [b"first", b"cut"]


def test_silence_times_out_and_a_closed_port_is_refused():
    async def handler(reader, writer):
        await reader.read()

    async def scenario(client: HttpClient):
        async with raw_server(handler) as endpoint:
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(TimeoutError):
                await client.post(endpoint, "/", b"x", CT, 0.3, 1.0, **CAPS)
            assert loop.time() - started < 1.0
        with pytest.raises(HttpClientError, match="cannot connect"):
            await client.post(endpoint, "/", b"x", CT, 1.0, 1.0, **CAPS)

    run(scenario)


async def host_app(scope, receive, send) -> None:
    """Answers a GET with the Host header it was sent."""
    if scope["type"] != "http":
        return
    host = dict(scope["headers"])[b"host"]
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(host)).encode())]})
    await send({"type": "http.response.body", "body": host})


def test_an_ipv6_endpoint_is_reached_and_named_in_brackets_in_the_host_header():
    # router.yaml writes an IPv6 replica as a URL does: [::1]:8000 (RFC 3986), and so must the
    # Host header (RFC 9110): ::1:8000 is an address of its own.
    try:
        sock = socket.socket(socket.AF_INET6)
        sock.bind(("::1", 0))
    except OSError as error:
        pytest.skip(f"no IPv6 loopback here: {error}")
    endpoint = f"[::1]:{sock.getsockname()[1]}"

    async def scenario(client: HttpClient):
        async with uvicorn_serving(host_app, sock):
            reply = await client.get(endpoint, "/", 5.0, 5.0, max_reply_bytes=1024)
        assert (reply.status, reply.body) == (200, endpoint.encode())

    with sock:
        run(scenario)


def test_connections_disable_nagle_and_stale_ones_are_closed():
    async def scenario():
        client = HttpClient(keep_alive_s=0.05)
        async with uvicorn_echo() as endpoint:
            first = await client.post(endpoint, "/", b"x", CT, 5.0, 1.0, **CAPS)
            (connection,) = client._idle[endpoint]  # the kept connection, to look at its socket
            sock = connection._transport.get_extra_info("socket")
            nodelay = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            await asyncio.sleep(0.1)
            client.close_idle()
            pruned = connection.closed and endpoint not in client._idle
            # a new connection
            second = await client.post(endpoint, "/", b"y", CT, 5.0, 1.0, **CAPS)
            client.close()
        return nodelay, pruned, first.body.split(b":")[0] != second.body.split(b":")[0]

    nodelay, pruned, new_connection = asyncio.run(scenario())
    assert nodelay != 0 and pruned and new_connection


# ------------------------------------------------------------------------ a hostile expert


def test_informational_replies_are_skipped():
    async def handler(reader, writer):
        body = await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n"
                     b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n"
                     + answer(200, body))
        await writer.drain()
        await reader.read()

    async def scenario(client: HttpClient):
        async with raw_server(handler) as endpoint:
            return await client.post(endpoint, "/", b"final", CT, 5.0, 1.0, **CAPS)

    reply = run(scenario)
    assert (reply.status, reply.body) == (200, b"final")


def test_a_call_whose_time_is_known_ticks_the_loop_from_near_its_end_until_its_reply():
    """Hybrid polling: a call to an endpoint and path whose last successful call took T ticks
    the client's loop from WARM_AFTER * T on (never before) while it waits, and stops after
    the reply; a first call, and a call after one that failed, tick not at all."""
    first_s = 0.06
    replies = [("/slow", first_s, 200), ("/slow", 5 * first_s, 200),  # longer than expected
               ("/fail", first_s, 500), ("/fail", first_s, 500)]
    ticks: list[float] = []

    class Recording(HttpClient):
        def _next_tick_s(self) -> float | None:  # asked at each tick
            ticks.append(asyncio.get_running_loop().time())
            return super()._next_tick_s()

    async def handler(reader, writer):
        for path, seconds, status in replies:
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.split(b" ")[1] == path.encode()
            await asyncio.sleep(seconds)
            writer.write(answer(status, b"v"))
            await writer.drain()

    async def scenario():
        loop = asyncio.get_running_loop()
        client = Recording(keep_alive_s=60.0)
        async with raw_server(handler) as endpoint:
            called = loop.time()
            await client.get(endpoint, "/slow", 5.0, 1.0, max_reply_bytes=64)
            first = loop.time() - called
            after_first = len(ticks)
            called = loop.time()
            await client.get(endpoint, "/slow", 5.0, 1.0, max_reply_bytes=64)
            replied = loop.time()
            while client._ticks.ticking:  # the chain ends at its first tick after the reply
                await asyncio.sleep(0.001)
            on_call = list(ticks)
            for _ in range(2):
                assert (await client.get(endpoint, "/fail", 5.0, 1.0,
                                         max_reply_bytes=64)).status == 500
        client.close()
        return after_first, first, called, replied, on_call

    after_first, first, called, replied, on_call = asyncio.run(scenario())
    assert after_first == 0
    assert on_call[0] >= called + WARM_AFTER * first - 0.002  # the loop's clock: ms
    assert sum(tick < replied for tick in on_call) >= 2  # while the call ran
    assert ticks == on_call  # they stopped, and none came for the failed path


def test_bytes_after_a_reply_close_the_connection_and_are_never_the_next_reply():
    """A forged reply sent after the real one, at once or later, must not answer the next
    request: the connection it came on is closed, the next request goes out on a new one."""
    connections = []

    async def handler(reader, writer):
        connections.append(writer)
        while True:
            try:
                body = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(answer(200, body) + answer(200, b"forged"))
            await writer.drain()

    async def scenario(client: HttpClient):
        async with raw_server(handler) as endpoint:
            return [(await client.post(endpoint, "/", body, CT, 5.0, 1.0, **CAPS)).body
                    for body in (b"one", b"two", b"three")]

    assert run(scenario) == [b"one", b"two", b"three"]
    assert len(connections) == 3


@pytest.mark.parametrize("reply, message", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 314572800\r\n\r\n", "declared"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
     + b"10000\r\n" + b"x" * 0x10000 + b"\r\n", "reply body over"),
    (b"HTTP/1.1 500 Oops\r\nContent-Length: 5000\r\n\r\n", "declared"),
    (b"HTTP/1.1 200 OK\r\nX-Pad: " + b"p" * 65536, "reply headers exceed"),
])
def test_replies_over_what_the_request_implies_are_refused_before_they_are_buffered(
        reply, message):
    """The server would go on sending for ever; the client stops at the cap."""
    sent = []

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(reply)
        try:
            while True:
                writer.write(b"x" * 65536 if b"chunked" not in reply
                             else b"10000\r\n" + b"x" * 0x10000 + b"\r\n")
                sent.append(0x10000)
                await writer.drain()
        except ConnectionError:
            pass

    async def scenario(client: HttpClient):
        async with raw_server(handler) as endpoint:
            with pytest.raises(HttpClientError, match=message):
                await client.post(endpoint, "/", b"x", CT, 5.0, 1.0,
                                  max_reply_bytes=256 << 10, max_error_bytes=4096)

    tracemalloc.start()
    try:
        run(scenario)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # the cap and socket buffers, not the endless reply


#: What the hostile expert may do with one request; see :func:`_hostile_expert`.
BEHAVIOURS = ("ok", "chunked", "informational", "leftover", "error", "error-too-big",
              "too-big", "garbage", "trickle", "silent", "close", "switch")
#: The caps the fuzz posts with: the right reply ("reply-to-req-<n>") and errors fit.
FUZZ_CAPS = {"max_reply_bytes": 64, "max_error_bytes": 96}
FUZZ_TIMEOUT_S = 0.25


def _right_reply(request: bytes, behaviour: str) -> tuple[int, bytes]:
    return (500, b"error-for-" + request) if behaviour == "error" else (200, b"reply-to-" + request)


def _hostile_expert(plans: list[tuple[str, list[int], bytes]]) -> Handler:
    """Answers each request (on any connection, in arrival order) as the next plan says:
    a behaviour, where to split the reply into writes, and garbage bytes."""
    async def handler(reader, writer):
        try:
            while True:
                request = await read_request(reader)
                behaviour, cuts, garbage = plans.pop(0) if plans else ("ok", [], b"")
                status, body = _right_reply(request, behaviour)
                forged = answer(200, b"reply-to-req-forged")
                cut = cuts[0] if cuts else len(forged)
                if behaviour == "chunked":
                    ends = sorted({c % (len(body) + 1) for c in cuts})
                    pieces = [body[a:b] for a, b in zip([0, *ends], [*ends, len(body)]) if b > a]
                    data = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                            + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
                            + b"0\r\n\r\n")
                else:
                    data = {
                        "informational": b"HTTP/1.1 100 Continue\r\n\r\n" + answer(status, body),
                        # all or part of a forged reply: a part would be finished by the
                        # next request's reply if the client kept reading
                        "leftover": answer(status, body) + forged[:cut % len(forged) + 1],
                        "error-too-big": answer(500, b"e" * 200),
                        "too-big": answer(200, b"r" * 200),
                        "garbage": b"\x00" + garbage,
                        "switch": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
                    }.get(behaviour, answer(status, body))
                if behaviour == "silent":
                    await reader.read()
                    return
                if behaviour == "close":
                    writer.close()
                    return
                cuts = sorted({c % (len(data) + 1) for c in cuts})
                for a, b in zip([0, *cuts], [*cuts, len(data)]):
                    writer.write(data[a:b])
                    await writer.drain()
                    if behaviour == "trickle":
                        await asyncio.sleep(FUZZ_TIMEOUT_S / 4)
                if behaviour == "trickle":  # a byte at a time: past any deadline
                    for byte in range(len(data)):
                        writer.write(data[byte:byte + 1])
                        await asyncio.sleep(FUZZ_TIMEOUT_S / 4)
        except (asyncio.IncompleteReadError, ConnectionError):
            return
    return handler


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(BEHAVIOURS),
                          st.lists(st.integers(0, 200), max_size=4),
                          st.binary(max_size=64)), min_size=1, max_size=10))
def test_a_hostile_expert_never_gets_a_wrong_answer_taken_or_a_call_held_past_its_deadline(
        plans):
    """Whatever the expert sends, each call returns the right reply to its own request, or
    fails with HttpClientError or TimeoutError, within its deadline."""
    outcomes = []

    async def scenario(client: HttpClient):
        async with raw_server(_hostile_expert(list(plans))) as endpoint:
            for n in range(len(plans)):
                request = b"req-%d" % n
                started = time.monotonic()
                try:
                    reply = await client.post(endpoint, "/", request, CT, FUZZ_TIMEOUT_S, 1.0,
                                              **FUZZ_CAPS)
                except (HttpClientError, TimeoutError) as error:
                    outcomes.append((request, type(error).__name__, time.monotonic() - started))
                    continue
                outcomes.append((request, (reply.status, reply.body), time.monotonic() - started))

    run(scenario)
    for request, outcome, seconds in outcomes:
        # a silent expert would hold the call for ever but for the deadline; the margin is
        # a loaded machine's
        assert seconds < FUZZ_TIMEOUT_S + 1.0, (request, outcome, seconds)
        if isinstance(outcome, tuple):
            assert outcome in {(200, b"reply-to-" + request), (500, b"error-for-" + request)}, (
                request, outcome, plans)
