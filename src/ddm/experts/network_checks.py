"""The checks of an expert's network by its outputs, whatever its conditioning: shapes and
dtypes, finiteness, determinism, the declared prediction's behaviour on real data, and parity
of one network on two frameworks; each returns a :class:`Verdict`. :mod:`ddm.experts.check`
(label experts) and :mod:`ddm.experts.text_check` (text experts) load a network and its data
and run them (:func:`check_outputs`).

The behaviour check tests the declared objective against the network's outputs on known
inputs: data ``x1`` the expert learned to generate and Gaussian noise ``x0``, mixed as its
declared schedule mixes them (``z = alpha x1 + sigma x0`` at our ``t`` = 0.2, 0.5, 0.8). Every
prediction is linear in ``(x1, x0)`` (``ddm.objectives.prediction_coefficients``), so each
candidate prediction has a known target, and the network's relative squared error against
it, ``sum |out - target|^2 / sum |target|^2``, says how much of the target it explains.
Predicting zero scores 1; the shipped experts score below 0.2 on their own prediction and
above 0.7 on any other (an epsilon network read as velocity scores 2.2). So a network fails
when its declared prediction scores above :data:`MAX_RELATIVE_ERROR`, or another prediction
explains its outputs at least twice as well.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ddm.models.loading import ModelFn
from ddm.objectives import PREDICTIONS, Objective, ObjectiveError, as_velocity, expert_point
from ddm.objectives import prediction_coefficients


#: The relative squared error above which a network does not predict what it declares.
MAX_RELATIVE_ERROR = 0.5
#: Another prediction explaining the outputs this many times better fails the declaration.
BETTER_FIT_FACTOR = 2.0
#: Our times at which the behaviour check noises its images (away from both ends, where
#: some predictions say little about the data or the noise).
BEHAVIOUR_TIMES = (0.2, 0.5, 0.8)
#: Images per time in the behaviour check.
BEHAVIOUR_IMAGES = 64
#: The largest torch/JAX difference tolerated, in output units.
PARITY_TOLERANCE = 1e-4
SEED = 0


@dataclass(frozen=True)
class Verdict:
    """One check's outcome: ``status`` is PASS, FAIL or SKIP (could not be run here)."""

    name: str
    status: str
    detail: str

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.detail}"


class ExpertCheckFailed(RuntimeError):
    """A network failed ``ddm expert check``; the message lists each failed check."""


def require_passing(verdicts: list[Verdict], who: str) -> None:
    """Raise :class:`ExpertCheckFailed` naming every failed check of ``who``."""
    failed = [v.line() for v in verdicts if v.failed]
    if failed:
        raise ExpertCheckFailed(f"{who} failed ddm expert check: {'; '.join(failed)}")


@dataclass(frozen=True)
class Examples:
    """What an expert learned to generate, for the behaviour check: ``x1`` (N, C, H, W)
    float32 in its model space, ``y`` (N,) int64 the conditioning each goes with (a label, or
    a row of the text embeddings the network is given), and a name for the report."""

    x1: np.ndarray
    y: np.ndarray
    name: str


@dataclass(frozen=True)
class Claim:
    """What config.json declares the network predicts, as a failed behaviour check names it:
    ``says`` (``velocity on linear (continuous time)``) and ``field`` (what to correct)."""

    says: str
    field: str


def check_outputs(network: ModelFn, objective: Objective, image_shape: tuple[int, int, int],
                  y: np.int64, examples: Examples | str, claim: Claim,
                  max_batch: int = BEHAVIOUR_IMAGES) -> list[Verdict]:
    """Shapes and dtypes, finiteness, determinism and behaviour of any expert's ``network(x,
    t, y)``, in its own time and prediction (``objective``), called with at most ``max_batch``
    rows at a time: ``y`` the conditioning of the rows the first three send (a label, or a row
    of the embeddings the network is given), ``examples`` its data, or why there is none (the
    behaviour check is then skipped), ``claim`` what config.json declares."""
    network = _in_batches(network, max_batch)
    rng = np.random.default_rng(SEED)
    velocity = as_velocity(objective, network)
    verdicts = [run_check("shapes", lambda: _shapes(velocity, image_shape, y, rng))]
    verdicts.append(run_check("finite", lambda: _finite(velocity, image_shape, y, rng)))
    verdicts.append(run_check("determinism", lambda: _determinism(velocity, image_shape, y, rng)))
    if any(v.failed for v in verdicts):
        verdicts.append(Verdict("behaviour", "SKIP", "the network's outputs are not usable"))
    elif isinstance(examples, str):
        verdicts.append(Verdict("behaviour", "SKIP", examples))
    else:
        verdicts.append(run_check("behaviour", lambda: _behaviour(objective, network, examples,
                                                              claim, rng)))
    return verdicts


def run_check(name: str, check: Callable[[], Verdict | str]) -> Verdict:
    """The verdict of ``check`` called: its detail string means PASS; an exception means
    FAIL."""
    try:
        outcome = check()
    except Exception as error:  # noqa: BLE001 - any failure of user code is the verdict
        return Verdict(name, "FAIL", f"{type(error).__name__}: {error}")
    return outcome if isinstance(outcome, Verdict) else Verdict(name, "PASS", outcome)


def missing_frameworks() -> list[str]:
    """The frameworks the parity check needs that are not installed here."""
    return [m for m in ("torch", "jax", "flax") if importlib.util.find_spec(m) is None]


def agreement(torch_network: ModelFn, jax_network: ModelFn, image_shape: tuple[int, int, int],
              y: np.int64) -> Verdict | str:
    """The parity verdict of one network on both frameworks, on the same inputs (conditioned
    on ``y``): their largest difference against :data:`PARITY_TOLERANCE`."""
    rng = np.random.default_rng(SEED)
    inputs = _inputs(image_shape, y, rng, (0.05, 0.3, 0.7, 0.95))
    diff = float(np.max(np.abs(torch_network(*inputs) - jax_network(*inputs))))
    if not diff <= PARITY_TOLERANCE:
        return Verdict("parity", "FAIL", f"torch and JAX outputs differ by up to {diff:.3g} "
                                         f"(tolerance {PARITY_TOLERANCE:g})")
    return f"torch and JAX outputs agree within {diff:.2g} (tolerance {PARITY_TOLERANCE:g})"
def _in_batches(network: ModelFn, max_batch: int) -> ModelFn:
    def run(x: np.ndarray, t: np.ndarray, y: np.ndarray) -> np.ndarray:
        if x.shape[0] <= max_batch:
            return network(x, t, y)
        return np.concatenate([network(x[i:i + max_batch], t[i:i + max_batch],
                                       y[i:i + max_batch])
                               for i in range(0, x.shape[0], max_batch)])

    return run


def _inputs(image_shape: tuple[int, int, int], y: np.int64, rng: np.random.Generator,
            t: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = len(t)
    return (rng.standard_normal((rows, *image_shape)).astype(np.float32),
            np.asarray(t, np.float32), np.full((rows,), y, np.int64))


def _shapes(velocity: ModelFn, image_shape: tuple[int, int, int], y: np.int64,
            rng: np.random.Generator) -> Verdict | str:
    for t in ((0.5,), (0.1, 0.5, 0.9)):
        x, tt, y = _inputs(image_shape, y, rng, t)
        out = np.asarray(velocity(x, tt, y))
        if out.shape != x.shape or out.dtype != np.float32:
            return Verdict("shapes", "FAIL", f"input {x.shape} float32 gave output "
                                             f"{out.shape} {out.dtype}; it must be the same")
    return f"output shape == input shape (B, {', '.join(map(str, image_shape))}), float32"


def _finite(velocity: ModelFn, image_shape: tuple[int, int, int], y: np.int64,
            rng: np.random.Generator) -> Verdict | str:
    times = (0.0, 0.01, 0.99, 1.0)  # both ends, where conversions divide by small numbers
    out = np.asarray(velocity(*_inputs(image_shape, y, rng, times)))
    bad = [f"{t:g}" for t, row in zip(times, out) if not np.all(np.isfinite(row))]
    if bad:
        return Verdict("finite", "FAIL", f"the velocity has NaN or inf values at t = "
                                         f"{', '.join(bad)} (of {', '.join(map(str, times))})")
    return f"finite velocities at t = {', '.join(map(str, times))}"


def _determinism(velocity: ModelFn, image_shape: tuple[int, int, int], y: np.int64,
                 rng: np.random.Generator) -> Verdict | str:
    inputs = _inputs(image_shape, y, rng, (0.1, 0.5, 0.9))
    first = np.array(velocity(*inputs), copy=True)
    second = np.asarray(velocity(*inputs))
    if not np.array_equal(first, second, equal_nan=True):
        diff = float(np.nanmax(np.abs(first - second)))
        return Verdict("determinism", "FAIL", f"the same input gave different outputs (max "
                                              f"difference {diff:.3g}); a router mixing "
                                              "experts needs a function of (x, t, y)")
    return "the same input twice gives identical outputs"


def _behaviour(objective: Objective, network: ModelFn, examples: Examples,
               claim: Claim, rng: np.random.Generator) -> Verdict | str:
    """The declared prediction against the others, on the declared schedule (module doc)."""
    candidates = {objective.prediction: objective}
    for prediction in PREDICTIONS:
        try:
            candidates.setdefault(prediction, dataclasses.replace(objective,
                                                                  prediction=prediction))
        except ObjectiveError:
            continue  # velocity is defined on flow schedules only
    errors = dict.fromkeys(candidates, 0.0)
    energy = dict.fromkeys(candidates, 0.0)
    fit = np.zeros(2)
    for t in BEHAVIOUR_TIMES:
        rows = rng.choice(len(examples.y), BEHAVIOUR_IMAGES)
        x1 = examples.x1[rows].astype(np.float64)
        x0 = rng.standard_normal(x1.shape)
        tt = np.full((BEHAVIOUR_IMAGES,), t)
        point = expert_point(objective, tt)
        z = point.alpha[:, None, None, None] * x1 + point.sigma[:, None, None, None] * x0
        out = np.asarray(network(z.astype(np.float32), point.expert_time.astype(np.float32),
                                 examples.y[rows]), np.float64)
        for prediction, candidate in candidates.items():
            a, b = prediction_coefficients(candidate, expert_point(candidate, tt))
            target = a[:, None, None, None] * x1 + b[:, None, None, None] * x0
            errors[prediction] += float(np.sum((out - target) ** 2))
            energy[prediction] += float(np.sum(target ** 2))
        if t == 0.5:
            basis = np.stack([x1.ravel(), x0.ravel()], axis=1)
            fit = np.linalg.lstsq(basis, out.ravel(), rcond=None)[0]
    relative = {p: errors[p] / energy[p] for p in candidates}
    declared = relative[objective.prediction]
    best = min((p for p in relative if p != objective.prediction), key=relative.__getitem__)
    seen = (f"on {len(BEHAVIOUR_TIMES) * BEHAVIOUR_IMAGES} {examples.name} images noised to "
            f"t = {', '.join(map(str, BEHAVIOUR_TIMES))}")
    if declared > MAX_RELATIVE_ERROR or relative[best] * BETTER_FIT_FACTOR < declared:
        return Verdict("behaviour", "FAIL", (
            f"config.json declares {claim.says}, but {seen} the network's outputs "
            f"miss that prediction's target by a relative squared error of {declared:.2f} "
            f"(a trained expert scores below {MAX_RELATIVE_ERROR}; predicting zero scores 1), "
            f"while {best} explains them with {relative[best]:.2f}; at t = 0.5 the outputs "
            f"are ~ {fit[0]:.2f} x1 {fit[1]:+.2f} x0 (x1 data, x0 noise). Declare the "
            f"{claim.field} the network was trained with"))
    return (f"{objective.prediction} explains the outputs {seen} (relative squared error "
            f"{declared:.3f}; next best {best} {relative[best]:.2f})")
