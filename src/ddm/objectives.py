"""What an expert predicts, and the one conversion of its output to our velocity.

An expert trained elsewhere declares an :class:`Objective` in its checkpoint: its *prediction*
(``velocity``, ``epsilon``, ``sample`` or ``v_prediction``), its *schedule* (how its noisy input
mixes data and noise over its own time) and its *time* parameterisation (what number its network
receives as time). Everything here converts between that objective and ``ddm.convention``'s path
``x_t = t x1 + (1 - t) x0`` (``x1`` data, ``x0`` noise), by matching signal-to-noise ratios:

* the expert's input is ``z = alpha x1 + sigma x0``; the point of our path with the same
  ratio ``alpha / sigma = t / (1 - t)`` is ``t = alpha / (alpha + sigma)``, where
  ``z = (alpha + sigma) x_t``;
* every prediction is linear in data and noise, ``p = A x1 + B x0``, so with
  ``D = t B - (1 - t) A`` our velocity is ``v = x1 - x0 = ((A + B) x_t - p) / D``.

docs/objectives.md derives each case. ``D`` vanishes where a prediction says nothing about the
data (``epsilon`` at pure noise, ``sample`` at pure data): there, and outside the times the
expert's schedule covers, ``t`` is clamped into :func:`time_range`, i.e. the velocity is the
one at the nearest time the expert can answer for. Our own objective converts as the identity.

The maths is written once, on arrays of any framework: functions that do arithmetic on a time
take ``xp`` (``numpy`` by default, ``jax.numpy`` inside a jitted training step); the two that
serving calls, :func:`expert_inputs` and :func:`velocity_from_prediction`, take NumPy arrays,
and :func:`as_velocity` wraps a NumPy network with both.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Mapping

import numpy as np

from ddm.convention import DATA_MAX, DATA_MIN

PREDICTIONS = ("velocity", "epsilon", "sample", "v_prediction")
SCHEDULES = ("linear", "rectified-flow", "vp-linear", "vp-cosine")
TIMES = ("continuous", "discrete", "sigma")
FLOW_SCHEDULES = ("linear", "rectified-flow")

#: ``epsilon`` is not converted below ``t = EDGE``, ``sample`` not above ``1 - EDGE``, and a
#: ``sigma`` time not below ``EDGE``: there ``D`` (or sigma/alpha) diverges, so the velocity used
#: is the one at ``EDGE`` (or ``1 - EDGE``); for a point mass that is within 1% of the true one.
EDGE = 0.01

#: DDPM's linear betas for T = 1000 (Ho et al. 2020); other T scale them by 1000 / T (Nichol &
#: Dhariwal 2021), and their continuous limit is beta(tau) = 0.1 + 19.9 tau (Song et al. 2021).
VP_BETA_MIN, VP_BETA_MAX = 0.1, 20.0
#: The cosine schedule's offset s and its per-step beta cap (Nichol & Dhariwal 2021).
COSINE_OFFSET, COSINE_MAX_BETA = 0.008, 0.999


class ObjectiveError(ValueError):
    """An objective that is malformed or that we cannot convert to our velocity."""


@dataclass(frozen=True)
class Objective:
    """An expert's training objective, as declared in its checkpoint's ``objective`` field.

    ``timesteps`` (T) is required with ``time="discrete"`` (the network gets the step index
    ``k`` in ``[0, T - 1]``, DDPM's ``alpha_bar_k``) and forbidden otherwise. ``time_scale``
    multiplies the number the network receives: SD3-style models take ``1000 tau``, our UNet
    takes ``k / T``. ``velocity`` means ``d z / d tau`` of the expert's own path (``tau`` in
    ``[0, 1]`` whatever the scale): ``x1 - x0`` on ``linear``, SD3's ``x0 - x1`` on
    ``rectified-flow``; it is defined on flow schedules only.
    """

    prediction: str = "velocity"
    schedule: str = "linear"
    time: str = "continuous"
    timesteps: int | None = None
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        for name, value, known in (("prediction", self.prediction, PREDICTIONS),
                                   ("schedule", self.schedule, SCHEDULES),
                                   ("time", self.time, TIMES)):
            if value not in known:
                raise ObjectiveError(f"objective {name} {value!r} is not one we convert; "
                                     f"known: {', '.join(known)}")
        if self.prediction == "velocity" and self.schedule not in FLOW_SCHEDULES:
            raise ObjectiveError(
                f"prediction 'velocity' on schedule {self.schedule!r} is not one we convert: "
                f"velocity is d z / d tau of a flow path ({', '.join(FLOW_SCHEDULES)}); "
                "a variance-preserving expert predicts epsilon, sample or v_prediction")
        if self.time == "discrete":
            if self.schedule in FLOW_SCHEDULES:
                raise ObjectiveError(
                    f"time 'discrete' needs a VP schedule, not {self.schedule!r}; a flow model "
                    "fed 1000 tau is continuous with time_scale 1000")
            if (not isinstance(self.timesteps, int) or isinstance(self.timesteps, bool)
                    or self.timesteps < 2):
                raise ObjectiveError(f"time 'discrete' needs timesteps >= 2, got "
                                     f"{self.timesteps!r}")
        elif self.timesteps is not None:
            raise ObjectiveError(f"timesteps is only for time 'discrete', not {self.time!r}")
        if (isinstance(self.time_scale, bool) or not isinstance(self.time_scale, (int, float))
                or not math.isfinite(self.time_scale) or self.time_scale <= 0):
            raise ObjectiveError(f"time_scale must be a positive number, got "
                                 f"{self.time_scale!r}")
        object.__setattr__(self, "time_scale", float(self.time_scale))

    @property
    def is_native(self) -> bool:
        """True for ``ddm.convention``'s own objective, which converts as the identity."""
        return self == NATIVE

    def describe(self) -> str:
        steps = f" T={self.timesteps}" if self.timesteps else ""
        scale = f" x{self.time_scale:g}" if self.time_scale != 1.0 else ""
        return f"{self.prediction} on {self.schedule} ({self.time}{steps}{scale} time)"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Objective":
        if not isinstance(d, Mapping):
            raise ObjectiveError(f"objective must be a JSON object, got {d!r}")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ObjectiveError(f"objective has unknown keys: {', '.join(unknown)}")
        return cls(**d)


#: ``ddm.convention``: velocity ``x1 - x0`` on the linear path, ``t`` in ``[0, 1]`` as is.
NATIVE = Objective()


@dataclass(frozen=True)
class ExpertPoint:
    """Our time ``t`` seen by an expert; every field has the shape of ``t``.

    ``t`` is clamped into :func:`time_range`; the expert's input is ``input_scale * x_t`` and
    equals ``alpha x1 + sigma x0``; ``expert_time`` is what its network receives as time.
    """

    t: Any
    input_scale: Any
    alpha: Any
    sigma: Any
    expert_time: Any


@dataclass(frozen=True)
class TrainingExample:
    """One batch in the expert's own terms: ``expert(expert_input, expert_time) ~ target``."""

    t: Any
    expert_input: Any
    expert_time: Any
    target: Any


def time_range(objective: Objective) -> tuple[float, float]:
    """The interval of our ``t`` that ``objective`` converts without clamping."""
    lo, hi = 0.0, 1.0
    if objective.schedule == "vp-linear" and objective.time != "discrete":
        lo = float(_vp_linear_t(np.float64(1.0), np))
    if objective.time == "discrete":
        log_snr = _discrete_log_snr(objective.schedule, objective.timesteps)
        lo, hi = float(_sigmoid(log_snr[-1] / 2, np)), float(_sigmoid(log_snr[0] / 2, np))
    if objective.prediction == "epsilon" or objective.time == "sigma":
        lo = max(lo, EDGE)
    if objective.prediction == "sample":
        hi = min(hi, 1.0 - EDGE)
    return lo, hi


def expert_point(objective: Objective, t: Any, xp: ModuleType = np) -> ExpertPoint:
    """Where our time ``t`` (shape ``(B,)``), clamped into :func:`time_range`, lies on the
    expert's schedule."""
    if objective.is_native:
        return _point(objective, t, xp)
    return _point(objective, xp.clip(t, *time_range(objective)), xp)


def _point(objective: Objective, t: Any, xp: ModuleType) -> ExpertPoint:
    if objective.is_native:
        return ExpertPoint(t=t, input_scale=xp.ones_like(t), alpha=t, sigma=1.0 - t,
                           expert_time=t)
    if objective.schedule in FLOW_SCHEDULES:
        scale, tau = xp.ones_like(t), (t if objective.schedule == "linear" else 1.0 - t)
    else:
        scale = 1.0 / xp.sqrt(t * t + (1.0 - t) * (1.0 - t))
        tau = _vp_time(objective, t, xp)
    if objective.time == "sigma":
        tau = (1.0 - t) / t
    return ExpertPoint(t=t, input_scale=scale, alpha=scale * t, sigma=scale * (1.0 - t),
                       expert_time=tau * objective.time_scale)


def prediction_coefficients(objective: Objective, point: ExpertPoint) -> tuple[Any, Any]:
    """``(A, B)`` with the expert's exact prediction ``p = A x1 + B x0`` at ``point``."""
    if objective.prediction == "velocity":  # d z / d tau of the flow path
        sign = 1.0 if objective.schedule == "linear" else -1.0
        return sign + 0.0 * point.t, -sign + 0.0 * point.t
    if objective.prediction == "epsilon":
        return 0.0 * point.t, 1.0 + 0.0 * point.t
    if objective.prediction == "sample":
        return 1.0 + 0.0 * point.t, 0.0 * point.t
    return -point.sigma, point.alpha  # v_prediction: alpha eps - sigma x (Salimans & Ho 2022)


def expert_inputs(objective: Objective, x_t: np.ndarray, t: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Our ``x_t`` ``(B, C, H, W)`` at ``t`` ``(B,)`` -> the expert's input and time ``(B,)``."""
    t = _time_array(t, x_t)
    point = expert_point(objective, t)
    x_expert = _per_sample(point.input_scale, x_t.ndim) * x_t
    return x_expert.astype(x_t.dtype, copy=False), point.expert_time.astype(np.float32)


def velocity_from_prediction(objective: Objective, prediction: np.ndarray, x_t: np.ndarray,
                             t: np.ndarray, data_range: tuple[float, float] | None = None
                             ) -> np.ndarray:
    """The expert's output at :func:`expert_inputs` ``(x_t, t)`` -> our velocity there.

    ``prediction`` and ``x_t`` are ``(B, C, H, W)``, ``t`` is ``(B,)``; the result has
    ``prediction``'s dtype. Outside :func:`time_range` it is the velocity at the clamped time.
    With ``data_range`` the data estimate ``x_t + (1 - t) v`` is clipped into it (DDPM's
    ``clip_sample``): the exact estimate, a posterior mean, lies in the data's range anyway,
    so only an expert's error is cut, and that error is largest where ``D`` is small.
    """
    if objective.is_native:
        return prediction
    t = _time_array(t, x_t)
    if prediction.shape != x_t.shape:
        raise ValueError(f"prediction has shape {prediction.shape}, x_t has {x_t.shape}")
    point = expert_point(objective, t)
    a, b = prediction_coefficients(objective, point)
    d = point.t * b - (1.0 - point.t) * a
    v = (_per_sample((a + b) / d, x_t.ndim) * x_t - _per_sample(1.0 / d, x_t.ndim) * prediction)
    if data_range is not None:
        v = _clip_data_estimate(v, x_t, point.t, data_range)
    return v.astype(prediction.dtype, copy=False)


def _clip_data_estimate(v: np.ndarray, x_t: np.ndarray, t: np.ndarray,
                        data_range: tuple[float, float]) -> np.ndarray:
    """``v`` moved so that ``x_t + (1 - t) v`` lies in ``data_range``; left alone within
    ``EDGE`` of the data end, where ``1 / (1 - t)`` would turn rounding into a jump."""
    gap = _per_sample(1.0 - t, x_t.ndim)
    estimate = x_t + gap * v
    correction = np.clip(estimate, *data_range) - estimate
    return v + np.where(gap >= EDGE, correction / np.maximum(gap, EDGE), 0.0)


#: A NumPy network or velocity: ``(x (B, C, H, W) f32, t (B,) f32, y (B,) int) -> (B, C, H, W)``.
NetworkFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def as_velocity(objective: Objective, network: NetworkFn,
                data_range: tuple[float, float] | None = (DATA_MIN, DATA_MAX)) -> NetworkFn:
    """Our velocity callable over an expert's network that was trained on ``objective``.

    Loaders call this once per expert; for our own objective it returns ``network`` itself.
    Images live in ``ddm.convention``'s ``[DATA_MIN, DATA_MAX]``, so the data estimate is
    clipped there by default (see :func:`velocity_from_prediction`).
    """
    if objective.is_native:
        return network

    def velocity(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        x_expert, t_expert = expert_inputs(objective, x, t)
        return velocity_from_prediction(objective, network(x_expert, t_expert, y), x, t,
                                        data_range)

    return velocity


def training_times(objective: Objective, u: Any, xp: ModuleType = np) -> Any:
    """Uniform ``u`` in ``[0, 1)`` -> our ``t``, spread as the expert's own recipe spreads them.

    Our objective draws ``t = u``; a flow draws ``tau = u``; a discrete VP expert draws its
    step ``k`` uniformly from ``0..T-1`` (DDPM) and a continuous one ``tau`` uniformly.
    """
    if objective.schedule == "linear":
        return u
    if objective.schedule == "rectified-flow":
        return 1.0 - u
    if objective.time == "discrete":
        log_snr = _discrete_log_snr(objective.schedule, objective.timesteps)
        k = xp.floor(u * objective.timesteps)
        return _sigmoid(xp.interp(k, np.arange(objective.timesteps, dtype=np.float64),
                                  log_snr) / 2, xp)
    if objective.schedule == "vp-linear":
        return _vp_linear_t(u, xp)
    phi = (u + COSINE_OFFSET) / (1 + COSINE_OFFSET) * (math.pi / 2)
    phi0 = COSINE_OFFSET / (1 + COSINE_OFFSET) * (math.pi / 2)
    noise = xp.sqrt(xp.maximum(xp.sin(phi - phi0) * xp.sin(phi + phi0), 0.0))
    return xp.cos(phi) / (xp.cos(phi) + noise)


def training_example(objective: Objective, noise: Any, data: Any, u: Any,
                     xp: ModuleType = np) -> TrainingExample:
    """The one loss target per objective: both trainers regress ``target`` from the input.

    ``noise`` (``x0``) and ``data`` (``x1``) are ``(B, C, H, W)``, ``u`` ``(B,)`` uniform.
    Times are not clamped: every target is defined on the whole schedule (``epsilon`` at pure
    noise too); only reading a prediction back needs :func:`time_range`.
    """
    point = _point(objective, training_times(objective, u, xp), xp)
    a, b = prediction_coefficients(objective, point)
    ndim = data.ndim
    alpha, sigma = _per_sample(point.alpha, ndim, xp), _per_sample(point.sigma, ndim, xp)
    target = _per_sample(a, ndim, xp) * data + _per_sample(b, ndim, xp) * noise
    return TrainingExample(t=point.t, expert_input=alpha * data + sigma * noise,
                           expert_time=point.expert_time, target=target)


# -- schedules ------------------------------------------------------------------------------------

def _vp_time(objective: Objective, t: Any, xp: ModuleType) -> Any:
    """Our ``t`` -> the VP schedule's time with the same signal-to-noise ratio."""
    if objective.time == "discrete":
        log_snr = _discrete_log_snr(objective.schedule, objective.timesteps)
        steps = np.arange(objective.timesteps, dtype=np.float64)
        log_snr_t = 2.0 * (xp.log(t) - xp.log1p(-t))
        return xp.interp(log_snr_t, log_snr[::-1], steps[::-1])
    if objective.schedule == "vp-linear":
        # -log alpha_bar = q(tau) = b0 tau + (b1 - b0) tau^2 / 2, solved without cancellation
        noise_to_signal = (1.0 - t) / t
        q = xp.log1p(noise_to_signal * noise_to_signal)
        spread = VP_BETA_MAX - VP_BETA_MIN
        return 2.0 * q / (VP_BETA_MIN + xp.sqrt(VP_BETA_MIN ** 2 + 2.0 * spread * q))
    # cosine: alpha_bar = cos^2(phi) / cos^2(phi0), phi = (tau + s) / (1 + s) * pi / 2
    alpha = t / xp.sqrt(t * t + (1.0 - t) * (1.0 - t))
    phi0 = COSINE_OFFSET / (1 + COSINE_OFFSET) * (math.pi / 2)
    phi = xp.arccos(xp.clip(alpha * math.cos(phi0), 0.0, 1.0))
    return xp.maximum(phi * (1 + COSINE_OFFSET) * (2 / math.pi) - COSINE_OFFSET, 0.0)


def _vp_linear_t(tau: Any, xp: ModuleType) -> Any:
    """Continuous VP with linear betas: ``tau`` -> our ``t`` (``alpha / (alpha + sigma)``)."""
    q = VP_BETA_MIN * tau + 0.5 * (VP_BETA_MAX - VP_BETA_MIN) * tau * tau
    alpha, sigma = xp.exp(-0.5 * q), xp.sqrt(-xp.expm1(-q))
    return alpha / (alpha + sigma)


def _discrete_log_snr(schedule: str, timesteps: int) -> np.ndarray:
    """``log(alpha_bar_k / (1 - alpha_bar_k))`` for ``k = 0..T-1`` (decreasing), float64."""
    if schedule == "vp-linear":
        scale = 1000.0 / timesteps
        betas = np.linspace(scale * VP_BETA_MIN / 1000, scale * VP_BETA_MAX / 1000, timesteps,
                            dtype=np.float64)
    else:
        edges = np.arange(timesteps + 1, dtype=np.float64) / timesteps
        f = np.cos((edges + COSINE_OFFSET) / (1 + COSINE_OFFSET) * (math.pi / 2)) ** 2
        betas = np.minimum(1.0 - f[1:] / f[:-1], COSINE_MAX_BETA)
    log_alpha_bar = np.cumsum(np.log1p(-betas))
    return log_alpha_bar - np.log(-np.expm1(log_alpha_bar))


def _sigmoid(x: Any, xp: ModuleType) -> Any:
    return 0.5 * (1.0 + xp.tanh(0.5 * x))


def _per_sample(values: Any, ndim: int, xp: ModuleType = np) -> Any:
    return xp.reshape(values, values.shape + (1,) * (ndim - values.ndim))


def _time_array(t: np.ndarray, x_t: np.ndarray) -> np.ndarray:
    t = np.asarray(t, dtype=np.float64)
    if t.shape != x_t.shape[:1]:
        raise ValueError(f"t must have shape ({x_t.shape[0]},) for x_t of shape {x_t.shape}, "
                         f"got {t.shape}")
    return t
