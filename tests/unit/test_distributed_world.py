"""Which process of how many: the world read from torchrun's or the JAX job's variables, and
each rank's slice of the global batch."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ddm.training.distributed import SINGLE, World, jax_world, torch_world
from ddm_devcluster.processes import free_ports

ROOT = Path(__file__).resolve().parents[2]


def test_the_ranks_slices_tile_the_global_batch_in_order():
    slices = [World(rank, 4).shard(32) for rank in range(4)]
    rows = np.concatenate([np.arange(32)[part] for part in slices])
    assert rows.tolist() == list(range(32)) and {s.stop - s.start for s in slices} == {8}
    assert SINGLE.shard(7) == slice(0, 7) and SINGLE.writer and not World(1, 2).writer


def test_a_batch_the_processes_cannot_share_equally_is_refused():
    with pytest.raises(ValueError, match="batch size 10 is not a multiple of the 4 training"):
        World(0, 4).shard(10)
    with pytest.raises(ValueError, match="rank 2 is outside a world of 2"):
        World(2, 2)


def test_without_launcher_variables_a_trainer_is_one_process():
    with torch_world("cpu", environ={}) as (world, device):
        assert world == SINGLE and device.type == "cpu"
    world, mesh = jax_world("cpu", environ={})
    assert world == SINGLE and mesh.devices.size == 1


@pytest.mark.parametrize("environ,message", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "RANK, WORLD_SIZE set but LOCAL_RANK missing"),
    ({"RANK": "0", "WORLD_SIZE": "two", "LOCAL_RANK": "0"}, "WORLD_SIZE='two'.*integers"),
    ({"RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "rank 3 is outside a world of 2"),
])
def test_torchrun_variables_that_make_no_world_are_named(environ, message):
    with pytest.raises(ValueError, match=message):
        with torch_world("cpu", environ=environ):
            pass


def test_jax_variables_without_a_coordinator_are_refused():
    with pytest.raises(ValueError, match="JAX_COORDINATOR_ADDRESS missing"):
        jax_world("cpu", environ={"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"})


def test_a_jax_world_in_a_pod_does_not_ask_kubernetes_for_its_cluster() -> None:
    """Inside a pod (KUBERNETES_SERVICE_HOST set) without a ServiceAccount token, the JAX job's
    variables alone make the world: JAX's own Kubernetes detection would load the in-cluster
    config and fail. A world of one, in a process of its own (JAX joins once per process)."""
    code = ("from ddm.training.distributed import jax_world; "
            "world, _ = jax_world('cpu'); print(world.rank, world.size)")
    (port,) = free_ports(1)
    env = {**os.environ, "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "1",
           "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "1",
           "JAX_PROCESS_ID": "0", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0", "1"]
