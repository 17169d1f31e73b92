"""One deployment plan: a DDMDeployment spec -> what runs (pure, no I/O, no ML imports).

Both ways of running a DDM consume it and add only what their place decides: the operator
(``ddm.operator.manifests``) turns it into Deployments, Services and a ConfigMap, with the
checkpoint at a path in the pod and the experts behind DNS; ``ddm up`` (``ddm.runtime.local``)
into processes, with the checkpoint a local directory and the experts at loopback ports.
Everything the spec decides (each expert server's arguments and environment, its backend,
the router's configuration and limits) is decided here, once, so the two cannot disagree.
The stages besides the experts (text encoder, decoder, router network) are planned the same
way: one placed ``separate`` is a server of its own (``ddm serve stage``) that the router
reaches as it reaches an expert; one placed ``router`` is loaded by the router from its
checkpoint directory. A pool (``spec.pools``) is one server (``ddm serve pool``) per replica
for all its members, experts and stages alike; a pooled component gets no server of its own,
and the router reaches it through its pool's discovery with ``member`` set to its name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from ddm.checkpoints.declared import CONFIG_KEYS, PLAN_NAMES, ROUTER
from ddm.checkpoints.uri import CheckpointSource
from ddm.deploy.accelerators import HOST, accelerator_type
from ddm.deploy.autoscaler import Scaled
from ddm.deploy.limits import ROUTER_MAX_STEPS, SERVER_MAX_BATCH, compile_buckets
from ddm.deploy.pod_options import parse_quantity
from ddm.deploy.router_config import (
    Auth,
    Discovery,
    ExpertEntry,
    MissingExpert,
    RouterConfigFile,
    RouterLimits,
    SamplingDefaults,
    StageEntry,
)
from ddm.deploy.spec import Autoscaling, DDMSpec, ExpertSpec, PoolSpec, StageSpec


@dataclass(frozen=True)
class ExpertPlan:
    """One expert's server. ``args``: the arguments the spec decides (backend, device,
    batching), after the ones its place decides (``command``); ``autoscaling``: replicas
    follow the router's demand (None: ``replicas`` fixed)."""

    name: str
    classes: tuple[int, ...]
    replicas: int
    checkpoint: CheckpointSource
    accelerator: str
    backend: str
    device: str | None
    args: tuple[str, ...]
    #: How long its server may take to become ready (:func:`ready_budget_s`).
    ready_s: int
    autoscaling: Autoscaling | None = None
    pool: str | None = None

    def command(self, checkpoint_dir: str, host: str, port: int, metrics_port: int,
                token_file: str | None = None) -> tuple[str, ...]:
        """``ddm``'s arguments that serve this expert from ``checkpoint_dir`` on host:port,
        with ``/metrics`` on ``metrics_port`` only (scraping it opens no model). With the
        router's ``token_file`` (auth on), ``/v1/*`` answers only callers presenting that token:
        the router does, so nobody calls the model around the router's authentication."""
        auth = ("--auth-token-file", token_file) if token_file is not None else ()
        return ("serve", "expert", "--checkpoint", checkpoint_dir, "--host", host,
                "--port", str(port), "--metrics-port", str(metrics_port), *auth, *self.args)

    def env(self, cache_dir: str) -> tuple[tuple[str, str], ...]:
        """Environment the server needs: where its accelerator's compile cache is, if it
        declares one (Neuron's), under ``cache_dir``."""
        return accelerator_env(self.accelerator, cache_dir)


@dataclass(frozen=True)
class StagePlan:
    """A stage besides the experts. ``role``: its name in the plan (a value of
    :data:`~ddm.checkpoints.declared.PLAN_NAMES`); ``separate``: served by ``replicas``
    servers of its own on ``accelerator`` (``args``: backend, device, precision), else loaded
    by the router from its checkpoint, cast to ``precision``; ``pool``: served by that pool
    instead (not ``separate``)."""

    role: str
    checkpoint: CheckpointSource
    separate: bool
    replicas: int
    accelerator: str
    backend: str
    device: str | None
    precision: str | None
    args: tuple[str, ...]
    #: How long its own server may take to become ready (:func:`ready_budget_s`).
    ready_s: int
    pool: str | None = None

    @property
    def in_router(self) -> bool:
        """Loaded by the router itself (neither separate nor pooled)."""
        return not self.separate and self.pool is None

    @property
    def config_key(self) -> str:
        """Its key in router.yaml."""
        return next(CONFIG_KEYS[role] for role, name in PLAN_NAMES.items() if name == self.role)

    def command(self, checkpoint_dir: str, host: str, port: int, metrics_port: int,
                token_file: str | None = None) -> tuple[str, ...]:
        """``ddm``'s arguments that serve this stage from ``checkpoint_dir`` on host:port (as
        :meth:`ExpertPlan.command`: ``/metrics`` alone on ``metrics_port``; with the router's
        expert ``token_file``, only the router may call it)."""
        auth = ("--auth-token-file", token_file) if token_file is not None else ()
        return ("serve", "stage", "--checkpoint", checkpoint_dir, "--host", host, "--port",
                str(port),
                "--metrics-port", str(metrics_port), *auth, *self.args)

    def env(self, cache_dir: str) -> tuple[tuple[str, str], ...]:
        return accelerator_env(self.accelerator, cache_dir)

    def entry(self, place: str | Discovery) -> StageEntry:
        """router.yaml's entry: the router loads the stage from ``place`` (a directory), or
        reaches its servers through ``place`` (a discovery)."""
        if isinstance(place, str):
            return StageEntry(checkpoint=place, precision=self.precision)
        return StageEntry(discovery=place)


@dataclass(frozen=True)
class PoolPlan:
    """One pool's server (``ddm serve pool``), ``replicas`` of them on ``accelerator``:
    ``members`` (name in the plan -> checkpoint) all loaded by one process; ``args``: backend,
    device, precision, batching and memory limit, after the ones its place decides
    (``command``); ``autoscaling``: replicas follow its experts' demand (None: fixed)."""

    name: str
    members: tuple[tuple[str, CheckpointSource], ...]
    replicas: int
    accelerator: str
    backend: str
    device: str | None
    args: tuple[str, ...]
    #: How long its server may take to become ready (:func:`ready_budget_s`).
    ready_s: int
    autoscaling: Autoscaling | None = None

    def command(self, member_dirs: Mapping[str, str], host: str, port: int, metrics_port: int,
                token_file: str | None = None) -> tuple[str, ...]:
        """``ddm``'s arguments that serve every member from ``member_dirs[name]`` on host:port
        (as :meth:`ExpertPlan.command`: ``/metrics`` alone on ``metrics_port``; with the
        router's expert ``token_file``, only the router may call it)."""
        auth = ("--auth-token-file", token_file) if token_file is not None else ()
        members = (arg for name, _ in self.members
                   for arg in ("--member", f"{name}={member_dirs[name]}"))
        return ("serve", "pool", *members, "--host", host, "--port", str(port),
                "--metrics-port", str(metrics_port), *auth, *self.args)

    def env(self, cache_dir: str) -> tuple[tuple[str, str], ...]:
        return accelerator_env(self.accelerator, cache_dir)


#: What a server may take to become ready for each member it holds beyond the first (whose
#: load, checks and warm-up its accelerator's start-up budget covers): a pool loads them one
#: after the other. About ten times the slowest measured (docs/benchmarks.md: the full-size
#: Paris release pooled on the CPU).
MEMBER_READY_S = 120
#: ... and for each batch size ``torch.compile`` compiles one member for (``compile`` set:
#: every size of ``compile_buckets(maxBatch)``, before it is ready). About three times the
#: slowest measured (docs/benchmarks.md, "Compiled against eager on the CPU"). Members of one
#: architecture share their compiled code, so a pool of like experts takes less; a plan does
#: not know their architectures and counts each (which also covers the one grouped forward
#: like Paris experts compile: :mod:`ddm.serving.model.grouped`). (JAX and Neuron servers
#: compile their batch sizes within their accelerator's budget, as they always have:
#: Neuron's is the longer one.)
COMPILE_READY_S = 120
#: The stages a pool compiles with its experts (the text encoder and decoder run eagerly).
COMPILED_STAGES = (PLAN_NAMES[ROUTER],)


def ready_budget_s(accelerator: str, members: int = 1, compiled: int = 0,
                   max_batch: int | None = None) -> int:
    """How long a server on ``accelerator`` holding ``members`` models, ``compiled`` of them
    under ``torch.compile`` at every bucket of ``max_batch`` (None: the server's default), may
    take to become ready before it is taken for hung: the operator's start-up probe and
    ``ddm up``'s wait, so that a pool, or a compiling server, is not restarted, or given up
    on, half way through a start that is merely long."""
    buckets = len(compile_buckets(max_batch or SERVER_MAX_BATCH))
    return (accelerator_type(accelerator).startup_budget_s + (members - 1) * MEMBER_READY_S
            + compiled * buckets * COMPILE_READY_S)


def _compiles(server: ExpertSpec | PoolSpec) -> bool:
    return server.compile not in (None, "none")


def accelerator_env(accelerator: str, cache_dir: str) -> tuple[tuple[str, str], ...]:
    """Environment a server on ``accelerator`` needs: its compile cache under ``cache_dir``
    when the accelerator declares one."""
    cache = accelerator_type(accelerator).cache
    return cache.environment(cache_dir) if cache is not None else ()


@dataclass(frozen=True)
class RouterPlan:
    """The router: its checkpoint (None with the oracle), request defaults and limits;
    ``auth``: the spec asks for a bearer token (where it comes from is the place's choice:
    a Secret in a cluster, a file ``ddm up`` writes); ``missing_expert``: the policy for a
    step routed to an expert without a ready replica."""

    replicas: int
    checkpoint: CheckpointSource | None
    num_classes: int
    sampling: SamplingDefaults
    limits: RouterLimits
    #: How long it may take to become ready, with the stages it loads itself.
    ready_s: int
    auth: bool = False
    missing_expert: MissingExpert = MissingExpert()
    conditioning: str = "labels"

    @staticmethod
    def command(config_file: str, host: str, port: int, metrics_port: int) -> tuple[str, ...]:
        """``ddm``'s arguments that serve the router with ``config_file`` on host:port, with
        ``/metrics`` on ``metrics_port`` only (scraping it opens no API)."""
        return ("serve", "router", "--config", config_file, "--host", host, "--port", str(port),
                "--metrics-port", str(metrics_port))


@dataclass(frozen=True)
class DeploymentPlan:
    """What runs for one spec: the experts (in the router network's output order), the router,
    the other stages (``separate`` ones run beside the experts) and the pools (which serve
    the experts and stages that name them)."""

    experts: tuple[ExpertPlan, ...]
    router: RouterPlan
    stages: tuple[StagePlan, ...] = ()
    pools: tuple[PoolPlan, ...] = ()

    @property
    def separate_stages(self) -> tuple[StagePlan, ...]:
        return tuple(s for s in self.stages if s.separate)

    @property
    def unpooled_experts(self) -> tuple[ExpertPlan, ...]:
        """The experts with servers of their own."""
        return tuple(e for e in self.experts if e.pool is None)

    @property
    def autoscaled(self) -> tuple[Scaled, ...]:
        """What follows the routers' demand: each expert with servers of its own and
        ``autoscaling``, then each pool with it (by the sum of its experts' demand)."""
        return (*(Scaled(e.name, (e.name,), e.autoscaling, e.ready_s)
                  for e in self.unpooled_experts if e.autoscaling is not None),
                *(Scaled(p.name, tuple(e.name for e in self.experts if e.pool == p.name),
                         p.autoscaling, p.ready_s, pool=True)
                  for p in self.pools if p.autoscaling is not None))

    def router_config(self, discovery: Mapping[str, Discovery], checkpoint_dir: str | None,
                      auth: Auth | None = None, trusted_proxies: tuple[str, ...] = (),
                      stage_places: Mapping[str, str | Discovery] | None = None,
                      pool_discovery: Mapping[str, Discovery] | None = None
                      ) -> RouterConfigFile:
        """router.yaml, with each expert reached through ``discovery[name]`` (a pooled one
        through its pool's ``pool_discovery[pool]``, as that pool's ``member``), the router
        network read from ``checkpoint_dir`` (None without one, or when it runs on its own)
        and every other stage from ``stage_places[role]``: a directory the router loads it
        from, or the discovery of its servers (placed ``separate``); with ``auth``, the token
        the router requires and sends to its experts and stages (give them the same file:
        :meth:`ExpertPlan.command`); ``trusted_proxies``: the CIDRs of the proxies in front of
        the router, whose ``X-Forwarded-For`` names the client its per-client limit counts. A
        label DDM's router network in the router stays ``router_checkpoint``; a text DDM's is
        ``router_network``."""
        router = self.router
        members = {name: dataclasses.replace((pool_discovery or {})[pool.name], member=name)
                   for pool in self.pools for name, _ in pool.members}
        discovery = {**discovery, **{e.name: members[e.name] for e in self.experts if e.pool}}
        places = {**(stage_places or {}),
                  **{s.role: members[s.role] for s in self.stages if s.pool}}
        if checkpoint_dir is not None:
            places.setdefault(PLAN_NAMES[ROUTER], checkpoint_dir)
        network = next((s for s in self.stages if s.role == PLAN_NAMES[ROUTER]), None)
        as_checkpoint = (router.conditioning == "labels" and network is not None
                         and network.in_router and network.precision is None)
        entries = {s.config_key: s.entry(places[s.role])
                   for s in self.stages if not (as_checkpoint and s is network)}
        return RouterConfigFile(
            experts=tuple(ExpertEntry(name=e.name, classes=e.classes, discovery=discovery[e.name])
                          for e in self.experts),
            num_classes=router.num_classes, sampling=router.sampling,
            router_checkpoint=places[PLAN_NAMES[ROUTER]] if as_checkpoint else None,
            limits=router.limits,
            auth=auth, trusted_proxies=trusted_proxies, missing_expert=router.missing_expert,
            conditioning=router.conditioning, **entries)


def plan_deployment(spec: DDMSpec) -> DeploymentPlan:
    """What runs for a validated ``spec``."""
    sampling = spec.sampling
    router = RouterPlan(
        replicas=spec.router.replicas, checkpoint=spec.router.checkpoint,
        num_classes=spec.num_classes,
        # The spec's parameters, the same declarations; the operator adds its strategies.
        sampling=SamplingDefaults(**dataclasses.asdict(sampling)),
        # A request may ask for as many steps as the DDM's own default.
        limits=RouterLimits(max_steps=max(ROUTER_MAX_STEPS, sampling.steps),
                            context_cache_bytes=spec.router.context_cache_bytes),
        auth=spec.router.auth is not None, missing_expert=spec.router.missing_expert,
        conditioning=spec.conditioning,
        ready_s=ready_budget_s(HOST, 1 + sum(stage.in_router
                                             for stage in spec.stages.values())))
    return DeploymentPlan(experts=tuple(plan_expert(e) for e in spec.experts), router=router,
                          stages=tuple(plan_stage(role, stage)
                                       for role, stage in spec.stages.items()),
                          pools=tuple(plan_pool(spec, pool) for pool in spec.pools))


def plan_pool(spec: DDMSpec, pool: PoolSpec) -> PoolPlan:
    """What runs for one pool of a validated ``spec``: its backend is its members' (the spec
    checks that they share one, and one precision)."""
    members = spec.members(pool.name)
    framework = next((m.framework for m in members.values() if isinstance(m, ExpertSpec)),
                     "torch")
    precision = next((m.precision for m in members.values()), None)
    backend, device = pool.accelerator.declared.backends[framework]
    args = (_server_args(backend, device, precision) + _batching_args(pool)
            + _memory_args(pool)
            + (["--grouped-forward", pool.grouped_forward] if pool.grouped_forward else []))
    compiled = sum(isinstance(m, ExpertSpec) or name in COMPILED_STAGES
                   for name, m in members.items()) if _compiles(pool) else 0
    return PoolPlan(name=pool.name,
                    members=tuple((name, m.checkpoint) for name, m in members.items()),
                    replicas=pool.replicas, accelerator=pool.accelerator.type, backend=backend,
                    device=device, args=tuple(args), autoscaling=pool.autoscaling,
                    ready_s=ready_budget_s(pool.accelerator.type, len(members), compiled,
                                           pool.max_batch))


def _memory_args(pool: PoolSpec) -> list[str]:
    """A CPU pool's memory limit (``resources.limits.memory``) as the bytes its members must fit
    in: in a pod that is the container's limit, which the server would read itself, and under
    ``ddm up`` it holds the processes to the spec as well. A device's pool is checked against
    the device's own free memory instead."""
    memory = parse_quantity(((pool.pod.resources or {}).get("limits") or {}).get("memory"))
    if pool.accelerator.type != HOST or memory is None or memory < 1:
        return []
    return ["--memory-limit-bytes", str(int(memory))]


def plan_stage(role: str, stage: StageSpec) -> StagePlan:
    """What runs for one validated stage (``role``: its key in ``DDMSpec.stages``)."""
    backend, device = stage.accelerator.declared.backends["torch"]
    return StagePlan(role=role, checkpoint=stage.checkpoint, separate=stage.separate,
                     replicas=stage.replicas, accelerator=stage.accelerator.type,
                     backend=backend, device=device, precision=stage.precision,
                     args=tuple(_server_args(backend, device, stage.precision)),
                     pool=stage.pool, ready_s=ready_budget_s(stage.accelerator.type))


def _server_args(backend: str, device: str | None, precision: str | None) -> list[str]:
    return ["--backend", backend, *(("--device", device) if device else ()),
            *(("--precision", precision) if precision else ())]


def plan_expert(expert: ExpertSpec) -> ExpertPlan:
    """What runs for one validated expert of a spec."""
    backend, device = expert.accelerator.declared.backends[expert.framework]
    args = _server_args(backend, device, expert.precision) + _batching_args(expert)
    return ExpertPlan(name=expert.name, classes=expert.classes, replicas=expert.replicas,
                      checkpoint=expert.checkpoint, accelerator=expert.accelerator.type,
                      backend=backend, device=device, args=tuple(args),
                      autoscaling=expert.autoscaling, pool=expert.pool,
                      ready_s=ready_budget_s(expert.accelerator.type,
                                             compiled=int(_compiles(expert)),
                                             max_batch=expert.max_batch))


def _batching_args(server: ExpertSpec | PoolSpec) -> list[str]:
    """A server's batcher and compile flags (an expert's, or a pool's for each of its
    members): compiled, a server pads each batch to a bucket of its ``--max-batch``."""
    return [*(("--max-batch", str(server.max_batch)) if server.max_batch is not None else ()),
            *(("--max-delay-ms", str(server.max_delay_ms))
              if server.max_delay_ms is not None else ()),
            *(("--compile", server.compile) if server.compile is not None else ())]
