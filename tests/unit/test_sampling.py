"""Steppers, routing strategies and the sampling loop in-process, against closed-form answers."""


import numpy as np
import pytest

from ddm.convention import (data_from_velocity, interpolate, noise_from_velocity, sample_path,
                            time_grid, to_model_space, to_uint8)
from ddm.models.ddm import DDM
from ddm.sampling.pipeline import generate
from ddm.sampling.routing import (Strategy, class_owners, mixture_weights, oracle_probs,
                                  parse_strategy, routing_weights, servable_labels)
from ddm.sampling.solvers import Evaluation, heun, initial_noise, integrate

SHAPE = (1, 4, 4)


def test_path_round_trips_through_velocity():
    rng = np.random.default_rng(0)
    x0, x1 = rng.standard_normal((2, 3, *SHAPE), dtype=np.float32)
    t = np.array([0.0, 0.3, 0.9], dtype=np.float32)
    path = sample_path(x0, x1, t)
    np.testing.assert_allclose(data_from_velocity(path.x_t, t, path.velocity), x1, atol=1e-6)
    np.testing.assert_allclose(noise_from_velocity(path.x_t, t, path.velocity), x0, atol=1e-6)
    np.testing.assert_array_equal(interpolate(x0, x1, np.zeros(3)), x0)
    np.testing.assert_array_equal(interpolate(x0, x1, np.ones(3)), x1)


def test_time_grid_runs_from_noise_to_data():
    grid = time_grid(4)
    np.testing.assert_allclose(grid, [0, 0.25, 0.5, 0.75, 1.0])
    with pytest.raises(ValueError, match="positive integer"):
        time_grid(0)


def test_uint8_mapping_puts_ink_at_255():
    images = np.array([[0.0, 1.0, 0.5]], dtype=np.float32)
    np.testing.assert_array_equal(to_uint8(to_model_space(images)), [[0, 255, 128]])


@pytest.mark.parametrize("solver", ["euler", "heun"])
def test_constant_velocity_is_exact(solver):
    x0 = initial_noise(2, SHAPE, seed=1)
    c = np.float32(0.7)
    out = integrate(lambda x, t, y: np.full_like(x, c), x0, np.zeros(2, np.int64), 5, solver)
    np.testing.assert_allclose(out, x0 + c, atol=1e-6)


def test_heun_is_exact_for_velocity_linear_in_time():
    # dx/dt = 2t  ->  x(1) = x(0) + 1; Heun's trapezoid rule is exact for linear integrands,
    # Euler under-shoots by 1/steps.
    x0 = np.zeros((1, *SHAPE), np.float32)

    def v(x, t, y):
        return np.broadcast_to(2 * t[:, None, None, None], x.shape).astype(np.float32)

    y = np.zeros(1, np.int64)
    np.testing.assert_allclose(integrate(v, x0, y, 4, "heun"), 1.0, atol=1e-6)
    np.testing.assert_allclose(integrate(v, x0, y, 4, "euler"), 0.75, atol=1e-6)


def test_noise_is_fixed_by_seed():
    np.testing.assert_array_equal(initial_noise(3, SHAPE, 7), initial_noise(3, SHAPE, 7))
    assert not np.array_equal(initial_noise(3, SHAPE, 7), initial_noise(3, SHAPE, 8))


@pytest.mark.parametrize("text,expected", [
    ("top1", Strategy("topk", k=1)), ("TOP2", Strategy("topk", k=2)),
    ("topk:3", Strategy("topk", k=3)), ("threshold:0.25", Strategy("threshold", threshold=0.25)),
    ("ensemble", Strategy("ensemble")), ("oracle", Strategy("oracle")),
])
def test_parse_strategy(text, expected):
    assert parse_strategy(text) == expected


@pytest.mark.parametrize("text", ["top1", "topk:12", "threshold:.0000001", "threshold:0.25",
                                  "threshold:1.0", "threshold:0.123456789012345678", "oracle"])
def test_a_strategys_name_parses_back_to_it(text):
    """The router validates a request's strategy, echoes its name and parses that again: a
    name the grammar refuses (``threshold:1e-07``, found by the API fuzz test) was a 500."""
    strategy = parse_strategy(text)
    assert parse_strategy(strategy.name) == strategy


@pytest.mark.parametrize("text", ["random", "top0", "threshold:1.5", "threshold:0", "", "top-1"])
def test_parse_strategy_rejects_unknown(text):
    with pytest.raises(ValueError):
        parse_strategy(text)


def test_routing_weights_per_sample():
    probs = np.array([[0.6, 0.3, 0.1], [0.1, 0.2, 0.7], [0.4, 0.4, 0.2]])
    np.testing.assert_allclose(routing_weights(probs, parse_strategy("top1")),
                               [[1, 0, 0], [0, 0, 1], [1, 0, 0]])  # tie -> lower index
    np.testing.assert_allclose(routing_weights(probs, parse_strategy("top2")),
                               [[2 / 3, 1 / 3, 0], [0, 2 / 9, 7 / 9], [0.5, 0.5, 0]], atol=1e-6)
    np.testing.assert_allclose(routing_weights(probs, parse_strategy("threshold:0.35")),
                               [[1, 0, 0], [0, 0, 1], [0.5, 0.5, 0]], atol=1e-6)
    np.testing.assert_allclose(routing_weights(probs, parse_strategy("ensemble")), probs, atol=1e-6)
    np.testing.assert_allclose(routing_weights(probs, parse_strategy("top5")), probs, atol=1e-6)


def test_oracle_needs_covering_disjoint_classes():
    classes = [(0, 1, 2), (3, 4)]
    np.testing.assert_array_equal(oracle_probs(np.array([4, 0]), classes), [[0, 1], [1, 0]])
    with pytest.raises(ValueError, match=r"labels \[7\] are not covered"):
        oracle_probs(np.array([7, 1]), classes)
    with pytest.raises(ValueError, match="owned by experts 0 and 1"):
        class_owners([(0, 1), (1, 2)])


def test_steppers_ask_for_velocities_and_never_call_a_model():
    x = np.ones((1, *SHAPE), np.float32)
    step = heun(x, 0.0, 0.5)
    first = next(step)
    assert first.t == 0.0 and first.x is x
    second = step.send(np.full_like(x, 2.0))  # v at (x, 0): Euler predicts x + 0.5 * 2
    assert isinstance(second, Evaluation) and second.t == 0.5
    np.testing.assert_array_equal(second.x, 2.0)
    with pytest.raises(StopIteration) as done:
        step.send(np.full_like(x, 4.0))
    np.testing.assert_array_equal(done.value.value, 1.0 + 0.25 * (2.0 + 4.0))


def test_label_mask_keeps_only_experts_trained_on_the_label():
    servable = servable_labels([(0, 1), (1, 2), ()], num_classes=3)
    np.testing.assert_array_equal(servable, [[1, 0, 1], [1, 1, 1], [0, 1, 1]])
    probs = np.array([[0.2, 0.7, 0.1], [0.0, 0.0, 0.0]], np.float32)
    labels = np.array([0, 2])
    # Label 0: expert 1 (most probable) never saw it, so top-1 is the best of the others.
    np.testing.assert_allclose(mixture_weights(probs, servable[labels], parse_strategy("top1")),
                               [[1, 0, 0], [0, 1, 0]])
    # A row whose servable experts all got 0 weighs them equally.
    np.testing.assert_allclose(
        mixture_weights(probs, servable[labels], parse_strategy("ensemble")),
        [[2 / 3, 0, 1 / 3], [0, 0.5, 0.5]], atol=1e-6)
    with pytest.raises(ValueError, match="trained for other experts"):
        mixture_weights(probs[:, :2], servable[labels], parse_strategy("top1"))


def _constant_expert(name, value, classes, calls):
    def velocity(x, t, cond):
        y = cond.labels
        assert not classes or set(y.tolist()) <= set(classes), f"{name} was sent labels {y}"
        calls.append(len(x))
        return np.full_like(x, value)
    return name, classes, velocity


def _ddm(experts, router=None):
    names, classes, velocities = zip(*experts)
    return DDM(expert_names=names, experts=velocities, expert_classes=classes,
               router=None if router is None else (
                   lambda x, t, cond: router(x, t, cond.labels)),
               latent_shape=SHAPE, num_classes=2)


def _fixed_router(x, t, y):
    """Sample 0 -> 90/10 for expert a, sample 1 -> 30/70."""
    return np.array([[0.9, 0.1], [0.3, 0.7]], np.float32)[: len(x)]


def _velocity_of_one_step(out, seed=0):
    """The velocity of a one-step Euler generation, per sample (dt = 1)."""
    return (out.state - initial_noise(len(out.labels), SHAPE, seed))[:, 0, 0, 0]


def test_mixture_routes_each_sample_and_weights_velocities():
    calls_a, calls_b = [], []
    experts = [_constant_expert("a", 1.0, (), calls_a), _constant_expert("b", 3.0, (), calls_b)]
    out = generate(_ddm(experts, _fixed_router), [0, 1], steps=1, seed=0, strategy="top1")
    np.testing.assert_allclose(_velocity_of_one_step(out), [1.0, 3.0], atol=1e-6)
    assert calls_a == [1] and calls_b == [1]  # each expert saw only its own sample

    out = generate(_ddm(experts, _fixed_router), [0, 1], steps=1, seed=0, strategy="ensemble")
    np.testing.assert_allclose(_velocity_of_one_step(out), [0.9 + 0.1 * 3, 0.3 + 0.7 * 3],
                               atol=1e-6)
    np.testing.assert_array_equal(out.expert_calls, [2, 2])


@pytest.mark.parametrize("strategy", ["top1", "top2", "threshold:0.05", "ensemble"])
def test_learned_strategies_send_a_label_only_to_experts_trained_on_it(strategy):
    """The router prefers b for both samples, but b never saw label 0 (a never saw 1)."""
    experts = [_constant_expert("a", 1.0, (0,), []), _constant_expert("b", 3.0, (1,), [])]

    def prefers_b(x, t, y):
        return np.tile(np.array([[0.1, 0.9]], np.float32), (len(x), 1))

    out = generate(_ddm(experts, prefers_b), [0, 1], steps=2, seed=0, strategy=strategy)
    assert out.experts_used() == [["a"], ["b"]]
    np.testing.assert_array_equal(out.expert_calls, [2, 2])


def test_oracle_mixture_uses_labels_and_logs_switches():
    experts = [_constant_expert("a", 1.0, (0,), []), _constant_expert("b", 3.0, (1,), [])]
    out = generate(_ddm(experts), [1, 0], steps=4, seed=0, strategy="oracle")
    np.testing.assert_allclose(out.state - initial_noise(2, SHAPE, 0),
                               np.array([3.0, 1.0])[:, None, None, None] + np.zeros(SHAPE),
                               atol=1e-5)
    np.testing.assert_array_equal(out.expert_calls, [4, 4])
    np.testing.assert_array_equal(out.usage.switches(), [0, 0])
    np.testing.assert_array_equal(out.usage.calls_per_expert(), [[0, 4], [4, 0]])


def test_learned_strategies_need_a_router():
    experts = [_constant_expert("a", 1.0, (0,), []), _constant_expert("b", 3.0, (1,), [])]
    with pytest.raises(ValueError, match="needs the router network"):
        generate(_ddm(experts), [0], steps=2, seed=0, strategy="top1")


def test_an_images_noise_does_not_depend_on_its_batch():
    whole = initial_noise(4, SHAPE, seed=3)
    np.testing.assert_array_equal(initial_noise(2, SHAPE, seed=3, first_index=2), whole[2:])


def test_the_steppers_are_exactly_the_declared_solvers() -> None:
    from ddm.deploy.limits import SOLVERS as DECLARED
    from ddm.sampling.solvers import SOLVERS

    assert tuple(SOLVERS) == DECLARED
