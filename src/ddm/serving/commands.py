"""``ddm serve expert``, ``ddm serve stage``, ``ddm serve pool`` and ``ddm serve router``: their
arguments, next to the servers they set. The first three run the one model server
(:mod:`ddm.serving.model.server`) with :class:`~ddm.serving.model.options.ServingOptions`
built once from their flags.

``ddm.cli`` adds these with :func:`add_serve_commands`. Importing this module is cheap (no
web framework, no NumPy): the servers are imported only when a command runs. Limits left out
on the router's command line come from ``router.yaml`` (``limits:``), and
``--auth-token-file`` overrides ``auth.token_file``, ``--trusted-proxy`` ``trusted_proxies``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ddm.deploy.limits import (COMPILE_MODES, EXPERT_BACKENDS, EXPERT_PORT, GROUPED_FORWARD_MODES,
                               PRECISIONS, ROUTER_PORT)

if TYPE_CHECKING:
    from ddm.serving.model.options import ServingOptions


def add_serve_commands(commands: argparse._SubParsersAction) -> None:
    """Add ``serve expert``, ``serve stage``, ``serve pool`` and ``serve router`` to the
    ``ddm`` command's subcommands."""
    serve = commands.add_parser("serve", help="run an expert or router server")
    roles = serve.add_subparsers(dest="role", required=True, metavar="ROLE")
    p = roles.add_parser("expert", help="serve one expert's velocity over the binary protocol")
    p.add_argument("--checkpoint", required=True, type=Path,
                   help="a label checkpoint, or a text DDM's stage checkpoint of role expert")
    _add_model_flags(p)
    p.add_argument("--context-cache-bytes", type=int, default=None,
                   help="text experts: bytes of generation contexts kept (least recently used "
                        "evicted first)")
    p.add_argument("--max-steps", type=int,
                   help="grid intervals per integrate request; more get 422")
    p.add_argument("--compile-cache", type=Path, default=None,
                   help="neuron: where traced models are cached")
    _add_common(p)
    p.set_defaults(handler=_serve_expert)

    p = roles.add_parser("stage", help="serve a text DDM's text encoder, decoder or router "
                                       "network over the binary protocol")
    p.add_argument("--checkpoint", required=True, type=Path,
                   help="a stage checkpoint of role text_encoder, decoder or router")
    _add_model_flags(p)
    _add_common(p)
    p.set_defaults(handler=_serve_stage)

    p = roles.add_parser("pool", help="serve several checkpoints of a DDM on one device, each "
                                      "under /v1/members/NAME")
    p.add_argument("--member", action="append", required=True, metavar="NAME=DIR",
                   help="a member: its name in the plan (an expert's, text-encoder, decoder, "
                        "router-network) and its checkpoint directory: a label checkpoint or "
                        "a stage checkpoint (repeatable)")
    p.add_argument("--grouped-forward", choices=GROUPED_FORWARD_MODES, default=None,
                   help="run the rows of same-architecture experts (Paris's) as one forward: "
                        "auto (default) where it measured faster at start, on, or off")
    _add_model_flags(p)
    _add_common(p)
    p.set_defaults(handler=_serve_pool)

    p = roles.add_parser("router", help="serve /v1/generate: the step loop over remote experts")
    p.add_argument("--config", required=True, type=Path, help="router.yaml")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a pod)")
    p.add_argument("--port", type=int, default=ROUTER_PORT)
    # Unset limits come from router.yaml's limits: (defaults in ddm.deploy.router_config).
    p.add_argument("--max-batch", type=int, help="labels per request; more get 422")
    p.add_argument("--max-steps", type=int, help="steps per request; more get 422")
    p.add_argument("--max-concurrent", type=int,
                   help="generations in flight; more get 429 with Retry-After")
    p.add_argument("--max-concurrent-per-client", type=int,
                   help="generations in flight from one client; more get 429 with Retry-After")
    p.add_argument("--trusted-proxy", action="append", default=None, metavar="CIDR",
                   help="a proxy in front of the router (repeatable; replaces router.yaml's "
                        "trusted_proxies): its requests count against the client its "
                        "X-Forwarded-For names")
    p.add_argument("--max-body-bytes", type=int,
                   help="request body size; more get 413 (default: the DDM's largest valid "
                        "request)")
    p.add_argument("--context-cache-bytes", type=int, default=None,
                   help="text DDMs: bytes of generation contexts the router keeps for its "
                        "experts (least recently used dropped first)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="time budget for one expert call, retries included")
    p.add_argument("--auth-token-file", type=Path, default=None,
                   help="require Authorization: Bearer <the token in this file> on /v1/* "
                        "(overrides router.yaml's auth.token_file)")
    _add_drain(p)
    _add_api_docs(p)
    _add_metrics_port(p)
    p.add_argument("--log-level", default="info")
    p.set_defaults(handler=_serve_router)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """Where the model runs and how many rows a call takes: every model server's flags."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a pod)")
    p.add_argument("--port", type=int, default=EXPERT_PORT)
    p.add_argument("--backend", choices=EXPERT_BACKENDS, default="torch")
    p.add_argument("--device", default=None,
                   help="torch: cpu, cuda[:N]; jax: cpu, gpu, tpu[:N]; neuron: none")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="stage checkpoints: cast the weights to this dtype, which replies "
                        "travel in too (default: the weights' own)")
    p.add_argument("--compile", choices=COMPILE_MODES, default=None,
                   help="torch backend: run the experts' and router network's torch networks "
                        "under torch.compile in this mode (reduce-overhead: with CUDA graphs), "
                        "each batch padded to the next of a few sizes up to --max-batch (powers "
                        "of two and, from 8, their halfway points), every size compiled before "
                        "/readyz is 200 (default none: eager)")
    # Defaults left to the servers (one place), and shown by their /v1/info.
    p.add_argument("--max-batch", type=int,
                   help="rows per model call (a guided row counts twice); more get 422")
    p.add_argument("--max-delay-ms", type=float,
                   help="wait this long for more requests before a model call")
    p.add_argument("--max-pending", type=int,
                   help="requests admitted at once, queued or running; more get 429")
    p.add_argument("--memory-limit-bytes", type=int, default=None,
                   help="refuse to start unless the weights and the activations of "
                        "--max-batch rows of every model fit in this many bytes (default: the "
                        "CUDA device's free memory, else the container's memory limit)")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--auth-token-file", type=Path, default=None,
                   help="require Authorization: Bearer <the token in this file> on /v1/*: the "
                        "DDM's router token, which the router sends to its experts and stages")
    _add_drain(p)
    _add_api_docs(p)
    _add_metrics_port(p)
    p.add_argument("--log-level", default="info")


def _add_drain(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drain-s", type=_seconds, default=0.0,
                   help="on SIGTERM, answer /readyz 503 and keep serving this long before "
                        "stopping (load balancers and DNS caches catch up meanwhile)")


def _add_metrics_port(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve /metrics on this port only (not on --port), so that scraping "
                        "needs no access to the API")


def _add_api_docs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-docs", action="store_true",
                   help="serve Swagger UI at /docs (it loads from a CDN, so it is off by "
                        "default; /openapi.json is always served)")


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be between 0 and 3600 seconds, got {text}")
    return value


def _serve_expert(args: argparse.Namespace) -> int:
    from ddm.checkpoints.declared import EXPERT
    from ddm.serving.model.server import serve_model

    serve_model(args.checkpoint, _options(args, "context_cache_bytes", "max_steps",
                                          "compile_cache"), (EXPERT,))
    return 0


def _serve_stage(args: argparse.Namespace) -> int:
    from ddm.checkpoints.declared import STAGE_ROLES
    from ddm.serving.model.server import serve_model

    serve_model(args.checkpoint, _options(args), STAGE_ROLES)
    return 0


def _serve_pool(args: argparse.Namespace) -> int:
    from ddm.serving.model.server import parse_members, serve_model
    from ddm.termination import fail_start

    try:
        members = parse_members(args.member)
    except ValueError as error:
        raise fail_start(f"ddm serve pool: {error}") from None
    serve_model(members, _options(args, "grouped_forward"))
    return 0


def _options(args: argparse.Namespace, *own: str) -> ServingOptions:
    """The serving options of a model server's command line: the flags every model server
    takes, and those among ``own`` its command adds; the flags not given keep the options'
    defaults (one place). A bad value exits 1 naming it."""
    from ddm.serving.model.options import ServingOptions
    from ddm.termination import fail_start

    names = ("host", "port", "log_level", "drain_s", "metrics_port", "api_docs",
             "auth_token_file", "backend", "device", "precision", "compile", "max_batch",
             "max_delay_ms",
             "max_pending", "memory_limit_bytes", *own)
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    try:
        return ServingOptions(**given)
    except ValueError as error:
        raise fail_start(f"ddm serve {args.role}: {error}") from None


def _serve_router(args: argparse.Namespace) -> int:
    from ddm.serving.router.api.server import serve_router

    serve_router(args.config, host=args.host, port=args.port, log_level=args.log_level,
                 max_batch=args.max_batch, max_steps=args.max_steps,
                 max_concurrent=args.max_concurrent, max_body_bytes=args.max_body_bytes,
                 max_concurrent_per_client=args.max_concurrent_per_client,
                 trusted_proxies=args.trusted_proxy,
                 context_cache_bytes=args.context_cache_bytes,
                 deadline_s=args.deadline_s, auth_token_file=args.auth_token_file,
                 drain_s=args.drain_s, api_docs=args.api_docs, metrics_port=args.metrics_port)
    return 0
