"""The pool server: several stage checkpoints of one DDM in one process, on one device
(``ddm serve pool``, issue 37).

Each member (an expert, the text encoder, the decoder or the router network; named as the
plan names it) is a :class:`~ddm.serving.expert.stage_server.StageServer` of its own: its
batcher (rows batch per member, across requests, never with another member's), context cache,
limits, admission count and metrics. The routes are a stage server's, per member, under
``/v1/members/NAME`` (:mod:`ddm.serving.paths`), with the same answers, and a step's calls to
several experts come as one request (:mod:`ddm.serving.expert.pool_step`); the pool's own
``/v1/info`` lists the members and the memory figures, its ``/readyz`` is 200 once every
member is loaded, its ``/metrics`` labels each member's series ``member="NAME"``.

Before anything loads, the members' weights plus the activations of ``max_batch`` rows are
checked against the device's limit (:mod:`ddm.serving.expert.pool_memory`); a pool that does
not fit refuses to start, saying each member's bytes, the sum and the limit. The members
then load one after the other in the app's lifespan.

Label UNet experts are not pooled: pools hold stage checkpoints (text DDMs) until the model
stacks are one (issue 36).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp

from ddm.checkpoints.declared import EXPERT, STAGE_ROLES, read_declaration
from ddm.checkpoints.format import CheckpointError
from ddm.deploy.limits import (DEFAULT_CONTEXT_CACHE_BYTES, EXPERT_PORT, SERVER_MAX_BATCH,
                               SERVER_MAX_DELAY_MS, SERVER_MAX_PENDING)
from ddm.deploy.router_config import MEMBER_NAME_PATTERN
from ddm.serving.auth import TokenFile
from ddm.serving.expert.metrics import MemberMetrics
from ddm.serving.expert.pool_memory import PoolMemory, member_bytes, memory_limit
from ddm.serving.expert.pool_step import pool_step_routes
from ddm.serving.expert.routes import SERVING_LOOPS, Binary, model_app, readiness
from ddm.serving.expert.stage_server import (StageServer, StartUp, answer_stage, load_member,
                                             stage_member)
from ddm.serving.http import ServerControl, probe_responses, run_server
from ddm.serving.paths import model_paths
from ddm.termination import fail_start

__all__ = ["create_pool_app", "parse_members", "serve_pool"]

logger = logging.getLogger(__name__)

#: Every role a pool holds.
_ROLES = (EXPERT, *STAGE_ROLES)


class _Pool:
    """What the pool's own routes read: its members (name -> stage) and their memory."""

    def __init__(self, members: Mapping[str, StageServer], memory: PoolMemory,
                 device: str | None) -> None:
        self.members = dict(members)
        self.memory = memory
        self.device = device or "cpu"
        self.metrics = MemberMetrics({name: m.metrics for name, m in self.members.items()})

    @property
    def ready(self) -> bool:
        return all(member.ready for member in self.members.values())

    @property
    def failure(self) -> str | None:
        return next((f"member {name}: {member.failure}" for name, member in self.members.items()
                     if member.failure is not None), None)

    def describe(self) -> dict[str, Any]:
        return {"pool": {**self.memory.describe(), "device": self.device, "ready": self.ready},
                "members": {name: member.describe() for name, member in self.members.items()}}

    async def close(self) -> None:
        for member in self.members.values():
            await member.batcher.close()


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


def create_pool_app(members: Mapping[str, str | os.PathLike[str]], backend: str = "torch",
                    device: str | None = None, max_batch: int = SERVER_MAX_BATCH,
                    max_delay_ms: float = SERVER_MAX_DELAY_MS, *,
                    max_pending: int = SERVER_MAX_PENDING,
                    memory_limit_bytes: int | None = None,
                    on_failure: Callable[[str], None] | None = None,
                    draining: Callable[[], bool] | None = None,
                    start_up: StartUp = asyncio.to_thread, api_docs: bool = False,
                    auth_token_file: str | os.PathLike[str] | None = None,
                    precision: str | None = None,
                    context_cache_bytes: int = DEFAULT_CONTEXT_CACHE_BYTES,
                    serving_loops: int = 1, cgroup_root: Path = Path("/sys/fs/cgroup")
                    ) -> ASGIApp:
    """An ASGI app serving ``members`` (name -> stage checkpoint directory) on one device.
    Each member's declaration and the flags are checked, and the memory check runs
    (``memory_limit_bytes``, else the device's or container's limit: ``cgroup_root``), here,
    before anything loads: :class:`ValueError` or :class:`CheckpointError` saying why. The
    members load one by one in the lifespan; the first that cannot tells ``on_failure``."""
    if not members:
        raise ValueError("a pool needs at least one member")
    if memory_limit_bytes is not None and memory_limit_bytes < 1:
        raise ValueError(f"--memory-limit-bytes must be >= 1, got {memory_limit_bytes}")
    for name, directory in members.items():
        if read_declaration(Path(directory)) is None:
            raise CheckpointError(f"member {name}: {directory} is not a stage checkpoint; pools "
                                  "hold stage checkpoints (text DDMs) until the model stacks "
                                  "are one (issue 36)")
    if auth_token_file is not None:
        TokenFile(auth_token_file)
    stages = {name: stage_member(directory, _ROLES, backend, device, max_batch, max_delay_ms,
                                 max_pending=max_pending, precision=precision,
                                 context_cache_bytes=context_cache_bytes,
                                 serving_loops=serving_loops)
              for name, directory in members.items()}
    memory = PoolMemory({name: member_bytes(stage.directory, precision,
                                            stage.limits.max_batch)
                         for name, stage in stages.items()},
                        memory_limit(memory_limit_bytes, device, cgroup_root))
    if not memory.fits:
        raise ValueError(memory.refusal())
    pool = _Pool(stages, memory, device)

    async def load() -> None:
        for stage in pool.members.values():
            await load_member(stage, on_failure, start_up)
            if stage.failure is not None:
                return

    binary = {model_paths(name).velocity: Binary(stage, functools.partial(answer_stage, stage))
              for name, stage in stages.items()}
    binary.update(pool_step_routes(stages, pool.metrics.registry))
    app = model_app(pool, binary, load, pool.close, title=f"ddm pool of {len(stages)}",
                    description="A DDM's stage checkpoints on one device, each behind the "
                                "binary protocol of docs/protocol.md under "
                                "/v1/members/NAME.",
                    api_docs=api_docs, draining=draining, auth_token_file=auth_token_file,
                    routes=functools.partial(_member_routes, stages, draining))
    return app


def _member_routes(stages: Mapping[str, StageServer], draining: Callable[[], bool] | None,
                   app: FastAPI) -> None:
    """Each member's ``info`` and ``readyz`` (the member's own ``velocity`` is binary)."""
    for name, stage in stages.items():
        _add_member_routes(app, name, stage, draining)


def _add_member_routes(app: FastAPI, name: str, stage: StageServer,
                       draining: Callable[[], bool] | None) -> None:
    paths = model_paths(name)

    async def info() -> dict[str, Any]:
        return stage.describe()

    async def readyz() -> JSONResponse:
        return readiness(stage.ready, stage.failure, draining)

    app.add_api_route(paths.info, info, methods=["GET"], name=f"info of {name}")
    app.add_api_route(paths.readyz, readyz, methods=["GET"], name=f"readyz of {name}",
                      responses=probe_responses(503, "the member is loading or failed to "
                                                     "load, or the server is draining"))


def serve_pool(members: Mapping[str, str | os.PathLike[str]], host: str = "127.0.0.1",
               port: int = EXPERT_PORT, backend: str = "torch", device: str | None = None,
               log_level: str = "info", *, drain_s: float = 0.0,
               metrics_port: int | None = None, **options: Any) -> None:
    """Serve a pool until interrupted (``ddm serve pool``); exits with status 1 and the reason
    in the termination-message file when it does not fit or a member cannot load."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")

    def make_app(control: ServerControl) -> ASGIApp:
        try:
            return create_pool_app(members, backend, device, on_failure=control.stop,
                                   draining=lambda: control.draining,
                                   start_up=control.start_up, serving_loops=SERVING_LOOPS,
                                   **options)
        except Exception as error:  # noqa: BLE001 - every start-up failure is reported alike
            raise fail_start(f"pool of {', '.join(members)}: {error}") from error

    run_server(make_app, host, port, log_level, drain_s, metrics_port, loops=SERVING_LOOPS)
