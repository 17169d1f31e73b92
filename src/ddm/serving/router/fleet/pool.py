"""The router's caller of its experts: velocity and integrate calls, merged across concurrent
generations (:mod:`ddm.serving.router.fleet.coalescing`) and sent through the experts'
:class:`~ddm.serving.router.fleet.servers.ModelServers` (replicas, load balancing, failover,
probing: what every caller of a model server shares).

Experts take their conditioning as a context (``docs/protocol.md``: text, version 2; labels,
version 4), sent once per replica. A label call's rows are rows of its expert's label context
(:mod:`~ddm.serving.router.fleet.label_contexts`: the classes it serves); a call's text rows are
looked up in the contexts the pool has made (:class:`_Contexts`: by the SHA-256
of each row's embeddings, mask and negative row), a new context is made of the call's distinct
rows where none holds them all, and the replica is sent that context before its first call
naming it. A replica that answers ``UNKNOWN_CONTEXT`` (it evicted the context, or restarted) is
sent it again and the call retried at once, within the same attempt: calls stay pure functions
of their inputs, and a context is content-addressed, so re-sending is always safe. Only calls
on the same context merge into one request.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Awaitable, Hashable, Iterable, Mapping, Protocol

import numpy as np

from ddm.conditioning import Conditioning, guided_rows, row_keys
from ddm.deploy.limits import MAX_CONTEXT_BODY_BYTES, MAX_CONTEXT_ROWS
from ddm.deploy.router_config import Discovery, RouterConfigFile
from ddm.serving.http.auth import TokenFile
from ddm.serving.router.fleet.coalescing import Coalescer
from ddm.serving.router.fleet.label_contexts import LabelContexts
from ddm.serving.router.fleet.pool_calls import PoolCalls
from ddm.serving.router.fleet.replicas import EndpointSource, ExpertInfo, Replica
from ddm.serving.router.fleet.servers import (ModelServers, PoolMetrics, PoolSettings,
                                              discovered_sources, gather_all)
from ddm.serving.wire.protocol import (UNKNOWN_CONTEXT, Context, IntegrateRequest, ProtocolError,
                                       RemoteExpertError, Solver, VelocityRequest, context_id,
                                       decode_context_ack, decode_response, encode_request,
                                       max_error_reply_bytes, max_reply_bytes)



@dataclass(frozen=True)
class _IntegrateKey:
    """Integrate calls merge only with calls on the same solver and time grid."""

    solver: Solver
    grid: bytes  # float32, little-endian


@dataclass(frozen=True)
class _ContextKey:
    """Calls merge only with calls on the same context (and, integrating, the same solver and
    grid); the key carries the context's body, to send to a replica that lacks it."""

    context: bytes  # its id
    integrate: _IntegrateKey | None = None
    body: bytes = field(default=b"", compare=False, repr=False)


_Request = VelocityRequest | IntegrateRequest


def _pooled_scope(key: Hashable) -> Hashable:
    """What a pool member's request counts against in its coalescer: a velocity call its
    context's own in-flight limit (one pool request carries every context's calls of a step),
    an integrate call, a request of its own to the member's route, the one limit."""
    assert isinstance(key, _ContextKey)
    return key if key.integrate is None else None

#: Context ids the pool remembers a replica holds (it may have evicted them: it says so).
MAX_KNOWN_CONTEXTS = 1024


class _Made(Protocol):
    """A context the pool made (of text rows, or of labels): its id and body."""

    id: bytes
    body: bytes


def _request(key: _ContextKey, request_id: int, inputs: tuple[np.ndarray, ...]) -> _Request:
    """The protocol request for a (possibly merged) call with ``key``."""
    if key.integrate is None:
        x, t, rows, guidance = inputs
        return VelocityRequest(request_id, x, t, key.context, rows, guidance)
    x, rows, guidance = inputs
    return IntegrateRequest(request_id, x, key.context, rows, guidance,
                                np.frombuffer(key.integrate.grid, "<f4"), key.integrate.solver)


@dataclass(frozen=True, eq=False)
class _MadeContext:
    id: bytes
    body: bytes
    embeddings: np.ndarray  # (N, L, D) float32
    mask: np.ndarray  # (N, L) uint8
    negative: np.ndarray  # (N, L, D), or (0, L, D)
    rows: dict[bytes, int]  # a row's digests (plain, and with its negative) -> its index


class _Contexts:
    """The contexts the pool has made, least recently used dropped past ``max_bytes`` of
    bodies (dropping one costs only re-making it). A row is known by the SHA-256 of its
    embeddings and mask (enough for an unguided row) and, with its negative row, for a guided
    one; a call uses a context holding all its rows, else a new one made of the most recent
    context that shares a row with it plus its other rows, so that the steps of a generation,
    whatever rows routing sends an expert and whether or not guidance is cut off, soon name
    one context that every replica keeps. A context never grows past what an expert takes
    (:data:`MAX_CONTEXT_ROWS` rows, a body of :data:`MAX_CONTEXT_BODY_BYTES`): a call that
    would grow it so starts a context of its own rows."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._made: OrderedDict[bytes, _MadeContext] = OrderedDict()

    def rows_of(self, cond: Conditioning, guided: np.ndarray) -> tuple[_MadeContext, np.ndarray]:
        """A context holding every row of ``cond`` (text; ``guided`` rows with their negative
        rows), and each row's index in it."""
        keys = _row_digests(cond, guided)
        for made in reversed(self._made.values()):
            if all(k in made.rows for k in keys):
                self._made.move_to_end(made.id)
                return made, np.array([made.rows[k] for k in keys], np.int32)
        base = next((m for m in reversed(self._made.values()) if any(k in m.rows for k in keys)),
                    None)
        made = _made_of(cond, keys, base)
        if base is not None and (made.embeddings.shape[0] > MAX_CONTEXT_ROWS
                                 or len(made.body) > MAX_CONTEXT_BODY_BYTES):
            made = _made_of(cond, keys, None)
        self._made[made.id] = made
        self.bytes += len(made.body)
        while self.bytes > self.max_bytes and len(self._made) > 1:
            _, dropped = self._made.popitem(last=False)
            self.bytes -= len(dropped.body)
        return made, np.array([made.rows[k] for k in keys], np.int32)


def _made_of(cond: Conditioning, keys: list[bytes], base: _MadeContext | None) -> _MadeContext:
    """A context of ``base``'s rows (if any) and the rows of ``cond`` it lacks."""
    assert cond.embeddings is not None
    new = [i for i, k in enumerate(keys)
           if (base is None or k not in base.rows) and k not in keys[:i]]
    embeddings = np.ascontiguousarray(cond.embeddings[new], np.float32)
    mask = (np.ones(embeddings.shape[:2], np.uint8) if cond.mask is None
            else np.asarray(cond.mask[new], np.uint8))
    negative = (np.ascontiguousarray(cond.negative.embeddings[new], np.float32)
                if cond.negative is not None else None)
    if base is not None:
        if negative is None and base.negative.shape[0]:
            negative = np.zeros_like(embeddings)  # placeholders: no guided key names them
        elif negative is not None and not base.negative.shape[0]:
            base = _with_placeholder_negative(base)
        embeddings = np.concatenate([base.embeddings, embeddings])
        mask = np.concatenate([base.mask, mask])
        if negative is not None:
            negative = np.concatenate([base.negative, negative])
    if negative is None:
        negative = np.zeros((0, *embeddings.shape[1:]), np.float32)
    rows = dict(base.rows) if base is not None else {}
    offset = 0 if base is None else base.embeddings.shape[0]
    plain = _row_digests(cond, np.zeros(len(cond), bool))
    with_negative = (_row_digests(cond, np.ones(len(cond), bool)) if cond.negative is not None
                     else None)
    for position, i in enumerate(new):
        rows[plain[i]] = offset + position
        if with_negative is not None:
            rows[with_negative[i]] = offset + position
    body = encode_request(Context(0, embeddings, mask, negative))
    return _MadeContext(context_id(body), body, embeddings, mask, negative, rows)


def _with_placeholder_negative(made: _MadeContext) -> _MadeContext:
    """``made`` with zero negative rows, which no guided row's digest names."""
    return _MadeContext(made.id, made.body, made.embeddings, made.mask,
                        np.zeros_like(made.embeddings),
                        {k: i for k, i in made.rows.items()})


def _row_digests(cond: Conditioning, guided: np.ndarray) -> list[bytes]:
    """Each row's digest: its content key (:func:`~ddm.conditioning.row_keys`: its
    embeddings and mask; made once per generation where ``cond`` is keyed), and for a
    ``guided`` row that key with its negative row's."""
    plain = [key.tobytes() for key in row_keys(cond)]
    if not guided.any():
        return plain
    assert cond.negative is not None
    negative = row_keys(cond.negative)
    return [hashlib.sha256(plain[i] + b"negative" + negative[i].tobytes()).digest()
            if guided[i] else plain[i] for i in range(len(cond))]


def context_rows(cond: Conditioning) -> int:
    """How many of ``cond``'s text rows one context an expert takes holds: at most
    :data:`MAX_CONTEXT_ROWS`, and a body within :data:`MAX_CONTEXT_BODY_BYTES` (each row's
    embeddings, its negative row and its mask; 141 rows of Paris's 77 x 768), so that a call
    of more rows than that (a router's ``max_batch`` above them) is sent as several."""
    assert cond.embeddings is not None
    _, tokens, width = cond.embeddings.shape
    row = tokens * (2 * 4 * width + 1)
    return max(1, min(MAX_CONTEXT_ROWS, (MAX_CONTEXT_BODY_BYTES - _CONTEXT_HEADER_BYTES) // row))


#: A context body's bytes besides its rows: the header and padding (a few dozen bytes).
_CONTEXT_HEADER_BYTES = 4096


async def _joined(calls: Iterable[Awaitable[np.ndarray]]) -> np.ndarray:
    """The calls' rows, concatenated in order (one call: its answer as it is)."""
    outs = await gather_all(*calls)
    return outs[0] if len(outs) == 1 else np.concatenate(outs)


def _guidance(cond: Conditioning) -> np.ndarray:
    """The rows' guidance scales (float32, 1: unguided); a guided row needs its negative row
    (the router's empty-prompt or negative-prompt embeddings: an expert has no text
    encoder)."""
    guided_rows(cond.guidance, len(cond), cond.negative is not None, "the conditioning")
    return (np.ones(len(cond), np.float32) if cond.guidance is None
            else np.asarray(cond.guidance, np.float32))


# ----------------------------------------------------------------------------------- pool


class ExpertPool:
    """Calls experts by name over the binary protocol. Use as ``async with``; shared by every
    request of a router (it holds replicas and connections, never a request's state).

    It owns what only expert calls need: a coalescer per expert, the text contexts it has made
    (and which replica holds which), and a pool server's per-step requests (:class:`PoolCalls`);
    the replicas, probes and the call itself (attempts, retries, failover, giving up) are its
    :class:`ModelServers`'."""

    def __init__(self, sources: Mapping[str, EndpointSource], settings: PoolSettings,
                 metrics: PoolMetrics | None = None, token: TokenFile | None = None,
                 members: Mapping[str, str] | None = None) -> None:
        """``members``: expert name -> its member name on pool servers (``router.yaml``'s
        ``discovery.member``), for those served in a pool."""
        self._servers = ModelServers(sources, settings, ExpertInfo.from_json, metrics, token,
                                     members)
        self._settings = settings
        self.metrics = self._servers.metrics
        self._ids = itertools.count(1)
        self._pooled = PoolCalls(self._post_call, self._send_context, self._ids)
        self._coalescers = {name: self._coalescer(name) for name in sources}
        self._contexts = _Contexts(settings.context_cache_bytes)
        self._label_contexts = LabelContexts()
        #: Bytes sent to experts, by message: what the context cache saves (benchmarks).
        self.bytes_sent = {"context": 0, "call": 0}

    @property
    def context_bytes(self) -> int:
        """Bytes of the text contexts the pool holds (at most ``context_cache_bytes``, or one
        context larger than that)."""
        return self._contexts.bytes

    @classmethod
    def from_config(cls, config: RouterConfigFile, settings: PoolSettings,
                    metrics: PoolMetrics | None = None) -> ExpertPool:
        """The experts ``config`` lists; with ``auth`` configured, the router presents its
        expert token (``auth.expert_token_file``) to them (``ddm serve expert
        --auth-token-file``)."""
        token = TokenFile(config.auth.expert_token) if config.auth is not None else None
        return cls.discovered({e.name: e.discovery for e in config.experts}, settings, metrics,
                              token)

    @classmethod
    def discovered(cls, discoveries: Mapping[str, Discovery], settings: PoolSettings,
                   metrics: PoolMetrics | None = None,
                   token: TokenFile | None = None) -> ExpertPool:
        """Experts by name, each where its ``router.yaml`` discovery says (its endpoints,
        and its routes: a pool member's where it names one)."""
        sources, members = discovered_sources(discoveries)
        return cls(sources, settings, metrics, token, members)

    async def __aenter__(self) -> ExpertPool:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Open the client, list every expert's replicas, and start refreshing and probing."""
        await self._servers.start()

    async def close(self) -> None:
        for coalescer in self._coalescers.values():
            await coalescer.close()
        await self._pooled.close()
        await self._servers.close()

    async def refresh(self) -> None:
        """Ask every source for its endpoints now; a source that fails keeps its last list."""
        await self._servers.refresh()

    def replicas(self, expert: str) -> tuple[Replica, ...]:
        return self._servers.replicas(expert)

    def ready_count(self, expert: str) -> int:
        return self._servers.ready_count(expert)

    def usable(self, expert: str) -> bool:
        """Some replica of ``expert`` is not down: a call may go out now."""
        return self._servers.usable(expert)

    async def wait_usable(self, expert: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a usable replica of ``expert``; False if none."""
        return await self._servers.wait_usable(expert, timeout)

    async def wait_missing(self, expert: str) -> None:
        """Until no replica of ``expert`` is usable."""
        await self._servers.wait_missing(expert)

    def info(self, expert: str) -> ExpertInfo | None:
        """What the expert's replicas say of it in ``/v1/info``; None until one has been
        probed ready."""
        return self._servers.info(expert)

    def invalid_report(self, expert: str) -> str | None:
        """Why, when every replica of ``expert`` last sent a report the router refused; None
        otherwise."""
        return self._servers.invalid_report(expert)

    async def velocity(self, expert: str, x: np.ndarray, t: np.ndarray,
                       cond: Conditioning) -> np.ndarray:
        """``v(x, t, cond)`` from ``expert``: ``x`` (B, C, H, W), ``t`` (B,), ``cond`` B rows
        of labels, or of text (guided per row by ``cond.guidance`` against ``cond.negative``),
        as rows of contexts."""
        guidance = _guidance(cond)
        return await _joined(self._rows(expert, _ContextKey(made.id, body=made.body),
                                        (x[part], t[part], rows, guidance[part]))
                             for part, made, rows in await self._in_contexts(expert, cond,
                                                                             guidance))

    async def integrate(self, expert: str, x: np.ndarray, cond: Conditioning,
                        grid: np.ndarray, solver: str) -> np.ndarray:
        """The state at ``grid[-1]`` after ``expert`` integrates from ``x`` at ``grid[0]``."""
        try:
            code = Solver[solver.upper()]
        except KeyError:
            raise ValueError(f"unknown solver {solver!r}") from None
        grid = np.ascontiguousarray(grid, dtype="<f4")
        key = _IntegrateKey(code, grid.tobytes())
        guidance = _guidance(cond)
        return await _joined(self._rows(expert, _ContextKey(made.id, key, made.body),
                                        (x[part], rows, guidance[part]))
                             for part, made, rows in await self._in_contexts(expert, cond,
                                                                             guidance))

    async def _in_contexts(self, expert: str, cond: Conditioning, guidance: np.ndarray
                           ) -> list[tuple[slice, _Made, np.ndarray]]:
        """A call's rows in runs of what one context holds, each with its context and its
        rows' indices in it: a label call's in the expert's label context
        (:mod:`~ddm.serving.router.fleet.label_contexts`: its classes, known once a replica is
        probed), a text call's in runs of :func:`context_rows`."""
        if cond.labels is not None:
            info = await self._servers.described(expert)
            return list(self._label_contexts.rows_of(info.classes, cond.labels))
        per = context_rows(cond)
        if len(cond) <= per:  # every step of a DDM within its limits: no copy of the rows
            return [(slice(None), *self._contexts.rows_of(cond, guidance != 1.0))]
        parts = [slice(start, start + per) for start in range(0, len(cond), per)]
        return [(part, *self._contexts.rows_of(cond.take(np.arange(len(cond))[part]),
                                               guidance[part] != 1.0)) for part in parts]

    async def _rows(self, expert: str, key: _ContextKey,
                    inputs: tuple[np.ndarray, ...]) -> np.ndarray:
        """Split a call into the expert's ``max_batch`` rows and submit the parts concurrently
        to the expert's coalescer, which merges them with other generations' calls."""
        made = time.monotonic()  # the call's deadline runs from here
        info = await self._servers.described(expert)
        coalescer = self._coalescers[expert]
        rows = inputs[0].shape[0]
        size = info.rows_per_call
        parts = [tuple(a[i:i + size] for a in inputs) for i in range(0, rows, size)]
        outs = await gather_all(*(coalescer.submit(key, part, made) for part in parts))
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def _coalescer(self, expert: str) -> Coalescer:
        """Merges ``expert``'s concurrent calls; sends each request through :meth:`_call`. A
        pool member's velocity calls are limited per context (:func:`_pooled_scope`): its pool
        gathers the calls of every context into one request per step."""
        replicas = self._servers.replica_set(expert)
        per_replica = self._settings.in_flight_per_replica
        rows = self.metrics.request_rows.labels(expert)

        async def send(key: Hashable, inputs: tuple[np.ndarray, ...],
                       since: float) -> np.ndarray:
            rows.observe(inputs[0].shape[0])
            assert isinstance(key, _ContextKey), "every call names a context"
            return await self._call(expert, _request(key, next(self._ids), inputs),
                                    since + self._settings.deadline_s, key)

        def max_rows() -> int:
            info = replicas.info()
            return info.rows_per_call if info is not None and per_replica else 1

        return Coalescer(send, max_rows, lambda: max(1, replicas.ready_count()) * per_replica,
                         scope=_pooled_scope if expert in self._servers.members else None)

    async def _call(self, expert: str, request: _Request, deadline: float,
                    context: _ContextKey) -> np.ndarray:
        """One expert request, on the replicas :meth:`ModelServers.send` picks. A pool
        member's velocity calls go to its pool in one request per step
        (:mod:`ddm.serving.router.fleet.pool_calls`)."""
        kind = "velocity" if isinstance(request, VelocityRequest) else "integrate"
        member = self._servers.members.get(expert)
        if member is not None and isinstance(request, VelocityRequest):
            def pooled(replica: Replica, timeout: float) -> Awaitable[np.ndarray]:
                return self._pooled_attempt(expert, member, replica, request, timeout,
                                            context)

            def joins(replica: Replica) -> bool:
                return self._pooled.joins(replica, member, request.x.shape[0])

            return await self._servers.send(expert, kind, pooled, deadline, joins)
        body = encode_request(request)

        def attempt(replica: Replica, timeout: float) -> Awaitable[np.ndarray]:
            return self._attempt(expert, replica, body, request, timeout, context)

        return await self._servers.send(expert, kind, attempt, deadline)

    async def _attempt(self, expert: str, replica: Replica, body: bytes, request: _Request,
                       timeout: float, context: _ContextKey) -> np.ndarray:
        """One exchange with one replica (two or three for a call whose context the replica
        lacks: sent first, or again after ``UNKNOWN_CONTEXT``)."""

        async def exchange(ends: float) -> np.ndarray:
            if context.context not in replica.contexts:
                await self._send_context(replica, context.context, context.body, ends)
            try:
                return await self._exchange(replica, body, request, ends)
            except RemoteExpertError as error:
                if error.code != UNKNOWN_CONTEXT:
                    raise
                replica.contexts.pop(context.context, None)  # evicted, or a restart
                await self._send_context(replica, context.context, context.body, ends)
                return await self._exchange(replica, body, request, ends)

        out = await self._servers.guarded(expert, replica, timeout, exchange)
        return out.astype(np.float32, copy=False)  # an expert may answer in (b)float16

    async def _pooled_attempt(self, expert: str, member: str, replica: Replica,
                              request: VelocityRequest, timeout: float,
                              context: _ContextKey) -> np.ndarray:
        """:meth:`_attempt` for a pool member: its rows go in its pool's request of this turn
        (:class:`~ddm.serving.router.fleet.pool_calls.PoolCalls`)."""

        def exchange(ends: float) -> Awaitable[np.ndarray]:
            return self._pooled.velocity(replica, member, request, context.body, ends)

        out = await self._servers.guarded(expert, replica, timeout, exchange)
        return out.astype(np.float32, copy=False)

    async def _exchange(self, replica: Replica, body: bytes, request: _Request,
                        ends: float) -> np.ndarray:
        """POST one call, decode its reply (:class:`RemoteExpertError` for an error reply)."""
        reply = await self._post_call(replica, replica.paths.velocity, body,
                                      max_reply_bytes(request.x.shape), ends)
        return decode_response(reply, request.request_id, request.x.shape)

    async def _post_call(self, replica: Replica, path: str, body: bytes, max_reply: int,
                         ends: float) -> bytes:
        """:meth:`ModelServers.post` of an expert call (a member's, or a pool's), counted in
        :attr:`bytes_sent`."""
        reply = await self._servers.post(replica, path, body, max_reply, ends)
        self.bytes_sent["call"] += len(body)
        return reply

    async def _send_context(self, replica: Replica, context: bytes, body: bytes,
                            ends: float) -> None:
        """Send the context ``context`` (its id) encoded as ``body`` to ``replica``, check
        the id it acknowledges, remember it."""
        request_id = next(self._ids)
        body = body[:8] + request_id.to_bytes(8, "little") + body[16:]
        reply = await self._servers.post(replica, replica.paths.velocity, body,
                                         max_error_reply_bytes(), ends)
        self.bytes_sent["context"] += len(body)
        acknowledged = decode_context_ack(reply, request_id)
        if acknowledged != context:
            raise ProtocolError(f"the expert acknowledged context {acknowledged.hex()[:16]} "
                                f"for {context.hex()[:16]}")
        replica.contexts[context] = None
        while len(replica.contexts) > MAX_KNOWN_CONTEXTS:
            replica.contexts.popitem(last=False)
