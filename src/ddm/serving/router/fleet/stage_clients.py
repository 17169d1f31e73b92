"""The router's stages: a text DDM's text encoder, decoder and router network, called over
the wire (``ddm serve stage``) or run in the router's process, behind one interface.

:class:`StageCaller` is what the router's driver asks: ``encode`` once per request, ``decode``
once at the end, ``route`` at every step. A :class:`StagePool` answers it over the wire
through its own :class:`~ddm.serving.router.fleet.servers.ModelServers` (the replica, discovery,
probing, retry and failover machinery every caller of a model server shares) pointed at stage
servers (``docs/protocol.md`` version 2: ENCODE, DECODE, ROUTE);
:class:`LocalStages` with stages loaded in this process
(:func:`ddm.models.stages.load_stage`), off the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Protocol, Sequence, TypeVar

import numpy as np

from ddm.checkpoints.declared import DECODER, ROUTER, TEXT_ENCODER
from ddm.checkpoints.roles import stage_roles
from ddm.conditioning import EncodedPrompts
from ddm.deploy.limits import (MAX_EXPERTS, MAX_PROMPT_BYTES, MAX_TEXT_TOKENS,
                               MAX_TEXT_WIDTH)
from ddm.serving.wire.protocol import (DecodeRequest, EncodeRequest, Limits, RouteRequest,
                                       decode_encoded, decode_probabilities, decode_response,
                                       encode_request, max_error_reply_bytes, max_reply_bytes)
from ddm.serving.http.auth import TokenFile
from ddm.serving.router.fleet.replicas import (EndpointSource, Replica, report_max_batch,
                                               report_shape, report_wire_dtype, require,
                                               short_text)
from ddm.serving.router.fleet.servers import ModelServers, PoolMetrics, PoolSettings, gather_all

if TYPE_CHECKING:  # the stages' modules import torch: only a router that runs stages needs it
    from ddm.models.stages import Stage

__all__ = ["LocalStages", "StageCaller", "StageInfo", "StagePool"]

_T = TypeVar("_T")


class StageCaller(Protocol):
    """A text DDM's stages as the router's driver calls them; remote or in-process."""

    async def encode(self, prompts: Sequence[str]) -> EncodedPrompts: ...

    async def decode(self, latents: np.ndarray) -> np.ndarray: ...

    async def route(self, x: np.ndarray, t: np.ndarray,
                    pooled: np.ndarray | None) -> np.ndarray: ...


@dataclass(frozen=True)
class StageInfo:
    """What a stage server says of itself in ``/v1/info``, checked as strictly as an expert's
    (:class:`~ddm.serving.router.fleet.replicas.ExpertInfo`): a peer's report sizes the router's
    allocations. ``latent_shape`` is what it takes (decoder, router), ``image_shape`` what a
    decoder makes (RGB, its sides whole multiples of the latent's), ``text_width`` what an
    encoder makes, ``clusters`` a router's outputs."""

    role: str
    max_batch: int
    wire_dtype: str
    latent_shape: tuple[int, int, int] | None = None
    image_shape: tuple[int, int, int] | None = None
    text_width: int | None = None
    clusters: int | None = None
    #: A text encoder's example prompt, if its checkpoint declares one.
    example_prompt: str | None = None
    #: The device it says it runs on (``cpu``, ``cuda:0``...; None: not said).
    device: str | None = None

    @classmethod
    def from_json(cls, raw: Any) -> StageInfo:
        require(isinstance(raw, Mapping), "/v1/info is not a JSON object")
        roles = {declared.name: declared for declared in stage_roles()}
        role = raw.get("role")
        require(role in roles,
                f"role must be one of {', '.join(roles)}, got {str(role)[:64]!r}")
        reports = roles[role].reports  # what this role's report must carry (its registry's)
        max_batch, wire_dtype = report_max_batch(raw), report_wire_dtype(raw)
        width = raw.get("text_width")
        require("text_width" not in reports
                or (type(width) is int and 1 <= width <= MAX_TEXT_WIDTH),
                f"a {role}'s text_width must be an integer in 1..{MAX_TEXT_WIDTH}")
        clusters = raw.get("clusters")
        require("clusters" not in reports
                or (type(clusters) is int and 1 <= clusters <= MAX_EXPERTS),
                f"a {role}'s clusters must be an integer in 1..{MAX_EXPERTS}")
        latent = report_shape(raw, "latent_shape") if "latent_shape" in reports else None
        image = report_shape(raw, "image_shape") if "image_shape" in reports else None
        require(image is None or latent is None or (
            image[0] == 3 and image[1] % latent[1] == 0 and image[2] % latent[2] == 0),
            "a decoder's image_shape must be RGB (3, H, W) at a whole multiple of its "
            "latent_shape's sides (the router sends RGB PNGs; VAEs up-sample by whole factors)")
        example = raw.get("example_prompt")
        require(example is None or (isinstance(example, str)
                                    and len(example) <= MAX_PROMPT_BYTES),
                f"example_prompt must be a prompt of at most {MAX_PROMPT_BYTES} characters")
        return cls(role, max_batch, wire_dtype, latent, image,
                   width if "text_width" in reports else None,
                   clusters if "clusters" in reports else None,
                   example if role == TEXT_ENCODER else None, short_text(raw.get("device")))


class StagePool:
    """Stage servers by role (sources named :data:`TEXT_ENCODER`, :data:`DECODER`,
    :data:`ROUTER`), a :class:`StageCaller`. It owns the stage messages (split to each
    server's ``max_batch``); its :class:`ModelServers` the replicas, probes and retries, their
    reports read as :class:`StageInfo`. Stage calls are not coalesced: each runs once per
    request. Use as ``async with``."""

    def __init__(self, sources: Mapping[str, EndpointSource], settings: PoolSettings,
                 metrics: PoolMetrics | None = None, token: TokenFile | None = None,
                 members: Mapping[str, str] | None = None) -> None:
        """``members``: role -> its member name on pool servers, for stages served in a pool
        (:func:`~ddm.serving.router.fleet.servers.discovered_sources` reads both from
        ``router.yaml``'s discoveries)."""
        self._servers = ModelServers(sources, settings, StageInfo.from_json, metrics, token,
                                     members)
        self._ids = itertools.count(1)

    async def __aenter__(self) -> StagePool:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Open the client, list every stage's replicas, and start refreshing and probing."""
        await self._servers.start()

    async def close(self) -> None:
        await self._servers.close()

    def info(self, stage: str) -> StageInfo | None:
        """What the stage's replicas say of it in ``/v1/info``; None until one has been
        probed ready."""
        return self._servers.info(stage)

    async def encode(self, prompts: Sequence[str]) -> EncodedPrompts:
        info = await self._servers.described(TEXT_ENCODER)
        limits = Limits(text_width=info.text_width)
        parts = [tuple(prompts[i:i + info.max_batch])
                 for i in range(0, len(prompts), info.max_batch)]

        async def one(part: tuple[str, ...]) -> EncodedPrompts:
            def request(request_id: int) -> tuple[bytes, int]:
                return (encode_request(EncodeRequest(request_id, part)),
                        _max_encoded_bytes(len(part), info.text_width or MAX_TEXT_WIDTH))

            return await self._stage_call(
                TEXT_ENCODER, len(part), request,
                lambda body, rid: decode_encoded(body, rid, len(part), limits))

        encoded = await gather_all(*(one(part) for part in parts))
        return encoded[0] if len(encoded) == 1 else EncodedPrompts.concat(encoded)

    async def decode(self, latents: np.ndarray) -> np.ndarray:
        info = await self._servers.described(DECODER)
        assert info.image_shape is not None, "StageInfo requires it of a decoder"

        async def one(x: np.ndarray) -> np.ndarray:
            shape = (x.shape[0], *info.image_shape)

            def request(request_id: int) -> tuple[bytes, int]:
                return (encode_request(DecodeRequest(request_id, x)),
                        max_reply_bytes(shape))

            images = await self._stage_call(
                DECODER, len(x), request, lambda body, rid: decode_response(body, rid, shape))
            return images.astype(np.float32)

        return await self._split(latents, info.max_batch, one)

    async def route(self, x: np.ndarray, t: np.ndarray,
                    pooled: np.ndarray | None) -> np.ndarray:
        info = await self._servers.described(ROUTER)
        text = np.zeros((len(x), 0), np.float32) if pooled is None else pooled

        async def one(rows: np.ndarray) -> np.ndarray:
            part, times = x[rows], t[rows]

            def request(request_id: int) -> tuple[bytes, int]:
                return (encode_request(RouteRequest(request_id, part, times,
                                                         text[rows])),
                        max_reply_bytes((part.shape[0], info.clusters or 1, 1, 1)) + 64)

            return await self._stage_call(
                ROUTER, len(part), request,
                lambda body, rid: decode_probabilities(body, rid, part.shape[0],
                                                       info.clusters))

        return await self._split(np.arange(x.shape[0]), info.max_batch, one)

    async def _split(self, rows: np.ndarray, size: int,
                     call: Callable[[np.ndarray], Awaitable[np.ndarray]]) -> np.ndarray:
        outs = await gather_all(*(call(rows[i:i + size]) for i in range(0, len(rows), size)))
        return outs[0] if len(outs) == 1 else np.concatenate(outs)

    async def _stage_call(self, stage: str, rows: int,
                          request: Callable[[int], tuple[bytes, int]],
                          decode: Callable[[bytes, int], _T]) -> _T:
        self._servers.metrics.request_rows.labels(stage).observe(rows)
        request_id = next(self._ids)
        body, max_reply = request(request_id)

        def attempt(replica: Replica, timeout: float) -> Awaitable[_T]:
            return self._servers.exchange_once(stage, replica, body, max_reply, timeout,
                                               lambda reply: decode(reply, request_id))

        return await self._servers.send(stage, stage, attempt,
                                        time.monotonic() + self._servers.settings.deadline_s)


class LocalStages:
    """:class:`StageCaller` with stages loaded in the router's process; each call runs in a
    worker thread, one at a time per stage (a model is not called concurrently: a tokenizer,
    for one, fails when it is). A call cancelled meanwhile (its client left) leaves its thread
    running, so the thread holds the stage's lock, not the cancelled coroutine; the asyncio
    lock only keeps waiting calls off the worker threads."""

    def __init__(self, text_encoder: Stage | None = None, decoder: Stage | None = None,
                 router: Stage | None = None) -> None:
        self._stages = {TEXT_ENCODER: text_encoder, DECODER: decoder, ROUTER: router}
        self._locks = {role: asyncio.Lock() for role in self._stages}
        self._running = {role: threading.Lock() for role in self._stages}

    async def encode(self, prompts: Sequence[str]) -> EncodedPrompts:
        stage = self._stage(TEXT_ENCODER)
        assert stage.tokens_cut is not None and stage.unknown_spans is not None, (
            "a text encoder stage counts truncation and unknown words")
        cut, unknown = stage.tokens_cut, stage.unknown_spans
        return await self._run(TEXT_ENCODER, lambda: EncodedPrompts(
            stage.forward(list(prompts)), cut(list(prompts)), unknown(list(prompts))))

    async def decode(self, latents: np.ndarray) -> np.ndarray:
        stage = self._stage(DECODER)
        return await self._run(DECODER, lambda: stage.forward(latents))

    async def route(self, x: np.ndarray, t: np.ndarray,
                    pooled: np.ndarray | None) -> np.ndarray:
        stage = self._stage(ROUTER)
        return await self._run(ROUTER, lambda: stage.forward(x, t, pooled))

    def _stage(self, role: str) -> Stage:
        stage = self._stages[role]
        if stage is None:
            raise ValueError(f"this router has no {role} stage")
        return stage

    async def _run(self, role: str, work: Callable[[], _T]) -> _T:
        running = self._running[role]

        def alone() -> _T:
            with running:
                return work()

        async with self._locks[role]:
            return await asyncio.to_thread(alone)


def _max_encoded_bytes(prompts: int, width: int) -> int:
    """The largest encode reply for ``prompts`` prompts of the declared ``width``: float32
    embeddings and a mask of at most MAX_TEXT_TOKENS tokens, the cuts, an unknown word's
    span (3 int32) per token at most, headers."""
    return (prompts * MAX_TEXT_TOKENS * (4 * width + 1 + 12) + 8 * prompts
            + max_error_reply_bytes())
