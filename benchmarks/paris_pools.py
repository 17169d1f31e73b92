"""``python -m benchmarks paris-pools``: issue 37's figures for a Paris-shaped DDM, served with
every component alone, as one pool, and sampled in-process.

The DDM is a Paris release with random weights (``tests.support.paris_release``), imported with
``ddm import paris`` exactly as a user imports the published one, so the served path is the
product's: eight experts, the router network, the text encoder and the decoder.

- ``--size small`` (any machine): eight small DiT experts with Paris's shapes (4x32x32
  latents, CLIP's 77 x 768 text, 256 px images) at tiny widths, on the CPU;
- ``--size micro``: the same shapes in networks too small to matter, so that a step's time is
  what it costs besides its models (the router's, the protocol's and the pool's own work);
- ``--size full --accelerator nvidia --precision bfloat16`` (a GPU machine): the published
  sizes (eight DiT-XL/2 experts, a DiT-B router network, CLIP ViT-L/14's text encoder, SD's
  VAE; 9.7 GiB in bf16) in one pool on one GPU: the issue's GPU check, whose target on an
  H200 is at least 8 images/s at 32 concurrent prompts and a p50 under 250 ms at 1.

``alone`` is the imported ddm.yaml as ``ddm up`` runs it; ``pooled`` the same DDM with every
component in one pool (:func:`pooled_manifest`); ``in_process`` ``load_ddm`` +
``generate_text`` in a fresh process (``benchmarks.pools``' child), eager. ``--compile
none,reduce-overhead`` measures each served deployment once per ``torch.compile`` mode (the
spec's ``compile``: the pool's, or every expert's when alone), keyed ``pooled`` for ``none``
and ``pooled-MODE`` for the others (:func:`deployment_key`). The sampling settings are the
release's (50 Euler steps, top-2, guidance 7.5) unless ``--steps`` says otherwise. Memory is
every process's lifetime peak RSS and, on NVIDIA, each process's GPU memory from nvidia-smi,
read while the deployment is still up.

``compare_calls_ahead`` measures the pooled deployments through two routers over the same
pool: the default one (``DDM_CALLS_AHEAD`` unset: ``auto``, calls ahead for a lone image on
an accelerator, none on the CPU), then one set to the choice ``auto`` makes for none of the
levels there (keyed ``calls_ahead_off`` on an accelerator, ``calls_ahead_on`` on the CPU),
each router's calls ahead counted
(``calls_ahead``: used and unused, by router), so that one start of the pool answers whether
calls ahead help there (``ddm.serving.router.fleet.remote``). The default router is measured
first; each router's figures count the model servers and that router alone. A
``DDM_CALLS_AHEAD`` in this process's environment reaches the default router too (the JSON's
``calls_ahead`` counts say what each did). ``lockstep_groups`` (say ``(1,)``) adds a router
per number of groups its lockstep keeps (``DDM_LOCKSTEP_GROUPS``, keyed ``lockstep_groups_1``:
``ddm.serving.router.fleet.lockstep``; the default router's ``auto`` keeps two on an
accelerator, one on the CPU), measured the same way after the others.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, TextIO

import httpx
import yaml

from benchmarks.fleet import BenchError, machine, say
from benchmarks.load import local_ddm
from benchmarks.model_time import calls_ahead
from benchmarks.pools import PoolBenchSettings, in_process, served
from ddm.serving.router.fleet.lockstep import LOCKSTEP_GROUPS_ENV, MAX_GROUPS
from ddm.serving.router.fleet.remote import CALLS_AHEAD_ENV
from ddm.deploy.limits import COMPILE_MODES
from ddm.models.paris import ParisExpertConfig, ParisRouterConfig
from tests.support.paris_release import FULL_PARIS, TinyParis, write_paris_release

#: Paris's shapes (4x32x32 latents, 77 x 768 text, 256 px) in small networks: what the CPU runs.
SMALL_PARIS = TinyParis(
    experts=8, text_width=768,
    expert=ParisExpertConfig(input_size=32, hidden_size=64, depth=2, num_heads=4),
    router=ParisRouterConfig(input_size=32, hidden_size=64, depth=2, num_heads=4),
    vae_channels=(8, 16, 16, 16))
#: Paris's shapes in networks too small to matter (width 16, depth 1, patch 8): what a step
#: costs besides its models, the router's, the protocol's and the pool's own work.
MICRO_PARIS = TinyParis(
    experts=8, text_width=768,
    expert=ParisExpertConfig(input_size=32, patch_size=8, hidden_size=16, depth=1, num_heads=2),
    router=ParisRouterConfig(input_size=32, patch_size=8, hidden_size=16, depth=1, num_heads=2),
    text_layers=1, text_heads=2, text_intermediate=16, vae_channels=(8, 8, 8, 8), vae_layers=1)
SIZES = {"micro": MICRO_PARIS, "small": SMALL_PARIS, "full": FULL_PARIS}
DEPLOYMENTS = ("alone", "pooled", "in_process")
#: The pool every component joins in the pooled variant.
POOL = "all"
#: Fields a pooled component may not carry: its pool places it (deploy/pools.py refuses them).
PLACEMENT_FIELDS = ("accelerator", "replicas", "resources", "nodeSelector", "tolerations",
                    "affinity", "image", "maxBatch", "maxDelayMs", "autoscaling", "placement")
#: The issue's targets for a full-size pool on one H200.
H200_IMAGES_PER_S, H200_P50_S = 8.0, 0.25
PROMPTS = ("a photo of a red car on the beach", "a cat on the beach at sunset",
           "a photo of the sunset", "a red cat")


@dataclass(frozen=True)
class ParisPoolSettings:
    """Which release, where it runs and what is measured. ``accelerator`` is the
    DDMDeployment's type (``cpu``, ``nvidia``); ``precision`` what every server casts to."""

    size: str = "small"
    accelerator: str = "cpu"
    precision: str | None = None
    deployments: tuple[str, ...] = DEPLOYMENTS
    max_batch: int = 64
    compile: tuple[str, ...] = ("none",)
    load: PoolBenchSettings = PoolBenchSettings(concurrency=(1, 8, 32), rounds=1)
    #: Where the imported release is kept for the next run to reuse (None: a temporary
    #: directory, removed after).
    keep_release: Path | None = None
    #: Also measure the pooled deployments through a router making the other choice of
    #: calls ahead (module docstring).
    compare_calls_ahead: bool = False
    #: Also measure the pooled deployments through a router whose lockstep keeps each of
    #: these numbers of groups (module docstring).
    lockstep_groups: tuple[int, ...] = ()

    @property
    def other_calls_ahead(self) -> str:
        """The choice the second router makes: ``off`` on an accelerator (where ``auto`` sends
        calls ahead at one prompt), ``on`` on the CPU (where it sends none)."""
        return "on" if self.accelerator == "cpu" else "off"

    def other_routers(self) -> dict[str, dict[str, str]]:
        """The routers measured after the default one over a pooled deployment's servers,
        by the key of their figures: each one's environment."""
        others = ({f"calls_ahead_{self.other_calls_ahead}": {
            CALLS_AHEAD_ENV: self.other_calls_ahead}} if self.compare_calls_ahead else {})
        return {**others, **{f"lockstep_groups_{n}": {LOCKSTEP_GROUPS_ENV: str(n)}
                             for n in self.lockstep_groups}}

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"size must be one of {', '.join(SIZES)}, got {self.size!r}")
        if self.accelerator not in ("cpu", "nvidia"):
            raise ValueError(f"accelerator must be cpu or nvidia, got {self.accelerator!r}")
        unknown = sorted(set(self.deployments) - set(DEPLOYMENTS))
        if unknown or not self.deployments:
            raise ValueError(f"deployments: give some of {', '.join(DEPLOYMENTS)}, "
                             f"got {', '.join(self.deployments) or 'none'}")
        if not 1 <= self.max_batch <= 1024:
            raise ValueError(f"max_batch must be in 1..1024, got {self.max_batch}")
        unknown = sorted(set(self.compile) - set(COMPILE_MODES))
        if unknown or not self.compile or len(set(self.compile)) != len(self.compile):
            raise ValueError(f"compile: give some of {', '.join(COMPILE_MODES)}, each once, "
                             f"got {', '.join(self.compile) or 'none'}")
        if len(set(self.lockstep_groups)) != len(self.lockstep_groups) or not all(
                1 <= n <= MAX_GROUPS for n in self.lockstep_groups):
            raise ValueError(f"lockstep_groups: give numbers from 1 to {MAX_GROUPS}, each "
                             f"once, got {self.lockstep_groups}")


#: The file that marks a release's import as whole (in the imported directory).
IMPORTED = ".imported"
#: ``--quick``: the small release, 2 steps, 1 and 2 prompts, one round.
QUICK = ParisPoolSettings(load=PoolBenchSettings(concurrency=(1, 2), rounds=1, steps=2))


def deployment_key(name: str, mode: str) -> str:
    """A served deployment's key in the JSON: ``name`` eager, ``name-MODE`` compiled."""
    return name if mode == "none" else f"{name}-{mode}"


def compiled_manifest(document: dict[str, Any], mode: str) -> dict[str, Any]:
    """``document`` (alone or pooled) with its model servers in compile ``mode``: each pool's
    and each unpooled expert's ``compile`` (pure: a new document)."""
    compiled = copy.deepcopy(document)
    if mode == "none":
        return compiled
    spec = compiled["spec"]
    for server in (*spec.get("pools", ()), *(e for e in spec["experts"] if "pool" not in e)):
        server["compile"] = mode
    return compiled


def pooled_manifest(document: dict[str, Any], accelerator: str, max_batch: int
                    ) -> dict[str, Any]:
    """The imported DDMDeployment ``document`` with every expert, the text encoder, the
    decoder and the router network in one pool on ``accelerator`` (pure: a new document)."""
    pooled = copy.deepcopy(document)
    spec = pooled["spec"]
    members = [*spec["experts"], spec["textEncoder"], spec["decoder"], spec["router"]["network"]]
    for member in members:
        for name in PLACEMENT_FIELDS:
            member.pop(name, None)
        member["pool"] = POOL
    spec["pools"] = [{"name": POOL, "accelerator": {"type": accelerator}, "replicas": 1,
                      "maxBatch": max_batch}]
    return pooled


def measuring_order(settings: ParisPoolSettings) -> list[tuple[str, str]]:
    """The asked deployments as (name, compile mode), in the order they are measured: the
    eager ones, then in-process sampling, then the compiled ones, whose start-up (compiling
    every bucket) is the longest and least certain, so that a run cut short keeps the rest."""
    served = [name for name in ("alone", "pooled") if name in settings.deployments]
    eager = [(name, "none") for name in served if "none" in settings.compile]
    local = [("in_process", "none")] if "in_process" in settings.deployments else []
    compiled = [(name, mode) for mode in settings.compile if mode != "none" for name in served]
    return [*eager, *local, *compiled]


def bench_paris_pools(settings: ParisPoolSettings, log: TextIO = sys.stderr,
                      on_figures: Callable[[dict[str, Any]], None] | None = None
                      ) -> dict[str, Any]:
    """Write and import the release, then measure each asked deployment; the figures as a
    JSON-ready dict. ``on_figures`` gets the figures so far after each deployment (the GPU
    check saves them, so that a run stopped at its time limit still reports)."""
    started = time.perf_counter()
    sizes = SIZES[settings.size]
    workdir = Path(tempfile.mkdtemp(prefix="ddm-bench-paris-"))
    try:
        imported = imported_release(settings, workdir, log)
        document = yaml.safe_load((imported / "ddm.yaml").read_text())
        # On loopback without the import's bearer token, as examples/text2img.yaml runs.
        document["spec"]["router"].pop("auth", None)
        documents = {"alone": document,
                     "pooled": pooled_manifest(document, settings.accelerator,
                                               settings.max_batch)}
        sampling = {"steps": settings.load.steps or document["spec"]["sampling"]["steps"],
                    "strategy": document["spec"]["sampling"]["strategy"],
                    "guidance_scale": document["spec"]["sampling"]["guidanceScale"]}
        result: dict[str, Any] = {
            "machine": machine(), "settings": {
                **asdict(settings), "sizes": asdict(sizes),
                "keep_release": settings.keep_release and str(settings.keep_release)},
            "sampling": sampling, "deployments": {}}
        load = replace(settings.load, prompts=PROMPTS)
        for name, mode in measuring_order(settings):
            if name == "in_process":
                say(log, "paris-pools: in-process generate_text")
                device = "cuda" if settings.accelerator == "nvidia" else "cpu"
                result["in_process"] = in_process(load, sampling, imported, device,
                                                  settings.precision)
            else:
                key = deployment_key(name, mode)
                say(log, f"paris-pools: {key}")
                manifest = imported / f"ddm-{key}.yaml"
                manifest.write_text(yaml.safe_dump(compiled_manifest(documents[name], mode)))
                also = settings.other_routers() if name == "pooled" else {}
                with local_ddm(manifest, max(load.concurrency), log, also=also) as ddm:
                    # Each router's figures count the model servers and that router alone.
                    pids = {process: pid for process, pid in ddm.pids.items()
                            if process not in also}
                    figures = asyncio.run(served(ddm.url, pids, load, log, ddm.metrics,
                                                 ddm.routers["router"][1]))
                    figures.update(gpu_memory(pids))
                    figures["groups"] = grouped_forwards(ddm.servers)
                    for other in also:
                        say(log, f"paris-pools: {key} through a router with {other}")
                        others = {process: pid for process, pid in ddm.pids.items()
                                  if process not in ("router", *also) or process == other}
                        url, metrics_url = ddm.routers[other]
                        figures[other] = asyncio.run(served(url, others, load, log,
                                                            ddm.metrics, metrics_url))
                    if also:
                        figures["calls_ahead"] = {
                            router: calls_ahead(httpx.get(metrics_url, timeout=60).text)
                            for router, (_, metrics_url) in ddm.routers.items()}
                result["deployments"][key] = {"compile": mode, **figures}
            result["targets"] = targets(result)
            if on_figures is not None:
                on_figures(result)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["load_average_after"] = list(os.getloadavg())
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def grouped_forwards(servers: dict[str, str]) -> dict[str, Any]:
    """Each pool's groups of experts sharing a forward, as its ``/v1/info`` says (members,
    the rows up to which a batch runs grouped, what ``auto`` measured): server name ->
    groups, for the servers that are pools."""
    found = {}
    for name, base in servers.items():
        info = httpx.get(f"{base}/v1/info", timeout=60).json()
        if "pool" in info:
            found[name] = info["pool"]["groups"]
    return found


def imported_release(settings: ParisPoolSettings, workdir: Path, log: TextIO) -> Path:
    """A release of ``settings.size`` with random weights, imported with ``ddm import paris``
    for the settings' accelerator and precision: under ``workdir``, or, with
    ``keep_release``, there, reused when an earlier run left one (the GPU check's second part
    runs on the machine its first part warmed, minutes saved). An import cut short (the run
    killed at its deadline) is never taken: only one marked whole (:data:`IMPORTED`), made
    again otherwise (its manifest names its checkpoints by their absolute paths, so it is
    made where it stays)."""
    dtype = "bfloat16" if settings.precision == "bfloat16" else "float32"
    name = f"paris-{settings.size}-{dtype}-{settings.accelerator}-{settings.precision or 'stored'}"
    imported = ((settings.keep_release or workdir) / name).absolute()  # its manifest's paths
    if (imported / IMPORTED).is_file():
        say(log, f"paris-pools: reusing the release imported at {imported}")
        return imported
    say(log, f"paris-pools: writing a {settings.size} release with random weights")
    release = _write_release(workdir / "release", SIZES[settings.size], dtype)
    shutil.rmtree(imported, ignore_errors=True)  # an import cut short
    imported.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "ddm", "import", "paris", str(release), "--out", str(imported),
         "--accelerator", settings.accelerator,
         *(("--precision", settings.precision) if settings.precision else ())],
        capture_output=True, text=True)
    say(log, f"paris-pools: {done.stdout.strip()}")
    if done.returncode != 0:
        raise BenchError(f"ddm import paris failed ({done.returncode}): "
                         f"{done.stderr[-2000:]}")
    shutil.rmtree(release)  # the import copied it: keep one copy on disk
    (imported / IMPORTED).write_text("ddm import paris finished\n")
    return imported


def _write_release(root: Path, sizes: TinyParis, dtype: str) -> Path:
    import torch

    return write_paris_release(root, sizes, seed=0, dtype=getattr(torch, dtype))


def targets(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets that this run can judge, for each measured pool (eager, and each
    compile mode: the target's name then ends in ``-MODE``): the pool against in-process
    sampling (memory within 1.3x, images/s at least 0.9x at the highest concurrency) and, for
    a full-size pool on a GPU, the H200 figures (images/s at 32 prompts, p50 at 1)."""
    from benchmarks.pools import MEMORY_RATIO, ratio_target
    from benchmarks.pools import targets as pool_targets

    judged: dict[str, Any] = {}
    local = result.get("in_process")
    full = result["settings"]["size"] == "full"
    for mode in result["settings"]["compile"]:
        pooled = result["deployments"].get(deployment_key("pooled", mode))
        if pooled is None:
            continue
        found: dict[str, Any] = {}
        if local:
            found.update(pool_targets({**result, "deployments": {"pooled": pooled},
                                       "settings": result["settings"]["load"]}))
            if "gpu_memory_used_mib" in local:  # on a GPU: its memory, each alone on it
                found["gpu_memory_pooled_to_in_process"] = ratio_target(
                    pooled.get("gpu_memory_used_mib"), local["gpu_memory_used_mib"],
                    MEMORY_RATIO, "<=")
        if full and "32" in pooled["levels"]:
            images = pooled["levels"]["32"]["images_per_s"]
            found["h200_images_per_s_at_32"] = {"value": images, "target": H200_IMAGES_PER_S,
                                                "comparison": ">=",
                                                "met": images >= H200_IMAGES_PER_S}
        if full and "1" in pooled["levels"]:
            p50 = pooled["levels"]["1"]["latency_s"]["p50"]
            found["h200_p50_s_at_1"] = {"value": p50, "target": H200_P50_S, "comparison": "<",
                                        "met": p50 < H200_P50_S}
        judged.update({deployment_key(name, mode): figure for name, figure in found.items()})
    return judged


def nvidia_smi_rows(query: str) -> list[str] | None:
    """``nvidia-smi``'s CSV rows for ``query`` (``--query-gpu=...``, ``--query-compute-apps=...``),
    no header or units; None without nvidia-smi (no NVIDIA GPU here)."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise BenchError(f"nvidia-smi failed ({done.returncode}): {done.stderr[-500:]}")
    return done.stdout.strip().splitlines()


def gpu_memory(pids: dict[str, int]) -> dict[str, Any]:
    """The GPU memory of ``pids`` (``gpu_memory_mib``) and of the whole GPU
    (``gpu_memory_used_mib``), each None without nvidia-smi; a failed reading is recorded
    (``gpu_memory_error``), not raised, so the deployment's other figures are kept."""
    try:
        return {"gpu_memory_mib": gpu_memory_mib(pids),
                "gpu_memory_used_mib": gpu_memory_used_mib()}
    except (BenchError, OSError, subprocess.SubprocessError) as error:
        return {"gpu_memory_mib": None, "gpu_memory_used_mib": None,
                "gpu_memory_error": str(error)}


def gpu_memory_mib(pids: dict[str, int]) -> dict[str, float] | None:
    """Each of ``pids``' GPU memory in MiB (nvidia-smi's compute apps); None without
    nvidia-smi."""
    rows = nvidia_smi_rows("--query-compute-apps=pid,used_memory")
    if rows is None:
        return None
    used = {}
    for line in rows:
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            used[int(pid)] = float(mib)
    return {name: used[pid] for name, pid in pids.items() if pid in used}


def gpu_memory_used_mib() -> float | None:
    """The memory in use on the first NVIDIA GPU, in MiB, every process's together (where
    nvidia-smi cannot map a sandboxed machine's processes to their PIDs, this still reads);
    None without nvidia-smi."""
    rows = nvidia_smi_rows("--query-gpu=memory.used")
    if rows is None:
        return None
    try:
        return float(rows[0])
    except (IndexError, ValueError):
        raise BenchError(f"nvidia-smi printed no memory figure: {rows[:2]!r}") from None


def bench_paris_pools_command(settings: ParisPoolSettings, out: TextIO = sys.stdout,
                              log: TextIO = sys.stderr) -> int:
    """``python -m benchmarks paris-pools``: the figures as JSON on ``out``, progress on
    ``log``."""
    print(json.dumps(bench_paris_pools(settings, log), indent=2), file=out)
    return 0
