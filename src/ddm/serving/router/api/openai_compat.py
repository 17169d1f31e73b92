"""What OpenAI's clients expect of the router besides the images route itself: errors of
``/v1/images/*`` in OpenAI's shape, and ``GET /v1/models``.

The router answers every error as :class:`~ddm.serving.router.api.requests.ErrorDetail`
(``{"detail", "param"?, "expert"?}``); OpenAI's SDKs read ``{"error": {"message", "type",
"param", "code"}}`` and show nothing else (``str(error)`` was just "Error code: 422"). So one
middleware rewrites the error bodies of OpenAI's paths, whichever layer answered (the body
limit, the bearer check, validation, the route, an expert's failure): the router's errors
stay written once, and OpenAI's shape is a view of them.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: The paths whose errors OpenAI's clients read.
OPENAI_PATHS = ("/v1/images/", "/v1/models")
#: The most bytes of an error body rewritten (ours are one line); a longer one passes as is.
MAX_ERROR_BYTES = 64 * 1024
#: The id ``GET /v1/models`` lists: a router serves one DDM, whatever ``model`` a request
#: names.
MODEL_ID = "ddm"
#: Why ``/v1/images/edits`` and ``/variations`` answer 400: editing needs an image encoder.
NO_IMAGE_EDITS = ("this router edits no images: its DDM has no image encoder (a VAE's "
                  "encoder) to start from one; POST /v1/images/generations makes images "
                  "from a prompt")


class OpenAIErrorDetail(BaseModel):
    """What went wrong, as OpenAI words it."""

    message: str = Field(description="what is wrong with the request, or which expert failed")
    type: str = Field(description="invalid_request_error, authentication_error, "
                                  "rate_limit_error or server_error")
    param: str | None = Field(description="the request field at fault, where one is")
    code: str | None = Field(description="the expert that failed (502 and 503 only)")


class OpenAIError(BaseModel):
    """Every error answer of ``/v1/images/*`` and ``/v1/models``: the router's
    (:class:`~ddm.serving.router.api.requests.ErrorDetail`) in OpenAI's shape."""

    error: OpenAIErrorDetail


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status."""
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def openai_error(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """The router's error body (:class:`ErrorDetail`) in OpenAI's shape: the reason in
    ``message``, the request field at fault in ``param``, the failing expert in ``code``."""
    return {"error": {"message": str(body.get("detail", "")), "type": error_type(status),
                      "param": body.get("param"), "code": body.get("expert")}}


def models_list(conditioning: str, expert_names: list[str], created: int) -> dict[str, Any]:
    """``GET /v1/models``: the one DDM this router serves, as OpenAI lists a model."""
    return {"object": "list", "data": [{
        "id": MODEL_ID, "object": "model", "created": created, "owned_by": "ddm",
        "conditioning": conditioning, "experts": expert_names}]}


class OpenAIErrors:
    """ASGI middleware: an error answer (status >= 400, JSON) on :data:`OPENAI_PATHS` is sent
    in OpenAI's shape (:func:`openai_error`), its other headers kept."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(OPENAI_PATHS):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewrite(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message  # held until the body is whole
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            await _send_rewritten(send, start, b"".join(chunks))

        await self.app(scope, receive, rewrite)


async def _send_rewritten(send: Send, start: Message, body: bytes) -> None:
    headers = [(name, value) for name, value in start.get("headers", [])
               if name.lower() != b"content-length"]
    try:
        original = json.loads(body) if len(body) <= MAX_ERROR_BYTES else None
    except ValueError:
        original = None
    if isinstance(original, dict) and "detail" in original:
        body = json.dumps(openai_error(start["status"], original)).encode()
    await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
