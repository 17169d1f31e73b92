"""In-process commands pick their CPU threads: the cores they may use, less the machine's other
work, at least one; the user's setting wins; a bad setting is named."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddm.threads import THREADS_ENV, apply_cpu_thread_policy, cpu_threads, usable_cpus


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
