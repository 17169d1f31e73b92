"""Memory and time of one full-size Paris network call on this machine (random weights).

``python -m tests.support.paris_footprint expert|router`` prints one JSON object. It runs as a
process of its own so that its peak resident memory is the network's and nothing else's:
``expert`` is one guided step (the conditional and unconditional rows as one batch of 2, then
``uncond + 7.5 * (cond - uncond)``); ``router`` is one call on one latent.
docs/paris.md records the figures.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from ddm.models.paris import ParisExpert, ParisRouter

GUIDANCE_SCALE = 7.5
CLIP_TOKENS, CLIP_WIDTH = 77, 768


def peak_rss_mib() -> float:
    """This process's peak resident memory so far: ``VmHWM`` of its own address space, not
    ``ru_maxrss``, which a child started by ``fork`` inherits from its parent (a large pytest
    process made every figure here its own size)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(role: str, calls: int = 2) -> dict[str, float | int | str]:
    """Build the full-size ``role`` network in float32 and time ``calls`` calls."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    baseline = peak_rss_mib()
    network = (ParisExpert() if role == "expert" else ParisRouter()).eval()
    parameters = sum(p.numel() for p in network.parameters())
    built = peak_rss_mib()
    latents = torch.randn(1, 4, 32, 32, generator=generator)
    timestep = torch.tensor([500.0])
    text = torch.randn(2, CLIP_TOKENS, CLIP_WIDTH, generator=generator)
    seconds = []
    with torch.inference_mode():
        for _ in range(calls):
            start = time.perf_counter()
            if role == "expert":
                both = network(torch.cat([latents, latents]), timestep.repeat(2), text)
                out = both[1:] + GUIDANCE_SCALE * (both[:1] - both[1:])
            else:
                out = torch.softmax(network(latents, timestep), dim=-1)
            seconds.append(time.perf_counter() - start)
    assert torch.isfinite(out).all()
    return {"role": role, "parameters": parameters, "torch_threads": torch.get_num_threads(),
            "float32_weights_mib": round(parameters * 4 / 2**20),
            "bfloat16_weights_mib": round(parameters * 2 / 2**20),
            "rss_before_mib": round(baseline), "rss_after_build_mib": round(built),
            "peak_rss_mib": round(peak_rss_mib()),
            "first_call_s": round(seconds[0], 2), "later_call_s": round(min(seconds[1:]), 2),
            "output_shape": list(out.shape)}


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("expert", "router"):
        sys.exit("usage: python -m tests.support.paris_footprint expert|router")
    print(json.dumps(measure(sys.argv[1])))
