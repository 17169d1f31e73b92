"""Data-parallel training: which process of how many this one is, read from its launcher.

We write no launcher and no rendezvous. PyTorch's trainers are started by ``torchrun`` (or by
Kubeflow Trainer's ``torch-distributed`` runtime, which runs torchrun with its ``PET_*``
variables), which sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT``; :func:`torch_world` joins that process group (gloo on CPU, NCCL on CUDA).
The JAX trainer joins ``jax.distributed`` when ``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` are set (Kubeflow Trainer's ``jax-distributed``
runtime sets them), see :func:`jax_world`. Without these variables a trainer is one process, the
default, and runs exactly as it always has: the same code with a world of one.

Every process draws the same global batch from ``(seed, step)`` and keeps its own contiguous
slice (:meth:`World.shard`); gradients are averaged over the world, so an update is that of one
process on the global batch. Only the writer (rank 0) saves checkpoints and training states and
reports progress.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Mapping

if TYPE_CHECKING:
    import jax
    import torch

#: The variables torchrun sets for each process it starts (``MASTER_*`` are read by
#: ``torch.distributed`` itself).
TORCH_RANK, TORCH_WORLD_SIZE, TORCH_LOCAL_RANK = "RANK", "WORLD_SIZE", "LOCAL_RANK"
#: The variables of a JAX job (Kubeflow Trainer's ``jax-distributed`` runtime); JAX reads the
#: coordinator's address itself, the other two we hand to ``jax.distributed.initialize``.
JAX_COORDINATOR, JAX_NUM_PROCESSES, JAX_PROCESS_ID = (
    "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
#: The one mesh axis: the global batch is split along it.
DATA_AXIS = "data"


@dataclass(frozen=True)
class World:
    """This process's ``rank`` among ``size`` data-parallel processes."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.size} process(es)")

    @property
    def writer(self) -> bool:
        """Whether this process writes checkpoints, training states and progress (rank 0)."""
        return self.rank == 0

    def shard(self, batch_size: int) -> slice:
        """This rank's rows of a global batch of ``batch_size`` rows: a contiguous, equal part,
        so that averaging the ranks' mean losses gives the global batch's mean loss."""
        if batch_size % self.size:
            raise ValueError(f"the batch size {batch_size} is not a multiple of the "
                             f"{self.size} training processes: each takes an equal part of "
                             "the global batch")
        part = batch_size // self.size
        return slice(self.rank * part, (self.rank + 1) * part)


#: One process: the default.
SINGLE = World()


def _integers(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[int, ...] | None:
    """The variables ``names`` as integers; None when none is set, an error when only some are."""
    present = [n for n in names if n in environ]
    if not present:
        return None
    if len(present) != len(names):
        missing = ", ".join(n for n in names if n not in environ)
        raise ValueError(f"{', '.join(present)} set but {missing} missing: a distributed run "
                         "needs all of them (start it with torchrun, or set the JAX variables)")
    try:
        return tuple(int(environ[n]) for n in names)
    except ValueError:
        shown = ", ".join(f"{n}={environ[n]!r}" for n in names)
        raise ValueError(f"{shown}: these must be integers") from None


@contextlib.contextmanager
def torch_world(device: str | None, environ: Mapping[str, str] = os.environ
                ) -> Iterator[tuple[World, torch.device]]:
    """This process's world and device, from torchrun's variables; joins (then leaves) the
    process group when there are several processes.

    ``device`` is as :func:`ddm.models.torch_io.select_torch_device` takes it; with several
    processes on CUDA each uses ``cuda:LOCAL_RANK``, so ``device`` names no index then.
    """
    import torch
    import torch.distributed as dist

    from ddm.models.torch_io import select_torch_device

    found = _integers(environ, (TORCH_RANK, TORCH_WORLD_SIZE, TORCH_LOCAL_RANK))
    world = SINGLE if found is None else World(rank=found[0], size=found[1])
    resolved = select_torch_device(device)
    if world.size == 1:
        yield world, resolved
        return
    if resolved.type == "cuda":
        if resolved.index is not None:
            raise ValueError(f"--device {device}: with {world.size} processes each takes the "
                             "GPU of its LOCAL_RANK; pass --device cuda")
        resolved = torch.device("cuda", found[2])
        torch.cuda.set_device(resolved)
        backend = "nccl"
    elif resolved.type == "cpu":
        backend = "gloo"
    else:
        raise ValueError(f"data-parallel training on {resolved.type} devices is not supported "
                         "here; use cpu or cuda")
    dist.init_process_group(backend, rank=world.rank, world_size=world.size)
    try:
        yield world, resolved
    finally:
        dist.destroy_process_group()


def jax_world(device: str | None, environ: Mapping[str, str] = os.environ
              ) -> tuple[World, jax.sharding.Mesh]:
    """This process's world and the data-parallel mesh: one device per process, each the
    ``device`` (as :func:`ddm.models.flax_unet.select_jax_device` takes it) among its own.

    Joins ``jax.distributed`` first when the JAX job's variables are set (on CPU its
    collectives are gloo, this JAX's default); JAX allows that once per process.
    """
    import jax

    from ddm.models.flax_unet import select_jax_device

    found = _integers(environ, (JAX_NUM_PROCESSES, JAX_PROCESS_ID))
    if found is not None and not jax.distributed.is_initialized():
        if JAX_COORDINATOR not in environ:
            raise ValueError(f"{JAX_NUM_PROCESSES} and {JAX_PROCESS_ID} set but "
                             f"{JAX_COORDINATOR} missing: the processes need a coordinator")
        # Every parameter is given, so JAX's cluster detection is off: inside a pod it would
        # take the Kubernetes environment for one to query (with the API client installed it
        # loads the in-cluster config, which a pod without a ServiceAccount token lacks).
        jax.distributed.initialize(coordinator_address=environ[JAX_COORDINATOR],
                                   num_processes=found[0], process_id=found[1],
                                   cluster_detection_method="deactivate")
    world = World(rank=jax.process_index(), size=jax.process_count())
    if world.size == 1:
        return world, data_mesh([select_jax_device(device)])
    platform, _, index = (device or jax.default_backend()).partition(":")
    select_jax_device(platform)  # the same checks and messages as one process
    devices = [jax.local_devices(process_index=p, backend=platform)[int(index or 0)]
               for p in range(world.size)]
    return world, data_mesh(devices)


def data_mesh(devices: list[jax.Device]) -> jax.sharding.Mesh:
    """A one-axis mesh (:data:`DATA_AXIS`) over ``devices``, the global batch split along it."""
    import jax
    import numpy as np

    return jax.sharding.Mesh(np.array(devices), (DATA_AXIS,))
