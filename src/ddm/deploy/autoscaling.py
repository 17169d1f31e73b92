"""An expert's ``autoscaling``: its bounds, its target and HPA-style ``behavior`` (pure).

The target is routed rows per second per replica (``target.rowsPerSecond``). An expert's
work is one forward pass per row the router sends it, batched: its cost is proportional to
the rows, whatever their mixture weight, and a replica's capacity is a rows-per-second
figure one can measure (``python -m benchmarks serve``). The router counts those rows before
any rerouting, so an expert with no replica still shows the demand it would get. Weight mass
changes the image, not the compute; time waited and generations waiting are symptoms of too
few replicas, not a measure of how many are needed (a waiting generation does start an
expert at zero: :mod:`ddm.deploy.autoscaler`).

``behavior`` is the HorizontalPodAutoscaler's (autoscaling/v2): per direction a
stabilization window and rate policies (``Pods`` or ``Percent`` per ``periodSeconds``,
combined by ``selectPolicy``), with HPA's defaults. ``scaleDownDelaySeconds`` is how long an
expert without any demand keeps one replica before going to ``minReplicas`` 0 (KEDA's
``cooldownPeriod``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddm.deploy.fields import FieldReader
from ddm.deploy.limits import DEFAULT_SCALE_DOWN_DELAY_S, MAX_REPLICAS, MAX_SCALE_DOWN_DELAY_S

#: The router's Prometheus series the operator scales by (``ddm.serving.router.fleet.demand``
#: exports them, labelled by ``expert``; a counter's samples end in ``_total``): routed rows, and
#: generations waiting now for the expert to have a replica.
ROWS_METRIC = "ddm_router_expert_rows"
WAITING_METRIC = "ddm_router_expert_generations_waiting"
#: The window demand rates are averaged over, in seconds: the router's ``/v1/demand`` and the
#: operator's rates from successive readings of those series alike.
DEMAND_WINDOW_S = 30.0
#: Rows per second one replica is sized for, unless ``target.rowsPerSecond`` says otherwise.
DEFAULT_TARGET_ROWS_PER_S = 64
MAX_TARGET_ROWS_PER_S = 1_000_000
#: HPA's bounds on a stabilization window and a policy's period.
MAX_STABILIZATION_WINDOW_S = 3600
MAX_POLICY_PERIOD_S = 1800
MAX_POLICY_VALUE = 10_000
POLICY_TYPES = ("Pods", "Percent")
#: Who sets the replicas: the operator's own scaler, or something else (an HPA on external
#: metrics, KEDA) that the operator then leaves them to.
OPERATOR_SCALER = "operator"
SCALERS = (OPERATOR_SCALER, "external")
SELECT_POLICIES = ("Max", "Min", "Disabled")


@dataclass(frozen=True)
class ScalePolicy:
    """At most ``value`` pods (``Pods``) or ``value`` percent (``Percent``) of the replicas
    at the start of the last ``period_s`` seconds may be added (or removed) in that period."""

    type: str
    value: int
    period_s: int


@dataclass(frozen=True)
class ScalingRules:
    """One direction's rules: recommendations are stabilized over the last
    ``stabilization_window_s`` seconds; ``select_policy`` picks the policy allowing the most
    change (``Max``), the least (``Min``), or forbids scaling this way (``Disabled``)."""

    stabilization_window_s: int
    select_policy: str
    policies: tuple[ScalePolicy, ...]


#: HPA's defaults: up at once, by 100% or 4 pods per 15 s, whichever is more; down after a
#: 300 s window, by up to 100% per 15 s.
DEFAULT_SCALE_UP = ScalingRules(0, "Max", (ScalePolicy("Percent", 100, 15),
                                           ScalePolicy("Pods", 4, 15)))
DEFAULT_SCALE_DOWN = ScalingRules(300, "Max", (ScalePolicy("Percent", 100, 15),))


@dataclass(frozen=True)
class Autoscaling:
    """An expert's replicas follow the router's demand between ``min_replicas`` (0: none
    while idle, started on demand) and ``max_replicas``, sized for ``target_rows_per_s``
    routed rows per second each; ``scale_down_delay_s``: how long without any demand before
    its last replica goes (``min_replicas`` 0). ``scaler``: ``external`` leaves the replicas
    to an HPA or KEDA (docs/autoscaling.md), the operator only keeps its hands off them."""

    min_replicas: int
    max_replicas: int
    scale_down_delay_s: int = DEFAULT_SCALE_DOWN_DELAY_S
    target_rows_per_s: int = DEFAULT_TARGET_ROWS_PER_S
    scale_up: ScalingRules = DEFAULT_SCALE_UP
    scale_down: ScalingRules = DEFAULT_SCALE_DOWN
    scaler: str = OPERATOR_SCALER


def parse_autoscaling(reader: FieldReader) -> Autoscaling | None:
    """``spec.experts[].autoscaling``; None (and problems in ``reader``) when invalid."""
    low = reader.integer("minReplicas", None, 0, MAX_REPLICAS)
    high = reader.integer("maxReplicas", None, 1, MAX_REPLICAS)
    delay = reader.integer("scaleDownDelaySeconds", DEFAULT_SCALE_DOWN_DELAY_S, 0,
                           MAX_SCALE_DOWN_DELAY_S)
    target = reader.child("target")
    rows = target.integer("rowsPerSecond", DEFAULT_TARGET_ROWS_PER_S, 1, MAX_TARGET_ROWS_PER_S)
    target.done()
    scaler = reader.string("scaler", OPERATOR_SCALER, choices=SCALERS) or OPERATOR_SCALER
    behavior = reader.child("behavior")
    up = _rules(behavior.child("scaleUp"), DEFAULT_SCALE_UP)
    down = _rules(behavior.child("scaleDown"), DEFAULT_SCALE_DOWN)
    behavior.done()
    for key, value in (("minReplicas", low), ("maxReplicas", high)):
        if value is None and not any(p.startswith(f"{reader.path}.{key}")
                                     for p in reader.problems):
            reader.problem(key, "is required")
    reader.done()
    if low is None or high is None:
        return None
    if low > high:
        reader.problem("minReplicas", f"{low} is above maxReplicas {high}")
        return None
    return Autoscaling(low, high, DEFAULT_SCALE_DOWN_DELAY_S if delay is None else delay,
                       rows or DEFAULT_TARGET_ROWS_PER_S, up, down, scaler)


def fleet_problems(experts: list[Autoscaling | None]) -> list[str]:
    """Rules across a DDM's experts (each with its own ``autoscaling``, or its pool's): one
    must keep a replica. The router learns the image
    shape from its experts and is not ready while none has a ready replica, so with every
    expert at zero it would never be in its Service, see demand, nor let anything start."""
    if experts and all(e is not None and e.min_replicas == 0 for e in experts):
        return ["spec.experts: every expert has autoscaling.minReplicas 0 (its own or its "
                "pool's); keep at least one replica of one expert (the router needs a ready "
                "expert to serve at all)"]
    return []


def _rules(reader: FieldReader, default: ScalingRules) -> ScalingRules:
    """One direction of ``behavior``: an omitted field keeps HPA's default."""
    window = reader.integer("stabilizationWindowSeconds", default.stabilization_window_s, 0,
                            MAX_STABILIZATION_WINDOW_S)
    select = reader.string("selectPolicy", default.select_policy, choices=SELECT_POLICIES)
    policies = default.policies
    if reader.has("policies"):
        raw = reader.items("policies")
        if not raw:
            reader.problem("policies", "must list at least one policy (or be left out)")
        policies = tuple(p for i, item in enumerate(raw)
                         if (p := _policy(FieldReader(item, f"{reader.path}.policies[{i}]",
                                                      reader.problems))))
    reader.done()
    return ScalingRules(default.stabilization_window_s if window is None else window,
                        select or default.select_policy, policies or default.policies)


def _policy(reader: FieldReader) -> ScalePolicy | None:
    kind = reader.string("type", None, choices=POLICY_TYPES)
    value = reader.integer("value", None, 1, MAX_POLICY_VALUE)
    period = reader.integer("periodSeconds", None, 1, MAX_POLICY_PERIOD_S)
    for key in ("type", "value", "periodSeconds"):
        if not reader.has(key):
            reader.problem(key, "is required")
    reader.done()
    if kind is None or value is None or period is None:
        return None
    return ScalePolicy(kind, value, period)
