"""One training step's gradient, made by the trainers' own pieces, in one process or as one of
several: ``python -m torch.distributed.run --nproc-per-node 2 THIS torch OUT``, or ``THIS jax
OUT`` with the JAX job's variables set. Each rank writes its gradient to ``OUT/rank<R>.npz``.

The data, model and step are fixed here, so a test computes the one-process gradient in its
own process with the same functions and compares.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ddm.models.config import UNET_CONFIGS
from ddm.objectives import NATIVE
from ddm.training.config import TrainConfig
from ddm.training.distributed import World

#: A global batch of 8 rows (4 per rank with two processes), at a step past the first.
TRAIN = TrainConfig(steps=10, batch_size=8, seed=3)
STEP = 5
CONFIG = UNET_CONFIGS["smoke"]


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.uniform(-1, 1, (32, CONFIG.in_channels, CONFIG.image_size, CONFIG.image_size)
                        ).astype(np.float32), rng.integers(0, CONFIG.num_classes, 32))


def torch_gradients() -> tuple[World, dict[str, np.ndarray]]:
    """This process's world and its gradient of step ``STEP``'s loss, per parameter name."""
    import torch

    from ddm.models.torch_unet import UNet
    from ddm.training.distributed import torch_world
    from ddm.training.torch_expert import unet_loss
    from ddm.training.torch_loop import prepare, unwrapped

    images, labels = _data()
    with torch_world("cpu") as (world, device):
        torch.manual_seed(TRAIN.seed)
        model, _, device = prepare(UNet(CONFIG), TRAIN, device, world)
        unet_loss(model, images, labels.astype(np.int64), TRAIN, NATIVE, STEP, device,
                  world).backward()
        return world, {name: p.grad.numpy().copy()
                       for name, p in unwrapped(model).named_parameters()}


def jax_gradients() -> tuple[World, dict[str, np.ndarray]]:
    """As :func:`torch_gradients`, for the Flax UNet on the data-parallel mesh."""
    import jax
    import jax.numpy as jnp

    from ddm.models.flax_unet import FlaxUNet, init_params
    from ddm.training.distributed import jax_world
    from ddm.training.jax_expert import objective_loss, step_batch

    world, mesh = jax_world("cpu")
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    images, labels = _data()
    params, images, labels, key = jax.device_put(
        (init_params(CONFIG, TRAIN.seed), images, labels.astype(np.int32),
         jax.random.PRNGKey(TRAIN.seed)), replicated)

    def gradient(params, images, labels, key):
        batch, rng = step_batch(jnp.int32(STEP), images, labels, key, TRAIN.batch_size, mesh)
        return jax.grad(objective_loss)(params, FlaxUNet(CONFIG), NATIVE, *batch, rng)

    grads = jax.jit(gradient, out_shardings=replicated)(params, images, labels, key)
    leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
    return world, {jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(leaf)
                   for path, leaf in leaves}


if __name__ == "__main__":
    framework, out = sys.argv[1], Path(sys.argv[2])
    world, gradients = {"torch": torch_gradients, "jax": jax_gradients}[framework]()
    np.savez(out / f"rank{world.rank}.npz", **gradients)
