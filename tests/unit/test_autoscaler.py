"""The operator's scale decision (ddm.deploy.autoscaler): HPA's rules on routed rows, with
scale to zero. Each expectation is worked out by hand from the rule it names."""

from __future__ import annotations

from ddm.deploy.autoscaling import Autoscaling, ScalePolicy, ScalingRules
from ddm.deploy.autoscaler import Demand, History, decide

IDLE = Demand(rows_per_s=0.0, waiting=0)
AT_ONCE = ScalingRules(0, "Max", (ScalePolicy("Percent", 100, 15),))


def _rules(**fields) -> Autoscaling:
    defaults = dict(min_replicas=0, max_replicas=8, scale_down_delay_s=60,
                    target_rows_per_s=64, scale_down=AT_ONCE)
    return Autoscaling(**{**defaults, **fields})


def _run(rules: Autoscaling, current: int, steps: list[tuple[float, Demand]],
         history: History | None = None) -> list[int]:
    """Replicas after each (time, demand), each decision applied before the next."""
    history = history or History.start(steps[0][0])
    seen = []
    for now, demand in steps:
        current, history = decide(rules, current, demand, history, now)
        seen.append(current)
    return seen


def test_replicas_are_the_rows_per_second_over_the_target_rounded_up() -> None:
    # 130 rows/s at 64 each: ceil(2.03) = 3 (HPA's default scale-up allows 1 -> 5)
    assert _run(_rules(), 1, [(0, Demand(130, 0, True))]) == [3]
    assert _run(_rules(max_replicas=2), 1, [(0, Demand(1000, 0, True))]) == [2]


def test_within_ten_percent_of_the_target_nothing_changes() -> None:
    # 2 replicas at 64 each: 135 rows/s is 5% over, 141 is 10.2% over -> ceil(2.2) = 3
    assert _run(_rules(), 2, [(0, Demand(135, 0, True))]) == [2]
    assert _run(_rules(), 2, [(0, Demand(141, 0, True))]) == [3]


def test_a_waiting_generation_starts_an_expert_at_zero_whatever_the_policies() -> None:
    # 100% of 0 replicas is 0 and the scale-up window's earlier recommendations are 0,
    # yet the first replica is not held back
    slow_up = ScalingRules(120, "Max", (ScalePolicy("Percent", 100, 60),))
    _, history = decide(_rules(scale_up=slow_up), 0, IDLE, History(), 0)
    assert _run(_rules(scale_up=slow_up), 0, [(1, Demand(0, 1))], history) == [1]


def test_rows_routed_to_an_expert_at_zero_start_it_too() -> None:
    """With reroute, rows still count against the expert they wanted."""
    assert _run(_rules(), 0, [(0, Demand(0.5, 0, True))]) == [1]


def test_the_last_replica_goes_once_the_delay_passes_without_demand() -> None:
    rules = _rules(scale_down_delay_s=60)
    assert _run(rules, 1, [(0, IDLE), (30, IDLE), (59.9, IDLE), (60, IDLE)]) == [1, 1, 1, 0]
    # demand at t=50 restarts the delay: zero at 110, not 60
    assert _run(rules, 1, [(0, IDLE), (50, Demand(2, 0, True)), (100, IDLE), (110, IDLE)]
                ) == [1, 1, 1, 0]


def test_the_last_replica_goes_after_the_delay_whatever_the_scale_down_window() -> None:
    """HPA's default 300 s window would keep the load's 1 for 300 s; the delay decides."""
    rules = _rules(scale_down_delay_s=60, scale_down=ScalingRules(300, "Max", AT_ONCE.policies))
    assert _run(rules, 1, [(0, Demand(5, 0, True)), (30, Demand(5, 0, True)), (89, IDLE),
                           (90, IDLE)]) == [1, 1, 1, 0]
    # between replicas the window still holds: 3 wanted at t=0 keeps 3 while load wants 1
    assert _run(rules, 3, [(0, Demand(190, 0, True)), (10, Demand(5, 0, True))]) == [3, 3]


def test_a_rate_still_averaging_old_rows_does_not_outlast_the_delay() -> None:
    """The window's rate lingers after the last row; the delay counts from that row."""
    rules = _rules(scale_down_delay_s=10)
    lingering = Demand(0.5, 0, active=False)
    assert _run(rules, 1, [(0, Demand(2, 0, True)), (9, lingering), (10, lingering)]
                ) == [1, 1, 0]


def test_a_fresh_operator_waits_a_whole_delay_before_taking_the_last_replica() -> None:
    assert _run(_rules(scale_down_delay_s=60), 1, [(1000, IDLE), (1059, IDLE), (1060, IDLE)]
                ) == [1, 1, 0]


def test_min_replicas_is_kept_whatever_the_demand() -> None:
    assert _run(_rules(min_replicas=2), 3, [(0, IDLE), (100, IDLE)]) == [2, 2]
    assert _run(_rules(min_replicas=2), 0, [(0, IDLE)]) == [2]


def test_scaling_down_takes_the_highest_recommendation_of_the_window() -> None:
    rules = _rules(min_replicas=1, scale_down=ScalingRules(300, "Max", AT_ONCE.policies))
    steps = [(0, Demand(256, 0, True)), (10, Demand(64, 0, True)), (299, Demand(64, 0, True)),
             (300, Demand(64, 0, True))]
    # 4 wanted at t=0 stays the window's highest until it is 300 s old
    assert _run(rules, 4, steps) == [4, 4, 4, 1]


def test_scaling_up_takes_the_lowest_recommendation_of_its_window() -> None:
    rules = _rules(min_replicas=1,
                   scale_up=ScalingRules(30, "Max", (ScalePolicy("Pods", 10, 15),)))
    steps = [(0, Demand(64, 0, True)), (10, Demand(256, 0, True)), (29, Demand(256, 0, True)),
             (30, Demand(256, 0, True))]
    assert _run(rules, 1, steps) == [1, 1, 1, 4]


def test_policies_limit_the_change_per_period() -> None:
    one_a_minute = ScalingRules(0, "Max", (ScalePolicy("Pods", 1, 60),))
    down = _rules(min_replicas=1, scale_down=one_a_minute)
    low = Demand(64, 0, True)
    assert _run(down, 4, [(0, low), (10, low), (60, low), (120, low)]) == [3, 3, 2, 1]
    up = _rules(scale_up=one_a_minute)
    high = Demand(320, 0, True)
    assert _run(up, 1, [(0, high), (10, high), (60, high)]) == [2, 2, 3]


def test_select_policy_picks_the_most_or_least_change_or_none() -> None:
    both = (ScalePolicy("Pods", 1, 15), ScalePolicy("Percent", 200, 15))
    high = Demand(640, 0, True)  # 10 wanted from 2: Pods allows 3, Percent 6
    assert _run(_rules(max_replicas=10, scale_up=ScalingRules(0, "Max", both)), 2,
                [(0, high)]) == [6]
    assert _run(_rules(max_replicas=10, scale_up=ScalingRules(0, "Min", both)), 2,
                [(0, high)]) == [3]
    assert _run(_rules(scale_up=ScalingRules(0, "Disabled", both)), 2, [(0, high)]) == [2]
    never_down = ScalingRules(0, "Disabled", AT_ONCE.policies)
    assert _run(_rules(scale_down=never_down, scale_down_delay_s=0), 3, [(0, IDLE)]) == [3]
