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

import re
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema,
                      field_validator)

from ddm.deploy.limits import SOLVERS, STRATEGY_PATTERN
from ddm.deploy.router_config import RouterConfigFile
from ddm.sampling.loop import SamplingRequest, check_labels
from ddm.sampling.routing import Strategy, parse_strategy

#: Longer than any name in the grammar needs; bounds ``threshold:0.000...1`` away from 0.
MAX_STRATEGY_CHARS = 32
_ORACLE_ONLY = r"^oracle$"


def _integral(value: Any) -> Any:
    """``2.0`` as ``2``: JSON Schema's ``integer`` is any number without a fraction."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


#: An integer field; in a strict model, a string, a bool or a fraction is refused.
Integer = Annotated[int, BeforeValidator(_integral)]


class ErrorDetail(BaseModel):
    """Every error answer of the router: what is wrong, in one line."""

    detail: str = Field(description="what is wrong with the request, or which expert failed")
    expert: str | None = Field(None, description="the expert that failed (502 and 503 only)")


class GenerateResponse(BaseModel):
    """The answer of ``POST /v1/generate``: one entry per requested label, in order."""

    images: list[str] = Field(description="base64 PNGs, grayscale, one per label")
    labels: list[int]
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


def _event(name: str, fields: dict[str, Any]) -> dict[str, Any]:
    data = {"type": "object", "required": list(fields), "properties": fields}
    return {"type": "object", "required": ["event", "data"],
            "properties": {"event": {"const": name},
                           "data": {"type": "string", "contentMediaType": "application/json",
                                    "contentSchema": data}}}


_INT, _STR, _NAMES = {"type": "integer"}, {"type": "string"}, {"type": "array", "items": {
    "type": "string"}}
#: One Server-Sent Event of ``GET /v1/generate/stream`` (the OpenAPI 3.1 reading of an event
#: stream's ``schema``): ``step`` after each chunk of the grid, then ``done`` or ``failure``.
STREAM_EVENT_SCHEMA: dict[str, Any] = {"oneOf": [
    _event("step", {"step": _INT, "steps": _INT, "t": {"type": "number"}, "image": _STR,
                    "experts": _NAMES, "delegated": {"type": "boolean"}, "round_trips": _INT,
                    "rerouted": {"type": "boolean"},
                    "probs": {"type": "array", "items": {"type": "number"},
                              "description": "p(k | x_t, t, y) per expert (expert_names' "
                                             "order) that routed the step's first evaluation"}}),
    _event("done", {"image": _STR, "label": _INT, "experts": _NAMES, "expert_names": _NAMES,
                    "routing": {"type": "array", "items": _INT}, "expert_calls": _INT,
                    "round_trips": _INT, "rerouted": {"type": "array", "items": _INT},
                    "waited_s": {"type": "number"}, "steps": _INT, "strategy": _STR,
                    "solver": _STR, "delegate_steps": _INT, "seconds": {"type": "number"}}),
    _event("failure", {"status": _INT, "detail": _STR, "expert": _STR})]}


def request_models(config: RouterConfigFile) -> tuple[type[BaseModel], type[BaseModel]]:
    """The JSON body of ``/v1/generate`` and the query of the stream, with this router's
    classes, limits and defaults (so that ``/openapi.json`` and ``/docs`` show them)."""
    defaults, num_classes, limits = config.sampling, config.num_classes, config.limits
    pattern = STRATEGY_PATTERN if config.router_checkpoint is not None else _ORACLE_ONLY
    label_schema = {"type": "integer", "minimum": 0, "maximum": num_classes - 1}

    class Sampling(BaseModel):
        model_config = ConfigDict(extra="forbid")

        steps: Integer = Field(defaults.steps, ge=1, le=limits.max_steps,
                               description="denoising steps")
        seed: Integer = Field(0, ge=0, lt=2**63,
                              description="image i's noise comes from (seed, first_index + i)")
        first_index: Integer = Field(0, ge=0, lt=2**62,
                                     description="this request's first image's index in a "
                                                 "larger run: a run split into requests gives "
                                                 "the images one request would")
        # Parsed here, once: the field holds the Strategy, the schema says what is sent.
        strategy: Annotated[Strategy, WithJsonSchema({"type": "string",
                                                      "maxLength": MAX_STRATEGY_CHARS})] = (
            Field(parse_strategy(defaults.strategy),
                  json_schema_extra={"pattern": pattern, "default": defaults.strategy},
                  description="oracle, topK, topk:K, threshold:P (0 < P <= 1) or ensemble; "
                              "only oracle without a router network"))
        solver: Literal[SOLVERS] = defaults.solver  # type: ignore[assignment]
        delegate_steps: Integer = Field(0, ge=0, le=limits.max_steps,
                                        description="steps per integrate request to an expert "
                                                    "when one expert is selected; 0 or 1: off")

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
            return parse_strategy(value)

    def in_classes(labels: list[int]) -> list[int]:
        check_labels(labels, num_classes)
        return labels

    class GenerateRequest(Sampling):
        # Strict, as the schema is: "2", 2.5 and true are not integers (2.0 is, see Integer).
        model_config = ConfigDict(extra="forbid", strict=True)

        labels: list[Integer] = Field(min_length=1, max_length=limits.max_batch,
                                  json_schema_extra={"items": label_schema},
                                  description="one image per label")

        @field_validator("labels")
        @classmethod
        def labels_in_classes(cls, value: list[int]) -> list[int]:
            return in_classes(value)

    class StreamQuery(Sampling):
        label: int = Field(json_schema_extra={k: v for k, v in label_schema.items()
                                              if k != "type"})

        @field_validator("label")
        @classmethod
        def label_in_classes(cls, value: int) -> int:
            return in_classes([value])[0]

    return GenerateRequest, StreamQuery


def sampling_request(body: Any, labels: tuple[int, ...]) -> SamplingRequest:
    return SamplingRequest(labels=labels, steps=body.steps, seed=body.seed,
                           strategy=body.strategy, solver=body.solver,
                           delegate_steps=body.delegate_steps, first_index=body.first_index)


def echo(request: SamplingRequest) -> dict[str, Any]:
    return {"steps": request.steps, "strategy": request.strategy.name, "solver": request.solver,
            "delegate_steps": request.delegate_steps}


def readable(errors: Any, fields_at: str = "/openapi.json") -> str:
    """Pydantic's errors as one line per problem: ``field: what is wrong``; an unknown field's
    line points to ``fields_at``, where the fields are listed (an endpoint that is served)."""
    lines = []
    for error in errors:
        where = ".".join(str(p) for p in error["loc"] if p not in ("body", "query")) or "body"
        if error["type"] == "extra_forbidden":
            lines.append(f"unknown field {where!r} (the fields: {fields_at})")
        else:
            lines.append(f"{where}: {str(error['msg']).removeprefix('Value error, ')}")
    return "; ".join(lines)


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
