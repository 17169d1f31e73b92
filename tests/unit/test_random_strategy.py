"""The evaluation's ``random`` baseline: an expert per sample and step, drawn uniformly among
those serving the label, keyed on (seed, image index, t); never accepted by anything served."""

import re

import numpy as np
import pytest

from ddm.deploy.limits import EVALUATION_STRATEGIES, STRATEGY_PATTERN
from ddm.deploy.router_config import RouterConfigFile
from ddm.models.ddm import DDM
from ddm.sampling.pipeline import generate
from ddm.sampling.routing import Strategy, parse_strategy, random_weights

SHAPE = (1, 4, 4)


def _expert(name, value, classes):
    def velocity(x, t, cond):
        y = cond.labels
        assert not classes or set(y.tolist()) <= set(classes), f"{name} was sent labels {y}"
        return np.full_like(x, value)
    return velocity


# Three experts and no router network: "c" serves only label 1.
MIXTURE = DDM(expert_names=("a", "b", "c"),
              experts=(_expert("a", 1.0, ()), _expert("b", 2.0, ()), _expert("c", 3.0, (1,))),
              expert_classes=((), (), (1,)), latent_shape=SHAPE, num_classes=2)


def _choices(generation) -> np.ndarray:
    """(N, evaluations) index of the one expert each sample used at each evaluation."""
    stacked = np.stack(generation.usage.selections)  # (E, N, K)
    assert (stacked.sum(axis=2) == 1).all(), "random picks exactly one expert"
    return stacked.argmax(axis=2).T


def test_only_the_evaluation_parses_random():
    assert parse_strategy("random", evaluation=True) == Strategy("random")
    with pytest.raises(ValueError, match="'random' is an evaluation baseline, not served"):
        parse_strategy("random")
    for name in EVALUATION_STRATEGIES:  # the CRD, router.yaml and requests use this pattern
        assert not re.match(STRATEGY_PATTERN, name)
    with pytest.raises(ValueError, match="sampling.strategy 'random' is not valid"):
        RouterConfigFile.from_dict({"experts": [
            {"name": "a", "discovery": {"endpoints": ["127.0.0.1:1"]}}],
            "sampling": {"strategy": "random"}})


def test_random_draws_per_sample_and_step_among_the_servable_experts():
    labels = [0] * 200 + [1] * 200
    choices = _choices(generate(MIXTURE, labels, steps=6, seed=4, strategy="random"))
    label0, label1 = choices[:200], choices[200:]
    assert set(np.unique(label0)) == {0, 1}  # c never sees label 0
    assert set(np.unique(label1)) == {0, 1, 2}
    # Uniform: 1,200 draws per label, each share within 5 points of 1/2 or 1/3.
    assert np.allclose(np.bincount(label0.ravel()) / label0.size, 1 / 2, atol=0.05)
    assert np.allclose(np.bincount(label1.ravel()) / label1.size, 1 / 3, atol=0.05)
    assert (choices[:, 1:] != choices[:, :-1]).any(axis=1).mean() > 0.9  # switches per sample


def test_random_depends_on_seed_and_image_index_not_on_the_batch():
    whole = generate(MIXTURE, [0, 1, 1, 0], steps=5, seed=9, strategy="random")
    alone = generate(MIXTURE, [1], steps=5, seed=9, strategy="random", first_index=2)
    np.testing.assert_array_equal(_choices(whole)[2], _choices(alone)[0])
    np.testing.assert_array_equal(whole.state[2], alone.state[0])
    again = generate(MIXTURE, [0, 1, 1, 0], steps=5, seed=9, strategy="random")
    np.testing.assert_array_equal(_choices(whole), _choices(again))
    other = generate(MIXTURE, [0, 1, 1, 0], steps=5, seed=10, strategy="random")
    assert not np.array_equal(_choices(whole), _choices(other))


def test_random_weights_are_one_hot_on_allowed_experts():
    servable = np.array([[True, False, True], [False, True, False]])
    keys = np.array([[0, 0], [0, 1]])
    weights = random_weights(keys, np.array([0.5, 0.5], np.float32), servable)
    assert weights.dtype == np.float32 and (weights.sum(axis=1) == 1).all()
    assert not (weights.astype(bool) & ~servable).any() and weights[1, 1] == 1
