"""Hostile clients on raw loopback sockets: connections that stay idle, trickle a request, send
part of a body, or send a header block too large, each recording when and how the server ended
it (``ddm.serving.http.connections`` says what each may cost)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from ddm.serving.http.connections import ConnectionLimits

#: What each kind of attacker does, and the deadline (a ConnectionLimits field) that ends it.
KINDS = {
    "idle": "head_timeout_s",            # connects and sends nothing
    "partial-line": "head_timeout_s",    # half a request line
    "trickled-head": "head_timeout_s",   # a header value, one byte every TRICKLE_S
    "slow-body": "body_timeout_s",       # declares 4 KiB, sends 16 bytes (took an expert offline)
    "huge-head": "head_timeout_s",       # 64 KiB of headers in one go
    "idle-keep-alive": "keep_alive_s",   # one request, then nothing
}
#: What the server answers each kind before closing (None: closes without a word).
EXPECTED_STATUS = {"idle": None, "partial-line": 408, "trickled-head": 408, "slow-body": 408,
                   "huge-head": 431, "idle-keep-alive": 200}
TRICKLE_S = 0.25
HUGE_HEAD_BYTES = 64 * 1024
_KEEP = 4096  # bytes of the server's answer kept per attacker


@dataclass
class Attacker:
    kind: str
    opened: float
    sent: int = 0
    closed: float | None = None
    reply: bytes = b""
    reset: bool = False  # the server closed with unread bytes in its buffer (RST)

    @property
    def status(self) -> int | None:
        if not self.reply.startswith(b"HTTP/1.1 "):
            return None
        return int(self.reply[9:12])

    @property
    def lasted_s(self) -> float:
        assert self.closed is not None
        return self.closed - self.opened


async def attack(host: str, port: int, kind: str, path: str) -> tuple[Attacker, asyncio.Task]:
    """Open one hostile connection of ``kind``; the task ends when the server closes it."""
    reader, writer = await asyncio.open_connection(host, port)
    attacker = Attacker(kind, time.monotonic())

    def send(data: bytes) -> None:
        attacker.sent += len(data)
        writer.write(data)

    async def run() -> None:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\n"
        if kind == "partial-line":
            send(f"POST {path[:4]}".encode())
        elif kind == "slow-body":
            send(f"{head}Content-Type: application/octet-stream\r\nContent-Length: 4096\r\n\r\n"
                 f"{'x' * 16}".encode())
        elif kind == "huge-head":
            send(f"{head}X-Big: {'a' * HUGE_HEAD_BYTES}\r\n\r\n".encode())
        elif kind == "idle-keep-alive":
            send(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        elif kind == "trickled-head":
            send(f"{head}X-Slow: ".encode())
        reading = asyncio.ensure_future(_read_to_end(reader, attacker))
        while kind == "trickled-head" and not reading.done():
            try:
                send(b"a")
                await writer.drain()
            except ConnectionError:
                break
            await asyncio.wait([reading], timeout=TRICKLE_S)
        await reading
        writer.close()

    return attacker, asyncio.ensure_future(run())


async def _read_to_end(reader: asyncio.StreamReader, attacker: Attacker) -> None:
    try:
        while chunk := await reader.read(65536):
            attacker.reply = (attacker.reply + chunk)[:_KEEP]
    except ConnectionResetError:
        attacker.reset = True
    attacker.closed = time.monotonic()


async def swarm(host: str, port: int, path: str, per_kind: dict[str, int]
                ) -> tuple[list[Attacker], list[asyncio.Task]]:
    """Open ``per_kind[kind]`` connections of each kind, interleaved."""
    attackers, tasks = [], []
    for round_ in range(max(per_kind.values())):
        for kind, count in per_kind.items():
            if round_ < count:
                attacker, task = await attack(host, port, kind, path)
                attackers.append(attacker)
                tasks.append(task)
    return attackers, tasks


def check_closed_in_time(attackers: list[Attacker], limits: ConnectionLimits,
                         slack_s: float) -> dict[str, float]:
    """Every attacker was closed by the server, as its kind expects, within its deadline (plus
    ``slack_s`` for a busy machine); returns the longest any kind lasted."""
    longest: dict[str, float] = {}
    for attacker in attackers:
        deadline = getattr(limits, KINDS[attacker.kind])
        assert attacker.closed is not None, f"{attacker.kind}: still open"
        assert attacker.lasted_s <= deadline + slack_s, (
            f"{attacker.kind}: closed after {attacker.lasted_s:.2f} s, deadline {deadline} s")
        expected = EXPECTED_STATUS[attacker.kind]
        if not (attacker.kind == "huge-head" and attacker.reset):
            assert attacker.status == expected, (attacker.kind, attacker.reply[:200])
        longest[attacker.kind] = max(longest.get(attacker.kind, 0.0), attacker.lasted_s)
    return longest
