"""The model server: one process holding N models by role on one device (``ddm serve
expert``, ``ddm serve stage``, ``ddm serve pool``; issues 36 and 37).

Each member (a label expert, a text expert, a text encoder, a decoder or a router network) is a
:class:`~ddm.serving.model.member.Member` of its own: its batcher (rows batch per member,
across requests, never with another member's), context cache, limits, admission count and
metrics; a pool's like Paris experts may share one grouped forward and its batcher instead
(:mod:`ddm.serving.model.grouped`: ``--grouped-forward``), formed before they warm up and
started after, before ``/readyz`` says ready. A server of one checkpoint
(:func:`create_model_app` given a directory) answers at the root (``/v1/velocity``,
``/v1/info``, ``/readyz``), as routers and router.yaml files expect of ``ddm serve expert`` and
``ddm serve stage``; a pool (given name -> directory) answers for each member under
``/v1/members/NAME`` (:mod:`ddm.serving.wire.paths`), with the same answers, and a step's calls
to its experts (of every generation) come as one request (:mod:`ddm.serving.model.pool_step`);
its own ``/v1/info`` lists the members and the memory figures, its ``/readyz`` is 200 once
every member is loaded, its ``/metrics`` labels each member's series ``member="NAME"``.

The lifespan starts loading the members one after the other in a worker thread and returns at
once, so that the server answers probes while a backend compiles (minutes on Neuron):
``/readyz`` is 503 until every member is warm, then 200; ``/healthz`` is 200 while the process
can still become ready and 500 once loading has failed, so that an orchestrator restarts it.
Run as a process (:func:`serve_model`), a server whose member fails to load, pass its checks
or warm up exits with status 1 and leaves the reason in the termination-message file
(:mod:`ddm.termination`), instead of staying alive and never ready.

Before anything loads, every member's weights plus the activations of ``max_batch`` rows are
checked against the device's limit (:mod:`ddm.serving.model.memory`), for one member as for
many; a server that does not fit refuses to start, saying each member's bytes, the sum and
the limit.

Limits: a body over a member's ``max_body_bytes`` is refused with 413 before it is read; more
than ``max_pending`` requests admitted at once to a member (queued or running, counted once
their body is in) get 429 with ``Retry-After``, which a router retries on another replica.
Slow, idle and oversized connections are cut off by the limits of
:mod:`ddm.serving.http.connections` before they reach this app.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp

from ddm.checkpoints.declared import EXPERT, STAGE_ROLES
from ddm.checkpoints.format import CheckpointError
from ddm.deploy.pools import MemberDeclaration, member_disagreements
from ddm.deploy.router_config import MEMBER_NAME_PATTERN
from ddm.models.stages import read_stage_declaration
from ddm.serving.http.server import ServerControl, probe_responses, run_server
from ddm.serving.model.contexts import ContextCache
from ddm.serving.model.grouped import ExpertGroup, preload
from ddm.serving.model.member import Member
from ddm.serving.model.memory import PoolMemory, member_bytes, memory_limit
from ddm.serving.model.metrics import MemberMetrics
from ddm.serving.model.options import Hooks, ServingOptions
from ddm.serving.model.pool_step import pool_step_routes
from ddm.serving.model.routes import (SERVING_LOOPS, Binary, ModelState, lifespan_app,
                                     model_routes, readiness)
from ddm.serving.model.stage import StageMember
from ddm.serving.wire.paths import MEMBERS_PREFIX, model_paths
from ddm.termination import fail_start
from ddm.threads import CpuShare, cap_malloc_arenas

__all__ = ["ROLES", "create_model_app", "load_member", "parse_members", "serve_model"]

logger = logging.getLogger(__name__)

#: Every role a model server holds (a label checkpoint is an expert).
ROLES = (EXPERT, *STAGE_ROLES)

#: One checkpoint served at the root, or name -> checkpoint served under /v1/members/NAME.
Checkpoints = str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]]


class _Pool:
    """What a pool's own routes read: its members (name -> member), their memory and the CPU
    threads they share (``cpu``: None in a test's process)."""

    def __init__(self, members: Mapping[str, Member], memory: PoolMemory,
                 device: str | None, cpu: CpuShare | None) -> None:
        self.members = dict(members)
        self.memory = memory
        self.device = device or "cpu"
        self.cpu = cpu
        self.metrics = MemberMetrics({name: m.metrics for name, m in self.members.items()})
        #: Its experts' groups (:mod:`ddm.serving.model.grouped`), and whether they started.
        self.groups: list[ExpertGroup] = []
        self.grouped = False

    @property
    def ready(self) -> bool:
        return self.grouped and all(member.ready for member in self.members.values())

    @property
    def failure(self) -> str | None:
        return next((f"member {name}: {member.failure}" for name, member in self.members.items()
                     if member.failure is not None), None)

    def describe(self) -> dict[str, Any]:
        return {"pool": {**self.memory.describe(), "device": self.device, "ready": self.ready,
                         "cpu_threads": None if self.cpu is None else self.cpu.budget,
                         "groups": [group.describe() for group in self.groups]},
                "members": {name: member.describe() for name, member in self.members.items()}}


def parse_members(specs: list[str]) -> dict[str, Path]:
    """``NAME=DIR`` arguments (``--member``) -> name -> directory, refusing a malformed,
    repeated or badly named one (names as the plan gives them: an expert's, ``text-encoder``,
    ``decoder``, ``router-network``)."""
    members: dict[str, Path] = {}
    for spec in specs:
        name, sep, directory = spec.partition("=")
        if not sep or not directory:
            raise ValueError(f"--member {spec!r} is not NAME=DIR")
        if not re.match(MEMBER_NAME_PATTERN, name):
            raise ValueError(f"--member {spec!r}: the name {name!r} must match "
                             f"{MEMBER_NAME_PATTERN}")
        if name in members:
            raise ValueError(f"--member {name} is given twice")
        members[name] = Path(directory)
    if not members:
        raise ValueError("a pool needs at least one --member NAME=DIR")
    return members


def load_member(directory: str | os.PathLike[str], options: ServingOptions, hooks: Hooks,
                roles: tuple[str, ...] = ROLES) -> StageMember:
    """The checkpoint in ``directory`` (a stage checkpoint, or a label checkpoint: an expert)
    as a member, not loaded yet; its declared role must be one of ``roles``."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint directory" if path.exists()
                              else f"{path} does not exist")
    declared = read_stage_declaration(path)
    if declared.role not in roles:
        raise CheckpointError(f"{path} is a stage of role {declared.role}; this command "
                              f"serves {' or '.join(roles)}")
    return StageMember(path, declared, options, hooks.serving_loops, hooks.loader, hooks.cpu)


def _share_contexts(members: Mapping[str, StageMember]) -> None:
    """One context cache for a pool's experts, of their budgets together: a generation's
    context (2 x 77 x 768 floats a prompt, for Paris) is sent to the pool once, not once per
    expert its steps call, and held once (the router's pool sends it so:
    :class:`~ddm.serving.router.fleet.pool_calls.PoolCalls`). Contexts are content-addressed
    and the experts agree on their text width (:func:`member_disagreements`), so any expert
    may take any context held."""
    experts = [m for m in members.values() if m.takes_velocity]
    if len(experts) > 1:
        shared = ContextCache(sum(m.contexts.max_bytes for m in experts))
        for member in experts:
            member.contexts = shared


def create_model_app(checkpoints: Checkpoints, options: ServingOptions = ServingOptions(),
                     hooks: Hooks = Hooks(), roles: tuple[str, ...] = ROLES) -> ASGIApp:
    """An ASGI app serving ``checkpoints`` on one device: one directory at the root, or a
    mapping name -> directory, each under ``/v1/members/NAME``. Each member's config and the
    options are checked, and the memory check runs (``options.memory_limit_bytes``, else the
    device's or container's limit: ``hooks.cgroup_root``), here, before anything loads:
    :class:`ValueError` or :class:`CheckpointError` saying why. The members load one by one
    in the lifespan; the first that cannot tells ``hooks.on_failure``."""
    pooled = isinstance(checkpoints, Mapping)
    named = dict(checkpoints) if isinstance(checkpoints, Mapping) else {"": checkpoints}
    if not named:
        raise ValueError("a pool needs at least one member")
    members: dict[str, StageMember] = {}
    for name, directory in named.items():
        try:
            members[name] = load_member(directory, options, hooks, roles)
        except (CheckpointError, ValueError) as error:
            if not pooled:
                raise
            kind = CheckpointError if isinstance(error, CheckpointError) else ValueError
            raise kind(f"member {name}: {error}") from error
    disagreements = member_disagreements({
        name: MemberDeclaration(m.declared.role, m.declared.latent_shape, m.declared.text_width,
                                m.declared.convention)
        for name, m in members.items()})
    if disagreements:
        raise ValueError("; ".join(disagreements))
    if pooled:
        _share_contexts(members)
    memory = PoolMemory({name: member_bytes(m.directory, options.precision, m.limits.max_batch)
                         for name, m in members.items()},
                        memory_limit(options.memory_limit_bytes, options.device,
                                     hooks.cgroup_root))
    if not memory.fits:
        raise ValueError(memory.refusal())

    pool = _Pool(members, memory, options.device, hooks.cpu) if pooled else None

    async def load() -> None:
        if pool is not None:
            pool.groups = await preload(members, options, hooks)
        for member in members.values():
            await member.load(hooks)
            if member.failure is not None:
                return
        if pool is not None:
            for group in pool.groups:
                await _start_group(group, hooks)
            pool.grouped = True

    async def close() -> None:
        for member in members.values():
            await member.close()
        for group in [] if pool is None else pool.groups:
            await group.close()

    binary = {model_paths(name if pooled else None).velocity: Binary(member, member.answer)
              for name, member in members.items()}
    if pool is not None:
        binary.update(pool_step_routes(members, pool.metrics.registry))
        state: ModelState = pool
        app = lifespan_app(f"ddm pool of {len(members)}", "A DDM's models on one device, each "
                           "behind the binary protocol of docs/protocol.md under "
                           "/v1/members/NAME.", load, close)
        _member_routes(members, hooks.draining, app)
    else:
        (state,) = members.values()
        app = lifespan_app(f"ddm {state.who}", "One model behind the binary protocol of "
                           "docs/protocol.md.", load, close)
    return model_routes(app, state, binary, api_docs=options.api_docs, draining=hooks.draining,
                        auth_token_file=options.auth_token_file)


async def _start_group(group: ExpertGroup, hooks: Hooks) -> None:
    """Compile, warm and measure ``group``; once active, its members' velocity calls go
    through it. One that cannot start leaves its members serving alone, as without it."""
    try:
        await hooks.start_up(group.start)
    except Exception as error:  # noqa: BLE001 - the members serve on alone
        logger.exception("the grouped forward of %s cannot start; they run alone",
                         ", ".join(group.names))
        group.failure = f"{type(error).__name__}: {error}"
        return
    if group.active:
        group.batcher.start()
        for member in group.members.values():
            member.group = group
    logger.info("members %s: %s", ", ".join(group.names),
                f"one grouped forward up to {group.up_to_rows} rows of one member"
                if group.active else "grouped forward not faster; they run alone")


def _member_routes(members: Mapping[str, Member], draining: Callable[[], bool] | None,
                   app: FastAPI) -> None:
    """Each member's ``info`` and ``readyz`` (the member's own ``velocity`` is binary), and a
    404 naming the members for any other name under ``/v1/members/`` (a router.yaml's typo)."""
    for name, member in members.items():
        _add_member_routes(app, name, member, draining)
    held = ", ".join(members)
    served = {"velocity": "POST", "info": "GET", "readyz": "GET"}

    async def no_such_route(name: str, rest: str) -> JSONResponse:
        if name not in members:
            return JSONResponse(
                {"detail": f"this pool holds no member {name!r}; it holds {held}"}, 404)
        if rest in served:  # a held member's route, asked with the other method
            return JSONResponse({"detail": f"use {served[rest]}"}, 405,
                                {"allow": served[rest]})
        return JSONResponse({"detail": f"member {name!r} has no route {rest!r}; it has "
                                       f"{', '.join(served)}"}, 404)

    app.add_api_route(f"{MEMBERS_PREFIX}{{name}}/{{rest:path}}", no_such_route,
                      methods=["GET", "POST"], include_in_schema=False)


def _add_member_routes(app: FastAPI, name: str, member: Member,
                       draining: Callable[[], bool] | None) -> None:
    paths = model_paths(name)

    async def info() -> dict[str, Any]:
        return member.describe()

    async def readyz() -> JSONResponse:
        return readiness(member.ready, member.failure, draining)

    app.add_api_route(paths.info, info, methods=["GET"], name=f"info of {name}")
    app.add_api_route(paths.readyz, readyz, methods=["GET"], name=f"readyz of {name}",
                      responses=probe_responses(503, "the member is loading or failed to "
                                                     "load, or the server is draining"))


def serve_model(checkpoints: Checkpoints, options: ServingOptions,
                roles: tuple[str, ...] = ROLES) -> None:
    """Serve ``checkpoints`` (:func:`create_model_app`) until interrupted (SIGINT/SIGTERM,
    after ``options.drain_s`` seconds of draining on SIGTERM: :mod:`ddm.serving.http.server`;
    ``/metrics`` on ``options.metrics_port`` only, if given): what ``ddm serve expert``,
    ``stage`` and ``pool`` run. Exits with status 1, the reason in the termination-message
    file, when a member cannot be loaded, checked, warmed up or fit, or a port cannot be
    bound."""
    cap_malloc_arenas()  # before the loops and batchers start their threads
    logging.basicConfig(level=options.log_level.upper(),
                        format="%(levelname)s %(name)s: %(message)s")
    what = (f"pool of {', '.join(checkpoints)}" if isinstance(checkpoints, Mapping)
            else f"model server of {checkpoints}")

    def make_app(control: ServerControl) -> ASGIApp:
        try:
            return create_model_app(checkpoints, options, Hooks.of(control, SERVING_LOOPS),
                                    roles)
        except Exception as error:  # noqa: BLE001 - every start-up failure is reported alike
            raise fail_start(f"{what}: {error}") from error

    run_server(make_app, options.host, options.port, options.log_level, options.drain_s,
               options.metrics_port, loops=SERVING_LOOPS)
