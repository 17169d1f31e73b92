"""Data-parallel training with two processes: started by torchrun (``python -m
torch.distributed.run``, so these sources are the ones run) or with the JAX job's variables,
on the CPU's gloo collectives over loopback.

A two-process step's gradient is the one-process gradient of the same global batch; the two
processes write one checkpoint that records ``training.world_size: 2`` and passes ``ddm expert
check``; a run resumes with another number of processes; one process stays bit-identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ddm.checkpoints.format import load_checkpoint, read_meta
from ddm.cli import EXIT_INTERRUPTED, main
from ddm.runtime.local import free_port
from tests.support import distributed_gradients
from tests.support.bars_mnist import write_bars_mnist

ROOT = Path(__file__).resolve().parents[2]
GRADIENTS = ROOT / "tests" / "support" / "distributed_gradients.py"
#: A generous bound on one multi-process command on a loaded two-core machine (JAX compiles).
DEADLINE_S = 600


def expert(framework: str, steps: int = 150, batch: int = 32) -> list[str]:
    """``ddm train expert``'s arguments; the defaults are enough for the smoke UNet to pass
    ``ddm expert check``'s behaviour check (0.34 where 0.5 is the bar, on one process)."""
    return ["train", "expert", "--framework", framework, "--config", "smoke", "--partition",
            "labels:0-4,5-9", "--index", "0", "--steps", str(steps), "--batch-size", str(batch),
            "--seed", "3", "--quiet"]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def _env() -> dict[str, str]:
    """The inherited environment (PYTHONPATH included), gloo held to the loopback interface."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def torchrun(*argv: str, processes: int = 2) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node PROCESSES ARGV`` on loopback."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr",
         "127.0.0.1", "--nproc-per-node", str(processes), *argv],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=DEADLINE_S)


def jax_processes(*argv: str, processes: int = 2) -> list[tuple[int, str]]:
    """``ARGV`` started ``processes`` times with ``JAX_COORDINATOR_ADDRESS``,
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` (as Kubeflow Trainer sets them): each
    process's exit status and output, in rank order."""
    address = f"127.0.0.1:{free_port()}"
    started = [subprocess.Popen(
        [sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env={**_env(), "JAX_COORDINATOR_ADDRESS": address,
                        "JAX_COORDINATOR_BIND_ADDRESS": address,
                        "JAX_NUM_PROCESSES": str(processes), "JAX_PROCESS_ID": str(rank)})
        for rank in range(processes)]
    try:
        outputs = [p.communicate(timeout=DEADLINE_S)[0] for p in started]
        return [(p.returncode, text) for p, text in zip(started, outputs)]
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()


def _assert_equal_gradients(out: Path, single: dict[str, np.ndarray]) -> None:
    for rank in (0, 1):
        with np.load(out / f"rank{rank}.npz") as shard:
            assert set(shard.files) == set(single)
            for name, gradient in single.items():
                np.testing.assert_allclose(shard[name], gradient, rtol=1e-5, atol=1e-7,
                                           err_msg=f"rank {rank}, {name}")


def test_a_torch_step_on_two_processes_has_the_one_process_gradient(tmp_path):
    done = torchrun(str(GRADIENTS), "torch", str(tmp_path))
    assert done.returncode == 0, done.stderr[-4000:]
    world, single = distributed_gradients.torch_gradients()
    assert world.size == 1 and any(np.any(g != 0) for g in single.values())
    _assert_equal_gradients(tmp_path, single)


def test_a_jax_step_on_two_processes_has_the_one_process_gradient(tmp_path):
    finished = jax_processes(str(GRADIENTS), "jax", str(tmp_path))
    assert [status for status, _ in finished] == [0, 0], finished[0][1][-4000:]
    world, single = distributed_gradients.jax_gradients()
    assert world.size == 1 and any(np.any(g != 0) for g in single.values())
    _assert_equal_gradients(tmp_path, single)


def _check_two_process_expert(out: Path, outputs: list[str], capsys) -> None:
    """One checkpoint, written and announced by rank 0 alone, that records the two processes
    and passes every check of ``ddm expert check``."""
    assert sum(text.count(f"wrote {out}") for text in outputs) == 1
    recorded = json.loads((out / "config.json").read_text())["training"]
    assert recorded["world_size"] == 2 and recorded["batch_size"] == 32
    capsys.readouterr()
    assert main(["expert", "check", str(out)]) == 0, capsys.readouterr().out


def test_torchrun_trains_an_expert_on_two_processes_into_one_checked_checkpoint(tmp_path,
                                                                                capsys):
    out = tmp_path / "expert"
    done = torchrun("-m", "ddm", *expert("torch"), "--out", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    _check_two_process_expert(out, [done.stdout], capsys)


def test_jax_processes_train_an_expert_into_one_checked_checkpoint(tmp_path, capsys):
    out = tmp_path / "expert"
    finished = jax_processes("-m", "ddm", *expert("jax"), "--out", str(out))
    assert [status for status, _ in finished] == [0, 0], finished[0][1][-4000:]
    _check_two_process_expert(out, [text for _, text in finished], capsys)


def _interrupt_at(step: int, monkeypatch) -> None:
    """Interrupt from inside the trainer's progress callback once it reports ``step``."""
    import ddm.training.cli

    def progress(args, total, what):
        def update(done, loss):
            if done >= step:
                raise KeyboardInterrupt
        return update

    monkeypatch.setattr(ddm.training.cli, "_progress", progress)


def test_a_run_saved_by_one_process_resumes_on_two(tmp_path, monkeypatch):
    """Progress is the step count on the global batch: a state saved at step 10 by one process
    is continued by two, which end where one uninterrupted process ends (within float
    rounding: two half-batch means summed, not one mean), and the checkpoint says two."""
    argv = [*expert("torch", steps=20), "--save-every", "10"]
    assert main([*argv, "--out", str(tmp_path / "whole")]) == 0
    with monkeypatch.context() as patch:
        _interrupt_at(15, patch)
        assert main([*argv, "--out", str(tmp_path / "cut")]) == EXIT_INTERRUPTED
    done = torchrun("-m", "ddm", *argv, "--out", str(tmp_path / "cut"), "--resume")
    assert done.returncode == 0, done.stderr[-4000:]
    assert read_meta(tmp_path / "cut").training["world_size"] == 2
    whole = load_checkpoint(tmp_path / "whole").weights
    resumed = load_checkpoint(tmp_path / "cut").weights
    for name, weight in whole.items():
        np.testing.assert_allclose(resumed[name], weight, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_one_process_under_torchrun_or_jax_variables_trains_as_one_process_alone(
        tmp_path, framework):
    """A world of one (torchrun with one process, or the JAX variables naming one) is the
    plain single process, bit for bit."""
    argv = expert(framework, steps=6, batch=8)
    assert main([*argv, "--out", str(tmp_path / "alone")]) == 0
    if framework == "torch":
        done = torchrun("-m", "ddm", *argv, "--out", str(tmp_path / "world"), processes=1)
        assert done.returncode == 0, done.stderr[-4000:]
    else:
        finished = jax_processes("-m", "ddm", *argv, "--out", str(tmp_path / "world"),
                                 processes=1)
        assert finished[0][0] == 0, finished[0][1][-4000:]
    alone = load_checkpoint(tmp_path / "alone")
    world = load_checkpoint(tmp_path / "world")
    assert world.meta.training["world_size"] == alone.meta.training["world_size"] == 1
    assert all(np.array_equal(world.weights[k], v) for k, v in alone.weights.items())


def test_torchrun_trains_a_text2img_expert_on_two_processes(tmp_path):
    """The text-to-image stages before the experts run alone (tiny, one step each); an expert
    then trains on two processes, and only rank 0 writes it and the model index."""
    from ddm.training.text2img.layout import DDM_CONFIG_KEY

    write_bars_mnist(tmp_path / "mnist", per_class=4)
    common = ["--mnist", str(tmp_path / "mnist"), "--root", str(tmp_path / "ddm"), "--size",
              "smoke", "--batch-size", "4", "--quiet"]
    for stage in ("tokenizer", "clip", "vae", "partition", "latents"):
        assert main(["train", "text2img", stage, *common, "--steps", "1"]) == 0
    done = torchrun("-m", "ddm", "train", "text2img", "expert", "--index", "0", *common,
                    "--steps", "3")
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("wrote ") == 1
    declared = json.loads((tmp_path / "ddm" / "expert_0" / "config.json").read_text())
    assert declared[DDM_CONFIG_KEY]["world_size"] == 2
    assert "expert_0" in json.loads((tmp_path / "ddm" / "model_index.json").read_text())
