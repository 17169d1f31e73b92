"""One model a model server holds, whatever its role: the member interface.

A member (a label expert, a text expert, a text encoder, a decoder, a router network) owns
its limits, its admission count, its metrics and its batcher (rows batch per member, across
requests, never with another member's, except a pool's experts that share a grouped
forward: :mod:`ddm.serving.model.grouped`); the routes (:mod:`ddm.serving.model.routes`) read
those, and call :meth:`Member.answer` with each body. Its weights load in the app's lifespan
through :meth:`Member.load`, the same for every role: off the event loop, checked and warmed
up by the member's own :meth:`Member.load_and_warm`, the batcher started before the model is
published (a route on another event loop submits as soon as it sees the member ready), a
failure kept for ``/healthz`` and ``/readyz`` and told to the process.

Every member answers ``/v1/info`` in one shape (:data:`INFO_FIELDS`): the fields of its role
that do not apply are null.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Hashable

from ddm.serving.batching import Batcher
from ddm.serving.model import metrics as expert_metrics
from ddm.serving.model.options import Hooks, ServingOptions
from ddm.serving.wire.protocol import Limits, ProtocolError, VelocityRequest
from ddm.threads import CpuShare

__all__ = ["INFO_FIELDS", "Member"]

logger = logging.getLogger(__name__)

#: Every field of a member's ``/v1/info``, in its order; :meth:`Member.describe` fills those
#: its role has and leaves the others null.
INFO_FIELDS = (
    "name", "kind", "role", "family", "model", "conditioning", "serves", "classes",
    "partition", "data", "summary", "cluster", "clusters", "objective", "convention",
    "network_convention", "latent_shape", "image_shape", "text_width", "example_prompt",
    "wire_dtype", "precision", "framework", "backend", "runtime", "device", "hardware",
    "compile", "max_batch", "max_steps", "max_body_bytes", "max_pending", "max_delay_ms",
    "context_cache_bytes", "ready")


class Member(ABC):
    """A model behind the binary protocol: what the routes admit, cap and count by
    (``limits``, ``pending``, ``max_pending``, ``metrics``), its batcher, and whether it is
    ready or why it failed."""

    def __init__(self, directory: Path, limits: Limits, options: ServingOptions,
                 serving_loops: int, cpu: CpuShare | None = None) -> None:
        self.directory = directory
        self.limits = limits
        self.options = options
        self.max_pending = options.max_pending
        self.pending = 0
        self.metrics = expert_metrics.ExpertMetrics()
        self.batcher = Batcher(self.execute, limits.max_batch, options.max_delay_ms,
                               self.metrics.observe_batch, serving_loops=serving_loops,
                               cpu=cpu)
        self.failure: str | None = None

    @property
    @abstractmethod
    def ready(self) -> bool:
        """Whether the model is loaded, checked and warm (its batcher runs)."""

    @property
    @abstractmethod
    def who(self) -> str:
        """How messages name this member (``expert NAME``, ``stage DIR``)."""

    @abstractmethod
    def facts(self) -> dict[str, Any]:
        """This member's fields of :data:`INFO_FIELDS` (the others are null)."""

    @abstractmethod
    async def answer(self, body: bytes) -> tuple[int, bytes]:
        """One request body -> (HTTP status, protocol reply); never raises."""

    @abstractmethod
    def execute(self, key: Hashable, inputs: tuple[Any, ...]) -> Any:
        """Run one batch (the batcher runs it on an event loop or its model thread)."""

    @abstractmethod
    def load_and_warm(self) -> Any:
        """Load, check and warm up the model (in a worker thread): what :meth:`publish`
        takes."""

    @abstractmethod
    def publish(self, loaded: Any) -> None:
        """Hold ``loaded``: from here :attr:`ready` is true."""

    @property
    def takes_velocity(self) -> bool:
        """Whether this member is an expert: it answers :meth:`velocity` (a pool's step route
        sends it its rows)."""
        return False

    async def velocity(self, message: VelocityRequest) -> Any:
        """The velocity (B, C, H, W) of ``message``'s rows of a context, run in this member's
        batcher with other requests' rows, for its own route and a pool's alike; a member
        that is not an expert refuses it (422)."""
        raise ProtocolError(f"{self.who} is not an expert: it takes no velocity calls", 422,
                            message.request_id)

    def describe(self) -> dict[str, Any]:
        """``/v1/info``: every field of :data:`INFO_FIELDS`, in its order."""
        facts = {"max_batch": self.limits.max_batch, "max_steps": self.limits.max_steps,
                 "max_body_bytes": self.limits.max_body_bytes, "max_pending": self.max_pending,
                 "max_delay_ms": self.options.max_delay_ms, "ready": self.ready, **self.facts()}
        unknown = set(facts) - set(INFO_FIELDS)
        assert not unknown, f"fields outside /v1/info's shape: {sorted(unknown)}"
        return {field: facts.get(field) for field in INFO_FIELDS}

    def not_ready(self) -> str:
        """Why a request finds the member not ready (503)."""
        if self.failure is not None:
            return f"{self.who} failed to load: {self.failure}"
        return f"{self.who} is still loading; retry when /readyz answers 200"

    async def load(self, hooks: Hooks) -> None:
        """Load, check and warm up off the event loop, then start batching; a failure is
        kept in :attr:`failure` and told to ``hooks.on_failure``."""
        started = time.perf_counter()
        try:
            loaded = await hooks.start_up(self.load_and_warm)
        except Exception as error:  # noqa: BLE001 - reported by /healthz and /readyz
            logger.exception("%s failed to load", self.who)
            self.failure = f"{type(error).__name__}: {error}"
            if hooks.on_failure is not None:
                hooks.on_failure(f"{self.who}: cannot load, check or warm up {self.directory}: "
                                 f"{error}")
            return
        # The batcher first: a route on another event loop submits as soon as it is ready.
        self.batcher.start()
        self.publish(loaded)
        logger.info("%s ready after %.1f s", self.who, time.perf_counter() - started)

    async def close(self) -> None:
        """Stop batching: queued requests fail with 503."""
        await self.batcher.close()
