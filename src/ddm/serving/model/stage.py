"""A stage checkpoint as a model server's member, whatever its conditioning (DESIGN-22 section
1; issue 36): a DDM's expert (labels or text), text encoder, decoder or router network,
loaded by :func:`ddm.models.stages.load_stage` (``--precision`` casts a text stage's
weights) behind the model server's routes, batcher and protocol
(:mod:`ddm.serving.model.routes`, ``docs/protocol.md``):

* expert: a context (text: CONTEXT, version 2; labels: LABEL_CONTEXT, version 4; stored in a
  :class:`~ddm.serving.model.contexts.ContextCache`, acknowledged with its id), VELOCITY and
  INTEGRATE naming its rows (and a pool's POOL_VELOCITY). Classifier-free guidance runs here
  (:func:`ddm.sampling.guidance.guided`): each guided row and its unconditional twin (the
  context's negative row: the empty prompt's embeddings unless a negative prompt replaced
  them; the router sends them with the context, so an expert needs no text encoder) go through
  the network in one batch with the other requests' rows; rows with scale 1 run once. Batches
  count forward rows, so a guided row costs two. Replies, velocities and an integrate
  request's final state alike, travel in the weights' dtype (``wire_dtype``: float32, float16
  or bfloat16); the chunk's own steps stay float32. Before it warms up, an expert runs the
  structural checks of ``ddm expert check`` (:func:`ddm.experts.text_check.
  check_loaded_expert`: shapes, finiteness, determinism); a failure is a failure to load,
  which names the failed check.
* a label expert (our UNet, a user's network, an exported program: ``ddm.models.
  label_stages``): our UNets have no null label, so classifier-free guidance has nothing to
  guide against: a row with a guidance scale other than 1 is refused (422), as is a label
  outside the checkpoint's classes; its weights run as stored (``--precision`` may only name
  the stored dtype).
  Before it warms up, it runs ``ddm expert check``'s checks of its network
  (:func:`ddm.experts.check.check_network`: shapes, dtypes, finiteness, determinism and that
  it predicts what its config.json declares). A network that runs at fixed batch sizes
  (an exported program, JAX, a Neuron trace: :attr:`ddm.models.stages.Stage.batch_sizes`)
  has each batch padded up to one (:func:`~ddm.serving.model.compiled.bucketed`) and is
  warmed at each.
* text_encoder: ENCODE -> embeddings, mask and the tokens truncation cut.
* decoder: DECODE -> images (B, 3, H, W) in [-1, 1].
* router: ROUTE (x, t and the prompts' pooled text vectors, for a router's text prior) ->
  probabilities (B, K).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Hashable, Protocol

import numpy as np

from ddm.checkpoints.declared import EXPERT, ROUTER, TEXT_ENCODER
from ddm.checkpoints.format import CheckpointError, CheckpointMeta, read_meta
from ddm.checkpoints.roles import ROLE_REGISTRY
from ddm.conditioning import LABELS, TEXT, Conditioning, EncodedPrompts, guided_rows
from ddm.convention import CONVENTION_NAME
from ddm.deploy.limits import MAX_CONTEXT_BODY_BYTES, batch_buckets, compile_buckets
from ddm.experts.check import behaviour_data, check_network
from ddm.experts.network_checks import require_passing
from ddm.experts.text_check import check_loaded_expert
from ddm.models.backends import check_backend
from ddm.models.label_stages import label_precision
from ddm.models.stages import Stage, StageDeclaration
from ddm.models.torch_io import compile_network
from ddm.sampling.guidance import guided
from ddm.sampling.solvers import iterate
from ddm.serving.batching import grid_slices
from ddm.serving.model.compiled import (CUDA_GRAPHS, WARM_TEXT_TOKENS, bucketed,
                                        on_compiled_thread)
from ddm.serving.model.contexts import ContextCache, StoredContext
from ddm.serving.model.member import Member
from ddm.serving.model.options import ServingOptions, StageLoader
from ddm.serving.model.routes import Handling, answer_or_error
from ddm.serving.wire.protocol import (QUERIES, WIRE_DTYPES, Context, DecodeRequest, EncodeRequest,
                                       IntegrateRequest, LabelContext, Limits, ProtocolError,
                                       Request, RouteRequest, VelocityRequest, check_batch_size,
                                       check_labels, decode_request, encode_context_ack,
                                       encode_encoded, encode_probabilities, encode_response,
                                       request_kind)
from ddm.threads import CpuShare

__all__ = ["StageMember", "VelocityKey", "batch_conditioning"]

def _serves(role: str) -> str:
    """What a ``role`` stage's ``/v1/velocity`` answers (``/v1/info`` ``serves``): its first
    declared query."""
    return ROLE_REGISTRY[role].queries[0]


def _takes(declared: StageDeclaration) -> tuple[type, ...]:
    """The requests a stage answers: its role's declared queries, a label expert's context
    being a label context."""
    takes = tuple(QUERIES[query] for query in ROLE_REGISTRY[declared.role].queries)
    if declared.conditioning == LABELS:
        return tuple(LabelContext if kind is Context else kind for kind in takes)
    return takes


#: Tokens per row of the expert's warm-up call (any length runs; the context decides).
_WARM_TOKENS = 8


@dataclass(frozen=True)
class VelocityKey:
    """Batch key of velocity calls: rows merge when their contexts' token length does (None:
    a label context's rows)."""

    tokens: int | None


class VelocityGroup(Protocol):
    """What runs an expert's velocity calls in place of its own batcher: a pool's group of
    experts that share a forward (:class:`ddm.serving.model.grouped.ExpertGroup`)."""

    async def submit(self, member: StageMember, key: VelocityKey,
                     inputs: tuple[np.ndarray, ...], cost: int) -> np.ndarray: ...


@dataclass(frozen=True)
class _Integrate:
    solver: str
    grid: bytes
    tokens: int | None


class StageMember(Member):
    """One stage checkpoint as a server holds it: the declaration, limits, its batcher and
    metrics, the context cache (an expert's), the loaded stage. The declaration, the backend
    and the limits are checked here, so that a wrong flag fails before the server starts;
    ``loader`` loads the stage (:func:`~ddm.models.stages.load_stage`, or a test's
    replacement)."""

    def __init__(self, directory: Path, declared: StageDeclaration, options: ServingOptions,
                 serving_loops: int, loader: StageLoader, cpu: CpuShare | None = None) -> None:
        check_backend(options.backend, options.device)
        #: A label checkpoint's config.json (its facts, its network check); None for text.
        self.meta: CheckpointMeta | None = None
        if declared.conditioning == LABELS:
            self.meta = _label_meta(directory, options)
        limits = Limits(max_batch=options.max_batch, max_steps=options.max_steps,
                        image_shape=declared.latent_shape, text_width=declared.text_width,
                        allowed_labels=declared.classes if self.meta is not None else None)
        limits = dataclasses.replace(limits, max_body_bytes=_max_body_bytes(declared, limits))
        super().__init__(directory, limits, options, serving_loops, cpu)
        self.declared = declared
        self.loader = loader
        self.contexts = ContextCache(options.context_cache_bytes)
        self.stage: Stage | None = None
        #: Loaded and checked ahead of warming by a pool forming a group (:mod:`ddm.serving.
        #: model.grouped`); the warm-up takes it.
        self.preloaded: Stage | None = None
        #: The group whose batcher runs this expert's velocity calls, once it is active.
        self.group: VelocityGroup | None = None

    @property
    def ready(self) -> bool:
        return self.stage is not None

    @property
    def who(self) -> str:
        """A label checkpoint by its own name, a stage by its directory."""
        if self.declared.name is not None:
            return f"{self.declared.role} {self.declared.name}"
        return f"{self.declared.role} stage {self.directory.name}"

    @property
    def wire_dtype(self) -> str | None:
        return None if self.stage is None else self.stage.dtype

    def facts(self) -> dict[str, Any]:
        stage, declared, backend = self.stage, self.declared, self.options.backend
        if stage is not None:
            declared = stage.declaration
        runtime = None if stage is None else stage.runtime
        latent = list(declared.latent_shape or ())
        image = (list(stage.image_shape) if stage is not None and stage.image_shape is not None
                 else latent)
        return {"name": declared.name or self.directory.name, "kind": declared.role,
                "role": declared.role, "family": declared.family, "model": declared.family,
                "conditioning": declared.conditioning if declared.role == EXPERT else None,
                "classes": list(declared.classes),
                **(declared.trained_on.info(declared.cluster)
                   if declared.trained_on is not None else {}),
                "cluster": declared.cluster,
                "clusters": None if stage is None else stage.clusters,
                "latent_shape": latent, "image_shape": image,
                "text_width": declared.text_width, "example_prompt": declared.example_prompt,
                "wire_dtype": self.wire_dtype,
                "precision": self.wire_dtype, "convention": CONVENTION_NAME,
                "network_convention": declared.convention, "serves": _serves(declared.role),
                "framework": declared.framework or backend, "backend": backend,
                "runtime": None if runtime is None else runtime.library,
                "device": self.options.device if runtime is None else runtime.device,
                "hardware": None if runtime is None else runtime.hardware,
                "compile": None if stage is None else
                self.options.compile if stage.network is not None else "none",
                # Its budget (a pool's experts hold one cache of theirs together).
                "context_cache_bytes": self.options.context_cache_bytes if declared.role == EXPERT
                else None, **({} if self.meta is None else _label_facts(self.meta))}

    async def answer(self, body: bytes) -> tuple[int, bytes]:
        async def handle(handling: Handling) -> bytes:
            message = decode_request(body, self.limits)
            handling.request_id = message.request_id
            handling.kind = request_kind(message)
            takes = _takes(self.declared)
            if not isinstance(message, takes):
                raise ProtocolError(self._refusal(takes, message), 422, message.request_id)
            if self.stage is None:
                raise ProtocolError(self.not_ready(), 503, message.request_id)
            reply = await self._run(message)
            handling.rows = (0 if isinstance(message, (Context, LabelContext, EncodeRequest))
                             else message.x.shape[0])
            return reply

        return await answer_or_error(self, handle)

    def _refusal(self, takes: tuple[type, ...], message: Request) -> str:
        """Why a request of a kind this stage does not take is refused."""
        if self.declared.conditioning == LABELS:
            return (f"{self.who} is conditioned on labels: send a label context, then velocity "
                    "or integrate requests naming its rows")
        return (f"this {self.declared.role} stage takes "
                f"{', '.join(t.__name__ for t in takes)}, not {type(message).__name__}")

    async def _run(self, message: Request) -> bytes:
        """The reply body to a decoded, accepted request."""
        request_id, batcher = message.request_id, self.batcher
        if isinstance(message, (Context, LabelContext)):
            self.contexts.put(message.id, message)
            return encode_context_ack(request_id, message.id)
        if isinstance(message, EncodeRequest):
            if len(message.prompts) > self.limits.max_batch:
                raise ProtocolError(f"{len(message.prompts)} prompts exceed this encoder's "
                                    f"max_batch of {self.limits.max_batch}", 422)
            embeddings, mask, cut, unknown = await batcher.submit(
                "encode", (np.array(message.prompts, dtype=object),))
            spans = np.array([(row, start, end) for row, words in enumerate(unknown)
                              for start, end in words], np.int64).reshape(-1, 3)
            return encode_encoded(request_id, EncodedPrompts(
                Conditioning(embeddings=self._wire(embeddings), mask=mask), cut, spans))
        if isinstance(message, DecodeRequest):
            return encode_response(request_id,
                                   self._wire(await batcher.submit("decode", (message.x,))))
        if isinstance(message, RouteRequest):
            return encode_probabilities(request_id, await batcher.submit(
                "route", (message.x, message.t, self._pooled(message))))
        if isinstance(message, VelocityRequest):
            return encode_response(request_id, await self.velocity(message))
        assert isinstance(message, IntegrateRequest)
        tokens, rows, cost = self._context_rows(message)
        solver, x = message.solver.name.lower(), message.x
        for piece in grid_slices(message.grid):
            x = await batcher.submit(_Integrate(solver, piece.tobytes(), tokens), (x, *rows),
                                     cost)
        return encode_response(request_id, self._wire(x))

    @property
    def takes_velocity(self) -> bool:
        return self.declared.role == EXPERT

    async def velocity(self, message: VelocityRequest) -> np.ndarray:
        """The guided velocity of ``message``'s rows (B, C, H, W) in the stage's wire dtype,
        run in the expert's batcher with other requests' rows: for its own route and a
        pool's (:mod:`ddm.serving.model.pool_step`) alike."""
        tokens, rows, cost = self._context_rows(message)
        inputs, group = (message.x, message.t, *rows), self.group
        out = await (self.batcher.submit(VelocityKey(tokens), inputs, cost) if group is None
                     else group.submit(self, VelocityKey(tokens), inputs, cost))
        return self._wire(out)

    def _context_rows(self, message: VelocityRequest | IntegrateRequest
                      ) -> tuple[int | None, tuple[np.ndarray, ...], int]:
        """The context's token length (None: labels), the conditioning of the message's rows
        as the batcher carries it (:func:`batch_conditioning`) and the forward rows the call
        costs."""
        if self.declared.conditioning == LABELS:
            check_batch_size(message.x.shape[0], self.limits.max_batch)
            return None, (self._labels(message),), message.x.shape[0]
        context, cost = self._text_rows(message)
        assert context.embeddings is not None
        # By reference: the batch gathers its rows of 77 x 768 floats once (batch_conditioning).
        held = np.empty(len(message.rows), object)
        held[:] = [context] * len(message.rows)
        return context.embeddings.shape[1], (held, message.rows, message.guidance), cost

    def _labels(self, message: VelocityRequest | IntegrateRequest) -> np.ndarray:
        """The labels of ``message``'s rows: rows of a label context this expert holds
        (412 otherwise), unguided, of classes it serves (422 otherwise)."""
        context = self.contexts.get(message.context, LABELS)
        context.check_rows(message.rows)
        assert context.labels is not None
        if (message.guidance != 1.0).any():
            raise ProtocolError(f"{self.who} is conditioned on labels and has no null label "
                                "to guide against: send its rows with guidance 1", 422)
        labels = context.labels[message.rows]
        check_labels(labels, self.limits)
        return labels

    def _text_rows(self, message: VelocityRequest | IntegrateRequest
                   ) -> tuple[StoredContext, int]:
        """The text context holding the rows (checked: 412 where not held, 422 for rows it
        lacks or guided rows without negative rows) and the forward rows the call costs."""
        context = self.contexts.get(message.context, TEXT)
        context.check_rows(message.rows)
        assert context.embeddings is not None and context.negative is not None
        try:
            guided_mask = guided_rows(message.guidance, len(message.rows),
                                      context.negative.shape[0] > 0, "the context")
        except ValueError as error:
            raise ProtocolError(str(error), 422) from None
        cost = message.x.shape[0] + int(guided_mask.sum())
        if cost > self.limits.max_batch:
            raise ProtocolError(f"{message.x.shape[0]} rows, {int(guided_mask.sum())} of them "
                                f"guided, run {cost} forward rows; the limit is "
                                f"{self.limits.max_batch}", 422)
        return context, cost

    def _pooled(self, message: RouteRequest) -> np.ndarray:
        """The request's pooled text rows as the router takes them: (B, D) for a router with
        a text prior (none sent: zeros, no evidence), else (B, 0), unused."""
        assert self.stage is not None, "requests are answered once the stage is loaded"
        prior, pooled = self.stage.declaration.text_prior, message.pooled
        if prior is None:
            return np.zeros((len(pooled), 0), np.float32)
        if pooled.shape[1] == 0:
            return np.zeros((len(pooled), prior.text_width), np.float32)
        if pooled.shape[1] != prior.text_width:
            raise ProtocolError(f"'pooled' is {pooled.shape[1]} wide; this router's text "
                                f"prior takes {prior.text_width}", 422)
        return pooled

    def _wire(self, out: np.ndarray) -> np.ndarray:
        """``out`` (float32) in the dtype the stage declares for its replies."""
        return np.asarray(out).astype(WIRE_DTYPES[self.wire_dtype or "float32"], copy=False)

    def execute(self, key: Hashable, inputs: tuple[Any, ...]) -> Any:
        stage = self.stage
        assert stage is not None, "the batcher starts once the stage is loaded"
        if key == "encode":
            (prompts,) = inputs
            cond = stage.forward(list(prompts))
            assert stage.tokens_cut is not None and stage.unknown_spans is not None
            assert cond.mask is not None
            spans = stage.unknown_spans(list(prompts))
            words = np.empty(len(prompts), object)  # per row, as the batcher splits rows
            for row in range(len(prompts)):
                words[row] = [(start, end) for _, start, end in spans[spans[:, 0] == row]]
            return (cond.embeddings, cond.mask.astype(np.uint8),
                    stage.tokens_cut(list(prompts)).astype(np.int32), words)
        if key in ("decode", "route"):
            return np.asarray(stage.forward(*inputs), np.float32)
        velocity = guided(stage.forward, None)
        if isinstance(key, VelocityKey):
            x, t, *rows = inputs
            return velocity(x, t, batch_conditioning(key.tokens, rows))
        assert isinstance(key, _Integrate), f"unknown batch key {key!r}"
        x, *rows = inputs
        for _, x in iterate(velocity, x, batch_conditioning(key.tokens, rows),
                            np.frombuffer(key.grid, np.float32), key.solver):
            pass
        return x

    def load_and_warm(self) -> Stage:
        """The stage (:meth:`load_checked`, unless a pool preloaded it) compiled where
        ``--compile`` asks and it has a torch network, warmed up: at one row, or at every
        batch size it runs at or is compiled for."""
        stage, self.preloaded = self.preloaded or self.load_checked(), None
        options = self.options
        if options.compile == "none" or stage.network is None:
            device = options.device if stage.runtime is None else stage.runtime.device
            _warm_up(stage, stage.batch_sizes or _eager_warm_sizes(device,
                                                                   self.limits.max_batch),
                     _WARM_TOKENS)
            return stage
        buckets = compile_buckets(self.limits.max_batch)
        compile_network(stage.network, options.compile, len(buckets))
        compiled = dataclasses.replace(stage, forward=bucketed(
            on_compiled_thread(options.compile, stage.forward), buckets))
        # CUDA graph trees record a shape at its second call (the first warms the allocator):
        # twice, so that no graph is recorded during live requests.
        for _ in range(2 if options.compile == CUDA_GRAPHS else 1):
            _warm_up(compiled, buckets, WARM_TEXT_TOKENS)
        return compiled

    def load_checked(self) -> Stage:
        """The stage at ``--precision``, padded to the batch sizes it runs at (if fixed), an
        expert checked by ``ddm expert check``'s checks (eagerly)."""
        options = self.options
        stage = self.loader(self.directory, options.precision, options.device,
                            options.backend, batch_buckets(self.limits.max_batch),
                            options.compile_cache)
        if stage.batch_sizes is not None:
            stage = dataclasses.replace(
                stage, forward=bucketed(stage.forward, stage.batch_sizes),
                prediction=(None if stage.prediction is None
                            else bucketed(stage.prediction, stage.batch_sizes)))
        if stage.declaration.role == EXPERT:
            require_passing(self._check(stage), self.who)
        return stage

    def _check(self, expert: Stage) -> list[Any]:
        """``ddm expert check``'s checks of a loaded expert: a label network's against what
        its config.json declares (its objective, on held-out images where there are any), a
        text expert's structural ones."""
        if self.meta is None:
            return check_loaded_expert(expert, self.limits.max_batch)
        assert expert.prediction is not None and self.limits.image_shape is not None
        network = expert.prediction

        def on_labels(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
            return network(x, t, Conditioning.from_labels(y))

        return check_network(self.meta, on_labels, self.limits.image_shape,
                             behaviour_data(self.meta), self.limits.max_batch)

    def publish(self, loaded: Stage) -> None:
        declared = loaded.declaration
        limits = dataclasses.replace(self.limits, image_shape=declared.latent_shape,
                                     text_width=declared.text_width)
        self.limits = dataclasses.replace(
            limits, max_body_bytes=_max_body_bytes(declared, limits))
        self.stage = loaded


def _label_meta(directory: Path, options: ServingOptions) -> CheckpointMeta:
    """A label checkpoint's config.json, refusing what a model server cannot serve of it."""
    if options.precision is not None:  # the loader's rule, checked before the server starts
        label_precision(directory, options.precision)
    meta = read_meta(directory)
    if meta.kind not in ("expert", "monolith"):
        raise CheckpointError(f"{directory} is a {meta.kind} checkpoint, not a UNet to serve")
    return meta


def _label_facts(meta: CheckpointMeta) -> dict[str, Any]:
    """What a label checkpoint says of itself in ``/v1/info``, where a stage's declaration
    says otherwise: its kind and model, what it was trained on, its objective and
    convention."""
    return {"kind": meta.kind, "family": meta.model.kind, "model": meta.model.kind,
            "partition": meta.partition, "data": meta.data,
            "objective": meta.objective.to_dict(), "convention": meta.convention,
            "network_convention": None, "cluster": None}


def batch_conditioning(tokens: int | None, rows: list[np.ndarray]) -> Conditioning:
    """A batch's rows as the batcher carries them (:meth:`StageMember._context_rows`) ->
    their conditioning: a label context's ``[labels]`` (``tokens`` None), or a text
    context's ``[contexts, rows, guidance]`` (each row's stored context and its index there)
    gathered once, guided against the negative rows (a row without guidance gets its own
    embeddings as a placeholder that is never run). The negative rows follow the rows in one
    buffer, so that guidance's one forward of both (:func:`ddm.sampling.guidance.guided`)
    copies none of them again (:func:`ddm.conditioning.concat`)."""
    if tokens is None:
        (labels,) = rows
        return Conditioning.from_labels(labels)
    held, index, guidance = rows
    both = np.empty((2 * len(index), *held[0].embeddings.shape[1:]), np.float32)
    plain, negative = both[:len(index)], both[len(index):]
    _gather(held, index, False, plain)
    _gather(held, index, True, negative)
    return Conditioning(embeddings=plain).with_guidance(guidance,
                                                        Conditioning(embeddings=negative))


def _gather(held: np.ndarray, index: np.ndarray, negative: bool, out: np.ndarray) -> None:
    """Row ``index[i]`` of context ``held[i]``'s embeddings, or of its ``negative`` rows (a
    context without any: its embeddings, placeholders never run), into ``out[i]`` (float32),
    in one copy per run of rows of one context (a call's rows are one run)."""
    start = 0
    for stop in range(1, len(held) + 1):
        if stop == len(held) or held[stop] is not held[start]:
            context = held[start]
            source = (context.negative if negative and context.negative.shape[0]
                      else context.embeddings)
            if source.dtype == np.float32:  # its rows are checked in range (check_rows)
                np.take(source, index[start:stop], axis=0, out=out[start:stop], mode="clip")
            else:
                out[start:stop] = source[index[start:stop]]
            start = stop


def _eager_warm_sizes(device: str | None, max_batch: int) -> tuple[int, ...]:
    """The batch sizes an eager network on ``device`` (``cpu``, ``cpu:0``, ``cuda:0``) is
    warmed at: on an accelerator one row and a full batch (the first full batch would pay the
    allocator's growth and the kernels' selection, cuDNN's autotuning, on a live request), on
    the CPU one row."""
    if device is None or device.split(":")[0] == "cpu":
        return (1,)
    return tuple(sorted({1, max_batch}))


def _warm_up(stage: Stage, sizes: tuple[int, ...], tokens: int) -> None:
    """One call at each of ``sizes`` rows (an expert's text ``tokens`` long), so that the
    first request pays no lazy initialisation or compilation."""
    declared = stage.declaration
    if declared.role == TEXT_ENCODER:
        stage.forward([""])
        return
    assert declared.latent_shape is not None
    for size in sizes:
        x = np.zeros((size, *declared.latent_shape), np.float32)
        t = np.full((size,), 0.5, np.float32)
        if declared.role == EXPERT and declared.conditioning == LABELS:
            stage.forward(x, t, Conditioning.from_labels(
                np.full(size, min(declared.classes, default=0))))
        elif declared.role == EXPERT:
            assert declared.text_width is not None
            stage.forward(x, t, Conditioning(
                embeddings=np.zeros((size, tokens, declared.text_width), np.float32)))
        elif declared.role == ROUTER:
            stage.forward(x, t)
        else:
            stage.forward(x)


def _max_body_bytes(declared: StageDeclaration, limits: Limits) -> int:
    """Twice the largest valid request of the role (a text context for a text expert, whose
    cap is :data:`~ddm.deploy.limits.MAX_CONTEXT_BODY_BYTES`), so that a batch just over
    ``max_batch`` is refused with a message about the batch."""
    role = declared.role
    if role == TEXT_ENCODER:
        return 2 * limits.max_prompts * (limits.max_prompt_bytes + 4) + 4096
    shape = limits.image_shape
    if shape is None:  # not declared: until the network says, a context's cap
        return MAX_CONTEXT_BODY_BYTES
    per_row = 4 * math.prod(shape) + 4 + 4 + 4  # x, t, rows, guidance
    calls = 2 * (limits.max_batch * per_row + (limits.max_steps + 1) * 4) + 4096
    if role == EXPERT and declared.conditioning == TEXT:
        return max(calls, MAX_CONTEXT_BODY_BYTES)
    return calls
