"""Objectives: every supported (prediction, schedule, time) converts to our exact velocity.

Known answers come from data whose posterior is closed-form: a Gaussian ``N(mu, s^2 I)`` (and a
point mass, ``s = 0``). Each expert's noisy input and exact prediction are computed here from
the textbook definition of its schedule (DDPM's cumulative products, Song et al.'s continuous
VP, Nichol & Dhariwal's cosine, SD3's reversed rectified flow), independently of
``ddm.objectives``, which must turn them into our velocity ``E[x1 - x0 | x_t]``.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddm.convention import data_from_velocity, noise_from_velocity
from ddm.objectives import (EDGE, NATIVE, PREDICTIONS, SCHEDULES, TIMES, Objective,
                            ObjectiveError, as_velocity, expert_inputs, expert_point,
                            prediction_coefficients, time_range, training_example,
                            training_times, velocity_from_prediction)

T = 1000


def _objective(prediction: str, schedule: str, time: str, time_scale: float = 1.0
               ) -> Objective | None:
    try:
        return Objective(prediction, schedule, time, timesteps=T if time == "discrete" else None,
                         time_scale=time_scale)
    except ObjectiveError:
        return None


SUPPORTED = [o for o in (_objective(*c) for c in itertools.product(PREDICTIONS, SCHEDULES, TIMES))
             if o is not None]


# -- the experts' own definitions, written from the papers ----------------------------------------

def _cosine_f(tau):
    return np.cos((tau + 0.008) / 1.008 * np.pi / 2) ** 2


def _discrete_alpha_bar(schedule: str) -> np.ndarray:
    if schedule == "vp-linear":  # DDPM, Ho et al. 2020
        betas = np.linspace(1e-4, 0.02, T)
    else:  # improved DDPM, Nichol & Dhariwal 2021
        i = np.arange(T)
        betas = np.minimum(1 - _cosine_f((i + 1) / T) / _cosine_f(i / T), 0.999)
    return np.cumprod(1 - betas)


def expert_coefficients(o: Objective, value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(alpha, sigma)`` of the expert's input ``alpha x + sigma eps`` at its time ``value``."""
    if o.time == "sigma":  # noise-to-signal ratio, as k-diffusion and EDM use it
        if o.schedule in ("linear", "rectified-flow"):
            return 1 / (1 + value), value / (1 + value)
        alpha = 1 / np.sqrt(1 + value ** 2)
        return alpha, value * alpha
    if o.schedule == "linear":
        return value, 1 - value
    if o.schedule == "rectified-flow":  # SD3: z = (1 - sigma) x + sigma eps, sigma = tau
        return 1 - value, value
    if o.time == "discrete":
        alpha_bar = _discrete_alpha_bar(o.schedule)[value.astype(int)]
    elif o.schedule == "vp-linear":  # Song et al. 2021, beta(tau) = 0.1 + 19.9 tau
        alpha_bar = np.exp(-(0.1 * value + 0.5 * 19.9 * value ** 2))
    else:
        alpha_bar = _cosine_f(value) / _cosine_f(0.0)
    return np.sqrt(alpha_bar), np.sqrt(1 - alpha_bar)


def exact_prediction(o: Objective, z, alpha, sigma, mu, s2):
    """The prediction a perfect expert makes from ``z``: posterior means under N(mu, s2)."""
    den = alpha ** 2 * s2 + sigma ** 2
    data = mu + alpha * s2 / den * (z - alpha * mu)
    eps = sigma / den * (z - alpha * mu)
    if o.prediction == "epsilon":
        return eps
    if o.prediction == "sample":
        return data
    if o.prediction == "v_prediction":  # Salimans & Ho 2022
        return alpha * eps - sigma * data
    return data - eps if o.schedule == "linear" else eps - data


def exact_velocity(x_t, t, mu, s2):
    """Our ``E[x1 - x0 | x_t]`` for data ``N(mu, s2)`` on ``x_t = t x1 + (1 - t) x0``."""
    den = t ** 2 * s2 + (1 - t) ** 2
    return (mu + t * s2 / den * (x_t - t * mu)) - (1 - t) / den * (x_t - t * mu)


def _per(a):
    return np.asarray(a).reshape(-1, 1, 1, 1)


def _expert_times(o: Objective, rng) -> np.ndarray:
    """Times inside the expert's domain, ends included, whose t lies in ``time_range``."""
    if o.time == "discrete":
        values = np.concatenate([[0, 1, T // 2, T - 1], rng.integers(0, T, 60)]).astype(float)
    elif o.time == "sigma":
        values = np.concatenate([[0.0, 1e-3, 1.0, 99.0], np.exp(rng.uniform(-6, 4.5, 60))])
    else:
        values = np.concatenate([[0.0, 1e-4, 0.5, 1 - 1e-4, 1.0], rng.uniform(0, 1, 60)])
    alpha, sigma = expert_coefficients(o, values)
    t = alpha / (alpha + sigma)
    lo, hi = time_range(o)
    return values[(t >= lo) & (t <= hi) & (sigma > 0)]  # a point mass has no noise at sigma 0


@pytest.mark.parametrize("o", SUPPORTED, ids=lambda o: o.describe())
@pytest.mark.parametrize("s2", [0.0, 0.25], ids=["point-mass", "gaussian"])
def test_every_objective_converts_the_exact_prediction_to_the_exact_velocity(o, s2):
    rng = np.random.default_rng(0)
    values = _expert_times(o, rng)
    assert len(values) > 20
    alpha, sigma = (_per(c) for c in expert_coefficients(o, values))
    mu = rng.standard_normal((1, 1, 4, 4))
    data = mu + math.sqrt(s2) * rng.standard_normal((len(values), 1, 4, 4))
    z = alpha * data + sigma * rng.standard_normal(data.shape)

    t = (alpha / (alpha + sigma)).reshape(-1)
    x_t = z / (alpha + sigma)
    x_expert, t_expert = expert_inputs(o, x_t, t)
    np.testing.assert_allclose(x_expert, z, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(t_expert, values * o.time_scale, rtol=1e-5, atol=2e-5)

    v = velocity_from_prediction(o, exact_prediction(o, z, alpha, sigma, mu, s2), x_t, t)
    expected = exact_velocity(x_t, _per(t), mu, s2)
    assert np.isfinite(expected).all()
    np.testing.assert_allclose(v, expected, rtol=1e-9, atol=1e-9)


def test_a_wrapped_network_answers_in_our_velocity():
    """``as_velocity`` over a perfect DDPM epsilon network is the exact velocity field."""
    o = Objective("epsilon", "vp-cosine", "discrete", timesteps=T, time_scale=1 / T)
    mu = np.full((1, 1, 2, 2), 0.5)
    seen = []

    def perfect_epsilon(z, k_over_t, y):  # a point mass at mu, on the expert's own schedule
        seen.append(k_over_t)
        table = _discrete_alpha_bar("vp-cosine")  # between steps: log-SNR interpolated linearly
        log_snr = np.interp(k_over_t * T, np.arange(T), np.log(table / (1 - table)))
        alpha_bar = 1 / (1 + np.exp(-log_snr))
        alpha, sigma = _per(np.sqrt(alpha_bar)), _per(np.sqrt(1 - alpha_bar))
        return (z - alpha * mu) / sigma

    x_t = np.random.default_rng(4).standard_normal((3, 1, 2, 2))
    t = np.array([0.2, 0.5, 0.8])
    v = as_velocity(o, perfect_epsilon)(x_t, t, np.zeros(3, np.int64))
    assert all(0 < k < 1 for k in seen[0])
    np.testing.assert_allclose(v, exact_velocity(x_t, _per(t), mu, 0.0), rtol=1e-5, atol=1e-5)
    assert as_velocity(NATIVE, perfect_epsilon) is perfect_epsilon


def test_clipping_the_data_estimate_cuts_only_errors():
    """The exact data estimate of in-range data is never clipped; an excursion is projected."""
    o = Objective("epsilon", "vp-linear", "discrete", timesteps=T)
    rng = np.random.default_rng(5)
    mu = rng.uniform(-0.9, 0.9, (1, 1, 3, 3))
    t = np.array([0.02, 0.3, 0.7, 0.995])
    x_t = rng.standard_normal((4, 1, 3, 3))
    point = expert_point(o, t)
    alpha, sigma = _per(point.alpha), _per(point.sigma)
    exact = exact_prediction(o, (alpha + sigma) * x_t, alpha, sigma, mu, 0.0)
    assert np.array_equal(velocity_from_prediction(o, exact, x_t, t, (-1.0, 1.0)),
                          velocity_from_prediction(o, exact, x_t, t))

    wrong = exact + 0.5  # an expert off by 0.5: its data estimates leave [-1, 1] at small t
    free = velocity_from_prediction(o, wrong, x_t, t)
    clipped = velocity_from_prediction(o, wrong, x_t, t, (-1.0, 1.0))
    gap = 1 - _per(point.t)
    np.testing.assert_allclose(x_t + gap * clipped, np.clip(x_t + gap * free, -1, 1),
                               rtol=1e-9, atol=1e-9)
    assert (np.abs(x_t + gap * free) > 1)[0].any()
    # within EDGE of the data end nothing is clipped: 1 / (1 - t) would amplify rounding
    assert np.array_equal(clipped[3], free[3])


def test_time_scale_multiplies_only_what_the_network_receives():
    plain, scaled = (Objective("velocity", "rectified-flow", time_scale=s) for s in (1, 1000))
    x_t, t = np.ones((3, 1, 2, 2)), np.array([0.1, 0.5, 0.9])
    assert np.allclose(expert_inputs(scaled, x_t, t)[1], 1000 * expert_inputs(plain, x_t, t)[1])
    assert np.allclose(expert_inputs(scaled, x_t, t)[1], [900, 500, 100], rtol=1e-6)
    p = np.arange(12.0).reshape(3, 1, 2, 2)
    assert np.array_equal(velocity_from_prediction(scaled, p, x_t, t), -p)


def test_our_own_objective_is_the_identity_even_at_the_ends():
    rng = np.random.default_rng(1)
    x_t = rng.standard_normal((4, 1, 3, 3)).astype(np.float32)
    p = rng.standard_normal((4, 1, 3, 3)).astype(np.float32)
    t = np.array([0.0, 0.3, 0.99999, 1.0], np.float32)
    assert velocity_from_prediction(NATIVE, p, x_t, t) is p
    x_expert, t_expert = expert_inputs(NATIVE, x_t, t)
    assert np.array_equal(x_expert, x_t) and np.array_equal(t_expert, t)
    assert time_range(NATIVE) == (0.0, 1.0)


@pytest.mark.parametrize("o", SUPPORTED, ids=lambda o: o.describe())
def test_the_ends_are_finite_and_answer_for_the_nearest_time_in_range(o):
    """At t = 0 and 1 (float32), every conversion is finite and exact for the clamped time."""
    rng = np.random.default_rng(2)
    t = np.array([0.0, 1e-30, 1e-7, EDGE / 2, 1 - 1e-7, 1.0], np.float32)
    x_t = rng.standard_normal((len(t), 1, 4, 4)).astype(np.float32)
    mu, s2 = rng.standard_normal((1, 1, 4, 4)), 0.25
    lo, hi = time_range(o)
    clamped = np.clip(t.astype(np.float64), lo, hi)
    point = expert_point(o, clamped)
    alpha, sigma = _per(point.alpha), _per(point.sigma)
    z = (alpha + sigma) * x_t
    p = exact_prediction(o, z, alpha, sigma, mu, s2).astype(np.float32)

    v = velocity_from_prediction(o, p, x_t, t)
    x_expert, t_expert = expert_inputs(o, x_t, t)
    assert v.dtype == np.float32 and np.isfinite(v).all()
    assert np.isfinite(x_expert).all() and np.isfinite(t_expert).all()
    expected = exact_velocity(x_t.astype(np.float64), _per(clamped), mu, s2)
    assert np.isfinite(expected).all()
    # float32 inputs: the error is the prediction's rounding amplified by at most 1 / EDGE
    np.testing.assert_allclose(v, expected, rtol=1e-4, atol=2e-4 / EDGE * 1e-2)


def test_the_singular_ends_are_the_documented_ones():
    assert time_range(Objective("epsilon", "linear"))[0] == EDGE
    assert time_range(Objective("sample", "linear"))[1] == 1 - EDGE
    assert time_range(Objective("v_prediction", "vp-cosine")) == (0.0, 1.0)
    lo, hi = time_range(Objective("v_prediction", "vp-linear", "discrete", timesteps=T))
    alpha_bar = _discrete_alpha_bar("vp-linear")
    to_t = [math.sqrt(a) / (math.sqrt(a) + math.sqrt(1 - a)) for a in alpha_bar[[-1, 0]]]
    assert (lo, hi) == pytest.approx(to_t, rel=1e-9)


# -- properties ------------------------------------------------------------------------------------

objectives = st.sampled_from(SUPPORTED)


@settings(max_examples=200, deadline=None)
@given(o=objectives, seed=st.integers(0, 2**32 - 1), where=st.floats(0, 1))
def test_velocity_to_prediction_and_back_round_trips(o, seed, where):
    """Any velocity, written as the expert's prediction at (x_t, t), converts back to itself."""
    rng = np.random.default_rng(seed)
    lo, hi = time_range(o)
    t = np.array([lo + where * (hi - lo)])
    x_t, v = rng.standard_normal((2, 1, 1, 3, 3))
    point = expert_point(o, t)
    a, b = (_per(c) for c in prediction_coefficients(o, point))
    p = a * data_from_velocity(x_t, t, v) + b * noise_from_velocity(x_t, t, v)
    np.testing.assert_allclose(velocity_from_prediction(o, p, x_t, t), v, rtol=1e-6, atol=1e-6)


@settings(max_examples=100, deadline=None)
@given(o=objectives, seed=st.integers(0, 2**32 - 1))
def test_training_targets_convert_to_the_conditional_velocity(o, seed):
    """What the trainers regress on, read back by the loader, is ``x1 - x0`` at ``x_t``."""
    rng = np.random.default_rng(seed)
    noise, data = rng.standard_normal((2, 8, 1, 3, 3))
    example = training_example(o, noise, data, rng.uniform(0, 1, 8))
    assert ((example.t >= 0) & (example.t <= 1)).all()
    lo, hi = time_range(o)
    inside = (example.t >= lo) & (example.t <= hi)  # outside, reading back clamps the time
    example = type(example)(*(getattr(example, f)[inside] for f in example.__dataclass_fields__))
    noise, data = noise[inside], data[inside]
    x_t = example.expert_input / _per(expert_point(o, example.t).input_scale)
    np.testing.assert_allclose(x_t, _per(example.t) * data + (1 - _per(example.t)) * noise,
                               rtol=1e-9, atol=1e-9)
    assert np.allclose(expert_inputs(o, x_t, example.t)[1], example.expert_time, atol=1e-4)
    np.testing.assert_allclose(velocity_from_prediction(o, example.target, x_t, example.t),
                               data - noise, rtol=1e-6, atol=1e-6)


@settings(max_examples=50, deadline=None)
@given(schedule=st.sampled_from(["vp-linear", "vp-cosine"]), u=st.floats(0, 1, exclude_max=True))
def test_discrete_experts_train_on_whole_steps(schedule, u):
    o = Objective("epsilon", schedule, "discrete", timesteps=T)
    example = training_example(o, np.zeros((1, 1, 2, 2)), np.ones((1, 1, 2, 2)), np.array([u]))
    assert example.expert_time[0] == pytest.approx(math.floor(u * T), abs=1e-6)
    assert example.t[0] == training_times(o, np.array([u]))[0]


def test_the_training_target_is_one_definition_for_numpy_and_jax():
    jnp = pytest.importorskip("jax.numpy")
    rng = np.random.default_rng(3)
    noise, data = rng.standard_normal((2, 16, 1, 4, 4)).astype(np.float32)
    u = rng.uniform(0, 1, 16).astype(np.float32)
    for o in SUPPORTED:
        ours, theirs = (training_example(o, noise, data, u, xp=xp) for xp in (np, jnp))
        for field in ("t", "expert_input", "expert_time", "target"):
            np.testing.assert_allclose(np.asarray(getattr(theirs, field)),
                                       getattr(ours, field), rtol=2e-4, atol=2e-4,
                                       err_msg=f"{o.describe()}: {field}")


# -- declarations ----------------------------------------------------------------------------------

@pytest.mark.parametrize("declared, problem", [
    ({"prediction": "score"}, "prediction 'score' is not one we convert"),
    ({"schedule": "ve"}, "schedule 've' is not one we convert"),
    ({"time": "log-snr"}, "time 'log-snr' is not one we convert"),
    ({"prediction": "velocity", "schedule": "vp-linear"}, "'velocity' on schedule 'vp-linear'"),
    ({"schedule": "linear", "time": "discrete", "timesteps": 10}, "needs a VP schedule"),
    ({"prediction": "epsilon", "schedule": "vp-linear", "time": "discrete"}, "timesteps >= 2"),
    ({"timesteps": 1000}, "only for time 'discrete'"),
    ({"time_scale": 0}, "time_scale must be a positive number"),
    ({"prediction": "epsilon", "offset": 1}, "unknown keys: offset"),
])
def test_objectives_we_cannot_convert_are_refused_by_name(declared, problem):
    with pytest.raises(ObjectiveError, match=problem.replace("(", r"\(")):
        Objective.from_dict(declared)


def test_objectives_round_trip_through_their_dict():
    for o in SUPPORTED:
        assert Objective.from_dict(o.to_dict()) == o
