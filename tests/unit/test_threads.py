"""In-process commands pick their CPU threads: the cores they may use, less the machine's other
work, at least one; the user's setting wins; a bad setting is named. A model server shares its
threads among its members' forwards."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from ddm.runtime.local import pool_threads
from ddm.threads import (ARENAS_ENV, THREADS_ENV, CpuShare, apply_cpu_thread_policy,
                         cap_malloc_arenas, cpu_threads, server_cpu_budget, usable_cpus)


@pytest.mark.parametrize(("affinity", "cpu_max", "expected"), [
    (8, "max 100000", 8),            # no quota
    (8, "200000 100000", 2),         # two CPUs' worth of quota
    (8, "150000 100000", 2),         # a partial CPU rounds up
    (2, "800000 100000", 2),         # the affinity is the tighter bound
    (4, "garbage", 4),
])
def test_usable_cpus_is_the_affinity_capped_by_the_cgroup_quota(affinity, cpu_max, expected):
    assert usable_cpus(affinity, cpu_max) == expected


@pytest.mark.parametrize(("usable", "load", "expected"), [
    (2, 0.0, 2), (2, 0.4, 2), (2, 1.0, 1), (2, 7.5, 1), (16, 3.2, 13), (1, 0.0, 1),
])
def test_the_policy_leaves_the_cores_other_work_keeps_busy(usable, load, expected):
    assert cpu_threads({}, usable, load) == expected


def test_the_users_setting_wins():
    assert cpu_threads({THREADS_ENV: "3"}, usable=16, load=15.0) == 3
    assert cpu_threads({THREADS_ENV: "framework"}, usable=2, load=9.0) is None
    assert cpu_threads({"OMP_NUM_THREADS": "4"}, usable=2, load=9.0) is None


@pytest.mark.parametrize("raw", ["0", "-1", "two", "1.5"])
def test_a_bad_setting_is_named(raw):
    with pytest.raises(ValueError, match=f"{THREADS_ENV}='{raw}'"):
        cpu_threads({THREADS_ENV: raw}, usable=2, load=0.0)


def test_applying_sets_the_frameworks_variables_and_torchs_pool():
    env: dict[str, str] = {THREADS_ENV: "1"}
    set_to: list[int] = []
    assert apply_cpu_thread_policy(env, set_to.append) == 1
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "--xla_cpu_multi_thread_eigen=false" in env["XLA_FLAGS"]
    assert set_to == [1]


def test_applying_leaves_the_frameworks_alone_when_told():
    env = {THREADS_ENV: "framework"}
    assert apply_cpu_thread_policy(env, lambda n: pytest.fail("torch's pool was set")) is None
    assert env == {THREADS_ENV: "framework"}


@pytest.mark.parametrize("command", [["sample", "--labels", "1", "--out", "s.npz"],
                                     ["eval", "samples.npz"]])
def test_in_process_commands_apply_the_policy_before_they_compute(command, tmp_path):
    """A bad DDM_CPU_THREADS stops the command with its name: the policy ran first."""
    (tmp_path / "samples.npz").write_bytes(b"")  # an input that exists, as parsing checks
    result = subprocess.run([sys.executable, "-m", "ddm", *command], cwd=tmp_path,
                            env={"PATH": "/usr/bin:/bin", THREADS_ENV: "lots"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"{THREADS_ENV}='lots'" in result.stderr


# -- several experts of one step at once (inter-op) -------------------------------------------

def test_expert_workers_share_the_intra_op_budget():
    from ddm.threads import EXPERT_WORKERS_ENV, expert_parallelism

    assert expert_parallelism({"OMP_NUM_THREADS": "4"}) == (1, 4)  # off by default
    assert expert_parallelism({EXPERT_WORKERS_ENV: "2", "OMP_NUM_THREADS": "4"}) == (2, 2)
    assert expert_parallelism({EXPERT_WORKERS_ENV: "3", "OMP_NUM_THREADS": "4"}) == (3, 1)
    assert expert_parallelism({EXPERT_WORKERS_ENV: "4", "OMP_NUM_THREADS": "2"}) == (2, 1)
    with pytest.raises(ValueError, match=f"{EXPERT_WORKERS_ENV}='0'"):
        expert_parallelism({EXPERT_WORKERS_ENV: "0"})


def _sample_both_ways(monkeypatch, generate):
    """``generate()`` one after the other and with two expert workers (two threads in all,
    one intra-op thread each); the images, and the threads that ran the expert calls."""
    import threading

    import torch

    from ddm.sampling import pipeline
    from ddm.threads import EXPERT_WORKERS_ENV

    ran_in: list[str] = []
    call = pipeline._Stages._call

    def recorded(self, query):
        ran_in.append(threading.current_thread().name)
        return call(self, query)

    monkeypatch.setattr(pipeline._Stages, "_call", recorded)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(1)
    monkeypatch.setenv(EXPERT_WORKERS_ENV, "1")
    alone = generate()
    one_after_the_other, ran_in[:] = set(ran_in), []
    monkeypatch.setenv(EXPERT_WORKERS_ENV, "2")
    together = generate()
    return alone, together, one_after_the_other, set(ran_in)


def test_experts_run_at_once_give_the_same_pixels(monkeypatch):
    from ddm.checkpoints.discovery import shipped_checkpoints
    from ddm.models.ddm import load_ddm
    from ddm.sampling.pipeline import generate

    ddm = load_ddm(shipped_checkpoints("digits"))
    alone, together, before, after = _sample_both_ways(
        monkeypatch, lambda: generate(ddm, list(range(10)) * 2, 6, 0, "top2", "euler").images)
    assert before == {"MainThread"} and {n.split("_")[0] for n in after} == {"ddm-expert"}
    assert np.array_equal(alone, together)


def test_text_experts_run_at_once_give_the_same_pixels(monkeypatch):
    from ddm.checkpoints.discovery import shipped_checkpoints
    from ddm.models.ddm import load_ddm
    from ddm.sampling.pipeline import generate_text

    ddm = load_ddm(shipped_checkpoints("text2img"), backends=("torch",))
    prompts = ["a thick red seven", "a thin blue three", "a green five", "an orange eight"]
    alone, together, before, after = _sample_both_ways(
        monkeypatch, lambda: generate_text(ddm, prompts, steps=4, seed=0,
                                           strategy="top2").images)
    assert before == {"MainThread"} and {n.split("_")[0] for n in after} == {"ddm-expert"}
    assert np.array_equal(alone, together)


_ARENAS_CHILD = "from ddm.threads import cap_malloc_arenas; print(cap_malloc_arenas())"


def test_a_server_caps_its_malloc_arenas_unless_the_environment_sets_them() -> None:
    """glibc takes the cap (mallopt answers 1); a MALLOC_ARENA_MAX of the user's is kept."""
    env = {k: v for k, v in os.environ.items() if k != ARENAS_ENV}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    capped = subprocess.run([sys.executable, "-c", _ARENAS_CHILD], env=env, capture_output=True,
                            text=True, timeout=60, check=True)
    assert capped.stdout.strip() == "True"
    kept = subprocess.run([sys.executable, "-c", _ARENAS_CHILD], env={**env, ARENAS_ENV: "4"},
                          capture_output=True, text=True, timeout=60, check=True)
    assert kept.stdout.strip() == "False"
    with pytest.raises(ValueError, match="arenas must be >= 1"):
        cap_malloc_arenas(0)


# -- a model server's share of its threads among its members' forwards ------------------------

def test_a_server_takes_the_users_thread_count_else_the_cpus_it_may_use():
    assert server_cpu_budget({"OMP_NUM_THREADS": "3"}) == 3
    assert server_cpu_budget({}) == server_cpu_budget({"OMP_NUM_THREADS": "0"}) == usable_cpus()


def test_a_forward_takes_the_budget_split_among_the_busy_members():
    share = CpuShare(4, set_threads=lambda threads: None)
    assert share.threads() == 4      # nothing busy: a forward about to run is alone
    share.busy(True)
    assert share.threads() == 4      # the one busy member is the forward's own
    share.busy(True)
    assert share.threads() == 2
    share.busy(True)
    assert share.threads() == 1      # 4 // 3, whole threads
    for _ in range(5):
        share.busy(True)
    assert share.threads() == 1      # at least one, however many are busy
    with pytest.raises(ValueError, match="at least one thread"):
        CpuShare(0)


def test_a_thread_s_count_is_set_only_when_its_share_changes():
    set_to: list[tuple[str, int]] = []
    share = CpuShare(2, set_threads=lambda n: set_to.append((threading.current_thread().name,
                                                             n)))
    share.claim()
    share.claim()
    share.busy(True)
    share.busy(True)
    share.claim()
    worker = threading.Thread(target=share.claim, name="other")
    worker.start()
    worker.join()
    main = threading.current_thread().name
    assert set_to == [(main, 2), (main, 1), ("other", 1)]


def test_pytorch_s_count_is_the_claiming_thread_s_own():
    import torch

    before = torch.get_num_threads()
    seen: list[int] = []
    share = CpuShare(3)  # neither this thread's count below nor PyTorch's default here

    def forward() -> None:
        share.claim()
        seen.append(torch.get_num_threads())

    try:
        torch.set_num_threads(1)
        worker = threading.Thread(target=forward)
        worker.start()
        worker.join()
        assert seen == [3] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_pool_process_gets_each_member_s_threads_up_to_the_machine_s_cpus():
    assert pool_threads(1, members=7, cpus=2) == 2
    assert pool_threads(1, members=3, cpus=16) == 3
    assert pool_threads(2, members=3, cpus=16) == 6
    assert pool_threads(1, members=1, cpus=16) == 1


def test_a_server_s_share_is_its_budget_and_its_process_default():
    import torch

    before = torch.get_num_threads()
    try:
        env: dict[str, str] = {"OMP_NUM_THREADS": "3"}
        share = CpuShare.for_server(env)
        assert share.budget == 3 and torch.get_num_threads() == 3
        assert env == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"}
        env = {}
        assert CpuShare.for_server(env).budget == usable_cpus()
        assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == str(usable_cpus())
    finally:
        torch.set_num_threads(before)
