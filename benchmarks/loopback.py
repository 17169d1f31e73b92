"""A benchmark's router on loopback, where every client has one address: the per-client
limits (concurrency, the budget of rows x steps) are lifted to the whole router's, so that the
benchmark measures serving, not the limits a shared router puts on one client."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ddm.runtime.local import LocalPlan, ProcessSpec


def one_client_router(plan: LocalPlan, concurrent: int, config_path: Path) -> ProcessSpec:
    """Write ``plan``'s router.yaml to ``config_path`` with the client budget lifted, and
    return its router process allowing ``concurrent`` generations, all from one client."""
    config = plan.router_config
    config_path.write_text(dataclasses.replace(config, limits=dataclasses.replace(
        config.limits, client_row_steps_per_s=1e12)).to_yaml())
    return dataclasses.replace(plan.router, argv=(
        *plan.router.argv, "--max-concurrent", str(concurrent),
        "--max-concurrent-per-client", str(concurrent)))


def another_router(router: ProcessSpec, name: str, port: int, metrics_port: int,
                   env: tuple[tuple[str, str], ...]) -> ProcessSpec:
    """``router`` again as process ``name``, on ``port`` and ``metrics_port``, with ``env``
    added: a second router over the same model servers, to compare router settings on one
    deployment (its model servers start once)."""
    flags = {"--port": str(port), "--metrics-port": str(metrics_port)}
    argv = list(router.argv)
    for flag, value in flags.items():
        if flag not in argv:
            raise ValueError(f"the router's command has no {flag}: {' '.join(argv)}")
        argv[argv.index(flag) + 1] = value
    return dataclasses.replace(router, name=name, argv=tuple(argv), port=port,
                               metrics_port=metrics_port, env=(*router.env, *env))
