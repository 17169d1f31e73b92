"""``python -m benchmarks WHAT``: the project's benchmarks, each printing JSON with ``--json``.

They live outside ``src/ddm`` (not shipped in the wheel or the images); run them from a
checkout with the project installed (``make install``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from collections.abc import Sequence
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Measure the system: serving throughput and overhead, load, the operator, "
                    "scale to zero.")
    kinds = parser.add_subparsers(dest="what", required=True, metavar="WHAT")
    p = kinds.add_parser("serve", help="serving on loopback with the shipped experts: "
                                       "throughput, per-step overhead, batching, wire bytes")
    p.add_argument("--json", action="store_true",
                   help="print every figure as JSON (progress goes to stderr)")
    p.add_argument("--quick", action="store_true", help="fewer repetitions: a smoke run")
    p.add_argument("--steps", type=int, default=40, help="denoising steps per generation")
    p.add_argument("--text-only", action="store_true",
                   help="only the text DDMs' figures (context bytes, guidance, decode share, the "
                        "shipped text2img's one-prompt latency)")
    p.set_defaults(handler=_bench_serve)

    p = kinds.add_parser("calls", help="one batch-1 expert call's cost beyond the model and "
                                       "the HTTP floor, fast and slow models, several source "
                                       "trees side by side")
    p.add_argument("trees", nargs="+", help="checkouts whose expert servers to compare")
    p.set_defaults(handler=_bench_calls)

    p = kinds.add_parser("router", help="the router's own CPU per one-step generation and per "
                                        "/readyz, several source trees side by side over the "
                                        "same MNIST experts")
    p.add_argument("trees", nargs="+", help="checkouts whose routers to compare")
    p.set_defaults(handler=_bench_router)

    p = kinds.add_parser("load", help="concurrent clients against a router on loopback for a "
                                      "bounded time: errors, throughput, latency, peak memory")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--router", default=None, help="a running router, http://127.0.0.1:PORT "
                   "(default: start the shipped example's experts and router)")
    p.add_argument("--json", action="store_true",
                   help="print every figure as JSON (progress goes to stderr)")
    p.set_defaults(handler=_bench_load)

    p = kinds.add_parser("operator", help="the operator bringing up many DDMDeployments on a dev "
                                          "cluster: time to children and statuses, memory, "
                                          "API requests")
    p.add_argument("--json", action="store_true",
                   help="print every figure as JSON (progress goes to stderr)")
    p.add_argument("--ddms", type=int, default=50, help="DDMDeployments to create")
    p.add_argument("--experts", type=int, default=8, help="experts in each (2 to 10)")
    p.add_argument("--kubeconfig", type=Path, default=None,
                   help="use this cluster as its admin (default: start a fresh dev cluster)")
    p.set_defaults(handler=_bench_operator)

    p = kinds.add_parser("scale-to-zero", help="a skewed, bursty trace against ddm up, fixed "
                                               "provisioning vs rare experts at minReplicas 0: "
                                               "replica-seconds, latency, failures, cold starts")
    p.add_argument("--json", action="store_true",
                   help="print every figure as JSON (progress goes to stderr)")
    p.add_argument("--quick", action="store_true", help="a shorter trace: a smoke run")
    p.add_argument("--delay", type=int, default=None,
                   help="the rare experts' scale-down delay, seconds (default: longer "
                        "than a cold start; shorter with --quick)")
    p.add_argument("--steps", type=int, default=10, help="denoising steps per generation")
    p.add_argument("--seed", type=int, default=0, help="the trace's seed")
    p.add_argument("--policies", default="wait",
                   help="autoscaled runs, one per missing-expert policy: wait, reroute or "
                        "wait,reroute")
    p.set_defaults(handler=_bench_scale_to_zero)

    p = kinds.add_parser("threads", help="in-process sampling of the shipped text DDM against "
                                         "its CPU thread policy, idle and under a load of "
                                         "busy processes (JSON)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per timed generation")
    p.add_argument("--load", type=int, default=4, help="busy processes in the loaded runs")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one configuration may take")
    p.add_argument("--policy", action="append", default=None, metavar="NAME",
                   help="run only this policy (repeatable; default: every one: "
                        "benchmarks/threads.py POLICIES)")
    p.set_defaults(handler=_bench_threads)

    p = kinds.add_parser("pools", help="the shipped text DDM with every component alone, in "
                                       "one pool, and in-process: total RSS and images/s at "
                                       "1, 8 and 32 concurrent prompts (JSON)")
    p.add_argument("--quick", action="store_true",
                   help="2 steps, 1 and 2 prompts, one round: a smoke run")
    p.add_argument("--rounds", type=int, default=2,
                   help="requests per client (batches in-process) at each level")
    p.add_argument("--threads", type=int, default=1,
                   help="ddm up --threads: intra-op threads per served process, a pool's "
                        "per member up to the machine's CPUs (default 1, as ddm up's); "
                        "in-process sampling takes the idle cores")
    p.set_defaults(handler=_bench_pools)

    p = kinds.add_parser("paris-pools", help="a Paris-shaped DDM (random weights, imported as "
                                             "a release) alone, in one pool and in-process: "
                                             "RSS, GPU memory and images/s (JSON)")
    p.add_argument("--size", choices=("micro", "small", "full"), default="small",
                   help="small: Paris's shapes in tiny networks (CPU); micro: in networks "
                        "too small to matter (a step's cost besides its models); full: the "
                        "published sizes (a GPU machine)")
    p.add_argument("--accelerator", choices=("cpu", "nvidia"), default="cpu")
    p.add_argument("--precision", choices=("float32", "bfloat16", "float16"), default=None)
    p.add_argument("--deployments", default="alone,pooled,in_process",
                   help="which of alone, pooled, in_process to measure (comma-separated)")
    p.add_argument("--concurrency", default="1,8,32", help="concurrent prompts per level")
    p.add_argument("--rounds", type=int, default=1, help="requests per client per level")
    p.add_argument("--steps", type=int, default=None, help="denoising steps (default: 50)")
    p.add_argument("--compile", default="none",
                   help="torch.compile modes to serve in, each measured (comma-separated: "
                        "none, default, reduce-overhead, max-autotune)")
    p.add_argument("--compare-calls-ahead", action="store_true",
                   help="measure the pooled deployments again through a second router over "
                        "the same pool with the other choice of DDM_CALLS_AHEAD")
    p.add_argument("--lockstep-groups", default="",
                   help="measure the pooled deployments again through a router per number "
                        "of lockstep groups given (DDM_LOCKSTEP_GROUPS; comma-separated, "
                        "from 1)")
    p.add_argument("--host-profile", action="store_true",
                   help="sample each served process with py-spy at every level: the share "
                        "of the time its interpreter was busy, and where (benchmarks/"
                        "host_profile.py)")
    p.add_argument("--quick", action="store_true",
                   help="small release, 2 steps, 1 and 2 prompts: a smoke run")
    p.set_defaults(handler=_bench_paris_pools)

    p = kinds.add_parser("gpu-check", help="issue 37's GPU check in one command: nvidia-smi, "
                                           "a full-size Paris release in one pool on the GPU, "
                                           "eager and CUDA graphs, against in-process, at 1 "
                                           "and 32 prompts (JSON under $OUT)")
    p.add_argument("--out", type=Path, default=None,
                   help="where gpu-check.json and nvidia-smi.txt go (default: $OUT, else "
                        "out/gpu-check)")
    p.add_argument("--quick", action="store_true",
                   help="check the command on the CPU: the small release, 2 steps, 1 and 2 "
                        "prompts")
    p.add_argument("--part", choices=("all", "eager", "compiled", "pool", "forwards", "kernels"),
                   default="all",
                   help="eager: the pool eager and in-process sampling; compiled: the pool "
                        "under reduce-overhead (each fits one device call); pool: the eager "
                        "pool alone; forwards: one expert's forwards outside any server, "
                        "kernels: where its time goes (benchmarks/forwards.py); default all")
    p.set_defaults(handler=_gpu_check)

    p = kinds.add_parser("grouped", help="the shipped text2img experts as one grouped forward "
                                         "(stacked parameters, torch.vmap) against member by "
                                         "member at 1, 8 and 32 rows each (JSON)")
    p.add_argument("--repeats", type=int, default=30, help="timed calls per way and level")
    p.set_defaults(handler=_bench_grouped)

    p = kinds.add_parser("forwards", help="a Paris expert's forward at each batch size (eager, "
                                          "CUDA graph, the pool's path) and two experts as "
                                          "one grouped forward, on one device (JSON)")
    p.add_argument("--size", default="small", help="micro, small or full (default small)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--precision", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--compile", default="none", help="the pool path's torch.compile mode "
                                                     "(default none)")
    p.add_argument("--rows", default="1,2,4,8,16,24,32,40,48,64", help="rows of each level")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per figure")
    p.add_argument("--parts", default="levels,grouped,served",
                   help="what to measure: some of levels, kernels, grouped, served (default "
                        "levels,grouped,served)")
    p.add_argument("--kernel-rows", default="2,64", help="rows of each kernel breakdown")
    p.set_defaults(handler=_bench_forwards)
    return parser


def _gpu_check(args: argparse.Namespace) -> int:
    from benchmarks.fleet import BenchError
    from benchmarks.gpu_check import default_out, gpu_check
    from ddm.termination import sigterm_handled

    def stop(signum: int, frame: object) -> None:
        # Unwinds through the running deployment, which stops the servers it started.
        raise SystemExit(128 + signum)

    try:
        with sigterm_handled(stop):
            return gpu_check(args.out or default_out(), quick=args.quick, part=args.part)
    except BenchError as error:
        print(f"benchmarks: error: {error}", file=sys.stderr)
        return 1


def _bench_paris_pools(args: argparse.Namespace) -> int:
    from benchmarks.paris_pools import QUICK, ParisPoolSettings, bench_paris_pools_command
    from benchmarks.pools import PoolBenchSettings

    try:
        modes = tuple(m.strip() for m in args.compile.split(",") if m.strip())
        settings = replace(QUICK, compile=modes) if args.quick else ParisPoolSettings(
            size=args.size, accelerator=args.accelerator, precision=args.precision,
            deployments=tuple(d.strip() for d in args.deployments.split(",") if d.strip()),
            compile=modes,
            load=PoolBenchSettings(concurrency=_levels(args.concurrency), rounds=args.rounds,
                                   steps=args.steps))
        settings = replace(settings, compare_calls_ahead=args.compare_calls_ahead,
                           lockstep_groups=_levels(args.lockstep_groups, "lockstep-groups"),
                           load=replace(settings.load, host_profile=args.host_profile))
    except ValueError as error:
        print(f"benchmarks: error: {error}", file=sys.stderr)
        return 2
    return bench_paris_pools_command(settings)


def _levels(text: str, option: str = "concurrency") -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{option}: give comma-separated integers, got {text!r}") from None


def _bench_pools(args: argparse.Namespace) -> int:
    from benchmarks.pools import QUICK, PoolBenchSettings, bench_pools_command

    try:
        settings = QUICK if args.quick else PoolBenchSettings(rounds=args.rounds,
                                                              threads=args.threads)
    except ValueError as error:
        print(f"benchmarks: error: {error}", file=sys.stderr)
        return 2
    return bench_pools_command(settings)


def _bench_grouped(args: argparse.Namespace) -> int:
    from benchmarks.grouped import GroupedSettings, bench_grouped_command

    try:
        settings = GroupedSettings(repeats=args.repeats)
    except ValueError as error:
        print(f"benchmarks: error: {error}", file=sys.stderr)
        return 2
    return bench_grouped_command(settings)


def _bench_forwards(args: argparse.Namespace) -> int:
    from benchmarks.forwards import ForwardSettings, bench_forwards_command

    try:
        settings = ForwardSettings(size=args.size, device=args.device,
                                   precision=args.precision, compile=args.compile,
                                   rows=_levels(args.rows, "rows"), repeats=args.repeats,
                                   parts=tuple(part for part in args.parts.split(",") if part),
                                   kernel_rows=_levels(args.kernel_rows, "kernel-rows"))
    except ValueError as error:
        print(f"benchmarks: error: {error}", file=sys.stderr)
        return 2
    return bench_forwards_command(settings)


def _bench_threads(args: argparse.Namespace) -> int:
    from benchmarks.threads import POLICIES, main

    try:
        return main(args.prompts, args.load, args.timeout, tuple(args.policy or POLICIES))
    except ValueError as error:
        print(f"benchmarks: error: {error}", file=sys.stderr)
        return 2


def _bench_scale_to_zero(args: argparse.Namespace) -> int:
    from benchmarks.scaling import POLICIES, bench_scale_to_zero_command

    policies = tuple(args.policies.split(","))
    if not set(policies) <= set(POLICIES):
        print(f"benchmarks: error: --policies {args.policies!r}: use wait, reroute or both, "
              "comma-separated", file=sys.stderr)
        return 2
    return bench_scale_to_zero_command(args.json, args.quick, delay_s=args.delay,
                                       steps=args.steps, seed=args.seed, policies=policies)


def _bench_serve(args: argparse.Namespace) -> int:
    from benchmarks.serve import bench_serve_command

    return bench_serve_command(steps=args.steps, quick=args.quick, as_json=args.json,
                               text_only=args.text_only)


def _bench_calls(args: argparse.Namespace) -> int:
    from benchmarks.calls import bench_calls_command

    return bench_calls_command(args.trees)


def _bench_router(args: argparse.Namespace) -> int:
    from benchmarks.router_cpu import bench_router_command

    return bench_router_command(args.trees)


def _bench_operator(args: argparse.Namespace) -> int:
    from benchmarks.operator import bench_operator_command

    return bench_operator_command(ddms=args.ddms, experts=args.experts,
                                  kubeconfig=args.kubeconfig, as_json=args.json)


def _bench_load(args: argparse.Namespace) -> int:
    from benchmarks.load import LoadTestError, load_test_command

    try:
        return load_test_command(clients=args.clients, duration_s=args.duration,
                                 router=args.router, as_json=args.json)
    except (LoadTestError, ValueError) as error:
        print(f"benchmarks: error: {error}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
