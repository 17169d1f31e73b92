"""``ddm up`` and ``ddm train-all``: their arguments, next to the local runtime they run.

``ddm.cli`` adds it with :func:`add_up_command`, as each area adds its own. Importing this
module is cheap: the runtime is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddm.checkpoints.shipped import DEFAULT_DDM
from ddm.deploy.limits import ROUTER_PORT
from ddm.fileio import existing_path


def add_up_command(commands: argparse._SubParsersAction) -> None:
    """Add ``up`` and ``train-all`` to the ``ddm`` command's subcommands."""
    p = commands.add_parser(
        "up", help="run a DDMDeployment's experts and router as local processes (default: the "
                   "shipped MNIST example, what make demo runs)",
        description="Plan a DDMDeployment as the operator would and run it here: one ddm "
                    "serve expert process per expert replica on a free loopback port, and a "
                    "ddm serve router process in front of them, each reported as it starts "
                    "and becomes ready. Runs until Ctrl-C (exit 0) or SIGTERM (exit 143), "
                    "which stop every process it started; a process that dies is restarted "
                    "after a back-off.")
    p.add_argument("manifest", nargs="?", type=existing_path, default=None,
                   help=f"a DDMDeployment YAML file (default: examples/{DEFAULT_DDM}.yaml, the "
                        f"shipped {DEFAULT_DDM} DDM over checkpoints/{DEFAULT_DDM})")
    p.add_argument("--port", type=int, default=ROUTER_PORT,
                   help=f"the router's port: its web page and API (default {ROUTER_PORT}); "
                        "the experts and every /metrics get free ports, printed once all is up")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address every process binds (default 127.0.0.1, this machine "
                        "only; 0.0.0.0 exposes them to the network, and is refused unless "
                        "the manifest's router.auth or --auth-token-file asks for a token)")
    _local_options(p, "a checkpoint pvc://CLAIM/PATH is read from DIR/CLAIM/PATH",
                   threads_default="default 1: the processes share the machine; a pool's "
                                   "process gets that many per member, up to the machine's "
                                   "CPUs, and shares them among the forwards it runs at once")
    p.add_argument("--fail-fast", action="store_true",
                   help="stop everything when one process dies (default: restart it with a "
                        "back-off from 1 s doubling to 5 min, as the kubelet does)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="the router's time budget for one expert call, waiting for a "
                        "restarting expert included; past it the request gets a 503 naming "
                        "the expert (default: router.yaml's, 60 s)")
    p.add_argument("--auth-token-file", type=Path, default=None,
                   help="require this bearer token on the router's API and on every expert "
                        "(default: a random one, in a private file it names, when the "
                        "manifest's router.auth asks for a token)")
    p.add_argument("--api-docs", action="store_true",
                   help="have the router serve Swagger UI at /docs (it loads from a CDN, so "
                        "off by default; /openapi.json is always served)")
    p.set_defaults(handler=_up)

    p = commands.add_parser(
        "train-all", help="run a DDMTraining's jobs (partition, experts, router) as local "
                          "processes, then write its DDMDeployment",
        description="Plan a DDMTraining as the operator would and run it here: the partition "
                    "first (k-means only), then every expert and the router network at once "
                    "(torchrun --standalone, or one process per rank with the JAX variables, "
                    "when processesPerNode > 1); a coloured-mnist training runs the "
                    "text-to-image DDM's stages. Finally the DDMDeployment over the outputs is "
                    "written to OUTPUT/deployment.yaml, for ddm up. Rerun to resume: finished "
                    "jobs are skipped, unfinished ones continue from their saved state. "
                    "Ctrl-C (exit 130) or SIGTERM (exit 143) stops every process.")
    p.add_argument("manifest", type=existing_path, help="a DDMTraining YAML file")
    _local_options(p, "pvc://CLAIM/PATH (the output, the data) is DIR/CLAIM/PATH",
                   None, "default: this machine's cores shared equally by the processes "
                         "running at once, at least 1 each")
    p.set_defaults(handler=_train_all)


def _local_options(p: argparse.ArgumentParser, claims: str, threads: int | None = 1,
                   threads_default: str = "default 1: the processes share the machine"
                   ) -> None:
    """``--pvc-root`` (``claims``: what it maps) and ``--threads`` (default ``threads``,
    described by ``threads_default``), as both local runtimes take them."""
    p.add_argument("--pvc-root", type=Path, default=None, metavar="DIR",
                   help=f"stands in for the cluster's PersistentVolumeClaims: {claims}")
    p.add_argument("--threads", type=int, default=threads,
                   help=f"CPU threads per process (OMP_NUM_THREADS; {threads_default})")


def _up(args: argparse.Namespace) -> int:
    from ddm.deploy.spec import load_manifest
    from ddm.runtime.local import DEFAULT_MANIFEST, run_local

    path = args.manifest or DEFAULT_MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"manifest {path} does not exist")
    # SIGTERM (`kill`) raises Terminated (see ddm.cli.main): run_local stops every process it
    # started on its way out, and ddm exits 143, "terminated", as a shell expects of a killed
    # command.
    return run_local(load_manifest(path), router_port=args.port, host=args.host,
                     pvc_root=args.pvc_root, threads=args.threads, fail_fast=args.fail_fast,
                     deadline_s=args.deadline_s, auth_token_file=args.auth_token_file,
                     api_docs=args.api_docs)


def _train_all(args: argparse.Namespace) -> int:
    from ddm.deploy.training_spec import load_training_manifest
    from ddm.runtime.training import run_training

    manifest = load_training_manifest(args.manifest)
    try:
        path = run_training(manifest, args.pvc_root, threads=args.threads)
    except KeyboardInterrupt:
        print("interrupted; rerun to resume every unfinished job", file=sys.stderr)
        return 130
    print(f"serve it: ddm up{f' --pvc-root {args.pvc_root}' if args.pvc_root else ''} {path}")
    return 0
