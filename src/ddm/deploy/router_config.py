"""``router.yaml``: the router server's configuration (its experts, how to reach them, defaults).

The operator writes it into a ConfigMap and the local runtime into a file; ``ddm serve router
--config FILE`` reads it. Experts are listed in the order of the router network's outputs, and
each is reached either through DNS (a headless Service name that resolves to every ready pod:
the router re-resolves it every ``dns_refresh_s`` and balances over the addresses) or through a
static list of ``host:port`` endpoints. Unknown keys are errors, so a typo never goes unnoticed.
``limits`` bounds what one request may ask for and how many run at once; ``auth``, when present,
makes every ``/v1/*`` route require ``Authorization: Bearer <the token in token_file>``.

Imports neither NumPy nor any ML framework: the operator imports this module. Its limits and
names are ``ddm.deploy.limits``'s.
"""

from __future__ import annotations

import dataclasses
import re
from decimal import Decimal
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

import yaml

from ddm.checkpoints.declared import CONFIG_KEYS, STAGE_ROLES
from ddm.checkpoints.destinations import Network, parse_networks
from ddm.deploy.endpoints import split_endpoint
from ddm.deploy.limits import (
    CONDITIONINGS,
    DEFAULT_CONTEXT_CACHE_BYTES,
    DEFAULT_MISSING_EXPERT_POLICY,
    MAX_MISSING_EXPERT_WAIT_S,
    MISSING_EXPERT_POLICIES,
    MISSING_EXPERT_WAIT_S,
    MAX_CONTEXT_CACHE_BYTES,
    MAX_STEPS,
    PORTS,
    PRECISIONS,
    ROUTER_CLIENT_ROW_STEPS,
    ROUTER_CLIENT_ROW_STEPS_PER_S,
    ROUTER_MAX_BATCH,
    ROUTER_MAX_CONCURRENT,
    ROUTER_MAX_CONCURRENT_PER_CLIENT,
    ROUTER_MAX_STEPS,
    STRATEGY_HINT,
    STRATEGY_PATTERN,
)
from ddm.sampling_params import SamplingError, SamplingParams
from ddm.deploy.strict_yaml import load_yaml


class RouterConfigError(ValueError):
    """``router.yaml`` is malformed; the message names the offending key."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RouterConfigError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _strict(cls: type, raw: Any, where: str) -> dict[str, Any]:
    """``raw`` as keyword arguments of dataclass ``cls``; unknown or missing keys are errors."""
    _check(isinstance(raw, Mapping), f"{where} must be a mapping, got {raw!r}")
    fields = dataclasses.fields(cls)
    known = [f.name for f in fields]
    unknown = sorted(set(raw) - set(known), key=str)  # YAML keys need not be strings
    _check(not unknown, f"{where} has unknown keys {unknown}; known keys: {known}")
    missing = [f.name for f in fields if f.name not in raw
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    _check(not missing, f"{where} needs {' and '.join(missing)}")
    return dict(raw)


def canonical_strategy(strategy: str) -> str:
    """A strategy of ``STRATEGY_PATTERN``'s grammar as ``Strategy.name`` spells it: ``topk:2``
    is ``top2``, ``threshold:.50`` is ``threshold:0.5``, ``threshold:1.0`` is ``threshold:1``."""
    name = strategy.strip().lower()
    if name.startswith("topk:"):
        return f"top{name.removeprefix('topk:')}"
    if name.startswith("threshold:"):
        return f"threshold:{Decimal(name.partition(':')[2]).normalize():f}"
    return name


def strategy_allowed(strategy: str, allowed: tuple[str, ...]) -> bool:
    """Whether ``strategy`` is one of ``allowed`` (empty: any), compared as
    :func:`canonical_strategy` spells them (the router's requests, the operator's
    ``DDM_ALLOWED_STRATEGIES``)."""
    return not allowed or canonical_strategy(strategy) in {canonical_strategy(s)
                                                           for s in allowed}


@dataclass(frozen=True)
class SamplingDefaults(SamplingParams):
    """What a request that leaves a parameter out gets: the DDM's defaults, declared once in
    ``ddm.sampling_params``; ``strategies``: the routing strategies a request may name (empty:
    any; the operator's ``DDM_ALLOWED_STRATEGIES``), ``strategy`` among them."""

    strategies: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(isinstance(self.strategies, tuple)
               and all(isinstance(s, str) and re.match(STRATEGY_PATTERN, s)
                       for s in self.strategies),
               f"sampling.strategies must be a list of strategies ({STRATEGY_HINT}), got "
               f"{self.strategies!r}")
        _check(strategy_allowed(self.strategy, self.strategies),
               f"sampling.strategy {self.strategy} is not among sampling.strategies "
               f"{list(self.strategies)}")


#: A pool member's name (``member`` in a discovery, ``ddm serve pool --member NAME=DIR``): an
#: expert's name or a stage's plan name (``text-encoder``, ``decoder``, ``router-network``);
#: it is a path segment of the member's routes (``/v1/members/NAME/...``).
MEMBER_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def _check_member(member: Any) -> None:
    _check(member is None or (isinstance(member, str) and
                              re.match(MEMBER_NAME_PATTERN, member) is not None),
           f"discovery.member must be a pool member's name matching {MEMBER_NAME_PATTERN}, got "
           f"{member!r}")


@dataclass(frozen=True)
class DnsDiscovery:
    """A name resolving to every ready replica (a headless Service); all listen on ``port``.
    With ``member``, the replicas are pool servers and this is their member of that name."""

    dns: str
    port: int
    member: str | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.dns, str) and bool(self.dns.strip()),
               f"discovery.dns must be a host name, got {self.dns!r}")
        _check(_is_int(self.port) and self.port in PORTS,
               f"discovery.port must be in {PORTS.start}..{PORTS.stop - 1}, got {self.port!r}")
        _check_member(self.member)


@dataclass(frozen=True)
class StaticDiscovery:
    """A fixed list of ``host:port`` replicas (the local runtime's processes); an IPv6 address
    in brackets (:func:`ddm.deploy.endpoints.split_endpoint`). With ``member``, the replicas are
    pool servers and this is their member of that name."""

    endpoints: tuple[str, ...]
    member: str | None = None

    def __post_init__(self) -> None:
        _check_member(self.member)
        _check(len(self.endpoints) > 0, "discovery.endpoints must list at least one host:port")
        for endpoint in self.endpoints:
            try:
                _, port = split_endpoint(str(endpoint))
            except ValueError as error:
                raise RouterConfigError(f"discovery.endpoints: {error}") from None
            _check(port in PORTS, f"discovery.endpoints: {endpoint!r} is not host:port "
                                  f"(its port is not in {PORTS.start}..{PORTS.stop - 1})")


Discovery = Union[DnsDiscovery, StaticDiscovery]


def discovery_dict(discovery: Discovery) -> dict[str, Any]:
    """``discovery`` as router.yaml writes it (``member`` only where there is one)."""
    out = _plain(dataclasses.asdict(discovery))
    if out["member"] is None:
        del out["member"]
    return out


def _discovery(raw: Any, where: str) -> Discovery:
    _check(isinstance(raw, Mapping), f"{where} must be a mapping, got {raw!r}")
    if "endpoints" in raw:
        args = _strict(StaticDiscovery, raw, where)
        _check(isinstance(args["endpoints"], (list, tuple)),
               f"{where}.endpoints must be a list of host:port")
        return StaticDiscovery(tuple(str(e) for e in args["endpoints"]), args.get("member"))
    _check("dns" in raw, f"{where} needs either dns (with port) or endpoints")
    args = _strict(DnsDiscovery, raw, where)
    return DnsDiscovery(**args)


@dataclass(frozen=True)
class StageEntry:
    """A text DDM's stage besides the experts: loaded in the router process from
    ``checkpoint`` (a component directory, cast to ``precision``), or served on its own and
    reached through ``discovery``."""

    checkpoint: str | None = None
    precision: str | None = None
    discovery: Discovery | None = None

    def __post_init__(self) -> None:
        _check((self.checkpoint is None) != (self.discovery is None),
               "a stage has either a checkpoint (loaded in the router) or a discovery")
        _check(self.precision is None or self.precision in PRECISIONS,
               f"a stage's precision must be one of {list(PRECISIONS)}, got "
               f"{self.precision!r}")
        _check(self.discovery is None or self.precision is None,
               "a stage served on its own has its precision in its server's flags, not here")

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> StageEntry:
        _check(isinstance(raw, Mapping), f"{where} must be a mapping, got {raw!r}")
        if "checkpoint" in raw:
            args = _strict(cls, raw, where)
            _check(isinstance(args["checkpoint"], str) and bool(args["checkpoint"]),
                   f"{where}.checkpoint must be a path")
            return cls(checkpoint=args["checkpoint"], precision=args.get("precision"))
        return cls(discovery=_discovery(raw, where))

    def to_dict(self) -> dict[str, Any]:
        if self.discovery is not None:
            return discovery_dict(self.discovery)
        return {"checkpoint": self.checkpoint,
                **({"precision": self.precision} if self.precision else {})}


@dataclass(frozen=True)
class ExpertEntry:
    """One expert: its name, the labels it was trained on, and where its replicas are."""

    name: str
    discovery: Discovery
    classes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check(isinstance(self.name, str) and bool(self.name),
               f"an expert's name must be a non-empty string, got {self.name!r}")
        _check(all(_is_int(c) and c >= 0 for c in self.classes),
               f"expert {self.name}: classes must be non-negative integers, got "
               f"{list(self.classes)}")

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> ExpertEntry:
        args = _strict(cls, raw, where)
        classes = args.get("classes", ())
        _check(isinstance(classes, (list, tuple)), f"{where}.classes must be a list")
        return cls(name=args["name"], classes=tuple(classes),
                   discovery=_discovery(args["discovery"], f"{where}.discovery"))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "classes": list(self.classes),
                "discovery": discovery_dict(self.discovery)}


@dataclass(frozen=True)
class Timeouts:
    """Seconds to open a connection to an expert, and to wait for one velocity answer."""

    connect_s: float = 2.0
    request_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("connect_s", "request_s"):
            value = getattr(self, name)
            _check(_is_number(value) and value > 0, f"timeouts.{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class Retries:
    """Tries per expert call (each on another replica when there is one), and the pause."""

    attempts: int = 2
    backoff_s: float = 0.05

    def __post_init__(self) -> None:
        _check(_is_int(self.attempts) and self.attempts >= 1,
               f"retries.attempts must be an integer >= 1, got {self.attempts!r}")
        _check(_is_number(self.backoff_s) and self.backoff_s >= 0,
               f"retries.backoff_s must be >= 0, got {self.backoff_s!r}")


@dataclass(frozen=True)
class Coalescing:
    """Merging the calls concurrent generations make to an expert
    (``ddm.serving.router.fleet.coalescing``): up to ``in_flight_per_replica`` requests per ready
    replica go out at once, later calls wait and go together. 0 sends every call on its own."""

    in_flight_per_replica: int = 2

    def __post_init__(self) -> None:
        _check(_is_int(self.in_flight_per_replica) and self.in_flight_per_replica >= 0,
               "coalescing.in_flight_per_replica must be an integer >= 0, got "
               f"{self.in_flight_per_replica!r}")


@dataclass(frozen=True)
class RouterLimits:
    """What one request may ask for, and how many generations run at once, in all and per
    client (more get 429; who a client is: ``RouterConfigFile.trusted_proxies``).

    ``max_body_bytes`` bounds a JSON body (413 beyond it); None (the default): the DDM's
    largest valid request, which follows from ``max_batch``, the prompts' cap and the state's
    shape (``ddm.serving.router.api.requests.max_body_bytes``; 1.6 MB for Paris at 64), so that
    every request the router would serve is read and no larger one is buffered.

    ``client_row_steps`` and ``client_row_steps_per_s`` are each client's budget of rows x
    steps (``ddm.sampling.loop.row_steps``), a token bucket of that capacity refilled at that
    rate: a generation is charged before it runs, 429 with ``Retry-After`` while the bucket
    holds too little, 422 for one larger than the whole bucket.

    ``context_cache_bytes`` bounds the text contexts (generations' embeddings) the router keeps
    to name in its calls to experts, least recently used dropped first (dropping one costs
    only making it again): 1 .. ``MAX_CONTEXT_CACHE_BYTES``.
    """

    max_batch: int = ROUTER_MAX_BATCH
    max_steps: int = ROUTER_MAX_STEPS
    max_concurrent: int = ROUTER_MAX_CONCURRENT
    max_body_bytes: int | None = None
    max_concurrent_per_client: int = ROUTER_MAX_CONCURRENT_PER_CLIENT
    client_row_steps: int = ROUTER_CLIENT_ROW_STEPS
    client_row_steps_per_s: float = ROUTER_CLIENT_ROW_STEPS_PER_S
    context_cache_bytes: int = DEFAULT_CONTEXT_CACHE_BYTES

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_steps", "max_concurrent", "max_body_bytes",
                     "max_concurrent_per_client", "client_row_steps"):
            value = getattr(self, name)
            if name == "max_body_bytes" and value is None:
                continue
            _check(_is_int(value) and value >= 1,
                   f"limits.{name} must be an integer >= 1, got {value!r}")
        _check(_is_number(self.client_row_steps_per_s) and self.client_row_steps_per_s > 0
               and self.client_row_steps_per_s != float("inf"),
               f"limits.client_row_steps_per_s must be a number > 0, got "
               f"{self.client_row_steps_per_s!r}")
        _check(self.max_steps <= MAX_STEPS,
               f"limits.max_steps must be at most {MAX_STEPS}, got {self.max_steps}")
        _check(_is_int(self.context_cache_bytes)
               and 1 <= self.context_cache_bytes <= MAX_CONTEXT_CACHE_BYTES,
               f"limits.context_cache_bytes must be an integer in 1..{MAX_CONTEXT_CACHE_BYTES}, "
               f"got {self.context_cache_bytes!r}")


@dataclass(frozen=True)
class MissingExpert:
    """A step routed to an expert without a ready replica (scaled to zero, or down): ``fail``
    answers 503 naming it; ``wait`` holds the generation until a replica is ready, for at most
    ``wait_s`` seconds per call (then 503); ``reroute`` gives the step to the best available
    experts that serve the label, weights renormalised over them (waiting as ``wait`` does only
    when none of them serves it)."""

    policy: str = DEFAULT_MISSING_EXPERT_POLICY
    wait_s: float = MISSING_EXPERT_WAIT_S

    def __post_init__(self) -> None:
        _check(self.policy in MISSING_EXPERT_POLICIES,
               f"missing_expert.policy must be one of {list(MISSING_EXPERT_POLICIES)}, got "
               f"{self.policy!r}")
        _check(_is_number(self.wait_s) and 0 < self.wait_s <= MAX_MISSING_EXPERT_WAIT_S,
               f"missing_expert.wait_s must be in (0, {MAX_MISSING_EXPERT_WAIT_S:g}], got "
               f"{self.wait_s!r}")


@dataclass(frozen=True)
class Auth:
    """Bearer-token authentication: the token is the content of ``token_file`` (a mounted
    Secret), stripped of surrounding whitespace, and re-read when the file changes.

    ``expert_token_file``: the token the router presents to its experts (which require it),
    distinct from the public one so that an expert never holds what clients use; None: the
    router presents ``token_file``'s (configurations written before the split)."""

    token_file: str
    expert_token_file: str | None = None

    def __post_init__(self) -> None:
        for key in ("token_file", "expert_token_file"):
            value = getattr(self, key)
            if key == "expert_token_file" and value is None:
                continue
            _check(isinstance(value, str) and bool(value.strip()),
                   f"auth.{key} must be a file path, got {value!r}")

    @property
    def expert_token(self) -> str:
        """The file of the token the router presents to its experts."""
        return self.expert_token_file or self.token_file


#: ``router.yaml``'s stages besides the experts (fields of :class:`RouterConfigFile`): a text
#: DDM's, each a :class:`StageEntry`.
STAGE_FIELDS = tuple(CONFIG_KEYS[role] for role in STAGE_ROLES)


@dataclass(frozen=True)
class RouterConfigFile:
    """The whole of ``router.yaml``. ``router_checkpoint`` is None only for the oracle.

    ``trusted_proxies``: CIDRs of the proxies in front of the router (an ingress controller's
    pods). A request from one of them counts against the client its ``X-Forwarded-For``
    names (the right-most address that is not a trusted proxy), any other against its peer
    address (``ddm.serving.router.api.clients``); empty: every client is its peer address."""

    experts: tuple[ExpertEntry, ...]
    num_classes: int = 10
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    router_checkpoint: str | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    retries: Retries = field(default_factory=Retries)
    dns_refresh_s: float = 5.0
    limits: RouterLimits = field(default_factory=RouterLimits)
    coalescing: Coalescing = field(default_factory=Coalescing)
    missing_expert: MissingExpert = field(default_factory=MissingExpert)
    auth: Auth | None = None
    trusted_proxies: tuple[str, ...] = ()
    conditioning: str = "labels"
    text_encoder: StageEntry | None = None
    decoder: StageEntry | None = None
    router_network: StageEntry | None = None

    def __post_init__(self) -> None:
        _check(len(self.experts) > 0, "experts must list at least one expert")
        _check(isinstance(self.trusted_proxies, tuple)
               and all(isinstance(c, str) for c in self.trusted_proxies),
               f"trusted_proxies must be a list of CIDRs, got {self.trusted_proxies!r}")
        try:
            parse_networks(self.trusted_proxies)
        except ValueError as error:
            raise RouterConfigError(
                f"trusted_proxies: {str(error).removeprefix('allowed ')}") from None
        names = [e.name for e in self.experts]
        _check(len(set(names)) == len(names), f"expert names must be unique, got {names}")
        _check(_is_int(self.num_classes) and self.num_classes >= 1,
               f"num_classes must be an integer >= 1, got {self.num_classes!r}")
        for expert in self.experts:
            outside = [c for c in expert.classes if c >= self.num_classes]
            _check(not outside, f"expert {expert.name}: classes {outside} are outside "
                                f"0..{self.num_classes - 1}")
        _check(self.conditioning in CONDITIONINGS,
               f"conditioning must be one of {list(CONDITIONINGS)}, got {self.conditioning!r}")
        _check(self.conditioning == "labels" or self.text_encoder is not None,
               "conditioning text needs text_encoder (prompts -> the experts' embeddings)")
        _check(self.router_checkpoint is None or self.router_network is None,
               "give the router network as router_checkpoint or router_network, not both")
        _check(self.sampling.strategy == "oracle" or bool(self.router_checkpoint)
               or self.router_network is not None,
               f"strategy {self.sampling.strategy} needs router_checkpoint (only oracle "
               "routes without the router network)")
        _check(_is_number(self.dns_refresh_s) and self.dns_refresh_s > 0,
               f"dns_refresh_s must be > 0, got {self.dns_refresh_s!r}")
        _check(self.sampling.steps <= self.limits.max_steps,
               f"sampling.steps {self.sampling.steps} exceeds limits.max_steps "
               f"{self.limits.max_steps}")

    def trusted_networks(self) -> tuple[Network, ...]:
        """``trusted_proxies`` as networks (checked when the config was made)."""
        return parse_networks(self.trusted_proxies)

    @classmethod
    def from_dict(cls, raw: Any) -> RouterConfigFile:
        args = _strict(cls, raw, "router config")
        _check(isinstance(args["experts"], list), "experts must be a list")
        if "trusted_proxies" in args:
            _check(isinstance(args["trusted_proxies"], list),
                   f"trusted_proxies must be a list of CIDRs, got {args['trusted_proxies']!r}")
            args["trusted_proxies"] = tuple(args["trusted_proxies"])
        args["experts"] = tuple(ExpertEntry.from_dict(e, f"experts[{i}]")
                                for i, e in enumerate(args["experts"]))
        for key in STAGE_FIELDS:
            if args.get(key) is not None:
                args[key] = StageEntry.from_dict(args[key], key)
        sampling = args.get("sampling")
        if isinstance(sampling, Mapping) and isinstance(sampling.get("strategies"), list):
            args["sampling"] = {**sampling, "strategies": tuple(sampling["strategies"])}
        for key, kind in (("sampling", SamplingDefaults), ("timeouts", Timeouts),
                          ("retries", Retries), ("limits", RouterLimits),
                          ("coalescing", Coalescing), ("missing_expert", MissingExpert),
                          ("auth", Auth)):
            if key in args and not (key == "auth" and args[key] is None):
                try:
                    args[key] = kind(**_strict(kind, args[key], key))
                except SamplingError as error:
                    raise RouterConfigError("; ".join(f"sampling.{name} {message}" for
                                                      name, message in error.problems)) from None
        return cls(**args)

    def to_dict(self) -> dict[str, Any]:
        out = _plain(dataclasses.asdict(self))
        out["experts"] = [e.to_dict() for e in self.experts]
        for key in STAGE_FIELDS:
            stage = getattr(self, key)
            if stage is None:
                del out[key]
            else:
                out[key] = stage.to_dict()
        if self.auth is None:
            del out["auth"]
        elif self.auth.expert_token_file is None:
            del out["auth"]["expert_token_file"]
        return out

    @classmethod
    def from_yaml(cls, text: str | bytes, name: str = "router.yaml") -> RouterConfigFile:
        """Parse ``text`` (of the file ``name``, which errors cite), strictly."""
        try:
            raw = load_yaml(text, name)
        except yaml.YAMLError as error:
            raise RouterConfigError(f"router config is not valid YAML: {error}") from None
        return cls.from_dict(raw)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _plain(value: Any) -> Any:
    """Tuples as lists, so that the YAML holds only plain lists and mappings."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
