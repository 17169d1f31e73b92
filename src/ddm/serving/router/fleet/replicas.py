"""An expert's replicas: where they are (discovery) and what is known of each (no I/O).

Endpoint sources list ``host:port`` replicas: a fixed list (the local runtime), a DNS name
resolving to every ready pod (a headless Service), or any async callable. A
:class:`ReplicaSet` keeps each replica's state (unknown, ready, down), requests in flight and
probe schedule, and picks the replica for the next call; the
:class:`~ddm.serving.router.fleet.pool.ExpertPool` does the I/O and tells it what happened.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import reprlib
import socket
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Sequence

from ddm.conditioning import LABELS, TEXT
from ddm.deploy.limits import (GUIDED_FORWARD_ROWS, MAX_BATCH, MAX_CLASS, MAX_EXPERT_INFO_DEPTH,
                               MAX_EXPERT_TEXT, MAX_EXPERTS, MAX_IMAGE_CHANNELS,
                               MAX_IMAGE_SIDE, MAX_NUM_CLASSES, MAX_TEXT_WIDTH, PRECISIONS)
from ddm.data.partition import partition_sha256
from ddm.deploy.router_config import Discovery, DnsDiscovery
from ddm.serving.wire.paths import ModelPaths, model_paths

#: ``() -> ["host:port", ...]``: where an expert's replicas are now.
EndpointSource = Callable[[], Awaitable[Sequence[str]]]


def static_endpoints(endpoints: Sequence[str]) -> EndpointSource:
    """A fixed list of ``host:port`` replicas."""
    fixed = tuple(endpoints)

    async def resolve() -> Sequence[str]:
        return fixed

    return resolve


def dns_endpoints(name: str, port: int) -> EndpointSource:
    """Every IPv4 address (A record) of ``name``, e.g. a headless Service, on ``port``."""

    async def resolve() -> Sequence[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(
            name, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
        return sorted({f"{info[4][0]}:{port}" for info in infos})

    return resolve


def source_for(discovery: Discovery) -> EndpointSource:
    """The endpoint source a ``router.yaml`` discovery entry describes."""
    if isinstance(discovery, DnsDiscovery):
        return dns_endpoints(discovery.dns, discovery.port)
    return static_endpoints(discovery.endpoints)


class InvalidReport(ValueError):
    """An expert answered a probe with what the router cannot use (a body over its cap, not
    JSON, a field out of bounds); the message names what."""


@dataclass(frozen=True)
class ExpertProblem:
    """What is wrong with what expert ``expert`` reports. ``summary`` is the router's own words
    (what unauthenticated callers see: ``/readyz``, 503 bodies); ``detail`` quotes the expert
    too, and goes only to the router's log."""

    expert: str
    summary: str
    detail: str

    @property
    def public(self) -> str:
        return f"expert {self.expert} {self.summary} (details in the router's log)"


_UNHASHED = ""  # ExpertInfo.scheme_sha256 before it is computed


@dataclass(frozen=True)
class ExpertAbout:
    """What an expert says runs it and what it learned from, for people (the router's
    ``/v1/info`` and web page), never for routing (``device`` says only how many lockstep
    groups ``auto`` keeps: ``ddm.serving.router.fleet.lockstep``): each a short string or
    None where not said (``hardware``: the processor's model name; ``data``: the training
    set's name)."""

    framework: str | None = None
    runtime: str | None = None
    device: str | None = None
    hardware: str | None = None
    data: str | None = None
    images: int | None = None
    #: What its images show, in words (a text expert's digits), where it says.
    summary: str | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ExpertAbout:
        data = raw.get("data") if isinstance(raw.get("data"), Mapping) else {}
        images = data.get("images")
        return cls(*(short_text(raw.get(key)) for key in ("framework", "runtime", "device",
                                                      "hardware")),
                   data=short_text(data.get("name")),
                   images=images if isinstance(images, int) and not isinstance(images, bool)
                   and images >= 0 else None, summary=short_text(raw.get("summary")))


def on_accelerator(device: str | None) -> bool:
    """Whether a server's reported ``device`` (``cuda:0``, ``xla:0``, ``cpu``...) is an
    accelerator; not where it said none."""
    return device is not None and not device.lower().startswith("cpu")


def short_text(value: Any) -> str | None:
    """``value`` cut to :data:`MAX_EXPERT_TEXT` if a peer sent a string, else None."""
    return value[:MAX_EXPERT_TEXT] if isinstance(value, str) else None


@dataclass(frozen=True)
class ExpertInfo:
    """What an expert replica says of itself in ``/v1/info`` (``convention`` and ``partition``
    as its checkpoint records them; the router checks them, ``ddm.serving.router.api.state``)."""

    image_shape: tuple[int, int, int]
    classes: tuple[int, ...]
    max_batch: int
    convention: str | None = None
    partition: Mapping[str, Any] | None = None
    #: What its ``/v1/velocity`` answers: ``velocity`` once the server has converted the
    #: network's own prediction (``ddm.objectives``); None from servers that predate the field.
    serves: str | None = None
    about: ExpertAbout = ExpertAbout()
    #: ``labels`` or ``text`` (a stage checkpoint's expert: docs/protocol.md version 2).
    conditioning: str = LABELS
    #: A text expert's embedding width ``D``; None for label experts.
    text_width: int | None = None
    #: The dtype its replies travel in: float32, float16 or bfloat16.
    wire_dtype: str = "float32"
    #: Its router-network output index (a text expert's cluster); None where not declared.
    cluster: int | None = None
    #: The convention its network was trained in (``ours``, ``flow-match-N``), which its
    #: server converts from, and which picks a text DDM's time grid; None: not said.
    network_convention: str | None = None

    @property
    def rows_per_call(self) -> int:
        """Rows a call may carry: a text expert runs each guided row twice, so half its
        ``max_batch`` (every row may be guided; :meth:`from_json` refuses less than a row)."""
        return (max(1, self.max_batch // GUIDED_FORWARD_ROWS) if self.conditioning == TEXT
                else self.max_batch)

    #: The sha256 of the partition's scheme (:func:`hash_scheme`), hashed once when made
    #: (``dataclasses.replace`` carries it over): the router compares it at every ``/readyz``
    #: and generation, and a report may hold 1 MB.
    scheme_sha256: str | None = dataclasses.field(default=_UNHASHED, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.scheme_sha256 == _UNHASHED:
            object.__setattr__(self, "scheme_sha256",
                               hash_scheme((self.partition or {}).get("scheme")))

    @classmethod
    def from_json(cls, raw: Any) -> ExpertInfo:
        """The fields the router uses from a parsed ``/v1/info``, each checked against the
        deployment's limits (``ddm.deploy.limits``): strict types, bounded sizes. An expert is
        a peer: its report sizes the router's allocations and splits its batches, so anything
        else is :class:`InvalidReport` naming the field."""
        require(isinstance(raw, Mapping), f"/v1/info is not a JSON object: {_shown(raw)}")
        shape = report_shape(raw, "image_shape")
        classes = _ints(raw, "classes", 0, MAX_NUM_CLASSES)
        require(all(0 <= c <= MAX_CLASS for c in classes) and len(set(classes)) == len(classes),
                f"classes must be distinct integers in 0..{MAX_CLASS}, got "
                f"{_shown(raw['classes'])}")
        max_batch = report_max_batch(raw)
        partition = raw.get("partition")
        require(partition is None or isinstance(partition, Mapping),
                f"partition must be an object or null, got {_shown(partition)}")
        require(not _nested_deeper(partition, MAX_EXPERT_INFO_DEPTH),
                f"partition nests objects and lists more than {MAX_EXPERT_INFO_DEPTH} deep")
        index = (partition or {}).get("index")
        require(index is None or (type(index) is int and 0 <= index < MAX_EXPERTS),
                f"partition.index must be an integer in 0..{MAX_EXPERTS - 1}, got "
                f"{_shown(index)}")
        conditioning = raw.get("conditioning", LABELS)
        require(conditioning in (LABELS, TEXT), f"conditioning must be {LABELS!r} or "
                                                f"{TEXT!r}, got {_shown(conditioning)}")
        require(conditioning == LABELS or max_batch >= GUIDED_FORWARD_ROWS,
                f"max_batch must be at least {GUIDED_FORWARD_ROWS} for a text expert (a guided "
                f"row runs as {GUIDED_FORWARD_ROWS} forward rows), got {max_batch}")
        text_width = raw.get("text_width")
        require(text_width is None if conditioning == LABELS else (
            type(text_width) is int and 1 <= text_width <= MAX_TEXT_WIDTH),
            f"text_width must be an integer in 1..{MAX_TEXT_WIDTH} for a text expert (null "
            f"for labels), got {_shown(text_width)}")
        wire_dtype = report_wire_dtype(raw, "float32")
        cluster = raw.get("cluster")
        require(cluster is None or (type(cluster) is int and 0 <= cluster < MAX_EXPERTS),
                f"cluster must be an integer in 0..{MAX_EXPERTS - 1} or null, got "
                f"{_shown(cluster)}")
        return cls(shape, classes, max_batch,
                   convention=_text(raw, "convention"), partition=partition,
                   serves=_text(raw, "serves"), about=ExpertAbout.from_json(raw),
                   conditioning=conditioning, text_width=text_width, wire_dtype=wire_dtype,
                   cluster=cluster, network_convention=_text(raw, "network_convention"))


def hash_scheme(scheme: Any) -> str | None:
    """The sha256 of a recorded partition's content; None when nothing usable is recorded."""
    if not isinstance(scheme, Mapping):
        return None
    try:
        return partition_sha256(scheme)
    except (TypeError, ValueError):
        return None


def report_shape(raw: Mapping[str, Any], field: str) -> tuple[int, int, int]:
    """A report's ``(C, H, W)`` ``field`` within the deployment's image limits, else
    :class:`InvalidReport` naming it."""
    shape = _ints(raw, field, 3, 3)
    require(1 <= shape[0] <= MAX_IMAGE_CHANNELS
            and all(1 <= side <= MAX_IMAGE_SIDE for side in shape[1:]),
            f"{field} must be (C, H, W) with C in 1..{MAX_IMAGE_CHANNELS} and H, W in "
            f"1..{MAX_IMAGE_SIDE}, got {_shown(raw[field])}")
    return shape[0], shape[1], shape[2]


def report_max_batch(raw: Mapping[str, Any]) -> int:
    """A report's ``max_batch`` within a deployment's bound (what sizes the router's batches
    to it), else :class:`InvalidReport` naming it."""
    max_batch = raw.get("max_batch")
    require(type(max_batch) is int and 1 <= max_batch <= MAX_BATCH,
            f"max_batch must be an integer in 1..{MAX_BATCH}, got {_shown(max_batch)}")
    return max_batch


def report_wire_dtype(raw: Mapping[str, Any], default: str | None = None) -> str:
    """A report's ``wire_dtype`` (``default`` where it says none; None: it must say), else
    :class:`InvalidReport` naming it."""
    wire_dtype = raw.get("wire_dtype", default)
    require(wire_dtype in PRECISIONS, f"wire_dtype must be one of {', '.join(PRECISIONS)}, "
                                      f"got {_shown(wire_dtype)}")
    return wire_dtype


def require(ok: bool, problem: str) -> None:
    """:class:`InvalidReport` of ``problem`` unless ``ok``: a peer's report is refused."""
    if not ok:
        raise InvalidReport(problem)


def _shown(value: Any) -> str:
    """``value`` for a log line, cut short: an expert chooses it."""
    return reprlib.repr(value)


def _nested_deeper(value: Any, levels: int) -> bool:
    """Whether ``value`` (parsed JSON) nests objects and lists more than ``levels`` deep; the
    recursion stops there, so it cannot overflow."""
    if not isinstance(value, (Mapping, list)):
        return False
    if levels == 0:
        return True
    items = value.values() if isinstance(value, Mapping) else value
    return any(_nested_deeper(item, levels - 1) for item in items)


def _ints(raw: Mapping[str, Any], field: str, least: int, most: int) -> tuple[int, ...]:
    values = raw.get(field)
    require(isinstance(values, list) and least <= len(values) <= most
            and all(type(v) is int for v in values),
            f"{field} must be a list of {least}..{most} integers, got {_shown(values)}")
    return tuple(values)


def _text(raw: Mapping[str, Any], field: str) -> str | None:
    value = raw.get(field)
    require(value is None or (isinstance(value, str) and len(value) <= MAX_EXPERT_TEXT),
            f"{field} must be a string of at most {MAX_EXPERT_TEXT} characters or null, got "
            f"{_shown(value)}")
    return value


class ReplicaState(enum.Enum):
    UNKNOWN = "unknown"  # listed, not yet probed: tried (after ready ones) rather than idle
    READY = "ready"
    DOWN = "down"        # failed; only the prober tries it again


#: Where a server of one model answers (no pool member named).
_ROOT_PATHS = model_paths()


@dataclass(eq=False)
class Replica:
    endpoint: str
    #: Where on it the model answers: the root, or a pool member's routes.
    paths: ModelPaths = _ROOT_PATHS
    state: ReplicaState = ReplicaState.UNKNOWN
    outstanding: int = 0
    failures: int = 0
    next_probe: float = 0.0
    probing: bool = False
    last_error: str | None = None
    info: ExpertInfo | None = None  # from /v1/info, fetched each time it becomes ready
    invalid: str | None = None  # why its last answer to a probe was refused (InvalidReport)
    #: Ids of the text contexts sent to it, oldest first (the pool bounds it; the replica may
    #: have evicted some: it answers UNKNOWN_CONTEXT and the pool sends it again). The pool
    #: members of one server share theirs, as the server shares one cache among its experts.
    contexts: OrderedDict[bytes, None] = dataclasses.field(default_factory=OrderedDict)

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"


class ReplicaSet:
    """The replicas of one expert and what is known of each. No I/O: the pool does that.
    ``paths``: where on each replica the expert answers (a pool member's routes, or the
    root's)."""

    def __init__(self, backoff_s: float, max_backoff_s: float, health_interval_s: float,
                 paths: ModelPaths = _ROOT_PATHS,
                 contexts: Callable[[str], OrderedDict[bytes, None]] | None = None) -> None:
        """``contexts``: a new replica's :attr:`Replica.contexts` by endpoint (None: its
        own)."""
        self._paths = paths
        self._contexts = contexts
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._health_interval_s = health_interval_s
        self._replicas: list[Replica] = []
        self._turn = 0
        self._usable = asyncio.Event()
        self._missing = asyncio.Event()  # no replica is usable (the opposite of _usable)
        self._described = asyncio.Event()
        #: What :meth:`info` last answered, and the replicas' (report, state) it came from.
        self._described_by: tuple[tuple[ExpertInfo | None, ReplicaState], ...] = ()
        self._description: ExpertInfo | None = None

    @property
    def replicas(self) -> tuple[Replica, ...]:
        return tuple(self._replicas)

    def update(self, endpoints: Sequence[str]) -> None:
        """Take the endpoints a source listed; known ones keep their state."""
        known = {r.endpoint: r for r in self._replicas}
        self._replicas = [known.get(e) or self._replica(e) for e in dict.fromkeys(endpoints)]
        self._sync()

    def _replica(self, endpoint: str) -> Replica:
        if self._contexts is None:
            return Replica(endpoint, self._paths)
        return Replica(endpoint, self._paths, contexts=self._contexts(endpoint))

    def choose(self, avoid: Replica | None = None,
               prefer: Callable[[Replica], bool] | None = None) -> Replica | None:
        """The usable replica with the fewest requests in flight, ready ones first; ties go
        to one ``prefer`` likes (a pool member's: one whose request of this step it can join),
        then round-robin; ``avoid`` (the one a call's last attempt failed on, which may still
        be ready) only when it is the only one usable. None when every replica is down."""
        usable = [r for r in self._replicas if r.state is not ReplicaState.DOWN]
        usable = [r for r in usable if r is not avoid] or usable
        if not usable:
            return None
        self._turn += 1
        start = self._turn % len(usable)
        rotated = usable[start:] + usable[:start]
        return min(rotated, key=lambda r: (r.state is not ReplicaState.READY, r.outstanding,
                                           prefer is not None and not prefer(r)))

    def mark_ready(self, replica: Replica, now: float) -> None:
        """It answered: the next health probe is due ``health_interval_s`` from now."""
        replica.state, replica.failures, replica.last_error = ReplicaState.READY, 0, None
        replica.invalid = None
        replica.next_probe = now + self._health_interval_s
        self._sync()

    def mark_down(self, replica: Replica, reason: str, now: float) -> None:
        """Concurrent failures of one replica count once, so the backoff grows per probe."""
        replica.last_error = reason
        if replica.state is not ReplicaState.DOWN:
            replica.state = ReplicaState.DOWN
            replica.failures += 1
            replica.next_probe = now + self.backoff(replica.failures)
        self._sync()

    def report_invalid(self, replica: Replica, reason: str, now: float) -> None:
        """Its answer to a probe was refused (:class:`InvalidReport`): not ready, and nothing
        it said before is used."""
        self.probe_failed(replica, f"invalid report: {reason}", now)
        replica.info, replica.invalid = None, reason

    def invalid_report(self) -> str | None:
        """Why, when every replica's last report was refused; None otherwise."""
        if not self._replicas or any(r.invalid is None for r in self._replicas):
            return None
        return "; ".join(f"{r.endpoint}: {r.invalid}" for r in self._replicas)

    def probe_failed(self, replica: Replica, reason: str, now: float) -> None:
        replica.state, replica.last_error, replica.invalid = ReplicaState.DOWN, reason, None
        replica.failures += 1
        replica.next_probe = now + self.backoff(replica.failures)
        self._sync()

    def backoff(self, failures: int) -> float:
        """Seconds until the next probe after ``failures`` failures in a row: doubling."""
        return min(self._max_backoff_s, self._backoff_s * 2 ** max(0, failures - 1))

    def due_for_probe(self, now: float) -> list[Replica]:
        return [r for r in self._replicas if not r.probing and r.next_probe <= now]

    def info(self) -> ExpertInfo | None:
        """The expert as its replicas describe it: image shape and classes of the first
        replica probed ready, and the smallest ``max_batch`` of the replicas not down, since a
        request may go to any of them (during a rolling update old and new ones differ).
        With every replica down, what they said last; None before any was probed ready.
        The same object until a replica's report or state changes, so that what the router
        makes of it is worked out once per change (``ddm.serving.router.api.state``)."""
        key = tuple((r.info, r.state) for r in self._replicas)
        if key != self._described_by:
            self._described_by, self._description = key, self._describe()
        return self._description

    def _describe(self) -> ExpertInfo | None:
        known = [r for r in self._replicas if r.info is not None]
        if not known:
            return None
        live = [r for r in known if r.state is not ReplicaState.DOWN] or known
        first = next((r for r in live if r.state is ReplicaState.READY), live[0]).info
        assert first is not None
        return dataclasses.replace(
            first, max_batch=min(r.info.max_batch for r in live if r.info is not None))

    def ready_count(self) -> int:
        return sum(r.state is ReplicaState.READY for r in self._replicas)

    async def wait_described(self, timeout: float) -> ExpertInfo | None:
        """:meth:`info`, waiting up to ``timeout`` seconds for a replica to be probed ready
        (the expert's batch limit is unknown until then); None on timeout."""
        try:
            async with asyncio.timeout(max(0.0, timeout)):
                await self._described.wait()
        except TimeoutError:
            pass
        return self.info()

    async def wait_usable(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a replica that is not down; False on timeout."""
        try:
            async with asyncio.timeout(max(0.0, timeout)):
                await self._usable.wait()
        except TimeoutError:
            return False
        return True

    def usable(self) -> bool:
        """Some replica is not down (ready, or not probed yet)."""
        return self._usable.is_set()

    async def wait_missing(self) -> None:
        """Until no replica is usable."""
        await self._missing.wait()

    def _sync(self) -> None:
        if any(r.info is not None for r in self._replicas):
            self._described.set()
        else:
            self._described.clear()
        if any(r.state is not ReplicaState.DOWN for r in self._replicas):
            self._usable.set()
            self._missing.clear()
        else:
            self._usable.clear()
            self._missing.set()
