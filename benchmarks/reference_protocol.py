"""The reference demo's expert protocol, reproduced as the baseline of
``python -m benchmarks serve``.

The reference demo called a remote expert at every denoising step by POSTing a zip-compressed
``.npz`` (``np.savez_compressed`` of ``x_t``, ``t`` and ``y``) over a new HTTP connection, and the
expert answered with a compressed ``.npz`` of ``v``. This module does exactly that, on the same
checkpoints and frameworks as our expert server, so that the benchmark compares protocols and not
models:

* the server is FastAPI on uvicorn (the stack ``ddm serve expert`` uses, with uvloop and
  httptools where installed): it decodes the ``.npz``, runs the expert's velocity in the
  framework it was trained with in a worker thread (as FastAPI runs a plain ``def`` route), and
  answers with ``np.savez_compressed`` of ``v``;
* the client (:func:`npz_velocity`) opens an ``http.client.HTTPConnection`` per call and closes
  it after the reply, as ``requests.post`` without a session does. ``http.client`` sets
  ``TCP_NODELAY`` and sends a small request in one segment, so no Nagle delay inflates it.

The router loop is ``ddm.sampling.pipeline.generate`` itself, with each expert's velocity replaced
by :func:`npz_velocity` (:func:`reference_ddm`): the same noise, routing and solver steps as
in-process sampling. Not for production; the real wire format is ``ddm.serving.wire.protocol``.
Run one server with ``python -m benchmarks.reference_protocol --checkpoint DIR --port N``.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import io
import os
import sys
from contextlib import asynccontextmanager
from typing import AsyncIterator, Sequence

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from ddm.checkpoints.format import load_checkpoint
from ddm.conditioning import Conditioning
from ddm.models.ddm import DDM
from ddm.models.loading import ModelFn, expert_velocity
from ddm.models.stages import ConditionedVelocity

ROUTE = "/velocity"
_TIMEOUT_S = 60.0


def encode_npz(**arrays: np.ndarray) -> bytes:
    """``np.savez_compressed`` of ``arrays`` into bytes: what the reference demo sent."""
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return buffer.getvalue()


def decode_npz(body: bytes) -> dict[str, np.ndarray]:
    """Every array of an ``.npz`` body (pickles refused)."""
    with np.load(io.BytesIO(body), allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def create_reference_app(checkpoint_dir: str | os.PathLike, backend: str = "native",
                         device: str | None = None) -> FastAPI:
    """An expert answering ``POST /velocity`` (``.npz`` of ``x``, ``t``, ``y`` -> ``.npz`` of
    ``v``) and ``GET /readyz``; the weights load, and the batch-1 program is warmed, in the
    lifespan, so the server accepts connections only once it can answer."""
    state: dict[str, ModelFn] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ckpt = load_checkpoint(checkpoint_dir)
        velocity = expert_velocity(ckpt, backend, device)
        label = min(ckpt.meta.classes, default=0)
        size = int(ckpt.meta.architecture["image_size"])
        channels = int(ckpt.meta.architecture["in_channels"])
        velocity(np.zeros((1, channels, size, size), np.float32), np.full(1, 0.5, np.float32),
                 np.full(1, label, np.int64))
        state["velocity"] = velocity
        yield

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.post(ROUTE)
    async def velocity(request: Request) -> Response:
        try:
            arrays = decode_npz(await request.body())
            x, t, y = arrays["x"], arrays["t"], arrays["y"]
        except (ValueError, KeyError, OSError) as error:
            return JSONResponse({"detail": f"bad .npz body: {error}"}, 400)
        v = await run_in_threadpool(state["velocity"], x, t, y)
        return Response(encode_npz(v=v), media_type="application/octet-stream")

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        return JSONResponse({"status": "ready"})

    return app


def npz_velocity(endpoint: str) -> ConditionedVelocity:
    """``v(x, t, cond)`` from the reference server at ``host:port`` (it takes the rows'
    labels), one new connection per call."""
    host, _, port = endpoint.rpartition(":")

    def velocity(x: np.ndarray, t: np.ndarray, cond: Conditioning) -> np.ndarray:
        body = encode_npz(x=x, t=t, y=cond.labels)
        connection = http.client.HTTPConnection(host, int(port), timeout=_TIMEOUT_S)
        try:
            connection.request("POST", ROUTE, body=body,
                               headers={"Content-Type": "application/octet-stream"})
            reply = connection.getresponse()
            data = reply.read()
        finally:
            connection.close()
        if reply.status != 200:
            raise RuntimeError(f"reference expert {endpoint} answered {reply.status}: "
                               f"{data[:200]!r}")
        return decode_npz(data)["v"]

    return velocity


def reference_ddm(ddm: DDM, endpoints: Sequence[str]) -> DDM:
    """``ddm`` with expert ``k``'s velocity fetched from ``endpoints[k]`` (``host:port``) over
    the reference protocol; the router network stays in this process, as in the reference
    demo."""
    if len(endpoints) != len(ddm.experts):
        raise ValueError(f"{len(endpoints)} reference endpoints for {len(ddm.experts)} experts")
    return dataclasses.replace(ddm, experts=tuple(npz_velocity(e) for e in endpoints))


def main(argv: Sequence[str] | None = None) -> int:
    """Serve one expert over the reference protocol until interrupted."""
    from ddm.serving.http.server import build_server

    parser = argparse.ArgumentParser(prog="python -m benchmarks.reference_protocol",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", choices=("native", "torch", "jax"), default="native")
    parser.add_argument("--device", default=None)
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    app = create_reference_app(args.checkpoint, args.backend, args.device)
    build_server(app, args.host, args.port, args.log_level).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
