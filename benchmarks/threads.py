"""``python -m benchmarks threads``: in-process sampling's time against its CPU thread policy,
on an idle machine and under a load of busy processes.

Each configuration runs in a fresh process (thread settings apply when a framework loads), which
loads the shipped text-to-image DDM, warms it with one prompt, then times ``PROMPTS`` prompts of
its default request. The load is ``LOAD`` processes spinning in a Python loop, each bounded in
time, started before and ended after each timed run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT_DDM = ROOT / "checkpoints" / "text2img"
#: The thread policies compared: the environment each process starts with.
POLICIES: dict[str, dict[str, str]] = {
    # torch's and OpenMP's own defaults: a thread per core, threads spin while they wait.
    "framework-default": {"DDM_CPU_THREADS": "framework"},
    # what ddm.threads picks (the default of every in-process command).
    "ddm-policy": {},
    # the default count, but waiting threads sleep.
    "framework-passive": {"DDM_CPU_THREADS": "framework", "OMP_WAIT_POLICY": "PASSIVE"},
    "one-thread": {"DDM_CPU_THREADS": "1"},
    # two intra-op threads, the experts of a step one after the other...
    "two-threads": {"DDM_CPU_THREADS": "2"},
    # ...or two experts at once, one intra-op thread each (inter-op parallelism across
    # experts: ddm.threads.expert_parallelism); the same threads in all.
    "two-expert-workers": {"DDM_CPU_THREADS": "2", "DDM_EXPERT_WORKERS": "2"},
}
_CHILD = """
import sys, time
from ddm.threads import apply_cpu_thread_policy
chosen = apply_cpu_thread_policy()
import torch
from ddm.models.ddm import load_ddm
from ddm.sampling.pipeline import generate_text
ddm = load_ddm(sys.argv[1], backends=("torch",))
generate_text(ddm, ["a red seven"], seed=0)
prompts = ["a thick red seven", "a thin blue three", "a green five", "an orange eight"]
prompts = [prompts[i % 4] for i in range(int(sys.argv[2]))]
start = time.perf_counter()
generate_text(ddm, prompts, seed=0)
print(time.perf_counter() - start, chosen, torch.get_num_threads())
"""


def _spinners(count: int, seconds: float) -> list[subprocess.Popen]:
    code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]


def _run(policy: dict[str, str], prompts: int, load: int, timeout_s: float) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "DDM_CPU_THREADS",
                        "DDM_EXPERT_WORKERS")}
    env.update(policy)
    spinners = _spinners(load, timeout_s) if load else []
    try:
        out = subprocess.run([sys.executable, "-c", _CHILD, str(TEXT_DDM), str(prompts)],
                             env=env, capture_output=True, text=True, timeout=timeout_s,
                             check=True)
    except subprocess.TimeoutExpired:
        return {"seconds": None, "timed_out_after_s": timeout_s}
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    seconds, chosen, torch_threads = out.stdout.split()[-3:]
    return {"seconds": round(float(seconds), 2), "policy_threads": chosen,
            "torch_threads": int(torch_threads)}


def bench_threads_command(prompts: int, load: int, timeout_s: float,
                          policies: tuple[str, ...] = tuple(POLICIES)) -> dict:
    """Each of ``policies`` idle and under ``load`` spinning processes; the figures as a
    dict (with the one-minute load average before each run: other work counts too)."""
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    results: dict = {"prompts": prompts, "load_processes": load, "cpus": os.cpu_count(),
                     "loadavg_before": os.getloadavg()[0], "runs": []}
    for label, spinning in (("idle", 0), ("loaded", load)):
        for name in policies:
            policy = POLICIES[name]
            print(f"[bench threads] {name}, {label}", file=sys.stderr, flush=True)
            started = time.perf_counter()
            run = _run(policy, prompts, spinning, timeout_s)
            run.update(policy=name, machine=label, loadavg_1m=os.getloadavg()[0],
                       wall_s=round(time.perf_counter() - started, 1))
            results["runs"].append(run)
            print(f"[bench threads] {json.dumps(run)}", file=sys.stderr, flush=True)
    return results


def main(prompts: int, load: int, timeout_s: float, policies: tuple[str, ...] = tuple(POLICIES)
         ) -> int:
    print(json.dumps(bench_threads_command(prompts, load, timeout_s, policies), indent=2))
    return 0
