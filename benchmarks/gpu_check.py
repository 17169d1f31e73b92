"""``python -m benchmarks gpu-check``: issue 37's GPU check as one command, for a session that
is lent an NVIDIA device; ``benchmarks/gpu-check.sh`` is how the device machine runs it, in
two parts (``--part eager``, then ``--part compiled``) that each end within one call.

It prints ``nvidia-smi``, then runs ``paris-pools`` (:mod:`benchmarks.paris_pools`) on a
full-size Paris release with random weights (``tests/support/paris_release.py``'s ``full``:
eight DiT-XL/2 experts, a DiT-B router network, CLIP ViT-L/14, SD's VAE), imported with
``ddm import paris`` in bf16: every component in one pool on the GPU, eager and with
``torch.compile``'s CUDA graphs (``reduce-overhead``), against in-process sampling, top-2,
50 steps, guidance 7.5, at 1 and 32 concurrent prompts. The figures (images/s, latency
percentiles, GPU memory per process and in all, the H200 targets judged) go to
``$OUT/gpu-check.json`` and ``nvidia-smi``'s report to ``$OUT/nvidia-smi.txt`` (``--out``
overrides ``$OUT``); a summary line per deployment goes to stdout. The JSON is rewritten
after each deployment (``"complete": false`` until the end), and the deployments run eager
first, in-process next, compiled last, so that a run stopped at its deadline (SIGTERM, on
which it stops the servers it started) keeps what it measured. The imported release is kept
under ``out/gpu-check-release`` (ignored by git), so that the second part, on the machine the
first left warm, starts measuring at once.

``--part forwards`` measures instead one full-size expert's forwards outside any server
(:mod:`benchmarks.forwards`: each batch size eager, as a CUDA graph and through the pool's
compiled path, and two experts as one grouped forward) into ``$OUT/forwards.json``
(rewritten after each part, ``"complete": false`` until the end): where a pooled step's time
goes inside the forwards. ``--part kernels`` measures the same expert's levels (eager and as
CUDA graphs), its kernels (:mod:`benchmarks.forwards`' ``kernels`` part: where an eager and a
compiled forward's device time goes, and its time under each attention kernel) and the
grouped forward, not the pool's path, into ``$OUT/kernels.json``: a few minutes of device
time.

``--quick`` checks the command itself on any machine: the small release on the CPU, 2 steps
at 1 and 2 prompts, both compile modes (``reduce-overhead`` compiles without CUDA graphs on a
CPU); with ``--part forwards``, the small expert on the CPU at 1 and 2 rows (``kernels``: at
2 rows).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from benchmarks.fleet import BenchError, say
from benchmarks.forwards import ForwardSettings, bench_forwards
from benchmarks.paris_pools import ParisPoolSettings, bench_paris_pools
from benchmarks.pools import PoolBenchSettings
from ddm.fileio import atomic_path

#: Where the check keeps the imported full-size release between its two parts: ignored by
#: git, so that the device machine keeps it between two calls while it stays warm.
KEPT_RELEASE = Path("out") / "gpu-check-release"
#: The check on the device: full size, one pool, eager and CUDA graphs, 1 and 32 prompts, each
#: pooled deployment also through a router of one lockstep group (the default router's
#: ``auto`` keeps two where the experts report a GPU).
GPU_CHECK = ParisPoolSettings(
    size="full", accelerator="nvidia", precision="bfloat16",
    deployments=("pooled", "in_process"), compile=("none", "reduce-overhead"),
    load=PoolBenchSettings(concurrency=(1, 32), rounds=3, host_profile=True),
    keep_release=KEPT_RELEASE, lockstep_groups=(1,))
#: ``--quick``: the same command on the CPU at the small size, 2 steps, 1 and 2 prompts (the
#: second router keeps two lockstep groups: ``auto`` keeps one on a CPU).
QUICK_CHECK = ParisPoolSettings(
    size="small", accelerator="cpu", deployments=("pooled", "in_process"),
    compile=("none", "reduce-overhead"), max_batch=8,
    load=PoolBenchSettings(concurrency=(1, 2), rounds=1, steps=2, host_profile=True),
    lockstep_groups=(2,))
#: ``--part``: what each part measures of the settings (all of it, or one call's share;
#: ``pool``, the eager pool alone, is what a lease with under five minutes left still fits).
PARTS = {"all": {},
         "eager": {"deployments": ("pooled", "in_process"), "compile": ("none",)},
         "compiled": {"deployments": ("pooled",), "compile": ("reduce-overhead",)},
         "pool": {"deployments": ("pooled",), "compile": ("none",)}}
#: The part that measures one expert's forwards instead (:mod:`benchmarks.forwards`).
FORWARDS_PART = "forwards"
#: ``--part forwards`` on the device: one full-size expert in bf16, the pool's compiled path
#: under CUDA graphs; ``--quick``: the small expert on the CPU at 1 and 2 rows.
GPU_FORWARDS = ForwardSettings(size="full", device="cuda", precision="bfloat16",
                               compile="reduce-overhead")
QUICK_FORWARDS = ForwardSettings(compile="reduce-overhead", rows=(1, 2), grouped_rows=(2,),
                                 repeats=2)
#: The part that measures the expert's kernels instead, and each part's settings, full size
#: on the device and ``--quick``.
KERNELS_PART = "kernels"
FORWARD_CHECKS = {FORWARDS_PART: (GPU_FORWARDS, QUICK_FORWARDS),
                  KERNELS_PART: (replace(GPU_FORWARDS, parts=("levels", "kernels", "grouped")),
                                 replace(QUICK_FORWARDS, parts=("levels", "kernels", "grouped"),
                                         kernel_rows=(2,)))}


def nvidia_smi(required: bool) -> str:
    """``nvidia-smi``'s report; without the tool, a line saying so, or an error where the
    check needs a GPU (``required``)."""
    if shutil.which("nvidia-smi") is None:
        if required:
            raise BenchError("nvidia-smi is not here: the GPU check needs an NVIDIA device "
                             "(--quick checks the command on the CPU)")
        return "nvidia-smi: not installed (no NVIDIA GPU here)\n"
    done = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise BenchError(f"nvidia-smi failed ({done.returncode}): {done.stderr[-500:]}")
    return done.stdout


def summary(result: dict[str, Any]) -> list[str]:
    """One line per measured deployment: images/s and p50 latency at each level, GPU MiB."""
    lines = []
    measured = {**result["deployments"], **({"in_process": result["in_process"]}
                                            if "in_process" in result else {})}
    for name, figures in measured.items():
        gpu = figures.get("gpu_memory_used_mib")  # the whole GPU's, read alike for each
        lines.append(f"{name}: {_levels(figures)}" + (f"; GPU MiB in use {gpu}" if gpu else ""))
        lines.extend(f"  {name} at {level} prompts: {where}"
                     for level, f in figures["levels"].items() if (where := time_went(f)))
        for other in (key for key, value in figures.items()
                      if isinstance(value, dict) and "levels" in value):
            lines.append(f"{name} through a router with {other}: {_levels(figures[other])}")
            lines.extend(f"  {name} with {other} at {level} prompts: {where}"
                         for level, f in figures[other]["levels"].items()
                         if (where := time_went(f)))
        for server, groups in figures.get("groups", {}).items():
            lines.extend(_group_line(f"{name} {server}", group) for group in groups)
        if "calls_ahead" in figures:
            lines.append(f"  {name} calls ahead by router: " + "; ".join(
                f"{router} {counts['used']} used, {counts['unused']} unused"
                for router, counts in figures["calls_ahead"].items()))
    for name, target in result.get("targets", {}).items():
        verdict = {True: "met", False: "not met", None: "not judged (a figure is missing)"}
        lines.append(f"target {name}: {target['value']} {target['comparison']} "
                     f"{target['target']}: {verdict[target['met']]}")
    return lines


def _group_line(where: str, group: dict[str, Any]) -> str:
    """A pool's group of experts sharing a forward: up to which rows it groups, or why not,
    and what ``auto`` measured."""
    said = (f"grouped up to {group['grouped_up_to_rows']} rows of one member"
            if group["grouped_up_to_rows"] else
            f"not grouped ({group['failure']})" if group["failure"] else "not grouped")
    measured = ", ".join(f"{m['rows_per_member']} rows each {m['grouped_ms']} ms grouped, "
                         f"{m['member_by_member_ms']} ms member by member"
                         for m in group["calibration"])
    return (f"  {where}: {', '.join(group['members'])} {said}"
            + (f"; measured {measured}" if measured else ""))


def _levels(figures: dict[str, Any]) -> str:
    return ", ".join(f"{level} prompts {f['images_per_s']:.2f} images/s "
                     f"p50 {f['latency_s']['p50']:.3f} s"
                     for level, f in figures["levels"].items())


def time_went(level: dict[str, Any]) -> str:
    """Where a served level's time went, in words: its servers' seconds in their models
    per second of wall time, the rows of an expert's batch on average, the router's mean
    round trip by what it called, the GPU's utilisation (:mod:`benchmarks.model_time`);
    empty where the level has none of these."""
    said = []
    servers = level.get("model_time", {}).values()
    if servers:
        said.append(f"model time {sum(s['busy'] for s in servers):.2f} s per s")
        experts = [m for s in servers for name, m in s["members"].items()
                   if name.startswith("expert")]
        batches = sum(m["batches"] for m in experts)
        if batches:
            rows = sum(m["batches"] * m["rows_per_batch"] for m in experts)
            said.append(f"{batches} expert batches of {rows / batches:.1f} rows")
    trips = level.get("round_trips", {})
    if trips:
        said.append("round trips " + ", ".join(f"{key} {t['mean_ms']:.1f} ms x{t['calls']}"
                                                for key, t in trips.items()))
    percent = level.get("gpu_utilisation", {}).get("percent")
    if percent is not None:
        said.append(f"GPU busy {percent}%")
    profiles = level.get("host_profile", {})
    if profiles:
        said.append("interpreter busy " + ", ".join(
            f"{process} {_interpreter(profile)}" for process, profile in profiles.items()))
    return ", ".join(said)


def _interpreter(profile: dict[str, Any]) -> str:
    """A process's host profile in words: how busy its interpreter was, and in what most."""
    if "error" in profile:
        return f"not sampled ({profile['error']})"
    top = ", ".join(f"{frame} {share:.0%}" for frame, share in profile["self"][:3])
    return f"{profile['gil_share']:.0%}" + (f" (most in {top})" if top else "")


def gpu_check(out: Path, quick: bool = False, part: str = "all", log: TextIO = sys.stderr,
              report: TextIO = sys.stdout) -> int:
    """Run the check (its ``part``: :data:`PARTS`), write ``out``/gpu-check.json and
    ``out``/nvidia-smi.txt, print the summary; 0 once the figures are written (targets met or
    not: the JSON says)."""
    if part not in (*PARTS, *FORWARD_CHECKS):
        raise BenchError(f"part must be one of {', '.join((*PARTS, *FORWARD_CHECKS))}, got "
                         f"{part!r}")
    settings = replace(QUICK_CHECK if quick else GPU_CHECK, **PARTS.get(part, {}))
    out.mkdir(parents=True, exist_ok=True)
    smi = nvidia_smi(required=settings.accelerator == "nvidia")
    (out / "nvidia-smi.txt").write_text(smi)
    print(smi, file=report, flush=True)
    if settings.accelerator == "nvidia":
        require_cuda()
    if part in FORWARD_CHECKS:
        path = out / f"{part}.json"
        on_device, on_cpu = FORWARD_CHECKS[part]
        forwards = bench_forwards(on_cpu if quick else on_device, log,
                                  lambda so_far: _write(path, {**so_far, "complete": False}))
        _write(path, {**forwards, "complete": True})
        for line in forwards_summary(forwards):
            print(line, file=report, flush=True)
        return 0
    figures = out / "gpu-check.json"
    say(log, f"gpu-check: {settings.size} release on {settings.accelerator}, compile "
             f"{', '.join(settings.compile)}; figures to {figures}")

    def save(result: dict[str, Any], complete: bool) -> None:
        _write(figures, {**result, "complete": complete})

    result = bench_paris_pools(settings, log, on_figures=lambda so_far: save(so_far, False))
    save(result, True)
    for line in summary(result):
        print(line, file=report, flush=True)
    return 0


def _write(path: Path, figures: dict[str, Any]) -> None:
    """``figures`` as JSON at ``path``, through a rename: a run killed at its time limit
    leaves whole figures, never half."""
    with atomic_path(path) as partial:
        partial.write_text(json.dumps(figures, indent=2))


def forwards_summary(figures: dict[str, Any]) -> list[str]:
    """``--part forwards``' or ``kernels``' figures in lines: per batch size each way's
    milliseconds (and the CUDA graph's TFLOP/s), the kernels' shares and each attention
    kernel's milliseconds, then the grouped comparisons."""
    served = {level["rows"]: level for level in figures.get("served", [])}
    lines = [f"forwards: {figures['gflop_per_row']} GFLOP a row, {figures['settings']['precision']}"
             f" on {figures.get('gpu', figures['settings']['device'])}"]
    for level in figures.get("levels", []):
        ways = [*_timings(level), *(f"served {way}"
                                    for way in _timings(served.get(level["rows"], {})))]
        rate = level.get("graph_tflop_per_s", level.get("eager_tflop_per_s"))
        lines.append(f"  {level['rows']} rows: {', '.join(ways)}; {rate} TFLOP/s")
    for level in figures.get("kernels", []):
        for way in ("profile", "compiled_profile"):
            if way not in level:
                continue
            profile = level[way]
            shares = ", ".join(f"{kind} {share:.0%}" for kind, share in profile["shares"].items())
            lines.append(f"  {'compiled ' if way != 'profile' else ''}kernels at {level['rows']} "
                         f"rows: {profile['ms_per_call']} ms of {profile['timed']} a forward: "
                         f"{shares}")
            lines.extend(f"    {kernel['us_per_call']} us x{kernel['per_call']} "
                         f"{kernel['kind']}: {kernel['name'][:110]}"
                         for kernel in profile["heaviest"][:6])
        lines.append(f"    ways: {', '.join(_timings(level))}")
    grouped = figures.get("grouped", [])
    if isinstance(grouped, dict):  # the group cannot run there, and says why
        lines.append(f"  grouped: {grouped['unsupported']}")
        grouped = []
    for level in grouped:
        lines.append(f"  grouped, {level['rows_per_expert']} rows per expert: "
                     f"{', '.join(_timings(level))}"
                     f"; largest difference {level['max_abs_difference']:.2g}")
    return lines


def _timings(level: dict[str, Any]) -> list[str]:
    """A level's ``WAY_ms`` figures as "way N ms", and any ``WAY_error`` (a CUDA graph that
    could not be captured) as "way: error"."""
    return [f"{key.removesuffix('_ms').replace('_', ' ')} {value} ms" if key.endswith("_ms")
            else f"{key.removesuffix('_error').replace('_', ' ')}: {value}"
            for key, value in level.items() if key.endswith(("_ms", "_error"))]


def require_cuda() -> None:
    """Refuse at once, before minutes go on writing a 9.7 GiB release, where PyTorch sees no
    CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise BenchError(f"PyTorch {torch.__version__} sees no CUDA device: the GPU check "
                         "needs one (--quick checks the command on the CPU)")


def default_out() -> Path:
    """``$OUT`` (the device machine's folder that comes back), else ``./out/gpu-check``."""
    return Path(os.environ.get("OUT") or Path("out") / "gpu-check")
