"""The router's client for its experts: load balancing, failover, probing and refreshing.

The router calls an expert at every denoising step, so a call must cost one round trip on a warm
connection and survive a replica dying mid-generation. Per expert the pool keeps the replicas
its endpoint source lists (:mod:`ddm.serving.router.replicas`: a static list, a DNS name re-resolved
every ``refresh_s``, or any async callable) and sends each call to the usable replica with the
fewest requests in flight, round-robin among ties. A replica that fails an attempt is marked
down and only re-probed (``GET /readyz``), with a doubling backoff, until it answers again;
ready replicas are re-probed every ``health_interval_s`` so that readiness reflects replicas
that died while idle. A failed attempt is retried on another replica within the call's deadline;
expert calls are pure functions of their inputs, so a retry is always safe. An expert's 4xx is
the router's own fault and is never retried.

Expert calls and probes (``/readyz``, ``/v1/info``) go through one
:class:`~ddm.serving.http_client.HttpClient`, a lean keep-alive HTTP/1.1 client (its cost is
paid at every step). It keeps ``TCP_NODELAY`` on (asyncio and uvloop set it on every TCP
connection), so a small request is not held back by Nagle's algorithm;
``tests/unit/test_expert_pool.py`` checks it.

An expert is a peer, not a part of the router: every body read from it is capped (a velocity
reply at what the request implies, ``/readyz`` at ``MAX_EXPERT_PROBE_BYTES``, ``/v1/info`` at
``MAX_EXPERT_INFO_BYTES``) and its ``/v1/info`` is validated
(:meth:`~ddm.serving.router.replicas.ExpertInfo.from_json`). A replica whose answer is refused
is not ready, and an expert all of whose replicas are refused is unavailable at once (503)
rather than waited for. What an expert says goes to the log, never to the router's callers:
:attr:`ExpertError.public` is the router's own words.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Coroutine, Hashable, Mapping, TypeVar, Union

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram

from ddm.deploy.limits import MAX_EXPERT_INFO_BYTES, MAX_EXPERT_PROBE_BYTES
from ddm.serving.auth import TokenFile
from ddm.serving.router.coalescing import Coalescer
from ddm.serving.http_client import HttpClient, HttpClientError, HttpReply, ReplyTooLarge
from ddm.serving.protocol import (CONTENT_TYPE, IntegrateRequest, ProtocolError,
                                  RemoteExpertError, Solver, VelocityRequest, decode_response,
                                  encode_request, max_error_reply_bytes, max_reply_bytes)
from ddm.serving.router.replicas import (EndpointSource, ExpertInfo, InvalidReport, Replica,
                                         ReplicaSet, ReplicaState, source_for)
from ddm.deploy.router_config import RouterConfigFile

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


@dataclass(frozen=True)
class _IntegrateKey:
    """Integrate calls merge only with calls on the same solver and time grid."""

    solver: Solver
    grid: bytes  # float32, little-endian


_VELOCITY = "velocity"
_Key = Union[str, _IntegrateKey]


def _request(key: Hashable, request_id: int, inputs: tuple[np.ndarray, ...]
             ) -> VelocityRequest | IntegrateRequest:
    """The protocol request for a (possibly merged) call with ``key``."""
    if isinstance(key, _IntegrateKey):
        x, y = inputs
        return IntegrateRequest(request_id, x, y, np.frombuffer(key.grid, "<f4"),
                                key.solver)
    x, t, y = inputs
    return VelocityRequest(request_id, x, t, y)


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
    """One attempt failed in a way another replica may not: retried elsewhere."""


class ExpertRejected(ExpertError):
    """The expert refused the request with a 4xx (``code``): the router sent something the
    expert does not serve (a misconfiguration, not a replica failure), so it is not retried."""

    def __init__(self, expert: str, code: int, message: str) -> None:
        super().__init__(expert, f"refused the request ({code}): {message}",
                         f"refused the request ({code})")
        self.code = code


# -------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class PoolSettings:
    """Timeouts in seconds. ``attempt_s`` bounds one HTTP exchange, ``deadline_s`` a whole call
    (every attempt, and waiting for a replica to come back); ``backoff_s`` is the first pause
    before a failed replica is probed again, doubling up to ``max_backoff_s``.
    ``in_flight_per_replica`` requests per ready replica of an expert may be outstanding before
    further calls to it wait and merge (:mod:`ddm.serving.router.coalescing`); 0 sends every call on
    its own."""

    connect_s: float = 2.0
    attempt_s: float = 30.0
    deadline_s: float = 60.0
    attempts: int = 2
    backoff_s: float = 0.05
    max_backoff_s: float = 5.0
    health_interval_s: float = 5.0
    refresh_s: float = 5.0
    in_flight_per_replica: int = 2

    def __post_init__(self) -> None:
        for name in ("connect_s", "attempt_s", "deadline_s", "max_backoff_s",
                     "health_interval_s", "refresh_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PoolSettings.{name} must be > 0, got {getattr(self, name)!r}")
        if self.attempts < 1 or self.backoff_s < 0 or self.in_flight_per_replica < 0:
            raise ValueError("PoolSettings needs attempts >= 1, backoff_s >= 0 and "
                             "in_flight_per_replica >= 0")


def pool_settings(config: RouterConfigFile, deadline_s: float | None = None) -> PoolSettings:
    """Settings from ``router.yaml``; the deadline defaults to every attempt timing out."""
    return PoolSettings(
        connect_s=config.timeouts.connect_s, attempt_s=config.timeouts.request_s,
        deadline_s=deadline_s or config.retries.attempts * config.timeouts.request_s,
        attempts=config.retries.attempts, backoff_s=config.retries.backoff_s,
        refresh_s=config.dns_refresh_s,
        in_flight_per_replica=config.coalescing.in_flight_per_replica)


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
                 metrics: PoolMetrics | None = None, token: TokenFile | None = None) -> None:
        self._sources = dict(sources)
        self._token = token  # sent to the experts as a bearer token (their --auth-token-file)
        self._settings = settings
        self.metrics = metrics or PoolMetrics(CollectorRegistry())
        self._sets = {name: ReplicaSet(settings.backoff_s, settings.max_backoff_s,
                                       settings.health_interval_s) for name in sources}
        self._ids = itertools.count(1)
        self._coalescers = {name: self._coalescer(name) for name in sources}
        self._client: HttpClient | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def from_config(cls, config: RouterConfigFile, settings: PoolSettings,
                    metrics: PoolMetrics | None = None) -> ExpertPool:
        """The experts ``config`` lists; with ``auth`` configured, the router presents its
        expert token (``auth.expert_token_file``) to them (``ddm serve expert
        --auth-token-file``)."""
        token = TokenFile(config.auth.expert_token) if config.auth is not None else None
        return cls({e.name: source_for(e.discovery) for e in config.experts}, settings, metrics,
                   token)

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
                       y: np.ndarray) -> np.ndarray:
        """``v(x, t, y)`` from ``expert``: ``x`` (B, C, H, W), ``t`` (B,), ``y`` (B,)."""
        return await self._rows(expert, _VELOCITY, (x, t, y))

    async def integrate(self, expert: str, x: np.ndarray, y: np.ndarray, grid: np.ndarray,
                        solver: str) -> np.ndarray:
        """The state at ``grid[-1]`` after ``expert`` integrates from ``x`` at ``grid[0]``."""
        try:
            code = Solver[solver.upper()]
        except KeyError:
            raise ValueError(f"unknown solver {solver!r}") from None
        grid = np.ascontiguousarray(grid, dtype="<f4")
        return await self._rows(expert, _IntegrateKey(code, grid.tobytes()), (x, y))

    async def _rows(self, expert: str, key: _Key, inputs: tuple[np.ndarray, ...]) -> np.ndarray:
        """Split a call into the expert's ``max_batch`` rows and submit the parts concurrently
        to the expert's coalescer, which merges them with other generations' calls. Before any
        replica has been probed the batch limit is unknown, and the call waits for a probe
        (sent whole, a batch over the limit would come back 422, a 502 to the client)."""
        made = time.monotonic()  # the call's deadline runs from here
        info = self.info(expert)  # an unknown expert is a ValueError here
        invalid = self.invalid_report(expert)
        if info is None and invalid is not None:  # nothing to wait for: it answered, wrongly
            raise self._give_up(expert, f"every replica's report was refused: {invalid}",
                                "its report was refused")
        if info is None:  # no replica probed yet: its batch limit is unknown, so wait for it
            info = await self._sets[expert].wait_described(self._settings.deadline_s)
            if info is None:
                raise self._give_up(expert, f"no replica was probed ready within "
                                            f"{self._settings.deadline_s:g} s "
                                            f"({_last_errors(self._sets[expert]) or 'none'})")
        coalescer = self._coalescers[expert]
        rows = inputs[0].shape[0]
        size = info.max_batch
        parts = [tuple(a[i:i + size] for a in inputs) for i in range(0, rows, size)]
        outs = await gather_all(*(coalescer.submit(key, part, made) for part in parts))
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    def _coalescer(self, expert: str) -> Coalescer:
        """Merges ``expert``'s concurrent calls; sends each request through :meth:`_call`."""
        replicas = self._sets[expert]
        per_replica = self._settings.in_flight_per_replica
        rows = self.metrics.request_rows.labels(expert)

        async def send(key: Hashable, inputs: tuple[np.ndarray, ...],
                       since: float) -> np.ndarray:
            rows.observe(inputs[0].shape[0])
            return await self._call(expert, _request(key, next(self._ids), inputs),
                                    since + self._settings.deadline_s)

        def max_rows() -> int:
            info = replicas.info()
            return info.max_batch if info is not None and per_replica else 1

        return Coalescer(send, max_rows, lambda: max(1, replicas.ready_count()) * per_replica)

    async def _call(self, expert: str, request: VelocityRequest | IntegrateRequest,
                    deadline: float) -> np.ndarray:
        """One request: attempts on the replicas ``choose`` picks until one answers, the
        attempts run out or the deadline passes; while none is usable, wait for a probe."""
        replicas = self._replica_set(expert)
        kind = "velocity" if isinstance(request, VelocityRequest) else "integrate"
        body = encode_request(request)
        attempt, failed = 0, None
        reason = ("no replica is listed" if not replicas.replicas else
                  "the call waited its whole deadline behind earlier requests to this expert")
        while (remaining := deadline - time.monotonic()) > 0:
            replica = replicas.choose()
            if replica is None:
                reason = _last_errors(replicas) or reason
                await replicas.wait_usable(remaining)
                continue
            if attempt:
                self.metrics.retries.labels(expert).inc()
                if replica is not failed:
                    self.metrics.failovers.labels(expert).inc()
            attempt += 1
            started = time.monotonic()
            try:
                out = await self._attempt(expert, replica, body, request,
                                          min(self._settings.attempt_s, remaining))
            except ExpertRejected:
                self.metrics.attempts.labels(expert, kind, "rejected").inc()
                replicas.mark_ready(replica, time.monotonic())
                raise
            except _ReplicaFailed as failure:
                reason = f"{replica.endpoint}: {failure}"
                self.metrics.attempts.labels(expert, kind, "failed").inc()
                logger.warning("expert %s: attempt %d failed: %s", expert, attempt, reason)
                replicas.mark_down(replica, str(failure), time.monotonic())
                failed = replica
                if attempt >= self._settings.attempts:
                    raise self._give_up(expert, f"{attempt} attempt(s) failed, the last: "
                                                f"{reason}") from None
                continue
            self.metrics.attempts.labels(expert, kind, "ok").inc()
            self.metrics.seconds.labels(expert, kind).observe(time.monotonic() - started)
            replicas.mark_ready(replica, time.monotonic())
            return out
        raise self._give_up(expert, f"no answer within {self._settings.deadline_s:g} s "
                                    f"({reason})")

    async def _attempt(self, expert: str, replica: Replica, body: bytes,
                       request: VelocityRequest | IntegrateRequest, timeout: float) -> np.ndarray:
        """One exchange with one replica: its answer, :class:`ExpertRejected` for a 4xx, or
        :class:`_ReplicaFailed` for anything another replica might do better."""
        assert self._client is not None, "start() the pool first"
        replica.outstanding += 1
        try:
            reply = await self._client.post(
                replica.endpoint, "/v1/velocity", body, CONTENT_TYPE, timeout,
                self._settings.connect_s, max_reply_bytes=max_reply_bytes(request.x.shape),
                max_error_bytes=_MAX_ERROR_BYTES, authorization=self._authorization())
            if reply.status == 401:
                raise _ReplicaFailed("answered 401: it does not accept the router's token "
                                     "(both must read the same auth token file)")
            out = decode_response(reply.body, request.request_id, request.x.shape)
        except RemoteExpertError as error:
            if 400 <= error.code < 500 and error.code not in _RETRIABLE_4XX:
                raise ExpertRejected(expert, error.code, error.message) from None
            raise _ReplicaFailed(f"answered {error.code}: {error.message}") from None
        except ProtocolError as error:
            raise _ReplicaFailed(f"malformed reply: {error}") from None
        except (HttpClientError, TimeoutError) as error:
            raise _ReplicaFailed(_describe(error)) from None
        finally:
            replica.outstanding -= 1
        return out.astype(np.float32, copy=False)  # an expert may answer in float16

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
            ready = await self._get(replica, "/readyz", MAX_EXPERT_PROBE_BYTES)
            if ready.status != 200:
                raise ValueError(f"/readyz answered {ready.status}")
            if replica.state is not ReplicaState.READY or replica.info is None:
                info = await self._get(replica, "/v1/info", MAX_EXPERT_INFO_BYTES,
                                       self._authorization())
                if info.status != 200:
                    raise ValueError(f"/v1/info answered {info.status}")
                replica.info = ExpertInfo.from_json(_json(info.body))
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


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as error:  # RecursionError: nested too deep
        raise InvalidReport(f"/v1/info is not JSON: {_describe(error)}") from None


def _describe(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "no answer in time"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _last_errors(replicas: ReplicaSet) -> str:
    return "; ".join(f"{r.endpoint}: {r.last_error or 'down'}" for r in replicas.replicas)
