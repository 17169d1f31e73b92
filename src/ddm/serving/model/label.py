"""A label expert as a model server's member: one UNet checkpoint (``checkpoints/format.py``,
served from :class:`~ddm.serving.model.backends.Backend`) behind the binary protocol
(``docs/protocol.md``), conditioned on labels: a generation's LABEL_CONTEXT (version 4, held
in the member's :class:`~ddm.serving.model.contexts.ContextCache` and acknowledged with its
id), then VELOCITY and INTEGRATE calls (and a pool's POOL_VELOCITY) naming its rows, as a text
expert takes them.
Our UNets have no null label, so classifier-free guidance has nothing to guide against: a row
with a guidance scale other than 1 is refused (422).

Before it warms up, the member runs ``ddm expert check``'s checks of the network it serves
(:func:`ddm.experts.check.check_network`: shapes, dtypes, finiteness, determinism and that it
predicts what its config.json declares); a failure is a failure to load, which names the
failed check.

Limits: a batch over ``max_batch``, a grid over ``max_steps``, a label outside the
checkpoint's classes or a context of text gets 422; a body over twice the largest valid request 413
(:mod:`ddm.serving.model.routes`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Hashable

import numpy as np

from ddm.checkpoints.format import CheckpointError, load_checkpoint, read_meta
from ddm.conditioning import LABELS
from ddm.experts.check import behaviour_data, check_network
from ddm.experts.network_checks import require_passing
from ddm.models.loading import expert_image_shape
from ddm.sampling.solvers import iterate
from ddm.serving.batching import grid_slices
from ddm.serving.model.backends import Backend, BackendLoader, check_backend
from ddm.serving.model.contexts import ContextCache
from ddm.serving.model.member import Member
from ddm.serving.model.options import ServingOptions
from ddm.serving.model.routes import Handling, answer_or_error
from ddm.serving.wire.protocol import (IntegrateRequest, LabelContext, Limits, ProtocolError,
                                       VelocityRequest, check_labels, decode_request,
                                       encode_context_ack, encode_response)

__all__ = ["LabelExpert"]

_VELOCITY = "velocity"
#: What a label expert answers.
_TAKES = (LabelContext, VelocityRequest, IntegrateRequest)


@dataclass(frozen=True)
class _Integrate:
    """Batch key of an integrate request: only requests on the same solver and grid merge."""

    solver: str
    grid: bytes  # float32, as sent


class LabelExpert(Member):
    """A UNet checkpoint conditioned on labels; its config is read and checked here, so that
    a wrong flag fails before the server starts, and the weights load in :meth:`load`."""

    def __init__(self, directory: Path, options: ServingOptions, serving_loops: int,
                 loader: BackendLoader) -> None:
        if options.precision is not None:
            raise CheckpointError(f"{directory} is a label checkpoint, served in float32: "
                                  "--precision is for stage checkpoints")
        check_backend(options.backend, options.device)
        meta = read_meta(directory)
        if meta.kind not in ("expert", "monolith"):
            raise CheckpointError(f"{directory} is a {meta.kind} checkpoint, not a UNet to "
                                  "serve")
        limits = Limits(max_batch=options.max_batch, max_steps=options.max_steps,
                        image_shape=expert_image_shape(meta), allowed_labels=meta.classes)
        limits = dataclasses.replace(limits, max_body_bytes=_max_body_bytes(limits))
        super().__init__(directory, limits, options, serving_loops)
        self.meta = meta
        self.loader = loader
        self.contexts = ContextCache(options.context_cache_bytes)
        self.backend: Backend | None = None  # set, and the batcher started, once warm

    @property
    def ready(self) -> bool:
        return self.backend is not None

    @property
    def who(self) -> str:
        return f"expert {self.meta.name}"

    def facts(self) -> dict[str, Any]:
        backend, device, runtime, hardware = (self.options.backend, self.options.device, None,
                                              None)
        if self.backend is not None:
            info = self.backend.info()
            backend, device, runtime, hardware = (info.backend, info.device, info.framework,
                                                  info.hardware)
        meta, shape = self.meta, list(self.limits.image_shape or ())
        return {"name": meta.name, "kind": meta.kind, "role": "expert",
                "family": meta.model.kind, "model": meta.model.kind, "conditioning": LABELS,
                "serves": "velocity", "classes": list(meta.classes),
                "partition": meta.partition, "data": meta.data,
                "objective": meta.objective.to_dict(), "convention": meta.convention,
                "latent_shape": shape, "image_shape": shape, "wire_dtype": "float32",
                "precision": "float32", "framework": meta.framework, "backend": backend,
                "runtime": runtime, "device": device, "hardware": hardware,
                "compile": self.options.compile,
                "context_cache_bytes": self.contexts.max_bytes}

    @property
    def takes_velocity(self) -> bool:
        return True

    async def answer(self, body: bytes) -> tuple[int, bytes]:
        async def handle(handling: Handling) -> bytes:
            message = decode_request(body, self.limits)
            handling.request_id = message.request_id
            if not isinstance(message, _TAKES):
                raise ProtocolError(f"expert {self.meta.name} is conditioned on labels: send "
                                    "a label context, then velocity or integrate requests "
                                    "naming its rows", 422, message.request_id)
            if isinstance(message, LabelContext):
                handling.kind = "context"
            else:
                handling.kind = ("velocity" if isinstance(message, VelocityRequest)
                                 else "integrate")
                handling.rows = message.x.shape[0]
            if self.backend is None:
                raise ProtocolError(self.not_ready(), 503, message.request_id)
            if isinstance(message, LabelContext):
                self.contexts.put(message.id, message)
                return encode_context_ack(message.request_id, message.id)
            return encode_response(message.request_id, await self._run(message))

        return await answer_or_error(self, handle)

    async def velocity(self, message: VelocityRequest) -> np.ndarray:
        """The velocity of ``message``'s rows of a label context (B, C, H, W) float32, run in
        the batcher with other requests' rows: for its own route and a pool's alike."""
        return await self.batcher.submit(_VELOCITY, (message.x, message.t,
                                                     self._labels(message)))

    def _labels(self, message: VelocityRequest | IntegrateRequest) -> np.ndarray:
        """The labels of ``message``'s rows: rows of a label context this expert holds
        (412 otherwise), unguided, of classes it serves (422 otherwise)."""
        context = self.contexts.get(message.context, LABELS)
        context.check_rows(message.rows)
        assert context.labels is not None
        if (message.guidance != 1.0).any():
            raise ProtocolError(f"expert {self.meta.name} is conditioned on labels and has no "
                                "null label to guide against: send its rows with guidance 1",
                                422)
        labels = context.labels[message.rows]
        check_labels(labels, self.limits)
        return labels

    async def _run(self, message: VelocityRequest | IntegrateRequest) -> np.ndarray:
        """A velocity request as one batcher job; an integration as one job per slice of its
        grid (:func:`~ddm.serving.batching.grid_slices`)."""
        if isinstance(message, VelocityRequest):
            return await self.velocity(message)
        labels = self._labels(message)
        solver, x = message.solver.name.lower(), message.x
        for piece in grid_slices(message.grid):
            x = await self.batcher.submit(_Integrate(solver, piece.tobytes()), (x, labels))
        return x

    def execute(self, key: Hashable, inputs: tuple[Any, ...]) -> np.ndarray:
        """A velocity, or a whole integration on one grid."""
        backend = self.backend
        assert backend is not None, "the batcher starts only once the backend is loaded"
        if not isinstance(key, _Integrate):
            x, t, y = inputs
            return backend.velocity(x, t, y)
        x, y = inputs
        for _, x in iterate(backend.velocity, x, y, np.frombuffer(key.grid, np.float32),
                            key.solver):
            pass
        return x

    def load_and_warm(self) -> Backend:
        """The backend, checked by ``ddm expert check``'s checks and warmed up."""
        options = self.options
        backend = self.loader(load_checkpoint(self.directory), options.backend, options.device,
                              self.limits.max_batch, options.compile_cache, options.compile)
        assert self.limits.image_shape is not None
        require_passing(check_network(self.meta, backend.network, self.limits.image_shape,
                                      behaviour_data(self.meta), self.limits.max_batch),
                        self.who)
        backend.warm_up()
        return backend

    def publish(self, loaded: Backend) -> None:
        self.backend = loaded


def _max_body_bytes(limits: Limits) -> int:
    """Twice the largest valid request, so that a batch just over ``max_batch`` is refused
    with a message about the batch rather than about the body."""
    assert limits.image_shape is not None
    per_image = math.prod(limits.image_shape) * 4 + 4 + 8  # x, t float32, rows, guidance
    return 2 * (limits.max_batch * per_image + (limits.max_steps + 1) * 4) + 4096
