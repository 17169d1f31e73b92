"""The router's client for its experts: load balancing, failover, probing and refreshing.

The router calls an expert at every denoising step, so a call must cost one round trip on a warm
connection and survive a replica dying mid-generation. Per expert the pool keeps the replicas its
endpoint source lists (:mod:`ddm.serving.router.fleet.replicas`: a static list, a DNS name
re-resolved every ``refresh_s``, or any async callable) and sends each call to the usable replica
with the fewest requests in flight, round-robin among ties. A failed attempt is retried on another
replica within the call's deadline; expert calls are pure functions of their inputs, so a retry is
always safe. Only what says the replica itself is unwell changes its health: a transport failure
(no connection, no answer in time), a 503 (loading or closing) or a 401 marks it down, and it is
then only re-probed (``GET /readyz``), with a doubling backoff, until it answers again; ready
replicas are re-probed every ``health_interval_s`` so that readiness reflects replicas that died
while idle. An answer a request may provoke (a 500, a malformed or non-finite reply, a 408 or 429)
is retried elsewhere but leaves the replica's state to the probes, and an expert's other 4xx is
that request's fault, never retried: a 422 (values the expert refuses, or whose output is not
finite, ``docs/protocol.md``) is the client's 422, any other the router's 502. So no request,
however hostile, can take replicas down or the router's ``/readyz`` with them (issue 35).

Expert calls and probes (``/readyz``, ``/v1/info``) go through one
:class:`~ddm.serving.http.client.HttpClient`, a lean keep-alive HTTP/1.1 client (its cost is
paid at every step). It keeps ``TCP_NODELAY`` on (asyncio and uvloop set it on every TCP
connection), so a small request is not held back by Nagle's algorithm;
``tests/unit/test_expert_pool.py`` checks it.

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

An expert is a peer, not a part of the router: every body read from it is capped (a velocity
reply at what the request implies, ``/readyz`` at ``MAX_EXPERT_PROBE_BYTES``, ``/v1/info`` at
``MAX_EXPERT_INFO_BYTES``) and its ``/v1/info`` is validated
(:meth:`~ddm.serving.router.fleet.replicas.ExpertInfo.from_json`). A replica whose answer is refused
is not ready, and an expert all of whose replicas are refused is unavailable at once (503)
rather than waited for. What an expert says goes to the log, never to the router's callers:
:attr:`ExpertError.public` is the router's own words.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import (Any, Awaitable, Callable, Coroutine, Hashable, Iterable, Mapping, Protocol,
                    TypeVar)

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram

from ddm.conditioning import Conditioning, guided_rows
from ddm.deploy.limits import (DEFAULT_CONTEXT_CACHE_BYTES, MAX_CONTEXT_BODY_BYTES,
                               MAX_CONTEXT_ROWS, MAX_EXPERT_INFO_BYTES, MAX_EXPERT_PROBE_BYTES)
from ddm.serving.http.auth import TokenFile
from ddm.serving.router.fleet.coalescing import Coalescer
from ddm.serving.router.fleet.label_contexts import LabelContexts
from ddm.serving.http.fetch import FetchError, decode_json
from ddm.serving.router.fleet.pool_calls import PoolCalls
from ddm.serving.http.client import HttpClient, HttpClientError, HttpReply, ReplyTooLarge
from ddm.serving.wire.protocol import (CONTENT_TYPE, UNKNOWN_CONTEXT, Context, ProtocolError,
                                       RemoteExpertError, Solver, TextIntegrateRequest,
                                       TextVelocityRequest, context_id, decode_context_ack,
                                       decode_response, encode_text_request,
                                       max_error_reply_bytes, max_reply_bytes)
from ddm.serving.router.fleet.replicas import (EndpointSource, ExpertInfo, InvalidReport, Replica,
                                               ReplicaSet, ReplicaState, source_for)
from ddm.deploy.router_config import Discovery, RouterConfigFile
from ddm.serving.wire.paths import model_paths

logger = logging.getLogger(__name__)

#: How often the prober looks for replicas due for a probe.
PROBE_TICK_S = 0.1
#: Shorter than the expert server's keep-alive (75 s), so that the client, not the server,
#: closes an idle connection and a request never goes out on one the server is closing.
KEEP_ALIVE_S = 60.0
#: An expert's error replies: the protocol's largest, or a server layer's short text (408, 431).
_MAX_ERROR_BYTES = max_error_reply_bytes()
# Statuses that say "this replica, now" rather than "your request": retried elsewhere.
_RETRIABLE_4XX = (408, 429)
_T = TypeVar("_T")
_Pool = TypeVar("_Pool", bound="ExpertPool")


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


_Request = TextVelocityRequest | TextIntegrateRequest
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
        return TextVelocityRequest(request_id, x, t, key.context, rows, guidance)
    x, rows, guidance = inputs
    return TextIntegrateRequest(request_id, x, key.context, rows, guidance,
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
        keys = [_row_digest(cond, i, bool(guided[i])) for i in range(len(cond))]
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
    for position, i in enumerate(new):
        rows[_row_digest(cond, i, False)] = offset + position
        if cond.negative is not None:
            rows[_row_digest(cond, i, True)] = offset + position
    body = encode_text_request(Context(0, embeddings, mask, negative))
    return _MadeContext(context_id(body), body, embeddings, mask, negative, rows)


def _with_placeholder_negative(made: _MadeContext) -> _MadeContext:
    """``made`` with zero negative rows, which no guided row's digest names."""
    return _MadeContext(made.id, made.body, made.embeddings, made.mask,
                        np.zeros_like(made.embeddings),
                        {k: i for k, i in made.rows.items()})


def _row_digest(cond: Conditioning, row: int, with_negative: bool) -> bytes:
    """SHA-256 of row ``row``'s embeddings (shape and bytes) and mask, and of its negative row
    ``with_negative``."""
    assert cond.embeddings is not None
    digest = hashlib.sha256(str(cond.embeddings.shape[1:]).encode())
    digest.update(np.ascontiguousarray(cond.embeddings[row], np.float32).tobytes())
    mask = (np.ones(cond.embeddings.shape[1], np.uint8) if cond.mask is None
            else np.asarray(cond.mask[row], np.uint8))
    digest.update(mask.tobytes())
    if with_negative:
        assert cond.negative is not None and cond.negative.embeddings is not None
        digest.update(b"negative")
        digest.update(np.ascontiguousarray(cond.negative.embeddings[row], np.float32).tobytes())
    return digest.digest()


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


class ExpertError(RuntimeError):
    """A call to ``expert`` failed; ``status`` is the HTTP status the router answers with.

    The message (for the log) says everything, what the expert said included; ``public`` (for
    the caller) names the expert and ``summary``, the router's own words."""

    status = 502

    def __init__(self, expert: str, reason: str, summary: str) -> None:
        super().__init__(f"expert {expert}: {reason}")
        self.expert = expert
        self.reason = reason
        self.public = f"expert {expert}: {summary} (details in the router's log)"


class ExpertUnavailable(ExpertError):
    """No replica of ``expert`` answered within the call's deadline and attempts, or every
    replica's report was refused."""

    status = 503

    def __init__(self, expert: str, reason: str,
                 summary: str = "no replica gave a usable answer in time") -> None:
        super().__init__(expert, f"unavailable: {reason}", f"unavailable: {summary}")


class _ReplicaFailed(Exception):
    """One attempt failed in a way another replica may not: retried elsewhere. ``down``: the
    failure says the replica itself is unwell (no connection or answer, a 503, a 401), so it
    is marked down until a probe finds it ready; otherwise (an answer the request may have
    provoked) its state is left to the probes."""

    def __init__(self, reason: str, down: bool) -> None:
        super().__init__(reason)
        self.down = down


class ExpertRejected(ExpertError):
    """The expert refused the request with a 4xx (``code``), not a replica failure, so it is
    not retried: a 422 refuses the request's values (a state beyond the wire's bound, an output
    that is not finite: the client's values, answered 422), any other 4xx something the router
    should not have sent (a misconfiguration, answered 502)."""

    def __init__(self, expert: str, code: int, message: str) -> None:
        values = code == 422
        super().__init__(expert, f"refused the request ({code}): {message}",
                         "refused this request's values (422: beyond what it computes, or "
                         "its output would not be finite)" if values
                         else f"refused the request ({code})")
        self.status = 422 if values else 502
        self.code = code


# -------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class PoolSettings:
    """Timeouts in seconds. ``attempt_s`` bounds one HTTP exchange, ``deadline_s`` a whole call
    (every attempt, and waiting for a replica to come back); ``backoff_s`` is the first pause
    before a failed replica is probed again, doubling up to ``max_backoff_s``.
    ``in_flight_per_replica`` requests per ready replica of an expert may be outstanding before
    further calls to it wait and merge (:mod:`ddm.serving.router.fleet.coalescing`); 0 sends every
    call on its own. ``context_cache_bytes`` bounds the text contexts the pool keeps (router.yaml's
    ``limits.context_cache_bytes``)."""

    connect_s: float = 2.0
    attempt_s: float = 30.0
    deadline_s: float = 60.0
    attempts: int = 2
    backoff_s: float = 0.05
    max_backoff_s: float = 5.0
    health_interval_s: float = 5.0
    refresh_s: float = 5.0
    in_flight_per_replica: int = 2
    context_cache_bytes: int = DEFAULT_CONTEXT_CACHE_BYTES

    def __post_init__(self) -> None:
        for name in ("connect_s", "attempt_s", "deadline_s", "max_backoff_s",
                     "health_interval_s", "refresh_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PoolSettings.{name} must be > 0, got {getattr(self, name)!r}")
        if (self.attempts < 1 or self.backoff_s < 0 or self.in_flight_per_replica < 0
                or self.context_cache_bytes < 1):
            raise ValueError("PoolSettings needs attempts >= 1, backoff_s >= 0, "
                             "in_flight_per_replica >= 0 and context_cache_bytes >= 1")


def pool_settings(config: RouterConfigFile, deadline_s: float | None = None) -> PoolSettings:
    """Settings from ``router.yaml``; the deadline defaults to every attempt timing out."""
    return PoolSettings(
        connect_s=config.timeouts.connect_s, attempt_s=config.timeouts.request_s,
        deadline_s=deadline_s or config.retries.attempts * config.timeouts.request_s,
        attempts=config.retries.attempts, backoff_s=config.retries.backoff_s,
        refresh_s=config.dns_refresh_s,
        in_flight_per_replica=config.coalescing.in_flight_per_replica,
        context_cache_bytes=config.limits.context_cache_bytes)


class PoolMetrics:
    """Expert calls (one per attempt) by expert, kind and outcome; retries, failovers, and
    calls given up as unavailable."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.attempts = Counter(
            "ddm_router_expert_calls", "Expert requests sent, by expert, kind (velocity, "
            "integrate) and outcome (ok, rejected, failed).", ["expert", "kind", "outcome"],
            registry=registry)
        self.seconds = Histogram(
            "ddm_router_expert_call_seconds", "Round-trip time of successful expert requests.",
            ["expert", "kind"], registry=registry,
            buckets=(2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 5.0))
        self.request_rows = Histogram(
            "ddm_router_expert_request_rows", "Rows per expert request (one per request, not per "
            "attempt), after merging the calls of concurrent generations.", ["expert"],
            registry=registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.retries = Counter("ddm_router_expert_retries",
                               "Attempts after a failed attempt, by expert.", ["expert"],
                               registry=registry)
        self.failovers = Counter("ddm_router_expert_failovers",
                                 "Retries sent to another replica than the failed one.",
                                 ["expert"], registry=registry)
        self.unavailable = Counter("ddm_router_expert_unavailable",
                                   "Calls given up: no replica answered in time.", ["expert"],
                                   registry=registry)


# ----------------------------------------------------------------------------------- pool


class ExpertPool:
    """Calls experts by name over the binary protocol. Use as ``async with``; shared by every
    request of a router (it holds replicas and connections, never a request's state)."""

    def __init__(self, sources: Mapping[str, EndpointSource], settings: PoolSettings,
                 metrics: PoolMetrics | None = None, token: TokenFile | None = None,
                 members: Mapping[str, str] | None = None) -> None:
        """``members``: expert name -> its member name on pool servers (``router.yaml``'s
        ``discovery.member``), for those served in a pool."""
        self._sources = dict(sources)
        self._token = token  # sent to the experts as a bearer token (their --auth-token-file)
        self._settings = settings
        self.metrics = metrics or PoolMetrics(CollectorRegistry())
        #: Expert -> its member name, for those served by pool servers: their text velocity
        #: calls go to the pool in one request per step
        #: (:mod:`ddm.serving.router.fleet.pool_calls`).
        self._members = dict(members or {})
        self._sets = {name: ReplicaSet(settings.backoff_s, settings.max_backoff_s,
                                       settings.health_interval_s,
                                       model_paths(self._members.get(name)))
                      for name in sources}
        self._ids = itertools.count(1)
        self._pooled = PoolCalls(self._post_call, self._send_context, self._ids)
        self._coalescers = {name: self._coalescer(name) for name in sources}
        self._contexts = _Contexts(settings.context_cache_bytes)
        self._label_contexts = LabelContexts()
        #: Bytes sent to experts, by message: what the context cache saves (benchmarks).
        self.bytes_sent = {"context": 0, "call": 0}
        self._client: HttpClient | None = None
        self._tasks: set[asyncio.Task[None]] = set()

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
    def discovered(cls: type[_Pool], discoveries: Mapping[str, Discovery],
                   settings: PoolSettings, metrics: PoolMetrics | None = None,
                   token: TokenFile | None = None) -> _Pool:
        """Models by name, each where its ``router.yaml`` discovery says (its endpoints,
        and its routes: a pool member's where it names one)."""
        return cls({name: source_for(d) for name, d in discoveries.items()}, settings, metrics,
                   token, {name: d.member for name, d in discoveries.items()
                           if d.member is not None})

    async def __aenter__(self) -> ExpertPool:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Open the clients, list every expert's replicas, and start refreshing and probing."""
        self._client = HttpClient(KEEP_ALIVE_S)
        await self.refresh()
        self._spawn(self._refresh_forever())
        self._spawn(self._probe_forever())

    async def close(self) -> None:
        for coalescer in self._coalescers.values():
            await coalescer.close()
        await self._pooled.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            self._client.close()

    async def refresh(self) -> None:
        """Ask every source for its endpoints now; a source that fails keeps its last list."""

        async def one(name: str) -> None:
            try:
                endpoints = await self._sources[name]()
            except Exception as error:  # noqa: BLE001 - a failing source must not stop refreshing
                logger.warning("cannot list the replicas of expert %s: %s", name, error)
                return
            self._sets[name].update(endpoints)

        await gather_all(*(one(name) for name in self._sources))

    def replicas(self, expert: str) -> tuple[Replica, ...]:
        return self._replica_set(expert).replicas

    def ready_count(self, expert: str) -> int:
        return self._replica_set(expert).ready_count()

    def usable(self, expert: str) -> bool:
        """Some replica of ``expert`` is not down: a call may go out now."""
        return self._replica_set(expert).usable()

    async def wait_usable(self, expert: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a usable replica of ``expert``; False if none."""
        return await self._replica_set(expert).wait_usable(timeout)

    async def wait_missing(self, expert: str) -> None:
        """Until no replica of ``expert`` is usable."""
        await self._replica_set(expert).wait_missing()

    def info(self, expert: str) -> ExpertInfo | None:
        """What the expert's replicas say of it in ``/v1/info`` (:meth:`ReplicaSet.info`);
        None until one has been probed ready."""
        return self._replica_set(expert).info()

    def invalid_report(self, expert: str) -> str | None:
        """Why, when every replica of ``expert`` last sent a report the router refused
        (:meth:`ReplicaSet.invalid_report`); None otherwise."""
        return self._replica_set(expert).invalid_report()

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
            info = await self._described_expert(expert, time.monotonic())
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
        info = await self._described_expert(expert, made)
        coalescer = self._coalescers[expert]
        rows = inputs[0].shape[0]
        size = info.rows_per_call
        parts = [tuple(a[i:i + size] for a in inputs) for i in range(0, rows, size)]
        outs = await gather_all(*(coalescer.submit(key, part, made) for part in parts))
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    async def _described_expert(self, expert: str, since: float) -> ExpertInfo:
        """What ``expert``'s replicas say of it. Before any replica has been probed its batch
        limit and classes are unknown, and a call waits for a probe, up to the deadline from
        ``since`` (sent whole, a batch over the limit would come back 422, a 502 to the
        client)."""
        info = self.info(expert)  # an unknown expert is a ValueError here
        invalid = self.invalid_report(expert)
        if info is None and invalid is not None:  # nothing to wait for: it answered, wrongly
            raise self._give_up(expert, f"every replica's report was refused: {invalid}",
                                "its report was refused")
        if info is None:  # no replica probed yet: its batch limit is unknown, so wait for it
            remaining = since + self._settings.deadline_s - time.monotonic()
            info = await self._sets[expert].wait_described(max(0.0, remaining))
            if info is None:
                raise self._give_up(expert, f"no replica was probed ready within "
                                            f"{self._settings.deadline_s:g} s "
                                            f"({_last_errors(self._sets[expert]) or 'none'})")
        return info

    def _coalescer(self, expert: str) -> Coalescer:
        """Merges ``expert``'s concurrent calls; sends each request through :meth:`_call`."""
        replicas = self._sets[expert]
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

        return Coalescer(send, max_rows, lambda: max(1, replicas.ready_count()) * per_replica)

    async def _call(self, expert: str, request: _Request, deadline: float,
                    context: _ContextKey) -> np.ndarray:
        """One expert request, on the replicas :meth:`_send` picks."""
        kind = "velocity" if isinstance(request, TextVelocityRequest) else "integrate"
        member = self._members.get(expert)
        if member is not None and isinstance(request, TextVelocityRequest):
            def pooled(replica: Replica, timeout: float) -> Awaitable[np.ndarray]:
                return self._pooled_attempt(expert, member, replica, request, timeout,
                                            context)

            return await self._send(expert, kind, pooled, deadline,
                                    lambda replica: self._pooled.joins(replica, member))
        body = encode_text_request(request)

        def attempt(replica: Replica, timeout: float) -> Awaitable[np.ndarray]:
            return self._attempt(expert, replica, body, request, timeout, context)

        return await self._send(expert, kind, attempt, deadline)

    async def _send(self, expert: str, kind: str,
                    attempt: Callable[[Replica, float], Awaitable[_T]], deadline: float,
                    prefer: Callable[[Replica], bool] | None = None) -> _T:
        """Attempts on the replicas ``choose`` picks (``prefer`` breaking its ties) until one
        answers, the attempts run out or the deadline passes; while none is usable, wait for
        a probe."""
        replicas = self._replica_set(expert)
        attempts, failed = 0, None
        reason = ("no replica is listed" if not replicas.replicas else
                  "the call waited its whole deadline behind earlier requests to this expert")
        while (remaining := deadline - time.monotonic()) > 0:
            replica = replicas.choose(avoid=failed, prefer=prefer)
            if replica is None:
                reason = _last_errors(replicas) or reason
                await replicas.wait_usable(remaining)
                continue
            if attempts:
                self.metrics.retries.labels(expert).inc()
                if replica is not failed:
                    self.metrics.failovers.labels(expert).inc()
            attempts += 1
            started = time.monotonic()
            try:
                out = await attempt(replica, min(self._settings.attempt_s, remaining))
            except ExpertRejected:
                self.metrics.attempts.labels(expert, kind, "rejected").inc()
                replicas.mark_ready(replica, time.monotonic())
                raise
            except _ReplicaFailed as failure:
                reason = f"{replica.endpoint}: {failure}"
                self.metrics.attempts.labels(expert, kind, "failed").inc()
                logger.warning("expert %s: attempt %d failed: %s", expert, attempts, reason)
                if failure.down:
                    replicas.mark_down(replica, str(failure), time.monotonic())
                failed = replica
                if attempts >= self._settings.attempts:
                    raise self._give_up(expert, f"{attempts} attempt(s) failed, the last: "
                                                f"{reason}") from None
                continue
            self.metrics.attempts.labels(expert, kind, "ok").inc()
            self.metrics.seconds.labels(expert, kind).observe(time.monotonic() - started)
            replicas.mark_ready(replica, time.monotonic())
            return out
        raise self._give_up(expert, f"no answer within {self._settings.deadline_s:g} s "
                                    f"({reason})")

    async def _exchange_once(self, expert: str, replica: Replica, body: bytes,
                             max_reply: int, timeout: float,
                             decode: Callable[[bytes], _T]) -> _T:
        """One POST to one replica, its reply decoded (:meth:`_guarded`)."""

        async def exchange(ends: float) -> _T:
            return decode(await self._post(replica, replica.paths.velocity, body, max_reply,
                                           ends))

        return await self._guarded(expert, replica, timeout, exchange)

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

        out = await self._guarded(expert, replica, timeout, exchange)
        return out.astype(np.float32, copy=False)  # an expert may answer in (b)float16

    async def _pooled_attempt(self, expert: str, member: str, replica: Replica,
                              request: TextVelocityRequest, timeout: float,
                              context: _ContextKey) -> np.ndarray:
        """:meth:`_attempt` for a pool member: its rows go in its pool's request of this turn
        (:class:`~ddm.serving.router.fleet.pool_calls.PoolCalls`)."""

        def exchange(ends: float) -> Awaitable[np.ndarray]:
            return self._pooled.velocity(replica, member, request, context.body, ends)

        out = await self._guarded(expert, replica, timeout, exchange)
        return out.astype(np.float32, copy=False)

    async def _guarded(self, expert: str, replica: Replica, timeout: float,
                       exchange: Callable[[float], Awaitable[_T]]) -> _T:
        """``exchange(ends)`` with the replica counted busy: its answer,
        :class:`ExpertRejected` for a 4xx, or :class:`_ReplicaFailed` for anything another
        replica might do better."""
        replica.outstanding += 1
        try:
            return await exchange(time.monotonic() + timeout)
        except RemoteExpertError as error:
            raise _rejected_or_failed(expert, error) from None
        except ProtocolError as error:
            raise _ReplicaFailed(f"malformed reply: {error}", down=False) from None
        except (HttpClientError, TimeoutError) as error:
            raise _ReplicaFailed(_describe(error), down=True) from None
        finally:
            replica.outstanding -= 1

    async def _exchange(self, replica: Replica, body: bytes, request: _Request,
                        ends: float) -> np.ndarray:
        """POST one call, decode its reply (:class:`RemoteExpertError` for an error reply)."""
        reply = await self._post_call(replica, replica.paths.velocity, body,
                                      max_reply_bytes(request.x.shape), ends)
        return decode_response(reply, request.request_id, request.x.shape)

    async def _post_call(self, replica: Replica, path: str, body: bytes, max_reply: int,
                         ends: float) -> bytes:
        """:meth:`_post` of an expert call (a member's, or a pool's), counted in
        :attr:`bytes_sent`."""
        reply = await self._post(replica, path, body, max_reply, ends)
        self.bytes_sent["call"] += len(body)
        return reply

    async def _send_context(self, replica: Replica, context: bytes, body: bytes,
                            ends: float) -> None:
        """Send the context ``context`` (its id) encoded as ``body`` to ``replica``, check
        the id it acknowledges, remember it."""
        request_id = next(self._ids)
        body = body[:8] + request_id.to_bytes(8, "little") + body[16:]
        reply = await self._post(replica, replica.paths.velocity, body, _MAX_ERROR_BYTES, ends)
        self.bytes_sent["context"] += len(body)
        acknowledged = decode_context_ack(reply, request_id)
        if acknowledged != context:
            raise ProtocolError(f"the expert acknowledged context {acknowledged.hex()[:16]} "
                                f"for {context.hex()[:16]}")
        replica.contexts[context] = None
        while len(replica.contexts) > MAX_KNOWN_CONTEXTS:
            replica.contexts.popitem(last=False)

    async def _post(self, replica: Replica, path: str, body: bytes, max_reply: int,
                    ends: float) -> bytes:
        """POST ``body`` to ``path`` on ``replica`` within ``ends``."""
        assert self._client is not None, "start() the pool first"
        remaining = ends - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        reply = await self._client.post(
            replica.endpoint, path, body, CONTENT_TYPE, remaining,
            self._settings.connect_s, max_reply_bytes=max_reply,
            max_error_bytes=_MAX_ERROR_BYTES, authorization=self._authorization())
        if reply.status == 401:
            raise _ReplicaFailed("answered 401: it does not accept the router's token "
                                 "(both must read the same auth token file)", down=True)
        return reply.body

    #: Reads a replica's ``/v1/info``; a pool of stages parses a stage's report.
    _parse_info: Callable[[Any], Any] = staticmethod(ExpertInfo.from_json)

    def _authorization(self) -> bytes | None:
        return None if self._token is None else b"Bearer " + self._token.token()

    def _give_up(self, expert: str, reason: str, *summary: str) -> ExpertUnavailable:
        self.metrics.unavailable.labels(expert).inc()
        return ExpertUnavailable(expert, reason, *summary)

    def _replica_set(self, expert: str) -> ReplicaSet:
        try:
            return self._sets[expert]
        except KeyError:
            raise ValueError(f"unknown expert {expert!r}; known: {', '.join(self._sets)}") from None

    # ------------------------------------------------------------------ background tasks

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._settings.refresh_s)
            await self.refresh()
            if self._client is not None:
                self._client.close_idle()

    async def _probe_forever(self) -> None:
        while True:
            now = time.monotonic()
            for name, replicas in self._sets.items():
                for replica in replicas.due_for_probe(now):
                    replica.probing = True
                    self._spawn(self._probe(name, replica))
            await asyncio.sleep(PROBE_TICK_S)

    async def _probe(self, name: str, replica: Replica) -> None:
        """``GET /readyz``, and ``/v1/info`` whenever the replica becomes ready (the router
        learns image shape and batch limit from it; a restarted replica may have new ones)."""
        replicas = self._sets[name]
        try:
            paths = replica.paths
            # With the token: a pool member's readyz is under /v1, which auth guards.
            ready = await self._get(replica, paths.readyz, MAX_EXPERT_PROBE_BYTES,
                                    self._authorization())
            if ready.status != 200:
                raise ValueError(f"{paths.readyz} answered {ready.status}")
            if replica.state is not ReplicaState.READY or replica.info is None:
                info = await self._get(replica, paths.info, MAX_EXPERT_INFO_BYTES,
                                       self._authorization())
                if info.status != 200:
                    raise ValueError(f"{paths.info} answered {info.status}")
                replica.info = self._parse_info(_report(paths.info, info.body))
        except InvalidReport as error:
            if replica.invalid != str(error):  # once per change: probes repeat every few s
                logger.warning("expert %s: replica %s is not ready, its report is refused: %s",
                               name, replica.endpoint, error)
            replicas.report_invalid(replica, str(error), time.monotonic())
        except (HttpClientError, TimeoutError, ValueError) as error:
            replicas.probe_failed(replica, f"probe failed: {_describe(error)}", time.monotonic())
        else:
            replicas.mark_ready(replica, time.monotonic())
        finally:
            replica.probing = False

    async def _get(self, replica: Replica, path: str, limit: int,
                   authorization: bytes | None = None) -> HttpReply:
        """A probe's ``GET``, within ``connect_s``; a body over ``limit`` bytes is refused
        (:class:`InvalidReport`) as soon as it is declared or read over it, the rest unread."""
        assert self._client is not None, "start() the pool first"
        timeout = self._settings.connect_s
        try:
            return await self._client.get(replica.endpoint, path, timeout, timeout,
                                          max_reply_bytes=limit, authorization=authorization)
        except ReplyTooLarge:
            raise InvalidReport(f"{path} sent a body over the {limit} bytes the router "
                                "reads") from None


async def gather_all(*calls: Awaitable[_T]) -> list[_T]:
    """Await ``calls`` concurrently; on the first failure cancel the rest and raise it."""
    if len(calls) == 1:  # the common case at every step: no task to schedule
        return [await calls[0]]
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _report(path: str, body: bytes) -> Any:
    """A replica's ``/v1/info`` body as JSON (judged as every small JSON read is), or
    :class:`InvalidReport`."""
    try:
        return decode_json(path, body)
    except FetchError as error:
        raise InvalidReport(str(error)) from None


def _rejected_or_failed(expert: str, error: RemoteExpertError) -> Exception:
    """An expert's error reply: its 4xx is the request's fault (not retried), the rest retried
    elsewhere; only a 503 (loading, closing: what its ``/readyz`` would say) marks it down."""
    if 400 <= error.code < 500 and error.code not in _RETRIABLE_4XX:
        return ExpertRejected(expert, error.code, error.message)
    return _ReplicaFailed(f"answered {error.code}: {error.message}", down=error.code == 503)


def _describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "no answer in time"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _last_errors(replicas: ReplicaSet) -> str:
    return "; ".join(f"{r.endpoint}: {r.last_error or 'down'}" for r in replicas.replicas)
