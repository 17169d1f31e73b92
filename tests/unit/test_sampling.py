"""Solvers, routing strategies and the mixture velocity, against closed-form answers."""

import numpy as np
import pytest

from ddm.convention import (data_from_velocity, interpolate, noise_from_velocity, sample_path,
                            time_grid, to_model_space, to_uint8)
from ddm.sampling.mixture import MixtureExpert, UsageLog, mixture_velocity
from ddm.sampling.routing import (Strategy, class_owners, oracle_probs, parse_strategy,
                                  routing_weights)
from ddm.sampling.solvers import initial_noise, integrate

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


def _constant_expert(name, value, classes, calls):
    def velocity(x, t, y):
        calls.append(len(x))
        return np.full_like(x, value)
    return MixtureExpert(name=name, classes=classes, velocity=velocity)


def test_mixture_routes_each_sample_and_weights_velocities():
    calls_a, calls_b = [], []
    experts = [_constant_expert("a", 1.0, (0,), calls_a), _constant_expert("b", 3.0, (1,), calls_b)]
    # Router: sample 0 -> expert a, sample 1 -> 70/30 split.

    def router(x, t, y):
        return np.array([[0.9, 0.1], [0.3, 0.7]], np.float32)[: len(x)]

    x = np.zeros((2, *SHAPE), np.float32)
    t = np.zeros(2, np.float32)
    y = np.array([0, 1])

    log = UsageLog(("a", "b"))
    v = mixture_velocity(experts, router, parse_strategy("top1"), log)(x, t, y)
    np.testing.assert_allclose(v[0], 1.0)
    np.testing.assert_allclose(v[1], 3.0)
    assert calls_a == [1] and calls_b == [1]  # each expert saw only its own sample

    log = UsageLog(("a", "b"))
    v = mixture_velocity(experts, router, parse_strategy("ensemble"), log)(x, t, y)
    np.testing.assert_allclose(v[0], 0.9 * 1 + 0.1 * 3, atol=1e-6)
    np.testing.assert_allclose(v[1], 0.3 * 1 + 0.7 * 3, atol=1e-6)
    np.testing.assert_array_equal(log.expert_calls(), [2, 2])


def test_oracle_mixture_uses_labels_and_logs_switches():
    experts = [_constant_expert("a", 1.0, (0,), []), _constant_expert("b", 3.0, (1,), [])]
    log = UsageLog(("a", "b"))
    velocity = mixture_velocity(experts, None, parse_strategy("oracle"), log)
    x0 = np.zeros((2, *SHAPE), np.float32)
    out = integrate(velocity, x0, np.array([1, 0]), 4)
    np.testing.assert_allclose(out[0], 3.0, atol=1e-6)
    np.testing.assert_allclose(out[1], 1.0, atol=1e-6)
    np.testing.assert_array_equal(log.expert_calls(), [4, 4])
    np.testing.assert_array_equal(log.switches(), [0, 0])
    np.testing.assert_array_equal(log.calls_per_expert(), [[0, 4], [4, 0]])


def test_learned_strategies_need_a_router():
    with pytest.raises(ValueError, match="needs a learned router"):
        mixture_velocity([_constant_expert("a", 1.0, (0,), [])], None, parse_strategy("top1"))


def test_an_images_noise_does_not_depend_on_its_batch():
    whole = initial_noise(4, SHAPE, seed=3)
    np.testing.assert_array_equal(initial_noise(2, SHAPE, seed=3, first_index=2), whole[2:])
