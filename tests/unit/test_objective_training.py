"""`ddm train expert --objective ...`: both trainers learn any objective and record it."""

import numpy as np
import pytest

from ddm.checkpoints.format import read_meta
from ddm.cli import main
from ddm.objectives import NATIVE, Objective
from ddm.training.config import TrainConfig
from ddm.training.torch_loop import expert_batch, noisy_batch

EPSILON_ARGS = ("--objective", "epsilon", "--schedule", "vp-linear", "--time", "discrete",
                "--timesteps", "100")

# the models run on two cores shared with everything else
pytestmark = pytest.mark.usefixtures("one_torch_thread")




def _train(out, framework, *objective):
    return main(["train", "expert", "--config", "smoke", "--framework", framework,
                 "--partition", "labels:0-4,5-9", "--index", "0", *objective, "--steps", "2",
                 "--batch-size", "4", "--quiet", "--out", str(out)])


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_an_epsilon_expert_trains_and_declares_its_objective(tmp_path, framework):
    assert _train(tmp_path / "eps", framework, *EPSILON_ARGS) == 0
    # our UNet's time input is a unit fraction: the network gets k / T
    assert read_meta(tmp_path / "eps").objective == Objective(
        "epsilon", "vp-linear", "discrete", timesteps=100, time_scale=0.01)


def test_a_velocity_expert_declares_our_objective(tmp_path):
    assert _train(tmp_path / "v", "torch") == 0
    assert read_meta(tmp_path / "v").objective == NATIVE


def test_our_objective_trains_on_exactly_the_old_batches():
    """Velocity experts trained before objectives existed are reproduced bit for bit."""
    images = np.random.default_rng(0).uniform(-1, 1, (10, 1, 4, 4)).astype(np.float32)
    train = TrainConfig(steps=1, batch_size=6, seed=3)
    rows, path = noisy_batch(images, train, step=7)
    same_rows, example = expert_batch(images, train, NATIVE, step=7)
    assert np.array_equal(rows, same_rows)
    for ours, old in ((example.expert_input, path.x_t), (example.expert_time, path.t),
                      (example.target, path.velocity)):
        assert ours.dtype == np.float32 and np.array_equal(ours, old)


def test_an_objective_we_cannot_train_is_refused_by_name(tmp_path, capsys):
    assert _train(tmp_path / "bad", "torch", "--objective", "velocity",
                  "--schedule", "vp-cosine") == 2
    assert "'velocity' on schedule 'vp-cosine'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
