"""Train the Flax UNet on an objective of ``ddm.objectives`` (``ddm.convention``'s by default).

The same objective (``ddm.objectives.training_example``, here on ``jax.numpy``), schedule,
clipping and EMA as the PyTorch trainer (``TrainConfig``), so an expert trained here is
interchangeable with one trained there; the result is canonical weights.

Randomness: step ``i`` uses ``key_i = fold_in(PRNGKey(seed), i)``, split into the batch key and
the ``rng`` handed to :func:`train_step`. The batch is ``batch_size`` indices drawn uniformly
*with replacement* from the key, so a run is a function of the seed and step alone, needs no
epoch bookkeeping and resumes anywhere. The initial weights are ``init_params(config, seed)``
(PyTorch's initialisation scheme, drawn by NumPy).

Data parallelism (``ddm.training.distributed``) is a mesh of one device per process, a single
device by default: the state is replicated over it and each step's global batch is sharded
along its one axis, so every device draws and computes its own rows, and the gradient of the
global mean loss is averaged by the collectives XLA inserts. One compiled function serves one
process and many.

``progress(steps_done, loss)`` follows the PyTorch trainer's contract: called every
``PROGRESS_EVERY`` steps and after the last, with the 1-based count of finished updates and the
latest loss. Only then is a loss fetched from the device; a fetch every step would stall JAX's
asynchronous dispatch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import flax.serialization
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddm.models.config import UNetConfig
from ddm.models.flax_unet import (FlaxUNet, Params, canonical_from_params, init_params,
                                  select_jax_device)
from ddm.objectives import NATIVE, Objective, training_example
from ddm.training.config import TrainConfig
from ddm.training.distributed import DATA_AXIS, data_mesh
from ddm.training.resume import Resumable

#: As ``ddm.training.torch_loop.PROGRESS_EVERY`` (not imported: this module must not need torch).
PROGRESS_EVERY = 10
#: The JAX trainer's state file (the whole ``TrainState``, Flax msgpack) in the state directory.
JAX_STATE = "state.msgpack"

class TrainState(flax.struct.PyTreeNode):
    """Everything one update reads and writes; ``step`` counts updates already applied."""

    step: jax.Array
    params: Params
    ema_params: Params
    opt_state: optax.OptState


def learning_rate_schedule(train: TrainConfig) -> optax.Schedule:
    """``TrainConfig.learning_rate_at`` as an optax schedule (``count`` is the 0-based step)."""
    warmup = max(train.warmup_steps, 1)  # unused branch when warmup_steps == 0: avoid 0/0
    span = max(1, train.steps - train.warmup_steps)

    def schedule(count: jax.Array) -> jax.Array:
        step = jnp.asarray(count, jnp.float32)
        warming = train.learning_rate * (step + 1.0) / warmup
        progress = jnp.minimum(1.0, (step - train.warmup_steps) / span)
        cosine = train.learning_rate * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        return jnp.where(step < train.warmup_steps, warming, cosine)

    return schedule


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on :func:`learning_rate_schedule`."""
    return optax.chain(
        optax.clip_by_global_norm(train.grad_clip),
        optax.adamw(learning_rate_schedule(train), weight_decay=train.weight_decay))


def objective_loss(params: Params, model: FlaxUNet, objective: Objective, x1: jax.Array,
                   y: jax.Array, rng: jax.Array) -> jax.Array:
    """MSE between the network and ``objective``'s target, ``u ~ U(0, 1)``, ``x0 ~ N(0, I)``.

    ``x1`` is ``(B, C, H, W)`` in model space; input, time and target come from
    ``ddm.objectives.training_example`` (for our objective: ``x_t``, ``t`` and ``x1 - x0``).
    """
    t_key, noise_key = jax.random.split(rng)
    u = jax.random.uniform(t_key, (x1.shape[0],), jnp.float32)
    x0 = jax.random.normal(noise_key, x1.shape, jnp.float32)
    example = training_example(objective, x0, x1, u, xp=jnp)
    pred = model.apply({"params": params}, example.expert_input, example.expert_time, y)
    return jnp.mean(jnp.square(pred - example.target))


def train_step(state: TrainState, batch: tuple[jax.Array, jax.Array], rng: jax.Array, *,
               model: FlaxUNet, optimizer: optax.GradientTransformation, train: TrainConfig,
               objective: Objective = NATIVE) -> tuple[TrainState, dict[str, jax.Array]]:
    """One pure update on ``batch = (x1 (B, C, H, W), y (B,))``: AdamW step, then the EMA
    (decay ``train.ema_decay_at(state.step)``, the warm-up the PyTorch trainer follows)."""
    x1, y = batch
    loss, grads = jax.value_and_grad(objective_loss)(state.params, model, objective, x1, y, rng)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    ema_decay = train.ema_decay_at(state.step, xp=jnp)
    ema = jax.tree.map(lambda e, p: ema_decay * e + (1.0 - ema_decay) * p,
                       state.ema_params, params)
    new_state = TrainState(step=state.step + 1, params=params, ema_params=ema,
                           opt_state=opt_state)
    return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}


def step_batch(step: jax.Array, images: jax.Array, labels: jax.Array, root_key: jax.Array,
               batch_size: int, mesh: jax.sharding.Mesh
               ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """Step ``step``'s global batch ``(x1 (B, C, H, W), y (B,))``, sharded over ``mesh``'s
    data axis, and the key of its times and noise: functions of ``(root_key, step)`` alone,
    whatever the mesh."""
    batch_key, rng = jax.random.split(jax.random.fold_in(root_key, step))
    idx = jax.random.randint(batch_key, (batch_size,), 0, images.shape[0])
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(DATA_AXIS))
    batch = (jax.lax.with_sharding_constraint(images[idx], rows),
             jax.lax.with_sharding_constraint(labels[idx], rows))
    return batch, rng


@functools.partial(jax.jit, static_argnames=("model_config", "train", "objective", "mesh"),
                   donate_argnums=0)
def _iteration(state: TrainState, images: jax.Array, labels: jax.Array, root_key: jax.Array, *,
               model_config: UNetConfig, train: TrainConfig, objective: Objective,
               mesh: jax.sharding.Mesh) -> tuple[TrainState, dict[str, jax.Array]]:
    """The one compiled function: draw step ``state.step``'s batch from its key, then update.

    Compiled once per ``(model_config, train, objective, mesh)``; callers pass ``train`` with
    seed 0 so that experts differing only in seed share the compilation.
    """
    batch, rng = step_batch(state.step, images, labels, root_key, train.batch_size, mesh)
    return train_step(state, batch, rng, model=FlaxUNet(model_config),
                      optimizer=make_optimizer(train), train=train,
                      objective=objective)


def train_flax_unet(model_config: UNetConfig, train: TrainConfig, images: np.ndarray,
                    labels: np.ndarray, progress: Callable[[int, float], None] | None = None,
                    *, mesh: jax.sharding.Mesh | None = None, objective: Objective = NATIVE,
                    resumable: Resumable | None = None) -> dict[str, np.ndarray]:
    """Train for ``train.steps`` updates; return the EMA parameters as canonical weights.

    ``resumable`` saves the ``TrainState`` as it goes and continues a saved one (the step is
    in the state; every key derives from it).

    ``images`` are ``(N, C, H, W)`` float32 in model space ``[-1, 1]``, ``labels`` ``(N,)`` ints
    in ``[0, num_classes)``, the same in every process; ``mesh`` (see
    :func:`ddm.training.distributed.jax_world`) defaults to JAX's default device alone.
    """
    _check_data(model_config, images, labels)
    mesh = data_mesh([select_jax_device(None)]) if mesh is None else mesh
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    # Always an explicit device: the default device is part of jit's cache key, so None here
    # and the same device named would otherwise compile the step twice.
    with jax.default_device(mesh.local_devices[0]):
        params = init_params(model_config, train.seed)
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                           ema_params=jax.tree.map(jnp.copy, params),
                           opt_state=make_optimizer(train).init(params))
        saved = resumable.saved(JAX_STATE) if resumable is not None else None
        if saved is not None:
            state = flax.serialization.from_bytes(state, saved.read_bytes())
        # every process holds the same values: each places its copy on its mesh devices
        state, root_key, data = jax.device_put(
            (state, jax.random.PRNGKey(train.seed),
             (np.asarray(images, np.float32), np.asarray(labels, np.int32))), replicated)
        compiled_train = dataclasses.replace(train, seed=0)
        for step in range(int(state.step), train.steps):
            state, metrics = _iteration(state, *data, root_key, model_config=model_config,
                                        train=compiled_train, objective=objective, mesh=mesh)
            done = step + 1
            if resumable is not None and resumable.due(done, train.steps):
                content = flax.serialization.to_bytes(state)
                resumable.save(JAX_STATE, done, lambda path: path.write_bytes(content))
            if progress is not None and (done % PROGRESS_EVERY == 0 or done == train.steps):
                progress(done, float(metrics["loss"]))
    return canonical_from_params(state.ema_params, model_config)


def _check_data(config: UNetConfig, images: np.ndarray, labels: np.ndarray) -> None:
    expected = (config.in_channels, config.image_size, config.image_size)
    if images.ndim != 4 or images.shape[1:] != expected or images.shape[0] == 0:
        raise ValueError(f"images must have shape (N, {', '.join(map(str, expected))}) with "
                         f"N >= 1 for this UNet config, got {images.shape}")
    if labels.shape != (images.shape[0],) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be {images.shape[0]} integers (one per image), got "
                         f"shape {labels.shape} of {labels.dtype}")
    if labels.min() < 0 or labels.max() >= config.num_classes:
        raise ValueError(f"labels must lie in [0, {config.num_classes}), got "
                         f"[{labels.min()}, {labels.max()}]")
