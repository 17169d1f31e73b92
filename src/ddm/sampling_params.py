"""The sampling parameters a DDM takes, declared once: types, bounds, defaults, descriptions.

Everything that reads or checks them is built from :data:`PARAMS`: the spec's ``sampling``
(``ddm.deploy.spec``; the CRD's fields are generated from these, ``ddm.deploy.crd``),
``router.yaml``'s ``sampling`` (``ddm.deploy.router_config``), the router's request schema
(``ddm.serving.router.api.requests``: pydantic bounds from :meth:`Param.bounds`), ``ddm sample``'s
and the evaluation's flags (:meth:`Param.parse`) and the loop's request check
(``ddm.sampling.loop.check_request``). Every check goes through :func:`sampling_problems`, so a
value one of them takes, all of them take.

:class:`SamplingParams` is a DDM's defaults: what a request that names no steps, solver,
strategy or guidance gets, from the DDM's own YAML (``spec.sampling``) wherever it is sampled.

Pure Python, in the bottom layer: the operator and the plan import it (no NumPy, no ML
framework).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

#: Sampling steps one request (or a DDM's default) may ask for; an expert's integrate grid too.
MAX_STEPS = 1000
#: Classifier-free guidance scales a request may ask for: 0 (unconditional) .. this; 1 is
#: unguided. diffusers' pipelines default to 4.5-7.5.
MAX_GUIDANCE_SCALE = 50.0
#: The solvers every driver implements (``ddm.sampling.solvers``, the router's async steps). A
#: solver's place in this tuple, from 1, is its wire code (``docs/protocol.md``): append only.
SOLVERS = ("euler", "heun")
#: The routing strategy grammar: ``oracle``, ``ensemble``, ``topK``/``topk:K`` (K 1..99) and
#: ``threshold:P`` with 0 < P <= 1. ``ddm.sampling.routing.parse_strategy`` reads its fields.
STRATEGY_PATTERN = (
    r"^(oracle|ensemble|top[1-9][0-9]?|topk:[1-9][0-9]?"
    r"|threshold:(0?\.[0-9]*[1-9][0-9]*|1(\.0+)?))$"
)
STRATEGY_HINT = "use oracle, ensemble, topK (K 1..99), topk:K or threshold:P with 0 < P <= 1"
#: Strategies only the evaluation (``ddm eval``/``ddm report``, ``ddm sample``) runs, outside
#: ``STRATEGY_PATTERN`` so that no DDMDeployment, ``router.yaml`` or request can pick them:
#: ``random`` (an expert drawn uniformly per sample and step, the paper's FID-157 baseline).
EVALUATION_STRATEGIES = ("random",)
#: What a DDM samples with when its spec (or a request) names nothing.
DEFAULT_STEPS = 40
DEFAULT_SOLVER = "euler"
DEFAULT_STRATEGY = "top1"


@dataclass(frozen=True)
class Param:
    """One sampling parameter: ``name`` in requests, ``router.yaml`` and
    :class:`SamplingParams`; ``kind`` its type; numbers within ``minimum`` .. ``maximum``
    (``minimum`` itself refused when ``exclusive_minimum``), strings among ``choices`` or
    matching ``pattern`` (``hint`` says what it takes)."""

    name: str
    kind: type
    default: Any
    description: str
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    choices: tuple[str, ...] = ()
    pattern: str | None = None
    hint: str = ""

    @property
    def key(self) -> str:
        """The CRD's and a DDMDeployment's spelling (``guidanceScale``)."""
        first, *rest = self.name.split("_")
        return first + "".join(word.capitalize() for word in rest)

    @property
    def flag(self) -> str:
        """The command-line flag (``--guidance-scale``)."""
        return "--" + self.name.replace("_", "-")

    def range(self) -> str:
        """The bounds as an interval: ``[1, 1000]``, ``(0, 1]``."""
        return (f"{'(' if self.exclusive_minimum else '['}{self.minimum:g}, "
                f"{self.maximum:g}]")

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` (``must be ...``), or None when it is valid."""
        if self.kind is str:
            if not isinstance(value, str):
                return f"must be a string, got {value!r}"
            if self.choices and value not in self.choices:
                return f"must be one of {', '.join(self.choices)}, got {value!r}"
            if self.pattern and not re.match(self.pattern, value):
                return f"{value!r} is not valid: {self.hint}"
            return None
        number = (isinstance(value, int) if self.kind is int
                  else isinstance(value, (int, float)) and math.isfinite(value))
        if (not number or isinstance(value, bool) or not self._inside(value)):
            what = "an integer" if self.kind is int else "a number"
            return f"must be {what} in {self.range()}, got {value!r}"
        return None

    def _inside(self, value: float) -> bool:
        low = self.minimum if self.minimum is not None else -math.inf
        high = self.maximum if self.maximum is not None else math.inf
        return (low < value if self.exclusive_minimum else low <= value) and value <= high

    def parse(self, text: str) -> Any:
        """A command-line value as ``kind``; ``ValueError`` naming the flag and what it takes
        (argparse reports it as the flag's error)."""
        try:
            value = self.kind(text)
        except ValueError:
            value = text
        problem = self.problem(value)
        if problem is not None:
            raise ValueError(f"{self.flag} {problem.replace(f'got {value!r}', f'got {text!r}')}")
        return value

    def bounds(self) -> dict[str, Any]:
        """The numeric bounds as pydantic ``Field`` keywords (``ge``/``gt``, ``le``)."""
        found: dict[str, Any] = {}
        if self.minimum is not None:
            found["gt" if self.exclusive_minimum else "ge"] = self.minimum
        if self.maximum is not None:
            found["le"] = self.maximum
        return found


STEPS = Param("steps", int, DEFAULT_STEPS, "denoising steps, from noise to image",
              minimum=1, maximum=MAX_STEPS)
SOLVER = Param("solver", str, DEFAULT_SOLVER,
               "the ODE solver: euler (one velocity per step) or heun (two)", choices=SOLVERS)
STRATEGY = Param("strategy", str, DEFAULT_STRATEGY,
                 "how each step picks experts: oracle (by label), ensemble, topK (or topk:K, "
                 "K 1..99) or threshold:P (0 < P <= 1)",
                 pattern=STRATEGY_PATTERN, hint=STRATEGY_HINT)
GUIDANCE_SCALE = Param("guidance_scale", float, 1.0,
                       "classifier-free guidance scale (text DDMs; 1: unguided, the only value "
                       "for labels), applied inside each expert",
                       minimum=0.0, maximum=MAX_GUIDANCE_SCALE)
GUIDANCE_CUTOFF = Param("guidance_cutoff", float, 1.0,
                        "the fraction of the steps guided, above 0 (text DDMs); later steps run "
                        "unguided, as diffusers' CFG cut-off callbacks",
                        minimum=0.0, maximum=1.0, exclusive_minimum=True)
#: A DDM's sampling parameters, in :class:`SamplingParams`'s order.
PARAMS = (STEPS, SOLVER, STRATEGY, GUIDANCE_SCALE, GUIDANCE_CUTOFF)
PARAMS_BY_NAME = {param.name: param for param in PARAMS}


class SamplingError(ValueError):
    """Sampling parameters out of their declared bounds; ``problems`` holds ``(name,
    message)`` pairs, so that each reader names the field its own way."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{name} {message}" for name, message in problems))
        self.problems = tuple(problems)


def sampling_problems(values: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(name, message)`` for each of ``values`` (by :attr:`Param.name`) outside its
    declaration; names not declared here are not looked at. The one check of the parameters'
    types and bounds."""
    return [(name, problem) for name, value in values.items()
            if name in PARAMS_BY_NAME and (problem := PARAMS_BY_NAME[name].problem(value))]


def check_sampling(values: Mapping[str, Any]) -> None:
    """Raise :class:`SamplingError` when any of ``values`` is out of its bounds."""
    problems = sampling_problems(values)
    if problems:
        raise SamplingError(problems)


@dataclass(frozen=True)
class SamplingParams:
    """A DDM's sampling defaults (``spec.sampling``, ``router.yaml``'s ``sampling``): what a
    request that leaves a parameter out gets. Checked when made (:class:`SamplingError`);
    an integral guidance (``guidanceScale: 4``) is kept as a float."""

    steps: int = STEPS.default
    solver: str = SOLVER.default
    strategy: str = STRATEGY.default
    guidance_scale: float = GUIDANCE_SCALE.default
    guidance_cutoff: float = GUIDANCE_CUTOFF.default

    def __post_init__(self) -> None:
        check_sampling(dataclasses.asdict(self))
        for param in PARAMS:
            if param.kind is float:  # frozen: set as dataclasses' own __init__ does
                object.__setattr__(self, param.name, float(getattr(self, param.name)))


def add_sampling_flags(parser: argparse.ArgumentParser, params: Sequence[Param] = PARAMS, *,
                       default: str = "the DDM's own", evaluation: bool = False) -> None:
    """A flag per parameter (``--guidance-scale``), its value checked against the declaration
    as argparse parses it; the default None stands for ``default``. ``evaluation`` lets
    ``--strategy`` take the evaluation's baselines too (``EVALUATION_STRATEGIES``)."""
    for param in params:
        extra = (f", or {', '.join(EVALUATION_STRATEGIES)} (the evaluation's baseline, "
                 "in-process only)" if evaluation and param is STRATEGY else "")
        parser.add_argument(param.flag, type=_flag_type(param, evaluation), default=None,
                            metavar=param.name.upper(),
                            help=f"{param.description}{extra} (default: {default})")


def _flag_type(param: Param, evaluation: bool) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if evaluation and param is STRATEGY and text in EVALUATION_STRATEGIES:
            return text
        try:
            return param.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return parse
