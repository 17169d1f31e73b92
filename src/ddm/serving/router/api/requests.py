"""The router's request and answer schemas, built per config so that they carry its classes,
limits and defaults, and pydantic's validation errors as one readable line.

The schemas are what ``/openapi.json`` documents, so they say exactly what the router enforces:
labels in ``0..num_classes - 1``, at most ``max_batch`` of them, ``steps`` in ``1..max_steps``,
a strategy in the CRD's grammar (``STRATEGY_PATTERN``; only ``oracle`` without a router
network), no unknown fields and, in a JSON body, integers as JSON Schema reads them (``2`` or
``2.0``, never ``"2"``, ``2.5`` or ``true``). What they cannot say are the checks that span
a label and the experts: :func:`ddm.sampling.loop.check_request`, the one request validator
(``ddm sample`` calls it too), makes them and answers a 422: with the ``oracle`` strategy each
label must be owned by exactly one expert, with the others by one at least. The label and
strategy checks here are its pieces (``check_labels``, ``parse_strategy``).

Not ``from __future__ import annotations``: pydantic reads the models' annotations at runtime.
"""

import base64
import binascii
import io
import math
import re
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                      WithJsonSchema, field_validator)

from ddm.conditioning import TEXT
from ddm.deploy.limits import (MAX_CLASS, MAX_PROMPT_BYTES, MAX_STATE_MAGNITUDE,
                               ROUTER_MIN_BODY_BYTES)
from ddm.deploy.router_config import RouterConfigFile, RouterLimits, strategy_allowed
from ddm.sampling.loop import SamplingRequest, check_labels
from ddm.sampling.routing import Strategy, parse_strategy
from ddm.sampling_params import (GUIDANCE_CUTOFF, GUIDANCE_SCALE, SOLVER, SOLVERS, STEPS,
                                 STRATEGY, STRATEGY_PATTERN)
from ddm.serving.router.api.info import has_router_network

#: The schema of a field this DDM takes none of (a label DDM's prompts, a text DDM's labels):
#: nothing matches it. The field stays, so that a request sending it is told why it is refused
#: (:func:`ddm.sampling.loop.check_request`) rather than that the field is unknown.
_NONE = {"not": {}}
#: Longer than any name in the grammar needs; bounds ``threshold:0.000...1`` away from 0.
MAX_STRATEGY_CHARS = 32
_ORACLE_ONLY = r"^oracle$"


def _integral(value: Any) -> Any:
    """``2.0`` as ``2``: JSON Schema's ``integer`` is any number without a fraction."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


#: An integer field; in a strict model, a string, a bool or a fraction is refused.
Integer = Annotated[int, BeforeValidator(_integral)]
def _fits(prompt: str) -> str:
    """A prompt within the wire's ``MAX_PROMPT_BYTES`` (UTF-8), which a text encoder served
    on its own takes (``docs/protocol.md``)."""
    size = len(prompt.encode("utf-8", "surrogatepass"))
    if size > MAX_PROMPT_BYTES:
        raise ValueError(f"a prompt may hold at most {MAX_PROMPT_BYTES} UTF-8 bytes, got "
                         f"{size}")
    return prompt


#: A prompt; the text encoder cuts what its tokenizer cannot take (and the answer says so).
Prompt = Annotated[str, Field(max_length=MAX_PROMPT_BYTES), AfterValidator(_fits)]
#: The answer's per-prompt count of tokens the text encoder cut.
TRUNCATED = ("per prompt (then the negative prompt, if one was given), the tokens the text "
             "encoder cut because the prompt is longer than its tokenizer takes (CLIP: 77 "
             "tokens, the start and end tokens included), as CLIP truncates; 0: the whole "
             "prompt was used. Empty for a label DDM")
#: The answer's lines saying what the text encoder ignored.
WARNINGS = ("what the text encoder ignored, a line per prompt that lost something: the words "
            "it does not know (a word-level vocabulary's; docs/text2img.md lists ours) and "
            "the tokens a prompt too long lost. Empty: every word was read")


class ErrorDetail(BaseModel):
    """Every error answer of the router: what is wrong, in one line."""

    detail: str = Field(description="what is wrong with the request, or which expert failed")
    param: str | None = Field(None, description="the request field at fault (422), where one "
                                                "is")
    expert: str | None = Field(None, description="the expert that failed (502 and 503 only)")


class GenerateResponse(BaseModel):
    """The answer of ``POST /v1/generate``: one entry per requested label or prompt, in
    order."""

    images: list[str] = Field(description="base64 PNGs, one per label or prompt: grayscale "
                                          "from a label DDM, RGB from a decoder")
    labels: list[int] = Field(description="the labels asked for (empty for a text DDM)")
    prompts: list[str] = Field(description="the prompts asked for (empty for a label DDM)")
    truncated: list[int] = Field(description=TRUNCATED)
    warnings: list[str] = Field(description=WARNINGS)
    experts: list[list[str]] = Field(description="the experts each image used, in any step")
    expert_names: list[str] = Field(description="the DDM's experts; bit k of routing is the "
                                                "k-th of them")
    routing: list[list[int]] = Field(description="per image, per step, the experts that ran "
                                                 "it: bit k set for expert_names[k] (top-1: a "
                                                 "power of two; 3 = experts 0 and 1)")
    expert_calls: list[int] = Field(description="expert evaluations per image")
    round_trips: list[int] = Field(description="HTTP requests to experts per image")
    rerouted: list[list[int]] = Field(description="per image, the steps (1-based) whose "
                                                  "missing expert's share went to the best "
                                                  "available experts (missing_expert reroute)")
    waited_s: float = Field(description="time the generation waited for missing experts "
                                        "to have a ready replica (missing_expert wait)")
    steps: int
    strategy: str
    solver: str
    delegate_steps: int
    seconds: float = Field(description="time spent generating")


def _event(name: str, fields: dict[str, Any], optional: tuple[str, ...] = ()
           ) -> dict[str, Any]:
    data = {"type": "object", "required": [f for f in fields if f not in optional],
            "properties": fields}
    return {"type": "object", "required": ["event", "data"],
            "properties": {"event": {"const": name},
                           "data": {"type": "string", "contentMediaType": "application/json",
                                    "contentSchema": data}}}


_INT, _STR, _NAMES = {"type": "integer"}, {"type": "string"}, {"type": "array", "items": {
    "type": "string"}}
#: One Server-Sent Event of ``GET /v1/generate/stream`` (the OpenAPI 3.1 reading of an event
#: stream's ``schema``): ``encoded`` first for a prompt, ``step`` after each chunk of the grid
#: (its ``image`` the state itself in grayscale, or the decoded predicted latent), then
#: ``done`` or ``failure``. A label DDM's ``done`` has no ``prompt``, a text DDM's no ``label``.
STREAM_EVENT_SCHEMA: dict[str, Any] = {"oneOf": [
    _event("encoded", {"truncated": {"type": "array", "items": _INT,
                                     "description": TRUNCATED},
                       "warnings": {"type": "array", "items": _STR, "description": WARNINGS}}),
    _event("step", {"step": _INT, "steps": _INT, "t": {"type": "number"}, "image": _STR,
                    "experts": _NAMES, "delegated": {"type": "boolean"}, "round_trips": _INT,
                    "rerouted": {"type": "boolean"},
                    "probs": {"type": "array", "items": {"type": "number"},
                              "description": "p(k | x_t, t, y) per expert (expert_names' "
                                             "order) that routed the step's first evaluation"}}),
    _event("done", {"image": _STR, "label": _INT, "prompt": _STR, "experts": _NAMES,
                    "expert_names": _NAMES,
                    "routing": {"type": "array", "items": _INT}, "expert_calls": _INT,
                    "round_trips": _INT, "rerouted": {"type": "array", "items": _INT},
                    "waited_s": {"type": "number"}, "steps": _INT, "strategy": _STR,
                    "solver": _STR, "delegate_steps": _INT, "seconds": {"type": "number"}},
           optional=("label", "prompt")),  # a label DDM's image has a label, a text DDM's a prompt
    _event("failure", {"status": _INT, "detail": _STR, "expert": _STR})]}


class ImageData(BaseModel):
    """One image of ``POST /v1/images/generations``."""

    b64_json: str = Field(description="the image as a base64 PNG (RGB from a decoder)")


class ImagesResponse(BaseModel):
    """The answer of ``POST /v1/images/generations``: OpenAI's (``created``, ``data``), with
    what the router adds."""

    created: int = Field(description="Unix time the images were made")
    data: list[ImageData] = Field(description="n images, in order")
    truncated: list[int] = Field(description=TRUNCATED)
    warnings: list[str] = Field(description=WARNINGS)
    expert_names: list[str] = Field(description="the DDM's experts; bit k of routing is the "
                                                "k-th of them")
    routing: list[list[int]] = Field(description="per image, per step, the experts that ran "
                                                 "it (bit k: expert_names[k])")
    seed: int
    steps: int
    strategy: str
    guidance_scale: float


def request_models(config: RouterConfigFile
                   ) -> tuple[type[BaseModel], type[BaseModel], type[BaseModel]]:
    """The JSON body of ``/v1/generate``, the query of the stream and the JSON body of
    ``/v1/images/generations``, with this router's classes, limits and defaults (so that
    ``/openapi.json`` and ``/docs`` show them)."""
    defaults, num_classes, limits = config.sampling, config.num_classes, config.limits
    pattern = STRATEGY_PATTERN if has_router_network(config) else _ORACLE_ONLY
    text = config.conditioning == TEXT
    label_schema = {"type": "integer", "minimum": 0, "maximum": num_classes - 1}

    class Sampling(BaseModel):
        model_config = ConfigDict(extra="forbid")

        steps: Integer = Field(defaults.steps, **{**STEPS.bounds(), "le": limits.max_steps},
                               description=STEPS.description)
        seed: Integer = Field(0, ge=0, lt=2**63,
                              description="image i's noise comes from (seed, first_index + i)")
        first_index: Integer = Field(0, ge=0, lt=2**62,
                                     description="this request's first image's index in a "
                                                 "larger run: a run split into requests gives "
                                                 "the images one request would")
        # Parsed here, once: the field holds the Strategy, the schema says what is sent (in
        # the type's schema, which a query parameter's document shows too).
        strategy: Annotated[Strategy, WithJsonSchema({  # type: ignore[valid-type]
            "type": "string", "maxLength": MAX_STRATEGY_CHARS, "pattern": pattern,
            "default": defaults.strategy})] = (
            Field(parse_strategy(defaults.strategy),
                  json_schema_extra={"pattern": pattern, "default": defaults.strategy},
                  description=f"{STRATEGY.description}; only oracle without a router "
                              "network"
                              + (f"; on this DDM only {', '.join(defaults.strategies)}"
                                 if defaults.strategies else "")))
        solver: Literal[SOLVERS] = Field(  # type: ignore[valid-type]
            defaults.solver, description=SOLVER.description)
        delegate_steps: Integer = Field(0, ge=0, le=limits.max_steps,
                                        description="steps per integrate request to an expert "
                                                    "when one expert is selected; 0 or 1: off")
        guidance_scale: float = Field(
            defaults.guidance_scale, **(GUIDANCE_SCALE.bounds() if text else {}),
            json_schema_extra=None if text else {"minimum": 1, "maximum": 1},
            description=GUIDANCE_SCALE.description)
        guidance_cutoff: float = Field(defaults.guidance_cutoff, **GUIDANCE_CUTOFF.bounds(),
                                       description=GUIDANCE_CUTOFF.description)
        negative_prompt: Prompt | None = Field(
            None, json_schema_extra=None if text else _NONE,
            description="text DDMs: its embedding replaces the empty prompt's as the "
                        "unguided half of guidance")

        @field_validator("strategy", mode="plain")
        @classmethod
        def known_strategy(cls, value: Any) -> Strategy:
            if not isinstance(value, str):
                raise ValueError(f"strategy must be a string, got {type(value).__name__}")
            if len(value) > MAX_STRATEGY_CHARS:
                raise ValueError(f"String should have at most {MAX_STRATEGY_CHARS} characters")
            if not re.fullmatch(STRATEGY_PATTERN, value):
                raise ValueError(f"unknown routing strategy {value!r}; use oracle, top1, top2, "
                                 "topk:K, threshold:P (0 < P <= 1) or ensemble")
            if not re.fullmatch(pattern, value):
                raise ValueError(f"strategy {value} needs the router network, and this router "
                                 "has none; use the oracle strategy")
            if not strategy_allowed(value, defaults.strategies):
                raise ValueError(f"strategy {value} is not allowed on this DDM; use "
                                 f"{', '.join(defaults.strategies)}")
            return parse_strategy(value)

    def in_classes(labels: list[int]) -> list[int]:
        if not text:  # a text DDM refuses labels whatever they are (check_request)
            check_labels(labels, num_classes)
        return labels

    class GenerateRequest(Sampling):
        # Strict, as the schema is: "2", 2.5 and true are not integers (2.0 is, see Integer).
        model_config = ConfigDict(extra="forbid", strict=True)

        labels: list[Integer] = Field(
            [] if text else ..., max_length=limits.max_batch,
            **({} if text else {"min_length": 1}),
            json_schema_extra=_NONE if text else {"items": label_schema},
            description="a label DDM: one image per label")
        prompts: list[Prompt] = Field(
            ... if text else [], max_length=limits.max_batch,
            **({"min_length": 1} if text else {}), json_schema_extra=None if text else _NONE,
            description="a text DDM: one image per prompt")

        @field_validator("labels")
        @classmethod
        def labels_in_classes(cls, value: list[int]) -> list[int]:
            return in_classes(value) if value else value

    class StreamQuery(Sampling):
        # A label DDM's label is an integer, never null (what a query could not send anyway).
        label: int | None if text else int = Field(  # type: ignore[valid-type]
            None if text else ..., json_schema_extra=_NONE if text else {
                k: v for k, v in label_schema.items() if k != "type"},
            description="a label DDM: the image's label")
        prompt: Prompt | None = Field(... if text else None,
                                      json_schema_extra=None if text else _NONE,
                                      description="a text DDM: the image's prompt")

        @field_validator("label")
        @classmethod
        def label_in_classes(cls, value: int | None) -> int | None:
            return value if value is None else in_classes([value])[0]

    class ImagesRequest(Sampling):
        """OpenAI's image generation request; ``seed``, ``steps``, ``strategy``,
        ``guidance_scale``, ``negative_prompt`` and ``latents`` are this router's."""

        prompt: Prompt = Field(description="the prompt of every image")
        n: Integer = Field(1, ge=1, le=limits.max_batch, description="images to make; image "
                                                                     "i's noise comes from "
                                                                     "(seed, i)")
        size: str | None = Field(None, pattern=r"^[0-9]{1,5}x[0-9]{1,5}$",
                                 description="WxH: the DDM's own size only (default)")
        response_format: str = Field("b64_json", description="b64_json only: the router "
                                                             "stores no images to link to")
        model: str | None = Field(None, max_length=256, description="accepted for "
                                  "compatibility and ignored: a router serves one DDM")
        user: str | None = Field(None, max_length=256, description="accepted and ignored")
        quality: Literal["auto", "standard", "hd", "low", "medium", "high"] | None = Field(
            None, description="accepted and ignored: the steps and guidance are the DDM's "
                              "(steps, guidance_scale)")
        style: Literal["vivid", "natural"] | None = Field(None,
                                                          description="accepted and ignored")
        output_format: Literal["png"] = Field("png", description="png only (b64_json)")
        background: Literal["auto", "opaque"] = Field(
            "auto", description="the images are opaque: transparent cannot be made")
        moderation: Literal["auto", "low"] | None = Field(
            None, description="accepted and ignored: the router moderates nothing")
        latents: str | None = Field(None, description="the initial noise, as diffusers' "
                                    "latents: base64 of a .npy float32 array (n, C, H, W) of "
                                    "the DDM's state shape, every value within "
                                    f"+-{MAX_STATE_MAGNITUDE:g}")

        @field_validator("response_format")
        @classmethod
        def b64_json_only(cls, value: str) -> str:
            if value != "b64_json":
                raise ValueError(f"response_format {value!r} is not supported: this router "
                                 "stores no images to link to; use b64_json")
            return value

    return GenerateRequest, StreamQuery, ImagesRequest


#: A body's bytes besides its labels, prompts and latents' data: every other field at its
#: longest (``strategy``, ``size``, ``model``, ``user``, ...), a .npy header, and JSON's spacing.
OTHER_FIELDS_BYTES = 4096
#: The most bytes JSON writes for one byte of a prompt: ``\\u00XX`` for a control character.
JSON_BYTES_PER_PROMPT_BYTE = 6


def max_body_bytes(limits: RouterLimits, conditioning: str,
                   state_shape: tuple[int, ...] | None) -> int:
    """The JSON body limit: ``limits.max_body_bytes`` when set, else the DDM's largest valid
    request (at least :data:`ROUTER_MIN_BODY_BYTES`). A label DDM's: ``max_batch`` labels; a
    text DDM's: ``max_batch`` prompts and a negative prompt of ``MAX_PROMPT_BYTES`` each
    (``/v1/generate``), or one prompt, its negative and ``max_batch`` latents of
    ``state_shape`` (C, H, W) as base64 float32 (``/v1/images/generations``; None: the
    experts have not reported it yet, and latents count once they have)."""
    if limits.max_body_bytes is not None:
        return limits.max_body_bytes
    if conditioning == TEXT:
        prompt = JSON_BYTES_PER_PROMPT_BYTE * MAX_PROMPT_BYTES + len('"", ')
        latents = (0 if state_shape is None
                   else 4 * math.ceil(4 * limits.max_batch * math.prod(state_shape) / 3))
        largest = max((limits.max_batch + 1) * prompt, 2 * prompt + latents)
    else:
        largest = limits.max_batch * len(f"{MAX_CLASS}.0, ")
    return max(ROUTER_MIN_BODY_BYTES, OTHER_FIELDS_BYTES + largest)


def sampling_request(body: Any, labels: tuple[int, ...] = (), prompts: tuple[str, ...] = (),
                     latents: np.ndarray | None = None) -> SamplingRequest:
    """The loop's request from a validated body (any of :func:`request_models`'s)."""
    return SamplingRequest(labels=labels, steps=body.steps, seed=body.seed,
                           strategy=body.strategy, solver=body.solver,
                           delegate_steps=body.delegate_steps, first_index=body.first_index,
                           prompts=prompts, guidance_scale=body.guidance_scale,
                           negative_prompt=body.negative_prompt,
                           guidance_cutoff=body.guidance_cutoff, latents=latents)


def echo(request: SamplingRequest) -> dict[str, Any]:
    return {"steps": request.steps, "strategy": request.strategy.name, "solver": request.solver,
            "delegate_steps": request.delegate_steps}


def parse_latents(encoded: str) -> np.ndarray:
    """``latents`` (base64 of a .npy file) as an array, or a ``ValueError`` naming what is
    wrong. Nothing in it is trusted: no pickle, and the header's shape must account for
    exactly the bytes sent before anything is allocated (the body limit bounds them).
    Its dtype and shape are checked against the DDM by ``check_request``."""
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("latents must be base64 (of a .npy file)") from None
    stream = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(stream)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = read_header(stream)
    except ValueError as error:
        raise ValueError(f"latents are not a .npy file: {error}") from None
    if dtype.hasobject:
        raise ValueError("latents must be float32, not objects")
    if dtype != np.dtype("<f4"):
        raise ValueError(f"latents must be float32 (little-endian <f4), got {dtype.str}")
    body = raw[stream.tell():]
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count * dtype.itemsize != len(body):
        raise ValueError(f"latents' header says shape {shape} ({count * dtype.itemsize} "
                         f"bytes), the file holds {len(body)}")
    array = np.frombuffer(body, dtype).reshape(shape, order="F" if fortran else "C")
    return np.ascontiguousarray(array, np.float32)


def readable(errors: Any, fields_at: str = "/openapi.json") -> str:
    """Pydantic's errors as one line per problem: ``field: what is wrong``; an unknown field's
    line points to ``fields_at``, where the fields are listed (an endpoint that is served)."""
    lines = []
    for error in errors:
        where = field_name(error) or "body"
        if error["type"] == "extra_forbidden":
            lines.append(f"unknown field {where!r} (the fields: {fields_at})")
        else:
            lines.append(f"{where}: {str(error['msg']).removeprefix('Value error, ')}")
    return "; ".join(lines)


def field_name(error: Any) -> str | None:
    """The request field a pydantic error is about (``steps``, ``labels.3``), or None for the
    body as a whole."""
    return ".".join(str(p) for p in error["loc"] if p not in ("body", "query")) or None


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON (``application/json``, ``application/*+json``), the
    only bodies FastAPI parses as JSON."""
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


def invalid_request(errors: Any, body: Any, content_type: str | None,
                    fields_at: str = "/openapi.json") -> tuple[int, str]:
    """The status and message for a request FastAPI could not validate: 400 with the line
    and column of malformed JSON, 415 for a body that is not sent as JSON, else 422 naming
    every problem (:func:`readable`)."""
    for error in errors:
        if error["type"] == "json_invalid" and isinstance(body, str):
            position = error["loc"][-1] if isinstance(error["loc"][-1], int) else 0
            line = body.count("\n", 0, position) + 1
            column = position - (body.rfind("\n", 0, position) + 1) + 1
            reason = error.get("ctx", {}).get("error", "invalid JSON")
            return 400, f"malformed JSON at line {line}, column {column}: {reason}"
    if not is_json(content_type) and any(error["loc"][:1] == ("body",) for error in errors):
        return 415, (f"the body must be JSON, sent with Content-Type: application/json "
                     f"(got {content_type or 'none'}; curl: -H 'content-type: "
                     "application/json')")
    return 422, readable(errors, fields_at)
