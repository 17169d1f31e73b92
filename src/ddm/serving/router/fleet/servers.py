"""The model servers a router calls, by name, each a set of replicas: where they are, how they
are, and the one way to call them.

The router calls a model server at every denoising step, so a call must cost one round trip on a
warm connection and survive a replica dying mid-generation. Per name :class:`ModelServers` keeps
the replicas its endpoint source lists (:mod:`ddm.serving.router.fleet.replicas`: a static list,
a DNS name re-resolved every ``refresh_s``, or any async callable) and sends each call to the
usable replica with the fewest requests in flight, round-robin among ties. A failed attempt is
retried on another replica within the call's deadline; calls are pure functions of their inputs,
so a retry is always safe. Only what says the replica itself is unwell changes its health: a
transport failure (no connection, no answer in time), a 503 (loading or closing) or a 401 marks
it down, and it is then only re-probed (``GET /readyz``), with a doubling backoff, until it
answers again; ready replicas are re-probed every ``health_interval_s`` so that readiness
reflects replicas that died while idle. An answer a request may provoke (a 500, a malformed or
non-finite reply, a 408 or 429) is retried elsewhere but leaves the replica's state to the
probes, and a server's other 4xx is that request's fault, never retried: a 422 (values the
server refuses, or whose output is not finite, ``docs/protocol.md``) is the client's 422, any
other the router's 502. So no request, however hostile, can take replicas down or the router's
``/readyz`` with them (issue 35).

Calls and probes (``/readyz``, ``/v1/info``) go through one
:class:`~ddm.serving.http.client.HttpClient`, a lean keep-alive HTTP/1.1 client (its cost is
paid at every step). It keeps ``TCP_NODELAY`` on (asyncio and uvloop set it on every TCP
connection), so a small request is not held back by Nagle's algorithm;
``tests/unit/test_expert_pool.py`` checks it.

A model server is a peer, not a part of the router: every body read from it is capped (a reply
at what the request implies, ``/readyz`` at ``MAX_EXPERT_PROBE_BYTES``, ``/v1/info`` at
``MAX_EXPERT_INFO_BYTES``) and its ``/v1/info`` is validated by its caller's parser
(:meth:`~ddm.serving.router.fleet.replicas.ExpertInfo.from_json`, a stage's
:meth:`~ddm.serving.router.fleet.stage_clients.StageInfo.from_json`). A replica whose answer is
refused is not ready, and a model all of whose replicas are refused is unavailable at once (503)
rather than waited for. What a server says goes to the log, never to the router's callers:
:attr:`ExpertError.public` is the router's own words.

:class:`~ddm.serving.router.fleet.pool.ExpertPool` (experts: coalescing, text contexts) and
:class:`~ddm.serving.router.fleet.stage_clients.StagePool` (a text DDM's stages) each hold one.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine, Mapping, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram

from ddm.deploy.limits import (DEFAULT_CONTEXT_CACHE_BYTES, MAX_EXPERT_INFO_BYTES,
                               MAX_EXPERT_PROBE_BYTES)
from ddm.deploy.router_config import Discovery, RouterConfigFile
from ddm.serving.http.auth import TokenFile
from ddm.serving.http.client import HttpClient, HttpClientError, HttpReply, ReplyTooLarge
from ddm.serving.http.fetch import FetchError, decode_json
from ddm.serving.router.fleet.replicas import (EndpointSource, InvalidReport, Replica,
                                               ReplicaSet, ReplicaState, source_for)
from ddm.serving.wire.paths import model_paths
from ddm.serving.wire.protocol import (CONTENT_TYPE, ProtocolError, RemoteExpertError,
                                       max_error_reply_bytes)

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
    """Calls to model servers (one per attempt) by server name, kind and outcome; retries,
    failovers, and calls given up as unavailable. ``subject`` names the servers in the
    families' names and their label: ``expert`` (``ddm_router_expert_calls``, by ``expert``)
    or ``stage`` (a text DDM's served text encoder, decoder and router network:
    ``ddm_router_stage_calls``, by ``stage``)."""

    def __init__(self, registry: CollectorRegistry, subject: str = "expert") -> None:
        if subject not in ("expert", "stage"):
            raise ValueError(f"PoolMetrics' subject is expert or stage, got {subject!r}")
        who = subject.capitalize()
        self.attempts = Counter(
            f"ddm_router_{subject}_calls", f"{who} requests sent, by {subject}, kind "
            f"(velocity, integrate, a stage's own) and outcome (ok, rejected, failed).",
            [subject, "kind", "outcome"], registry=registry)
        self.seconds = Histogram(
            f"ddm_router_{subject}_call_seconds",
            f"Round-trip time of successful {subject} requests.", [subject, "kind"],
            registry=registry,
            buckets=(2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0, 5.0))
        merged = (", after merging the calls of concurrent generations" if subject == "expert"
                  else "")
        self.request_rows = Histogram(
            f"ddm_router_{subject}_request_rows", f"Rows per {subject} request (one per "
            f"request, not per attempt){merged}.", [subject], registry=registry,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.retries = Counter(f"ddm_router_{subject}_retries",
                               f"Attempts after a failed attempt, by {subject}.", [subject],
                               registry=registry)
        self.failovers = Counter(f"ddm_router_{subject}_failovers",
                                 "Retries sent to another replica than the failed one.",
                                 [subject], registry=registry)
        self.unavailable = Counter(f"ddm_router_{subject}_unavailable",
                                   "Calls given up: no replica answered in time.", [subject],
                                   registry=registry)

# ----------------------------------------------------------------------------- servers


class ModelServers:
    """Model servers by name (experts, or a text DDM's stages), each a :class:`ReplicaSet`
    whose ``/v1/info`` ``parse_info`` reads, and :meth:`send`: the one way a call reaches
    them. Holds replicas, connections and probes, never a request's state."""

    def __init__(self, sources: Mapping[str, EndpointSource], settings: PoolSettings,
                 parse_info: Callable[[Any], Any], metrics: PoolMetrics | None = None,
                 token: TokenFile | None = None, members: Mapping[str, str] | None = None
                 ) -> None:
        """``members``: name -> its member name on pool servers (``router.yaml``'s
        ``discovery.member``), for those served in a pool: their routes are the member's."""
        self._sources = dict(sources)
        self._token = token  # sent to the servers as a bearer token (their --auth-token-file)
        self.settings = settings
        self.metrics = metrics or PoolMetrics(CollectorRegistry())
        self.members = dict(members or {})
        self._parse_info = parse_info
        #: What each pool server holds of the contexts sent to its members (one cache for
        #: all its experts: :func:`ddm.serving.model.server.create_model_app`), while a
        #: member's replica at that endpoint is listed: pods come and go at new addresses.
        self._pool_contexts: weakref.WeakValueDictionary[str, OrderedDict[bytes, None]] = (
            weakref.WeakValueDictionary())
        self._sets = {name: ReplicaSet(settings.backoff_s, settings.max_backoff_s,
                                       settings.health_interval_s,
                                       model_paths(self.members.get(name)),
                                       self._held_by_pool if name in self.members else None)
                      for name in sources}
        self._client: HttpClient | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def _held_by_pool(self, endpoint: str) -> OrderedDict[bytes, None]:
        held = self._pool_contexts.get(endpoint)
        if held is None:
            held = self._pool_contexts[endpoint] = OrderedDict()
        return held

    async def start(self) -> None:
        """Open the client, list every server's replicas, and start refreshing and probing."""
        self._client = HttpClient(KEEP_ALIVE_S)
        await self.refresh()
        self._spawn(self._refresh_forever())
        self._spawn(self._probe_forever())

    async def close(self) -> None:
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
        return self.replica_set(expert).replicas

    def ready_count(self, expert: str) -> int:
        return self.replica_set(expert).ready_count()

    def usable(self, expert: str) -> bool:
        """Some replica of ``expert`` is not down: a call may go out now."""
        return self.replica_set(expert).usable()

    async def wait_usable(self, expert: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a usable replica of ``expert``; False if none."""
        return await self.replica_set(expert).wait_usable(timeout)

    async def wait_missing(self, expert: str) -> None:
        """Until no replica of ``expert`` is usable."""
        await self.replica_set(expert).wait_missing()

    def info(self, expert: str) -> Any:
        """What the expert's replicas say of it in ``/v1/info``, as ``parse_info`` reads it
        (:meth:`ReplicaSet.info`); None until one has been probed ready."""
        return self.replica_set(expert).info()

    def invalid_report(self, expert: str) -> str | None:
        """Why, when every replica of ``expert`` last sent a report the router refused
        (:meth:`ReplicaSet.invalid_report`); None otherwise."""
        return self.replica_set(expert).invalid_report()

    async def described(self, name: str) -> Any:
        """What ``name``'s replicas say of it (:meth:`info`), waiting up to the deadline for a
        first probe; :class:`ExpertUnavailable` at once when every replica's report was
        refused, or when none was probed ready in time."""
        info = self.info(name)  # an unknown name is a ValueError here
        if info is not None:
            return info
        invalid = self.invalid_report(name)
        if invalid is not None:  # nothing to wait for: it answered, wrongly
            raise self.give_up(name, f"every replica's report was refused: {invalid}",
                               "its report was refused")
        info = await self._sets[name].wait_described(self.settings.deadline_s)
        if info is None:
            raise self.give_up(name, f"no replica was probed ready within "
                                     f"{self.settings.deadline_s:g} s "
                                     f"({_last_errors(self._sets[name]) or 'none'})")
        return info

    async def send(self, expert: str, kind: str,
                   attempt: Callable[[Replica, float], Awaitable[_T]], deadline: float,
                   prefer: Callable[[Replica], bool] | None = None) -> _T:
        """Attempts on the replicas ``choose`` picks (``prefer`` breaking its ties) until one
        answers, the attempts run out or the deadline passes; while none is usable, wait for
        a probe."""
        replicas = self.replica_set(expert)
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
                out = await attempt(replica, min(self.settings.attempt_s, remaining))
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
                if attempts >= self.settings.attempts:
                    raise self.give_up(expert, f"{attempts} attempt(s) failed, the last: "
                                               f"{reason}") from None
                continue
            self.metrics.attempts.labels(expert, kind, "ok").inc()
            self.metrics.seconds.labels(expert, kind).observe(time.monotonic() - started)
            replicas.mark_ready(replica, time.monotonic())
            return out
        raise self.give_up(expert, f"no answer within {self.settings.deadline_s:g} s "
                                   f"({reason})")

    async def exchange_once(self, expert: str, replica: Replica, body: bytes,
                            max_reply: int, timeout: float,
                            decode: Callable[[bytes], _T]) -> _T:
        """One POST to one replica, its reply decoded (:meth:`guarded`)."""

        async def exchange(ends: float) -> _T:
            return decode(await self.post(replica, replica.paths.velocity, body, max_reply,
                                          ends))

        return await self.guarded(expert, replica, timeout, exchange)

    async def guarded(self, expert: str, replica: Replica, timeout: float,
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

    async def post(self, replica: Replica, path: str, body: bytes, max_reply: int,
                   ends: float) -> bytes:
        """POST ``body`` to ``path`` on ``replica`` within ``ends``."""
        assert self._client is not None, "start() the pool first"
        remaining = ends - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        reply = await self._client.post(
            replica.endpoint, path, body, CONTENT_TYPE, remaining,
            self.settings.connect_s, max_reply_bytes=max_reply,
            max_error_bytes=_MAX_ERROR_BYTES, authorization=self._authorization())
        if reply.status == 401:
            raise _ReplicaFailed("answered 401: it does not accept the router's token "
                                 "(both must read the same auth token file)", down=True)
        return reply.body

    def _authorization(self) -> bytes | None:
        return None if self._token is None else b"Bearer " + self._token.token()

    def give_up(self, expert: str, reason: str, *summary: str) -> ExpertUnavailable:
        """The error a call that gives up on ``expert`` raises, counted."""
        self.metrics.unavailable.labels(expert).inc()
        return ExpertUnavailable(expert, reason, *summary)

    def replica_set(self, expert: str) -> ReplicaSet:
        """``expert``'s replicas; ValueError for a name this fleet does not call."""
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
            await asyncio.sleep(self.settings.refresh_s)
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
            if ready.status == 404:  # not a model that is loading: none it serves (a typo)
                raise InvalidReport(f"{paths.readyz} answered 404: "
                                    f"{_detail(paths.readyz, ready.body)}")
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
        timeout = self.settings.connect_s
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


def _detail(path: str, body: bytes) -> str:
    """What a peer's error reply says (its JSON ``detail``, else its body), cut to 200
    characters, anything unprintable made ``?``: it goes into logs and errors."""
    try:
        detail = decode_json(path, body).get("detail")
    except (FetchError, AttributeError):
        detail = None
    text = detail if isinstance(detail, str) else body[:200].decode("utf-8", "replace")
    return "".join(c if c.isprintable() else "?" for c in text[:200])


def _last_errors(replicas: ReplicaSet) -> str:
    return "; ".join(f"{r.endpoint}: {r.last_error or 'down'}" for r in replicas.replicas)


def discovered_sources(discoveries: Mapping[str, Discovery]
                       ) -> tuple[dict[str, EndpointSource], dict[str, str]]:
    """Each model's endpoint source, and the member names of those served in a pool, as their
    ``router.yaml`` discoveries say (the arguments :class:`ModelServers` takes)."""
    return ({name: source_for(d) for name, d in discoveries.items()},
            {name: d.member for name, d in discoveries.items() if d.member is not None})
