"""``python -m benchmarks serve``'s text DDM figures (issue 22's "must show"), measured on
loopback against ``ddm serve expert`` and ``ddm serve stage`` processes (one CPU thread each)
serving a tiny text DDM with Paris's shapes (4x32x32 latents, CLIP's 77 x 768 embeddings,
256x256 images; random weights at tiny widths, ``tests.support.text_stages``):

1. bytes per step of one generation at batch 1, guided: with the context cache (the context
   sent once, each step only the latent and a few per-row numbers) and without it (the
   context sent with every step, as inline conditioning would); target: a step with the cache
   within 5% of the latent's own bytes;
2. guided (scale 7.5) and unguided (scale 1) time per step, one round trip each, alternated;
3. the decode stage's share of a generation: encode, the steps, decode, each timed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator, TextIO

import httpx
import numpy as np

from benchmarks.fleet import HOST, BenchError, say
from ddm.serving.router.fleet.pool import ExpertPool
from ddm.serving.router.fleet.servers import PoolSettings
from ddm.serving.router.fleet.replicas import static_endpoints
from ddm.serving.router.fleet.stage_clients import StagePool
from tests.support.text_stages import PARIS_SHAPES, write_text_ddm

#: Target: a step's request with the context cache over the latent's own bytes.
STEP_BYTES_TARGET = 1.05
GUIDANCE = 7.5
PROMPT = "a red car on the beach"
READY_TIMEOUT_S = 300.0
SETTINGS = PoolSettings(attempt_s=120.0, deadline_s=240.0, health_interval_s=1.0)


def text_figures(steps: int, rounds: int, log: TextIO = sys.stderr) -> dict[str, Any]:
    """Every text figure, with the servers started and stopped here."""
    with tempfile.TemporaryDirectory(prefix="ddm-bench-text-") as workdir, ExitStack() as stack:
        root = write_text_ddm(Path(workdir) / "ddm", experts=1, shapes=PARIS_SHAPES)
        say(log, f"text DDM written to {root}; starting its expert and stages")
        endpoints = {
            "expert": stack.enter_context(_server("expert", root / "expert_0", workdir)),
            "text_encoder": stack.enter_context(_server("stage", root / "text_encoder",
                                                        workdir)),
            "decoder": stack.enter_context(_server("stage", root / "decoder", workdir))}
        return asyncio.run(_measure(endpoints, steps, rounds, log))


async def _measure(endpoints: dict[str, str], steps: int, rounds: int,
                   log: TextIO) -> dict[str, Any]:
    stages = {role: static_endpoints([endpoints[role]]) for role in ("text_encoder",
                                                                     "decoder")}
    async with ExpertPool({"e": static_endpoints([endpoints["expert"]])}, SETTINGS) as pool, \
            StagePool(stages, SETTINGS) as remote:
        started = time.perf_counter()
        prompt, empty = await remote.encode([PROMPT]), await remote.encode([""])
        encode_s = time.perf_counter() - started
        cond = prompt.cond.with_guidance(GUIDANCE, empty.cond)
        x = np.random.default_rng(0).standard_normal((1, 4, 32, 32)).astype(np.float32)
        grid = np.linspace(0.0, 1.0, steps + 1, dtype=np.float32)
        say(log, f"one generation of {steps} guided steps with the context cache")
        started = time.perf_counter()
        state = x
        for a, b in zip(grid, grid[1:]):
            state = state + (b - a) * await pool.velocity("e", state, np.full(1, a), cond)
        steps_s = time.perf_counter() - started
        cached = dict(pool.bytes_sent)
        started = time.perf_counter()
        await remote.decode(state)
        decode_s = time.perf_counter() - started

        say(log, f"the same {steps} steps without the cache (the context with every step)")
        replica = pool.replicas("e")[0]
        before = dict(pool.bytes_sent)
        for a in grid[:-1]:
            replica.contexts.clear()  # as if the expert kept nothing: every step re-sends
            await pool.velocity("e", x, np.full(1, a), cond)
        uncached = {k: pool.bytes_sent[k] - before[k] for k in before}

        say(log, f"{rounds} alternated rounds of guided and unguided steps")
        times: dict[str, list[float]] = {"guided": [], "unguided": []}
        for _ in range(rounds):
            for name, scale in (("guided", GUIDANCE), ("unguided", 1.0)):
                started = time.perf_counter()
                await pool.velocity("e", x, np.full(1, 0.5), cond.with_guidance(
                    scale, empty.cond if scale != 1.0 else None))
                times[name].append(time.perf_counter() - started)
    latent = x.nbytes
    step_with_cache = cached["call"] / steps
    medians = {name: statistics.median(values) for name, values in times.items()}
    total = encode_s + steps_s + decode_s
    return {
        "text_model": {"latent_shape": [4, 32, 32], "text_shape": [77, 768],
                       "image_shape": [3, 256, 256], "steps": steps, "guidance": GUIDANCE},
        "text_bytes_per_step": {
            "latent_bytes": latent, "context_bytes": cached["context"],
            "with_cache_step_bytes": round(step_with_cache, 1),
            "with_cache_amortised_bytes": round((cached["call"] + cached["context"]) / steps, 1),
            "without_cache_step_bytes": round((uncached["call"] + uncached["context"]) / steps,
                                              1),
            "value": round(step_with_cache / latent, 4), "target": STEP_BYTES_TARGET,
            "comparison": "<=", "met": step_with_cache / latent <= STEP_BYTES_TARGET},
        "text_guidance_time": {
            "rounds": rounds, "guided_ms": round(1000 * medians["guided"], 2),
            "unguided_ms": round(1000 * medians["unguided"], 2),
            "ratio": round(medians["guided"] / medians["unguided"], 3)},
        "text_decode_share": {
            "encode_s": round(encode_s, 3), "steps_s": round(steps_s, 3),
            "decode_s": round(decode_s, 3), "value": round(decode_s / total, 4)},
    }


@contextmanager
def _server(command: str, checkpoint: Path, workdir: str) -> Iterator[str]:
    """``ddm serve {command} --checkpoint ...`` on a free port, one thread; its endpoint once
    ready."""
    import socket

    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    ddm = shutil.which("ddm") or str(Path(sys.executable).with_name("ddm"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    log = open(Path(workdir) / f"{checkpoint.name}.log", "w")
    process = subprocess.Popen([ddm, "serve", command, "--checkpoint", str(checkpoint),
                                "--host", HOST, "--port", str(port), "--log-level", "warning"],
                               stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_ready(f"http://{HOST}:{port}", process)
        yield f"{HOST}:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def _wait_ready(base: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchError(f"{base} exited with {process.returncode} before it was ready")
        try:
            if httpx.get(f"{base}/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise BenchError(f"{base} not ready after {READY_TIMEOUT_S} s")


def text_summary_lines(result: dict[str, Any]) -> list[str]:
    """The text figures, one line each."""
    wire, timing, decode = (result["text_bytes_per_step"], result["text_guidance_time"],
                            result["text_decode_share"])
    return [f"{'met ' if wire['met'] else 'MISS'}  text step bytes / latent bytes with the "
            f"context cache: {wire['value']} (target <= {wire['target']}); without it "
            f"{wire['without_cache_step_bytes']:.0f} bytes a step for a "
            f"{wire['latent_bytes']}-byte latent",
            f"      guided / unguided time per step: {timing['guided_ms']} / "
            f"{timing['unguided_ms']} ms (x{timing['ratio']})",
            f"      decode share of a generation: {decode['value']:.1%} ({decode['decode_s']} s "
            f"of {decode['encode_s'] + decode['steps_s'] + decode['decode_s']:.2f} s)"]
