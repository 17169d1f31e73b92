"""The Flax UNet against the PyTorch one, its canonical conversion, and the JAX trainer."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

from ddm.checkpoints.format import CheckpointError
from ddm.models.config import UNET_CONFIGS, UNetConfig
from ddm.models.flax_unet import (canonical_from_params, canonical_shapes, init_params,
                                  make_velocity_fn, params_from_canonical, select_jax_device)
from ddm.training.config import TrainConfig
from ddm.training.distributed import data_mesh
from ddm.training.jax_expert import learning_rate_schedule, train_flax_unet

PARITY_TOL = 1e-4


def _inputs(config: UNetConfig, batch: int, seed: int) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, config.in_channels, config.image_size, config.image_size))
    t = rng.uniform(size=batch)
    y = rng.integers(0, config.num_classes, batch)
    return x.astype(np.float32), t.astype(np.float32), y


def _random_canonical(config: UNetConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32)
            for k, s in canonical_shapes(config).items()}


@pytest.mark.parametrize("name", ["smoke", "digits-small", "mnist-small"])
def test_velocity_matches_pytorch(name: str) -> None:
    torch = pytest.importorskip("torch")
    from ddm.models.torch_unet import UNet

    config = UNET_CONFIGS[name]
    torch.manual_seed(0)
    model = UNet(config).eval()
    # params_from_canonical checks every state_dict name and shape against the Flax model.
    weights = {k: v.numpy() for k, v in model.state_dict().items()}
    x, t, y = _inputs(config, batch=4, seed=1)
    with torch.no_grad():
        expected = model(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(y)).numpy()

    actual = make_velocity_fn(params_from_canonical(weights, config), config)(x, t, y)

    assert actual.shape == expected.shape and actual.dtype == np.float32
    diff = float(np.max(np.abs(actual - expected)))
    print(f"{name}: max |v_flax - v_torch| = {diff:.2e}")
    assert diff <= PARITY_TOL


def test_canonical_round_trip_is_bit_exact() -> None:
    config = UNET_CONFIGS["smoke"]
    weights = _random_canonical(config, seed=0)

    back = canonical_from_params(params_from_canonical(weights, config), config)

    assert back.keys() == weights.keys()
    for name, array in weights.items():
        assert back[name].dtype == np.float32
        np.testing.assert_array_equal(back[name], array, err_msg=name)


def test_flax_round_trip_is_bit_exact() -> None:
    config = UNET_CONFIGS["smoke"]
    params = init_params(config, seed=0)

    back = params_from_canonical(canonical_from_params(params, config), config)

    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name,corrupt,message", [
    ("mid.conv1.weight", lambda w: np.zeros((1, 2, 3, 3), np.float32),
     "mid.conv1.weight has shape (1, 2, 3, 3)"),
    ("conv_out.bias", None, "missing conv_out.bias"),
])
def test_mismatched_weights_name_the_tensor(name, corrupt, message) -> None:
    config = UNET_CONFIGS["smoke"]
    weights = _random_canonical(config, seed=0)
    if corrupt is None:
        del weights[name]
    else:
        weights[name] = corrupt(weights[name])

    with pytest.raises(CheckpointError, match=re.escape(message)):
        params_from_canonical(weights, config, source="ckpt/expert-0")


def test_learning_rate_schedule_matches_train_config() -> None:
    for train in (TrainConfig(steps=50, warmup_steps=10), TrainConfig(steps=20, warmup_steps=0)):
        steps = np.arange(train.steps + 5)
        rates = np.asarray(learning_rate_schedule(train)(steps))
        expected = np.array([train.learning_rate_at(int(s)) for s in steps])
        np.testing.assert_allclose(rates, expected, rtol=1e-6, atol=1e-9)


def test_train_flax_unet_is_finite_and_deterministic() -> None:
    config = UNET_CONFIGS["smoke"]
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (32, 1, config.image_size, config.image_size)).astype(np.float32)
    labels = rng.integers(0, config.num_classes, 32)
    train = TrainConfig(steps=12, batch_size=8, warmup_steps=2, seed=3)
    seen: list[tuple[int, float]] = []

    first = train_flax_unet(config, train, images, labels, lambda s, loss: seen.append((s, loss)),
                            mesh=data_mesh([select_jax_device("cpu")]))
    second = train_flax_unet(config, train, images, labels)
    other_seed = train_flax_unet(config, dataclasses.replace(train, seed=4), images, labels)

    assert [s for s, _ in seen] == [10, 12]  # every PROGRESS_EVERY steps and after the last
    assert all(np.isfinite(loss) for _, loss in seen)
    assert first.keys() == canonical_shapes(config).keys()
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)
    assert any(not np.array_equal(first[k], other_seed[k]) for k in first)


def test_train_flax_unet_rejects_bad_labels() -> None:
    config = UNET_CONFIGS["smoke"]
    images = np.zeros((4, 1, config.image_size, config.image_size), np.float32)
    with pytest.raises(ValueError, match="labels must lie in"):
        train_flax_unet(config, TrainConfig(steps=1, batch_size=2), images, np.array([0, 1, 2, 10]))


def test_select_jax_device() -> None:
    assert select_jax_device("cpu").platform == "cpu"
    assert select_jax_device(None) is not None
    with pytest.raises(ValueError, match="'tpu' is not available"):
        select_jax_device("tpu")
    with pytest.raises(ValueError, match="unknown JAX device 'cuda'"):
        select_jax_device("cuda")
    with pytest.raises(ValueError, match="cpu has 1 device"):
        select_jax_device("cpu:7")


def test_velocity_pads_odd_batches_without_changing_results() -> None:
    config = UNET_CONFIGS["smoke"]
    velocity = make_velocity_fn(init_params(config, seed=0), config)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 1, 8, 8), dtype=np.float32)
    t, y = rng.random(5, dtype=np.float32), np.arange(5)
    whole = velocity(x, t, y)
    assert whole.shape == (5, 1, 8, 8)
    np.testing.assert_allclose(velocity(x[:3], t[:3], y[:3]), whole[:3], atol=1e-6)


def test_mnist_small_stays_a_few_megabytes() -> None:
    """The shipped MNIST experts: a few MB of float32 each (``reference`` is 26 MB)."""
    sizes = {name: 4 * sum(int(np.prod(s)) for s in canonical_shapes(UNET_CONFIGS[name]).values())
             for name in ("mnist-small", "reference")}
    assert sizes["mnist-small"] < 4e6 and sizes["mnist-small"] * 8 < sizes["reference"]
    assert UNET_CONFIGS["mnist-small"].image_size == 32
