"""``python -m benchmarks grouped``: one grouped forward of a pool's same-architecture experts
against their forwards member by member (issue 37, deliverable 3).

The shipped text-to-image DDM's four experts (checkpoints/text2img/expert_*, diffusers'
``PixArtTransformer2DModel``, float32, one architecture) run a step's rows two ways at 1, 8 and
32 rows per expert: ``per_member``, each expert's network on its own rows one after the other
(what the pool server does: a batcher per member), and ``grouped``, the four networks' stacked
parameters (``torch.func.stack_module_state``) in one ``torch.vmap`` of
``torch.func.functional_call`` (PyTorch's model-ensembling recipe). Each figure is the median
of ``repeats`` timed calls after one warm-up call of each, the two ways alternating; the
largest difference between their outputs is recorded too. The text rows are the text
encoder's 32 tokens of 128, the times uniform; the CPU thread count is the one every ddm
command takes (:func:`ddm.threads.apply_cpu_thread_policy`), and the load average is recorded.
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, TextIO

from benchmarks.fleet import machine, say
from ddm.runtime.local import REPOSITORY_ROOT
from ddm.threads import apply_cpu_thread_policy

EXPERTS = tuple(REPOSITORY_ROOT / "checkpoints" / "text2img" / f"expert_{k}" for k in range(4))
#: The shipped text encoder's tokens per prompt and the experts' text width.
TOKENS, WIDTH = 32, 128


@dataclass(frozen=True)
class GroupedSettings:
    """Rows per expert at each level, and timed calls per way and level."""

    rows: tuple[int, ...] = (1, 8, 32)
    repeats: int = 30

    def __post_init__(self) -> None:
        if not self.rows or min(self.rows) < 1 or self.repeats < 1:
            raise ValueError("GroupedSettings needs rows >= 1 and repeats >= 1")


def bench_grouped(settings: GroupedSettings, log: TextIO = sys.stderr) -> dict[str, Any]:
    """The figures: per level, each way's median milliseconds and the grouped speed-up."""
    threads = apply_cpu_thread_policy()
    import torch
    from diffusers import PixArtTransformer2DModel
    from torch.func import functional_call, stack_module_state

    figures: dict[str, Any] = {"machine": machine(), "torch_threads": torch.get_num_threads(),
                               "policy_threads": threads, "experts": len(EXPERTS),
                               "settings": {"rows": list(settings.rows),
                                            "repeats": settings.repeats}}
    networks = [PixArtTransformer2DModel.from_pretrained(path).eval() for path in EXPERTS]
    params, buffers = stack_module_state(networks)
    skeleton = copy.deepcopy(networks[0]).to("meta")
    added = {"resolution": None, "aspect_ratio": None}
    say(log, f"{len(networks)} experts of {sum(p.numel() for p in networks[0].parameters()):,} "
             f"parameters, {torch.get_num_threads()} torch threads")

    def one(p: Any, b: Any, x: Any, text: Any, timestep: Any) -> Any:
        return functional_call(skeleton, (p, b), (x,), {
            "encoder_hidden_states": text, "timestep": timestep,
            "added_cond_kwargs": added}).sample

    grouped = torch.vmap(one)
    channels, size = networks[0].config.in_channels, networks[0].config.sample_size
    generator = torch.Generator().manual_seed(0)
    levels = []
    for rows in settings.rows:
        shape = (len(networks), rows)
        x = torch.randn((*shape, channels, size, size), generator=generator)
        text = torch.randn((*shape, TOKENS, WIDTH), generator=generator)
        timestep = torch.rand(shape, generator=generator) * 1000

        def per_member() -> Any:
            return torch.stack([net(x[k], encoder_hidden_states=text[k], timestep=timestep[k],
                                    added_cond_kwargs=added).sample
                                for k, net in enumerate(networks)])

        def stacked() -> Any:
            return grouped(params, buffers, x, text, timestep)

        with torch.inference_mode():
            difference = float((per_member() - stacked()).abs().max())
            times = _alternating({"per_member": per_member, "grouped": stacked},
                                 settings.repeats)
        level = {"rows_per_expert": rows, **{f"{way}_ms": round(statistics.median(ms), 3)
                                             for way, ms in times.items()},
                 "max_abs_difference": difference}
        level["grouped_speedup"] = round(level["per_member_ms"] / level["grouped_ms"], 3)
        say(log, f"{rows} rows per expert: {level}")
        levels.append(level)
    figures["levels"] = levels
    figures["machine"]["load_average_after"] = list(__import__("os").getloadavg())
    return figures


def _alternating(ways: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Milliseconds of ``repeats`` calls of each way, the ways taking turns (a shared
    machine's load moves both alike)."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, way in ways.items():
            started = time.perf_counter()
            way()
            times[name].append((time.perf_counter() - started) * 1000)
    return times


def bench_grouped_command(settings: GroupedSettings, out: TextIO = sys.stdout,
                          log: TextIO = sys.stderr) -> int:
    """``python -m benchmarks grouped``: the figures as JSON on ``out``, progress on ``log``."""
    print(json.dumps(bench_grouped(settings, log), indent=2), file=out)
    return 0
