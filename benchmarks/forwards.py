"""``python -m benchmarks forwards``: a Paris expert's forward at each batch size on one
device, and a step's two experts as one grouped forward (issue 37).

The third H200 run put the pooled step in the forwards (docs/benchmarks.md, "Full size on one
H200"): at 32 prompts a compiled DiT-XL/2 cost about 2 ms a row in the pool, a fifth of the
GPU's bf16 matrix rate, and at one prompt each 2-row batch took 6-8 ms of the pool's model time
with the GPU busy 36-43% of the step. This measures those forwards outside any server, on
random weights of the release's shapes (``paris_pools.SIZES``), each figure the median of
``repeats`` synchronised calls after warm-up:

- ``eager``: the network on device tensors; ``graph``: the same network replayed from a CUDA
  graph captured at that batch size (CUDA only: no launch left on the host), so that eager -
  graph is the launches and graph / rows the per-row cost, padding's cost included;
- ``served``: the pool's own path from NumPy rows to NumPy velocities
  (``ddm.models.stages.paris_expert_velocity``; under ``compile`` the server's
  ``compile_network``, ``bucketed`` and ``on_compiled_thread``, each batch padded to its
  bucket), so that served - graph is the host's work around a forward;
- ``kernels`` (asked for by name: ``parts``): at each of ``kernel_rows`` where an eager
  forward's time goes by PyTorch's profiler (device kernels by kind: matrix products,
  attention, normalisation, convolution, the rest; the heaviest by name), and the forward's
  milliseconds under each attention kernel ``scaled_dot_product_attention`` offers, so that
  a kernel's share is measured before a model is rewritten for it; where ``compile`` is not
  ``none``, the same breakdown of the forward under ``torch.compile``'s inductor without CUDA
  graphs (:data:`KERNEL_COMPILE_MODE`: the profiler then sees each of its kernels), to say
  what its fusions leave;
- ``grouped``: two experts' rows in one forward of their group
  (:class:`~ddm.models.paris.ParisExpertGroup`: each projection one grouped matrix product
  over the experts' stacked weights; eager and, on CUDA, graph-replayed) against their two
  forwards one after the other, with the largest difference between the two ways' outputs and
  the grouped forward's profile (as ``kernels``'); where the group cannot run (CUDA in
  float32, say), why.

TFLOP/s per level count the expert's matrix products (:func:`expert_flop_per_row`: 289 GFLOP a
row at full size, the issue's figure) times the rows.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, TextIO

from benchmarks.fleet import machine, say
from ddm.deploy.limits import COMPILE_MODES, PRECISIONS, compile_buckets
from ddm.threads import apply_cpu_thread_policy

#: CLIP's tokens per prompt: what a Paris expert's text rows carry.
TEXT_TOKENS = 77
#: What :func:`bench_forwards` can measure (the module docstring), in the order it runs them.
FORWARD_PARTS = ("levels", "kernels", "grouped", "served")
#: The parts measured unless others are asked for (``kernels`` is its own device check).
DEFAULT_PARTS = ("levels", "grouped", "served")
#: ``scaled_dot_product_attention``'s kernels (``torch.nn.attention.SDPBackend``' names) that
#: the ``kernels`` part times the forward under, one at a time.
ATTENTION_BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")
#: How the ``kernels`` part sorts a kernel or operator by its name (the first kind whose
#: fragments one matches; the rest are "other": elementwise work, copies, reductions).
KERNEL_KINDS = (("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
                ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "addmm", "aten::mm", "bmm",
                            "grouped_mm", "matmul")),
                ("convolution", ("conv",)),
                ("normalisation", ("norm",)))
#: The heaviest kernels the ``kernels`` part names, per level.
HEAVIEST_KERNELS = 12
#: The grouped forwards the ``grouped`` part profiles, per level.
GROUPED_PROFILED_CALLS = 3
#: The ``torch.compile`` mode whose kernels the ``kernels`` part profiles: inductor's fusions
#: without ``reduce-overhead``'s CUDA graphs, which would hide them from the profiler.
KERNEL_COMPILE_MODE = "default"


@dataclass(frozen=True)
class ForwardSettings:
    """What to measure: the expert's size (``paris_pools.SIZES``), where, in which precision,
    the compile mode of the served path, the rows of each level, of the grouped levels and
    of the kernel breakdowns, the timed calls per figure and the parts measured
    (:data:`FORWARD_PARTS`)."""

    size: str = "small"
    device: str = "cpu"
    precision: str = "float32"
    compile: str = "none"
    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 40, 48, 64)
    grouped_rows: tuple[int, ...] = (2, 16)
    kernel_rows: tuple[int, ...] = (2, 64)
    repeats: int = 20
    parts: tuple[str, ...] = DEFAULT_PARTS

    def __post_init__(self) -> None:
        from benchmarks.paris_pools import SIZES

        if self.size not in SIZES:
            raise ValueError(f"size must be one of {', '.join(SIZES)}, got {self.size!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got "
                             f"{self.precision!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got "
                             f"{self.compile!r}")
        if (not self.rows or min((*self.rows, *self.grouped_rows, *self.kernel_rows)) < 1
                or self.repeats < 1):
            raise ValueError("ForwardSettings needs rows >= 1 and repeats >= 1")
        unknown = [part for part in self.parts if part not in FORWARD_PARTS]
        if unknown or not self.parts:
            raise ValueError(f"parts must be some of {', '.join(FORWARD_PARTS)}, got "
                             f"{', '.join(self.parts) or 'none'}")


def bench_forwards(settings: ForwardSettings, log: TextIO = sys.stderr,
                   on_figures: Callable[[dict[str, Any]], None] | None = None
                   ) -> dict[str, Any]:
    """The figures (the module docstring), as JSON-ready values; ``on_figures`` sees them so
    far after each part (a run stopped at its deadline keeps what it measured: the compile of
    the pool's path comes last)."""
    said = on_figures or (lambda figures: None)
    threads = apply_cpu_thread_policy()
    import torch

    from benchmarks.paris_pools import SIZES
    from ddm.models.paris import ParisExpert, ParisExpertGroup, grouped_forward_unsupported

    device = torch.device(settings.device)
    dtype = getattr(torch, settings.precision)
    config = SIZES[settings.size].expert
    text_width = SIZES[settings.size].text_width
    torch.manual_seed(0)
    with device:  # built where they run: a full-size expert's initialisation is slow on a CPU
        experts = [_random(ParisExpert(**{**config.to_dict(), "text_embed_dim": text_width}),
                           dtype) for _ in range(2)]
    # Before any part runs: the group moves the experts' weights into its stacked tensors
    # (each expert's are views of them), and a compiled forward holds their addresses.
    unsupported = grouped_forward_unsupported(experts[0].config, dtype, device)
    group = ParisExpertGroup(experts) if unsupported is None else None
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    figures: dict[str, Any] = {"machine": machine(), "policy_threads": threads,
                               "settings": asdict(settings), "config": config.to_dict(),
                               "parameters": sum(p.numel() for p in experts[0].parameters())}
    if cuda:
        figures["gpu"] = torch.cuda.get_device_name(device)

    def inputs(rows: int, generator: torch.Generator) -> tuple[Any, Any, Any]:
        return (torch.randn((rows, config.in_channels, config.input_size, config.input_size),
                            generator=generator).to(device, dtype),
                (torch.rand(rows, generator=generator) * 1000).to(device),
                torch.randn((rows, TEXT_TOKENS, text_width), generator=generator
                            ).to(device, dtype))

    generator = torch.Generator().manual_seed(1)
    flops_per_row = expert_flop_per_row(config, TEXT_TOKENS, text_width)
    figures["gflop_per_row"] = round(flops_per_row / 1e9, 2)
    say(log, f"forwards: {figures['parameters']:,} parameters, {figures['gflop_per_row']} "
             f"GFLOP a row, {settings.precision} on {device}")

    def rate(rows: int, ms: float) -> float:
        return round(flops_per_row * rows / (ms / 1000) / 1e12, 2)

    if "levels" in settings.parts:
        figures["levels"] = _levels(experts[0], settings, inputs, generator, sync, rate, log)
        said(figures)
    if "kernels" in settings.parts:
        calls = [inputs(rows, generator) for rows in settings.kernel_rows]
        figures["kernels"] = [_kernels(experts[0], rows, args, settings, sync, cuda, log)
                              for rows, args in zip(settings.kernel_rows, calls)]
        said(figures)
        if settings.compile != "none":
            _compiled_kernels(experts[0], figures["kernels"], calls, settings, sync, cuda, log)
        said(figures)
    if "grouped" in settings.parts and group is None:
        figures["grouped"] = {"unsupported": unsupported}
    elif "grouped" in settings.parts:
        figures["grouped"] = [_grouped(group, experts, rows, inputs(rows * 2, generator),
                                       settings, sync, cuda, log)
                              for rows in settings.grouped_rows]
        said(figures)
    if "served" in settings.parts:
        figures["served"] = _served(experts[0], settings, config, text_width, sync, log)
    figures["machine"]["load_average_after"] = list(os.getloadavg())
    return figures


def _levels(expert: Any, settings: ForwardSettings, inputs: Callable[..., Any],
            generator: Any, sync: Callable[[], None], rate: Callable[[int, float], float],
            log: TextIO) -> list[dict[str, Any]]:
    """Each level's rows eager and (on CUDA) replayed from a CUDA graph."""
    import torch

    cuda = settings.device == "cuda"
    levels = []
    for rows in settings.rows:
        x, timestep, text = inputs(rows, generator)
        level: dict[str, Any] = {"rows": rows}
        with torch.inference_mode():
            level["eager_ms"] = _median_ms(lambda: expert(x, timestep, text),
                                           settings.repeats, sync)
            if cuda:
                _graph_ms(level, "graph", lambda: expert(x, timestep, text),
                          settings.repeats, sync)
        for way in ("eager", "graph"):
            if f"{way}_ms" in level:
                level[f"{way}_tflop_per_s"] = rate(rows, level[f"{way}_ms"])
        say(log, f"forwards: {level}")
        levels.append(level)
    return levels


def expert_flop_per_row(config: Any, text_tokens: int, text_width: int) -> int:
    """Floating-point operations (two per multiply-add) of one row through a Paris expert's
    matrix products: per block self-attention (q, k, v, out, scores and values over the
    patches), cross-attention to the text tokens, the MLP; the patch embedding, the text
    projection and the final layer (the time embedding is per row and negligible)."""
    patches = (config.input_size // config.patch_size) ** 2
    width, hidden = config.hidden_size, int(config.hidden_size * config.mlp_ratio)
    self_attention = 4 * patches * width**2 + 2 * patches**2 * width
    cross_attention = (2 * patches * width**2 + 2 * text_tokens * width**2
                       + 2 * patches * text_tokens * width)
    mlp = 2 * patches * width * hidden
    patch_values = config.patch_size**2
    ends = (patches * width * patch_values * config.in_channels + text_tokens * text_width * width
            + patches * width * patch_values * config.out_channels)
    return 2 * (config.depth * (self_attention + cross_attention + mlp) + ends)


def _random(network: Any, dtype: Any) -> Any:
    """``network`` with every parameter drawn at a small scale (the constructor leaves the
    tables zero, which a timing would not mind but a difference between two ways would
    hide), in ``dtype``, for inference."""
    import torch

    with torch.no_grad():
        for parameter in network.parameters():
            parameter.normal_(std=0.02)
    return network.to(dtype).eval()


def _median_ms(call: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    """Milliseconds of one synchronised call: the median of ``repeats`` after two warm-ups."""
    for _ in range(2):
        call()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        sync()
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 3)


def _graph_ms(level: dict[str, Any], way: str, call: Callable[[], Any], repeats: int,
              sync: Callable[[], None]) -> None:
    """``level[way_ms]``: ``call`` replayed from a CUDA graph; or ``level[way_error]``, why
    it could not be captured (a kernel that synchronises with the host, say)."""
    try:
        level[f"{way}_ms"] = _median_ms(_graphed(call), repeats, sync)
    except RuntimeError as error:
        level[f"{way}_error"] = f"{type(error).__name__}: {error}"[:500]


def _graphed(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` (on fixed device tensors) captured in a CUDA graph, as its replay (PyTorch's
    recipe: warmed up on a side stream, then captured)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def _kernels(expert: Any, rows: int, args: tuple[Any, Any, Any], settings: ForwardSettings,
             sync: Callable[[], None], cuda: bool, log: TextIO) -> dict[str, Any]:
    """``expert``'s eager forward on ``rows`` rows: the profiler's breakdown, then its
    milliseconds under PyTorch's choice of attention kernel and under each of
    :data:`ATTENTION_BACKENDS` alone (``WAY_error`` where that kernel refuses the shapes)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call() -> Any:
        return expert(*args)

    level: dict[str, Any] = {"rows": rows}
    with torch.inference_mode():
        level["profile"] = _profile(call, settings.repeats, sync, cuda)
        level["attention_default_ms"] = _median_ms(call, settings.repeats, sync)
        for backend in ATTENTION_BACKENDS:
            way = f"attention_{backend.lower()}"
            try:
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    level[f"{way}_ms"] = _median_ms(call, settings.repeats, sync)
            except RuntimeError as error:
                level[f"{way}_error"] = f"{type(error).__name__}: {error}"[:300]
    say(log, f"forwards: kernels {level}")
    return level


def _compiled_kernels(expert: Any, levels: list[dict[str, Any]], calls: list[Any],
                      settings: ForwardSettings, sync: Callable[[], None], cuda: bool,
                      log: TextIO) -> None:
    """Each kernel level's forward compiled (:data:`KERNEL_COMPILE_MODE`; as in the server, a
    second shape makes the batch dynamic): its milliseconds and its profile, into the level.
    ``expert`` itself stays eager (``torch.compile`` wraps it)."""
    import torch

    compiled = torch.compile(expert, mode=KERNEL_COMPILE_MODE)
    with torch.inference_mode():
        for level, args in zip(levels, calls):
            level["compiled_ms"] = _median_ms(lambda: compiled(*args), settings.repeats, sync)
            level["compiled_profile"] = _profile(lambda: compiled(*args), settings.repeats,
                                                 sync, cuda)
            say(log, f"forwards: compiled kernels at {level['rows']} rows "
                     f"{level['compiled_profile']}")


def _profile(call: Callable[[], Any], calls: int, sync: Callable[[], None],
             cuda: bool) -> dict[str, Any]:
    """Where ``calls`` calls' time goes by PyTorch's profiler: on CUDA the device kernels, on
    a CPU the operators' own time; per call the total, each kind's share
    (:data:`KERNEL_KINDS`) and the heaviest by name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    call()
    sync()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as profiler:
        for _ in range(calls):
            call()
        sync()
    where = DeviceType.CUDA if cuda else DeviceType.CPU
    timed = [(event.key, event.count,
              event.self_device_time_total if cuda else event.self_cpu_time_total)
             for event in profiler.key_averages() if event.device_type == where]
    total = sum(us for _, _, us in timed) or 1
    shares: dict[str, float] = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for name, _, us in timed:
        shares[kernel_kind(name)] += us / total
    heaviest = sorted(timed, key=lambda kernel: -kernel[2])[:HEAVIEST_KERNELS]
    return {"timed": "device kernels" if cuda else "operators' own CPU time",
            "ms_per_call": round(total / calls / 1000, 3),
            "shares": {kind: round(share, 4) for kind, share in shares.items()},
            "heaviest": [{"name": name[:200], "per_call": round(count / calls, 2),
                          "us_per_call": round(us / calls, 1), "kind": kernel_kind(name)}
                         for name, count, us in heaviest]}


def kernel_kind(name: str) -> str:
    """The kind of a kernel or operator by its name (:data:`KERNEL_KINDS`), else "other"."""
    lowered = name.lower()
    return next((kind for kind, fragments in KERNEL_KINDS
                 if any(fragment in lowered for fragment in fragments)), "other")


def _grouped(group: Any, experts: list[Any], rows: int, inputs: tuple[Any, Any, Any],
             settings: ForwardSettings, sync: Callable[[], None], cuda: bool,
             log: TextIO) -> dict[str, Any]:
    """Two experts on ``rows`` rows each: one after the other, and as one forward of their
    group (:class:`~ddm.models.paris.ParisExpertGroup`)."""
    import torch

    x, timestep, text = inputs
    members = torch.arange(len(experts), device=x.device).repeat_interleave(rows)

    def one_after_the_other() -> Any:
        return torch.cat([expert(x[k * rows:(k + 1) * rows], timestep[k * rows:(k + 1) * rows],
                                 text[k * rows:(k + 1) * rows])
                          for k, expert in enumerate(experts)])

    def together() -> Any:
        return group(x, timestep, text, members)

    level: dict[str, Any] = {"rows_per_expert": rows}
    _compare_grouped(level, one_after_the_other, together, settings.repeats, sync, cuda)
    say(log, f"forwards: grouped {level}")
    return level


def _compare_grouped(level: dict[str, Any], one_after_the_other: Callable[[], Any],
                     together: Callable[[], Any], repeats: int, sync: Callable[[], None],
                     cuda: bool) -> None:
    import torch

    with torch.inference_mode():
        level["max_abs_difference"] = float((one_after_the_other() - together())
                                            .float().abs().max())
        level["one_after_the_other_ms"] = _median_ms(one_after_the_other, repeats, sync)
        level["grouped_ms"] = _median_ms(together, repeats, sync)
        level["grouped_profile"] = _profile(together, GROUPED_PROFILED_CALLS, sync, cuda)
        if cuda:
            _graph_ms(level, "one_after_the_other_graph", one_after_the_other, repeats, sync)
            _graph_ms(level, "grouped_graph", together, repeats, sync)


def _served(expert: Any, settings: ForwardSettings, config: Any, text_width: int,
            sync: Callable[[], None], log: TextIO) -> list[dict[str, Any]]:
    """The pool's path from NumPy rows to NumPy velocities at each level's rows, eager, then
    (where ``compile`` is not ``none``) compiled as the server compiles it, padded to its
    buckets and warmed twice (a CUDA graph is recorded at a shape's second call)."""
    import numpy as np

    from ddm.conditioning import Conditioning
    from ddm.convention import network_convention
    from ddm.models.paris_ddm import PARIS_CONVENTION
    from ddm.models.stages import paris_expert_velocity
    from ddm.models.torch_io import compile_network
    from ddm.serving.model.compiled import CUDA_GRAPHS, bucketed, on_compiled_thread

    velocity = paris_expert_velocity(expert, network_convention(PARIS_CONVENTION))
    generator = np.random.default_rng(2)
    calls = [(generator.standard_normal((rows, config.in_channels, config.input_size,
                                         config.input_size), np.float32),
              generator.uniform(0.05, 0.95, rows).astype(np.float32),
              Conditioning(embeddings=generator.standard_normal(
                  (rows, TEXT_TOKENS, text_width), np.float32)))
             for rows in settings.rows]
    levels: list[dict[str, Any]] = [{"rows": rows} for rows in settings.rows]
    for level, args in zip(levels, calls):  # eager: before compiling changes the network
        level["none_ms"] = _median_ms(lambda: velocity(*args), settings.repeats, sync)
    if settings.compile != "none":
        buckets = compile_buckets(max(settings.rows))
        compile_network(expert, settings.compile, len(buckets))
        compiled = bucketed(on_compiled_thread(settings.compile, velocity), buckets)
        for level, args in zip(levels, calls):
            for _ in range(2 if settings.compile == CUDA_GRAPHS else 1):  # as the server warms
                compiled(*args)
            level[f"{settings.compile}_ms"] = _median_ms(lambda: compiled(*args),
                                                         settings.repeats, sync)
    for level in levels:
        say(log, f"forwards: served {level}")
    return levels


def bench_forwards_command(settings: ForwardSettings, out: TextIO = sys.stdout,
                           log: TextIO = sys.stderr) -> int:
    """``python -m benchmarks forwards``: the figures as JSON on ``out``, progress on
    ``log``."""
    print(json.dumps(bench_forwards(settings, log), indent=2), file=out)
    return 0
