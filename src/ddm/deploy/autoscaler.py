"""How many replicas an autoscaled expert should run: the HPA's algorithm on routed rows (pure).

:func:`decide` is the HorizontalPodAutoscaler's (autoscaling/v2, ``replica_calculator`` and
``normalizeDesiredReplicasWithBehaviors``) applied to the router's demand, plus scale to zero:

1. the raw recommendation is ``ceil(rows_per_s / target)``, kept at the current count while the
   load per replica is within ``TOLERANCE`` of the target (HPA's 10%);
2. an expert a generation waits for, or one with demand within its ``scale_down_delay_s``, gets
   at least one replica (from zero: neither window nor policy holds back that first one); one
   without any for a whole delay needs none, and its last replica goes then, whatever the
   scale-down window (KEDA's ``cooldownPeriod`` does the same);
3. the recommendation is clamped to ``[min_replicas, max_replicas]``;
4. stabilization: scaling up takes the lowest recommendation of the scale-up window, scaling
   down the highest of the scale-down window;
5. the policies limit the change per period, counted from the replicas at the period's start.

State between calls is a :class:`History` the caller keeps per expert and passes back; time is
the caller's (monotonic seconds), so tests drive it with known answers. What is scaled is a
:class:`Scaled`: an expert with servers of its own, or a pool, whose demand is the sum of its
member experts' (:meth:`Scaled.demand`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Mapping

from ddm.deploy.autoscaling import Autoscaling, ScalingRules

#: HPA's tolerance: no change while the load per replica is within 10% of the target.
TOLERANCE = 0.1


@dataclass(frozen=True)
class Demand:
    """An expert's demand: routed rows per second (summed over the routers, over the rate
    window), the generations waiting for it to have a replica now, and whether rows came
    since the last reading."""

    rows_per_s: float
    waiting: int
    active: bool = False  #: rows were routed to it since the last reading

    @property
    def now(self) -> bool:
        """Whether the expert is in demand at this moment (the delay counts from the last)."""
        return self.active or self.waiting > 0


@dataclass(frozen=True)
class Scaled:
    """What one scaler decision sets the replicas of: an expert's servers (``experts`` is its
    own name) or, ``pool``, a pool's, which serve every member expert in ``experts`` in one
    process each. Its ``rules`` are the expert's or the pool's ``autoscaling``; ``ready_s``:
    how long one of its servers may take to become ready once started (its plan's), for
    which a cold start of it counts as in demand."""

    name: str
    experts: tuple[str, ...]
    rules: Autoscaling
    ready_s: float
    pool: bool = False

    @property
    def key(self) -> str:
        """Its name among the others (a pool may be named like an expert)."""
        return f"pool/{self.name}" if self.pool else self.name

    def demand(self, experts: Mapping[str, Demand]) -> Demand:
        """Its demand from each expert's: rows per second and waiting generations summed
        (a pool replica does every member's rows), active when any member's is. A pool at zero
        is every member missing: one generation waiting for any member wakes it."""
        members = [experts[name] for name in self.experts]
        return Demand(sum(d.rows_per_s for d in members), sum(d.waiting for d in members),
                      any(d.active for d in members))


@dataclass(frozen=True)
class History:
    """What :func:`decide` remembers per expert: its recent recommendations and scale events
    ``(time, replicas)`` / ``(time, change)``, and when it last had demand."""

    recommendations: tuple[tuple[float, int], ...] = ()
    changes: tuple[tuple[float, int], ...] = ()
    last_demand: float | None = None

    @staticmethod
    def start(now: float) -> History:
        """A fresh history: the expert counts as in demand ``now``, so an operator that
        (re)starts never takes a replica away before a whole scale-down delay has passed."""
        return History(last_demand=now)


def raw_recommendation(rules: Autoscaling, current: int, demand: Demand) -> int:
    """Replicas for ``demand`` at ``rules.target_rows_per_s`` each, before bounds and
    behavior (HPA's tolerance kept)."""
    if current > 0:
        usage = demand.rows_per_s / (current * rules.target_rows_per_s)
        if abs(usage - 1.0) <= TOLERANCE:
            return current
    return math.ceil(demand.rows_per_s / rules.target_rows_per_s)


def decide(rules: Autoscaling, current: int, demand: Demand, history: History, now: float
           ) -> tuple[int, History]:
    """The replicas to run now, and the history to pass to the next call."""
    last = now if demand.now else history.last_demand
    recent = last is not None and now - last < rules.scale_down_delay_s
    # A whole delay without demand: none needed, whatever rate the window still averages.
    raw = raw_recommendation(rules, current, demand) if recent else 0
    floor = 1 if demand.waiting > 0 or recent else 0
    load = _bounded(rules, raw)
    wanted = _bounded(rules, max(raw, floor))
    keep = max(rules.scale_up.stabilization_window_s, rules.scale_down.stabilization_window_s)
    recommendations = tuple((t, r) for t, r in history.recommendations if now - t < keep)
    stabilized = _stabilized(rules, current, wanted, recommendations, now)
    limited = _limited(rules, current, stabilized, history.changes, now)
    if current == 0 and wanted > 0:
        limited = max(limited, 1)  # a generation needs it: nothing holds back the first one
    if current <= 1 and not floor:
        limited = 0  # a whole delay idle: the last replica goes, as KEDA's cooldown decides
    replicas = _bounded(rules, limited)
    period = max((p.period_s for p in rules.scale_up.policies + rules.scale_down.policies),
                 default=0)
    changes = tuple((t, c) for t, c in history.changes if now - t < period)
    if replicas != current:
        changes += ((now, replicas - current),)
    # The load's recommendation is remembered, not the floor: the scale-down window smooths
    # the load between replicas; the delay alone decides when the last one goes.
    return replicas, replace(history, recommendations=recommendations + ((now, load),),
                             changes=changes, last_demand=last)


def _bounded(rules: Autoscaling, replicas: int) -> int:
    return min(max(replicas, rules.min_replicas), rules.max_replicas)


def _stabilized(rules: Autoscaling, current: int, wanted: int,
                recommendations: tuple[tuple[float, int], ...], now: float) -> int:
    """HPA's ``stabilizeRecommendationWithBehaviors``: up to the lowest recommendation of
    the scale-up window, down to the highest of the scale-down window."""
    up = min([wanted] + [r for t, r in recommendations
                         if now - t < rules.scale_up.stabilization_window_s])
    down = max([wanted] + [r for t, r in recommendations
                           if now - t < rules.scale_down.stabilization_window_s])
    return min(max(current, up), down)


def _limited(rules: Autoscaling, current: int, wanted: int,
             changes: tuple[tuple[float, int], ...], now: float) -> int:
    """``wanted`` within what the policies allow in their periods."""
    if wanted > current:
        return min(wanted, _limit(rules.scale_up, current, changes, now, up=True))
    if wanted < current:
        return max(wanted, _limit(rules.scale_down, current, changes, now, up=False))
    return wanted


def _limit(rules: ScalingRules, current: int, changes: tuple[tuple[float, int], ...],
           now: float, *, up: bool) -> int:
    """HPA's ``calculateScaleUpLimitWithScalingRules`` / ``...ScaleDownLimit...``."""
    if rules.select_policy == "Disabled":
        return current
    limits = []
    for policy in rules.policies:
        recent = [c for t, c in changes if now - t < policy.period_s]
        added = sum(c for c in recent if c > 0)
        removed = -sum(c for c in recent if c < 0)
        start = current - added + removed  # the replicas when the period began
        if up:
            limits.append(start + policy.value if policy.type == "Pods"
                          else math.ceil(start * (1 + policy.value / 100)))
        else:
            limits.append(start - policy.value if policy.type == "Pods"
                          else math.floor(start * (1 - policy.value / 100)))
    most_change = max if up else min
    least_change = min if up else max
    return (most_change if rules.select_policy == "Max" else least_change)(limits)
