"""The weight average warms up: the random initial weights never dominate it (issue 15)."""

import math

import numpy as np
import pytest
import torch

from ddm.models.config import UNET_CONFIGS
from ddm.models.torch_unet import UNet
from ddm.training.config import TrainConfig
from ddm.training.torch_loop import EMA


def _initial_share(train: TrainConfig, steps: int) -> float:
    """What is left of the initial weights in the average after ``steps`` updates, measured on
    the real EMA: a layer starts at 1 and every update moves it to 0."""
    layer = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in layer.parameters():
            p.fill_(1.0)
    ema = EMA(layer, train)
    with torch.no_grad():
        for p in layer.parameters():
            p.zero_()
    for step in range(steps):
        ema.update(layer, step)
    return float(max(v.max() for v in ema.shadow.values()))


@pytest.mark.parametrize("steps", [1, 10, 100, 1500])
def test_initial_weights_never_dominate_the_average(steps):
    share = _initial_share(TrainConfig(ema_decay=0.999), steps)
    expected = math.prod((1 + t) / (10 + t) for t in range(min(steps, 9990)))
    assert share == pytest.approx(expected, rel=1e-4, abs=1e-30) and share < 0.1 + 1e-6


def test_decay_ramps_up_to_the_configured_ceiling():
    train = TrainConfig(ema_decay=0.999)
    decays = [float(train.ema_decay_at(t)) for t in (0, 1, 90, 8990, 8991, 100_000)]
    assert decays[:3] == [0.1, pytest.approx(2 / 11), pytest.approx(0.91)]
    assert decays[3] == pytest.approx(0.999) and decays[4:] == [0.999, 0.999]
    # Without the warm-up a fixed 0.999 kept 22% of the random weights after 1,500 updates.
    assert 0.999 ** 1500 > 0.22


def _one_step_average(framework: str, ema_decay: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, (16, 1, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 10, 16)
    train = TrainConfig(steps=1, batch_size=8, warmup_steps=0, ema_decay=ema_decay,
                        learning_rate=1e-2)
    if framework == "torch":
        from ddm.training.torch_expert import train_torch_unet

        return train_torch_unet(UNET_CONFIGS["smoke"], train, images, labels)
    from ddm.training.jax_expert import train_flax_unet

    return train_flax_unet(UNET_CONFIGS["smoke"], train, images, labels)


def _initial_weights(framework: str) -> dict[str, np.ndarray]:
    config = UNET_CONFIGS["smoke"]
    if framework == "torch":
        torch.manual_seed(0)
        return {k: v.numpy() for k, v in UNet(config).state_dict().items()}
    from ddm.models.flax_unet import canonical_from_params, init_params

    return canonical_from_params(init_params(config, 0), config)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_both_trainers_give_the_first_update_nine_tenths(framework):
    """One update with decay 0.999: the average is 0.1 x initial + 0.9 x updated weights
    (``ema_decay=0`` returns the updated weights themselves, from the same trajectory)."""
    initial = _initial_weights(framework)
    updated = _one_step_average(framework, 0.0)
    average = _one_step_average(framework, 0.999)
    moved = [k for k in initial if np.abs(updated[k] - initial[k]).max() > 1e-4]
    assert len(moved) > len(initial) // 2
    for k in moved:
        np.testing.assert_allclose(average[k], 0.1 * initial[k] + 0.9 * updated[k],
                                   rtol=1e-4, atol=1e-6, err_msg=k)
