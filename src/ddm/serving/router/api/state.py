"""What the router's routes share: its config and limits, the expert pool, the router network.

The network, and a text DDM's stages placed in the router (``router.yaml``'s
``text_encoder``, ``decoder``, ``router_network`` with a ``checkpoint``, answered by
:class:`~ddm.serving.router.fleet.stage_clients.LocalStages`), load in the background
(``RouterState.load``) so that probes are answered at once;
``problems`` says what keeps the router from being ready (some experts down is only degraded);
``slot`` counts generations in and out against ``limits.max_concurrent`` and, per client
(:mod:`ddm.serving.router.api.clients`), ``limits.max_concurrent_per_client``, and charges the
client's budget of rows x steps (``limits.client_row_steps``) before a generation runs.

The router checks what it is given (:func:`expert_mismatches`): each expert's ``/v1/info``
(convention, partition, classes, image shape) against the router network's checkpoint (its
partition: expert ``k`` of the partition must be the network's output ``k``) and
``router.yaml`` (the expert listed at position ``k``, the classes listed). While anything
disagrees the router is not ready and generates nothing, naming the expert and the mismatch: a
k-means router whose experts are listed in another order must not route to the wrong experts.

``/readyz`` and 503 bodies are answered to anyone, so they say what is wrong in the router's
own words, naming the expert by its ``router.yaml`` name (:class:`ExpertProblem`); what the
expert said (its convention, partition, refused report) goes to the log, once per change.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ddm.checkpoints.declared import CONFIG_KEYS, DECODER, ROUTER, STAGE_ROLES, TEXT_ENCODER
from ddm.checkpoints.format import CheckpointError, CheckpointMeta
from ddm.conditioning import TEXT
from ddm.convention import CONVENTION_NAME, FLOW_MATCH_PREFIX, TimeGrid
from ddm.data.partition import PartitionMismatchError, check_partition_hash
from ddm.models.loading import RouterFn
from ddm.serving.http.auth import TokenFile
from ddm.serving.router.api.clients import ClientBudget, ClientBusy, ClientSlots, client_key
from ddm.serving.router.fleet.demand import DemandMeter
from ddm.serving.router.fleet.lockstep import (ACCELERATOR_GROUPS, Lockstep, auto_groups,
                                               lockstep_groups)
from ddm.serving.router.fleet.missing import Held, MissingExperts
from ddm.serving.router.fleet.pool import ExpertPool
from ddm.serving.router.fleet.servers import PoolMetrics, discovered_sources, pool_settings
from ddm.serving.router.api.previews import decoded_size
from ddm.serving.router.fleet.remote import (Guard, NullConditioning, RemoteMixture,
                                             RouterNetwork, calls_ahead, calls_ahead_choice,
                                             local_network, stage_route)
from ddm.serving.router.fleet.replicas import ExpertInfo, ExpertProblem, hash_scheme
from ddm.sampling.loop import SamplingRequest
from ddm.deploy.router_config import RouterConfigFile, StageEntry

if TYPE_CHECKING:  # the stages' modules import torch: loaded only where a DDM has stages
    from ddm.models.stages import Stage
    from ddm.serving.router.fleet.stage_clients import StageCaller, StagePool

logger = logging.getLogger(__name__)


def load_router_config(path: str | os.PathLike[str]) -> RouterConfigFile:
    """Read ``router.yaml``; a relative ``router_checkpoint`` or stage checkpoint is relative
    to the file."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as error:
        raise FileNotFoundError(f"cannot read router config {path}: {error.strerror}") from None
    config = RouterConfigFile.from_yaml(text, str(path))
    if config.router_checkpoint and not Path(config.router_checkpoint).is_absolute():
        config = dataclasses.replace(
            config, router_checkpoint=str(path.parent / config.router_checkpoint))
    for role in STAGES:
        stage: StageEntry | None = getattr(config, role)
        if stage is not None and stage.checkpoint and not Path(stage.checkpoint).is_absolute():
            config = dataclasses.replace(config, **{role: dataclasses.replace(
                stage, checkpoint=str(path.parent / stage.checkpoint))})
    return config



class Busy(RuntimeError):
    """More generations in flight than the router allows, in all or to this client, or more
    rows x steps than the client's budget holds now; ``retry_after_s`` says when to retry
    (None: the router's default, a generation ending any time)."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotReady(RuntimeError):
    """The router cannot generate yet (network loading or failed, experts never seen)."""


class RouterMetrics:
    """HTTP requests by route and status, their latency, generations in flight, and the
    waves they step in."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("ddm_router_requests", "HTTP requests answered, by route and "
                                "status.", ["route", "status"], registry=registry)
        self.seconds = Histogram(
            "ddm_router_request_seconds", "Time to answer, to the end of the stream for "
            "/v1/generate/stream, by route.", ["route"], registry=registry,
            buckets=(1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.in_flight = Gauge("ddm_router_generations_in_flight",
                               "Generations running now (JSON and streamed).", registry=registry)
        self.waves = Counter(
            "ddm_router_lockstep_waves", "Waves of concurrent generations' steps "
            "(ddm.serving.router.fleet.lockstep), by what let them go: every generation "
            "stepping had asked (all), or a generation held elsewhere past the wait (timer).",
            ["released"], registry=registry)
        self.wave_generations = Histogram(
            "ddm_router_lockstep_wave_generations", "Generations a wave let go at once.",
            registry=registry, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.calls_ahead = Counter(
            "ddm_router_calls_ahead", "Expert calls started beside a served router network's "
            "routing, as the previous step's selection would make them "
            "(ddm.serving.router.fleet.remote), by whether the step then asked for them "
            "(used) or not (unused: routing moved all their rows, or the generation ended).",
            ["outcome"],
            registry=registry)
        self.client_busy = Counter(
            "ddm_router_client_limited", "Generations refused because their client already "
            "ran limits.max_concurrent_per_client, or its budget of rows x steps "
            "(limits.client_row_steps) held too little.", registry=registry)

    def observe_wave(self, generations: int, by_timer: bool) -> None:
        """A lockstep wave let ``generations`` go (:data:`~ddm.serving.router.fleet.
        lockstep.WaveObserver`)."""
        self.waves.labels("timer" if by_timer else "all").inc()
        self.wave_generations.observe(generations)

    def observe_ahead(self, used: int, unused: int) -> None:
        """A step's calls started ahead: how many it asked for, how many it did not."""
        if used:
            self.calls_ahead.labels("used").inc(used)
        if unused:
            self.calls_ahead.labels("unused").inc(unused)


class RouterState:
    """What the routes share: config, limits, the pool, the router network once loaded."""

    def __init__(self, config: RouterConfigFile, deadline_s: float | None = None,
                 on_failure: Callable[[str], None] | None = None) -> None:
        if deadline_s is not None and not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.config = config
        self.limits = config.limits
        self.on_failure = on_failure
        self.tokens = TokenFile(config.auth.token_file) if config.auth is not None else None
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics(self.registry)
        self.pool = ExpertPool.from_config(config, pool_settings(config, deadline_s),
                                           PoolMetrics(self.registry))
        self.names = tuple(e.name for e in config.experts)
        self.demand = DemandMeter(self.names, self.registry)
        self.missing = MissingExperts(config.missing_expert, self.pool, self.demand,
                                      config.sampling.strategy)
        #: Keeps concurrent generations in step, so that their calls merge, in as many
        #: groups as DDM_LOCKSTEP_GROUPS says (``auto``: :meth:`_auto_lockstep_groups`).
        groups = lockstep_groups(os.environ)
        self.lockstep = Lockstep(on_wave=self.metrics.observe_wave,
                                 groups=groups or ACCELERATOR_GROUPS,
                                 open_groups=None if groups else self._auto_lockstep_groups)
        #: Whether steps' calls go beside a served router network's pass (DDM_CALLS_AHEAD).
        self._calls_ahead_choice = calls_ahead_choice(os.environ)
        self.network: RouterNetwork | None = None
        self.network_shape: tuple[int, int, int] | None = None
        self.network_meta: CheckpointMeta | None = None
        #: ``router.yaml``'s stages by name, and the time convention its router network stage
        #: declares.
        self.stages: dict[str, StageCaller] = {}
        self.stage_convention: str | None = None
        self.null: NullConditioning | None = None
        self._stage_pool: StagePool | None = None  # the stages served on their own
        self._settings = pool_settings(config, deadline_s)
        self._decoded_size: asyncio.Task[tuple[int, int]] | None = None
        self._example_prompt: str | None = None  # a text encoder loaded here declares it
        self.loaded = config.router_checkpoint is None and not self._stage_entries()
        self.failure: str | None = None
        self.trusted_proxies = config.trusted_networks()
        self._in_flight = 0
        self._clients = ClientSlots(config.limits.max_concurrent_per_client)
        self._budget = ClientBudget(config.limits.client_row_steps,
                                    config.limits.client_row_steps_per_s)
        #: The experts' reports, invalid reports and the network's state last seen, and
        #: what the router made of them (:meth:`_view`).
        self._viewed: tuple[Any, _View] | None = None

    async def load(self) -> None:
        """Load the router network and the stages placed in the router off the event loop;
        a failure is reported by the probes."""
        if self.loaded:
            return
        what = "router network"
        try:
            if self.config.router_checkpoint is not None:
                probs, self.network_shape, self.network_meta = await asyncio.to_thread(
                    _load_network, self.config.router_checkpoint, self.config)
                self.network = RouterNetwork(local_network(probs))
            what = "a stage"
            await self._load_stages()
        except Exception as error:  # noqa: BLE001 - reported by /healthz and /readyz
            logger.exception("%s failed to load", what)
            self.failure = f"{what} failed to load: {type(error).__name__}: {error}"
            if self.on_failure is not None:
                self.on_failure(f"{what}: {error}")
            return
        self.loaded = True

    async def _load_stages(self) -> None:
        """A text DDM's stages: those placed in the router loaded here (off the event loop),
        those served on their own reached through one stage pool."""
        from ddm.serving.router.fleet.stage_clients import LocalStages, StagePool

        entries = self._stage_entries()
        loaded = {}
        for name, entry in entries.items():
            if entry.checkpoint is not None:
                try:
                    loaded[name] = await asyncio.to_thread(_load_stage, name, entry)
                except Exception as error:
                    raise CheckpointError(f"{name} stage {entry.checkpoint}: {error}") from error
        local = LocalStages(**{STAGES[name]: stage for name, stage in loaded.items()})
        remote = {name: entry.discovery for name, entry in entries.items()
                  if entry.discovery is not None}
        if remote:
            token = (TokenFile(self.config.auth.expert_token) if self.config.auth is not None
                     else None)
            sources, members = discovered_sources({STAGES[name]: discovery
                                                   for name, discovery in remote.items()})
            self._stage_pool = StagePool(sources, self._settings,
                                         PoolMetrics(self.registry, subject="stage"),
                                         token=token, members=members)
            await self._stage_pool.start()
        self.stages = {name: local if name in loaded else self._stage_pool
                       for name in entries}
        if CONFIG_KEYS[TEXT_ENCODER] in loaded:
            self._example_prompt = loaded[CONFIG_KEYS[TEXT_ENCODER]].declaration.example_prompt
        if CONFIG_KEYS[ROUTER] in loaded:
            self.stage_convention = loaded[CONFIG_KEYS[ROUTER]].declaration.convention
        if CONFIG_KEYS[TEXT_ENCODER] in self.stages:
            self.null = NullConditioning(self.stages[CONFIG_KEYS[TEXT_ENCODER]])
        if CONFIG_KEYS[ROUTER] in self.stages:  # its calls merged as a label DDM's network's
            self.network = RouterNetwork(stage_route(self.stages[CONFIG_KEYS[ROUTER]]),
                                         self._calls_ahead
                                         if CONFIG_KEYS[ROUTER] not in loaded else
                                         lambda rows: False)

    def _calls_ahead(self, rows: int) -> bool:
        """Whether the calls of a step of ``rows`` images go beside the served router network's
        pass (:func:`~ddm.serving.router.fleet.remote.calls_ahead`)."""
        info = self._stage_pool.info(ROUTER) if self._stage_pool is not None else None
        return calls_ahead(self._calls_ahead_choice, None if info is None else info.device,
                           self.alone(rows))

    def _auto_lockstep_groups(self) -> int:
        """``auto``'s lockstep groups for a generation joining now, by the devices the experts'
        replicas report (:func:`~ddm.serving.router.fleet.lockstep.auto_groups`)."""
        infos = (self.pool.info(name) for name in self.names)
        return auto_groups(info.about.device for info in infos if info is not None)

    def alone(self, rows: int) -> bool:
        """Whether a step of ``rows`` images is all this router generates: one image, no other
        generation in flight."""
        return rows == 1 and self._in_flight <= 1

    def example_prompt(self) -> str | None:
        """The prompt the text encoder's checkpoint declares as its example (None: none, or
        the encoder has not loaded or reported yet)."""
        if self._example_prompt is not None or self._stage_pool is None:
            return self._example_prompt
        info = self._stage_pool.info(TEXT_ENCODER)
        return None if info is None else info.example_prompt

    async def close(self) -> None:
        """Stop what runs in the router process (the router is stopping)."""
        if self.network is not None:
            await self.network.close()
        if self._decoded_size is not None:
            self._decoded_size.cancel()
        if self._stage_pool is not None:
            await self._stage_pool.close()

    def _stage_entries(self) -> dict[str, StageEntry]:
        """``router.yaml``'s stages besides the experts, by name."""
        return {name: entry for name in STAGES
                if (entry := getattr(self.config, name)) is not None}

    async def decoded_size(self, latent_shape: tuple[int, int, int]) -> tuple[int, int] | None:
        """The (H, W) of the decoder's images (None without a decoder), asked once
        (:func:`ddm.serving.router.api.previews.decoded_size`) by the first request that wants
        it."""
        decoder = self.stages.get(CONFIG_KEYS[DECODER])
        if decoder is None:
            return None
        task = self._decoded_size
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = self._decoded_size = asyncio.create_task(decoded_size(decoder, latent_shape))
        return await asyncio.shield(task)

    def image_shape(self) -> tuple[tuple[int, int, int] | None, list[str]]:
        """The experts' image shape as they report it, and any disagreement."""
        view = self._view()
        return view.image_shape, list(view.disagreement)

    def problems(self) -> tuple[list[str], list[str]]:
        """(experts without a ready replica, every reason not to be ready).

        Some experts without a ready replica (down, or their report refused) do not make the
        router unready: it still serves the labels the others own and answers a 503 naming the
        missing expert for the rest, which an unready router (out of its Service) could not
        tell a client. With no expert ready it can serve nothing, and that is a problem."""
        view = self._view()
        missing = [name for name in self.names if self.pool.ready_count(name) == 0]
        problems = ([f"no expert has a ready replica ({', '.join(missing)})",
                     *(p.public for p in view.refused)]
                    if len(missing) == len(self.names) else [])
        if self.failure is not None:
            problems.append(self.failure)
        elif not self.loaded:
            problems.append("router network is loading")
        problems += [p.public for p in view.mismatches]
        problems += view.disagreement
        if view.image_shape is None and not view.disagreement:
            problems.append("no expert has reported its image shape yet")
        return missing, problems

    def mismatches(self) -> list[ExpertProblem]:
        """How the experts that answered disagree with the router network and router.yaml."""
        return list(self._view().mismatches)

    def mixture(self) -> RemoteMixture:
        """The DDM as the experts' reports and the router network make it, or
        :class:`NotReady` saying why there is none."""
        view = self._view()
        if view.mixture is None:
            raise NotReady(view.not_ready)
        return view.mixture

    def _view(self) -> _View:
        """What the experts' reports and the router network make of the DDM, worked out again
        only when one of them changed (every generation, stream and probe reads it)."""
        key = (tuple(self.pool.info(n) for n in self.names),
               tuple(self.pool.invalid_report(n) for n in self.names), self.loaded, self.failure)
        if self._viewed is None or self._viewed[0] != key:
            infos = dict(zip(self.names, key[0]))
            view = _view_of(self.config, infos, self.network_meta, self.network_shape,
                            self._refused(), self.network if self.loaded else None,
                            self.loaded, self.failure, self.stages, self.stage_convention,
                            self.null)
            for problem in set(view.mismatches) - set(self._viewed[1].mismatches
                                                      if self._viewed else ()):
                logger.warning("expert %s: %s", problem.expert, problem.detail)
            self._viewed = (key, view)
        return self._viewed[1]

    def _refused(self) -> tuple[ExpertProblem, ...]:
        """Experts every replica of which sent a report the router refused (the pool logs
        what each sent)."""
        return tuple(ExpertProblem(name, "sent the router a report it refuses", detail)
                     for name in self.names if (detail := self.pool.invalid_report(name)))

    def guard(self, request: SamplingRequest, streamed: bool = False) -> Guard:
        """A new generation's guard: the missing-expert policy, its own waiting time, whether
        its strategy may wake missing experts, and its part in the router's lockstep, which it
        steps out of while it waits for a missing expert. A ``streamed`` generation (its
        previews would hold the others' steps) and one delegating chunks of steps (each call a
        whole chunk) step on their own."""
        in_step = not streamed and request.delegate_steps <= 1
        stepper = self.lockstep.stepper() if in_step else None
        held = Held() if stepper is None else Held(away=stepper.away)
        return Guard(self.missing, held, self.missing.wakes(request.strategy.name), stepper,
                     self.metrics.observe_ahead)

    def client(self, peer: str | None, forwarded_for: Iterable[bytes]) -> str:
        """Who a request from ``peer`` counts against (:func:`clients.client_key`)."""
        return client_key(peer, forwarded_for, self.trusted_proxies)

    def take_slot(self, client: str, row_steps: int) -> None:
        """Count a generation of ``client`` costing ``row_steps`` (``ddm.sampling.loop.
        row_steps``) in, charging the client's budget, or refuse it (:class:`Busy` naming the
        limit reached: the client's own first; ``clients.OverBudget``, a 422, for a cost no
        budget holds); :meth:`release_slot` counts it out. Only a generation that runs is
        charged."""
        try:
            self._clients.take(client)
        except ClientBusy as error:
            self.metrics.client_busy.inc()
            raise Busy(str(error)) from None
        try:
            if self._in_flight >= self.limits.max_concurrent:
                raise Busy(f"{self._in_flight} generations are in flight, the limit is "
                           f"{self.limits.max_concurrent} (limits.max_concurrent); retry "
                           "shortly")
            try:
                self._budget.charge(client, row_steps, time.monotonic())
            except ClientBusy as error:
                self.metrics.client_busy.inc()
                raise Busy(str(error), error.retry_after_s) from None
        except BaseException:
            self._clients.release(client)
            raise
        self._in_flight += 1
        self.metrics.in_flight.inc()

    def release_slot(self, client: str) -> None:
        self._in_flight -= 1
        self._clients.release(client)
        self.metrics.in_flight.dec()

    @contextmanager
    def slot(self, client: str, row_steps: int) -> Iterator[None]:
        self.take_slot(client, row_steps)
        try:
            yield
        finally:
            self.release_slot(client)


@dataclasses.dataclass(frozen=True)
class _View:
    """What the router makes of its experts' reports and its network: their disagreements,
    the image shape, and the mixture to generate with (None: ``not_ready`` says why)."""

    mismatches: tuple[ExpertProblem, ...]
    refused: tuple[ExpertProblem, ...]
    image_shape: tuple[int, int, int] | None
    disagreement: tuple[str, ...]
    mixture: RemoteMixture | None
    not_ready: str


def _view_of(config: RouterConfigFile, infos: Mapping[str, ExpertInfo | None],
             network_meta: CheckpointMeta | None, network_shape: tuple[int, int, int] | None,
             refused: tuple[ExpertProblem, ...], network: RouterNetwork | None, loaded: bool,
             failure: str | None, stages: Mapping[str, StageCaller],
             stage_convention: str | None, null: NullConditioning | None) -> _View:
    mismatches = tuple(expert_mismatches(config, infos, network_meta))
    shapes: dict[str, tuple[int, int, int]] = {
        name: info.image_shape for name, info in infos.items() if info is not None}
    if network_shape is not None:
        shapes["the router network"] = network_shape
    disagreement = (f"image shapes disagree: {shapes}",) if len(set(shapes.values())) > 1 else ()
    shape = None if disagreement else next(iter(shapes.values()), None)
    mixture, not_ready = None, ""
    if not loaded:
        not_ready = (failure if failure
                     else "router network is still loading; retry when /readyz is 200")
    elif mismatches:
        not_ready = "; ".join(p.public for p in mismatches)
    elif shape is None:
        not_ready = ("; ".join(disagreement) or "; ".join(p.public for p in refused)
                     or "no expert replica has answered yet; retry when /readyz is 200")
    elif config.conditioning == TEXT:
        mixture = RemoteMixture(
            tuple(e.name for e in config.experts), ((),) * len(config.experts), network, shape,
            0, conditioning=TEXT, encoder=stages.get(CONFIG_KEYS[TEXT_ENCODER]),
            decoder=stages.get(CONFIG_KEYS[DECODER]),
            grid=_grid(infos, stage_convention), null=null)
    else:
        mixture = RemoteMixture(tuple(e.name for e in config.experts),
                                tuple(e.classes for e in config.experts),
                                network, shape, config.num_classes)
    return _View(mismatches, refused, shape, disagreement, mixture, not_ready)


def _grid(infos: Mapping[str, ExpertInfo | None], network_convention: str | None
          ) -> TimeGrid:
    """A text DDM's time grid: FlowMatchEulerDiscrete's where its networks were trained on
    it (the router network's declared convention, or the experts' reported one), else ours."""
    conventions = {network_convention,
                   *(info.network_convention for info in infos.values() if info is not None)}
    return TimeGrid("flow-match" if any((c or "").startswith(FLOW_MATCH_PREFIX)
                                        for c in conventions) else "uniform")


def expert_mismatches(config: RouterConfigFile, infos: Mapping[str, ExpertInfo | None],
                      network: CheckpointMeta | None) -> list[ExpertProblem]:
    """Every disagreement between what the experts say of themselves (``infos`` by name; None:
    not heard from yet), the router network's checkpoint (None: oracle only) and ``config``,
    one each naming the expert: ``summary`` in the router's words, ``detail`` quoting both."""
    found = []
    trained_on = (network.partition or {}).get("scheme") if network is not None else None
    trained_sha = hash_scheme(trained_on) or "unreadable"
    for position, entry in enumerate(config.experts):
        info = infos.get(entry.name)
        if info is None:
            continue
        name = entry.name

        def mismatch(summary: str, detail: str) -> None:
            found.append(ExpertProblem(name, summary, detail))

        if info.convention is not None and info.convention != CONVENTION_NAME:
            mismatch(f"follows another convention than the router's {CONVENTION_NAME!r}",
                     f"follows the convention {info.convention!r}, the router "
                     f"{CONVENTION_NAME!r}")
        if info.serves is not None and info.serves != "velocity":
            mismatch("does not answer velocity: its server does not convert its objective",
                     f"answers {info.serves!r}, not our velocity: its server does not convert "
                     "its objective")
        if not set(entry.classes) <= set(info.classes):
            mismatch(f"does not serve every class the router config lists "
                     f"{list(entry.classes)}",
                     f"serves classes {list(info.classes)}, but the router config lists "
                     f"{list(entry.classes)}")
        if trained_on is None:  # oracle only, or a network that records no partition
            continue
        partition = info.partition or {}
        found_sha = info.scheme_sha256
        if found_sha is None or "index" not in partition:
            mismatch(f"records no partition, so nothing says it is the router network's output "
                     f"{position}", f"records no partition, so nothing says it is the router "
                     f"network's output {position} ({_scheme(trained_on)})")
            continue
        try:
            check_partition_hash(trained_sha, found_sha,
                                 f"its partition ({_scheme(partition['scheme'])})")
        except PartitionMismatchError as exc:
            mismatch("was made for another partition than the router network's: experts and "
                     "router must share one fitted partition",
                     f"{exc} (the router network's: {_scheme(trained_on)})")
            continue
        if partition["index"] != position:
            mismatch(f"is not part {position} of the router network's partition, but the "
                     f"router config lists it at position {position}: list the experts in "
                     "partition order",
                     f"is part {partition['index']} of the router network's partition, but "
                     f"the router config lists it at position {position}: list the experts in "
                     "partition order")
    return found


def _scheme(scheme: Any) -> str:
    if not isinstance(scheme, Mapping):
        return "no partition recorded"
    parts = scheme.get("groups", scheme.get("centroids", []))
    return f"{scheme.get('method', 'unknown')} partition into {len(parts)}"


#: ``router.yaml``'s stages -> the role their checkpoints declare.
STAGES = {CONFIG_KEYS[role]: role for role in STAGE_ROLES}


def _load_stage(name: str, entry: StageEntry) -> Stage:
    """``router.yaml``'s stage ``name`` from its checkpoint (safetensors only: loading runs no
    code), cast to its ``precision``, on the router's CPU; another role is refused naming
    both."""
    from ddm.models.stages import load_stage

    assert entry.checkpoint is not None, "only stages placed in the router are loaded"
    stage = load_stage(entry.checkpoint, entry.precision)
    if stage.role != STAGES[name]:
        raise CheckpointError(f"{entry.checkpoint} declares the role {stage.role!r}; "
                              f"router.yaml's {name} needs a {STAGES[name]!r} checkpoint")
    return stage


def _load_network(path: str, config: RouterConfigFile
                  ) -> tuple[RouterFn, tuple[int, int, int], CheckpointMeta]:
    """The router network's probabilities, checked against ``config``, its image shape and
    what its checkpoint records (the partition its outputs follow)."""
    from ddm.checkpoints.format import load_checkpoint
    from ddm.models.loading import router_network_config, router_probabilities

    ckpt = load_checkpoint(path)
    arch = router_network_config(ckpt)
    if arch.num_experts != len(config.experts):
        raise CheckpointError(f"router {path} was trained for {arch.num_experts} experts, but "
                              f"the config lists {len(config.experts)}")
    if arch.num_classes != config.num_classes:
        raise CheckpointError(f"router {path} knows {arch.num_classes} classes, the config says "
                              f"{config.num_classes}")
    return (router_probabilities(ckpt), (arch.in_channels, arch.image_size, arch.image_size),
            ckpt.meta)
