"""The router's demand accounting against a synthetic routing trace with known sums."""

from __future__ import annotations

import pytest

from ddm.serving.router.fleet.demand import DemandWindow


def test_rates_are_the_windows_sums_over_the_window() -> None:
    window = DemandWindow(("hot", "cold"), window_s=10, bucket_s=1)
    for second in range(10):  # 10 s of 4 rows a second to hot, weight 0.75 each
        window.routed(100.0 + second, rows=[4, 0], weight=[3.0, 0.0])
    window.rerouted(105.5, "cold", 6)
    window.wait_started(106.0, "cold")
    window.wait_ended(108.0, "cold", 2.0)
    demand = window.summary(109.5)
    assert demand["hot"].rows_per_s == pytest.approx(4.0)
    assert demand["hot"].weight_per_s == pytest.approx(3.0)
    assert demand["hot"].idle_s == pytest.approx(0.5)
    assert demand["cold"].rows_per_s == 0.0
    assert demand["cold"].rerouted_rows_per_s == pytest.approx(0.6)
    assert demand["cold"].waited_s_per_s == pytest.approx(0.2)
    assert demand["cold"].idle_s == pytest.approx(1.5)


def test_old_buckets_leave_the_window() -> None:
    window = DemandWindow(("e",), window_s=5, bucket_s=1)
    window.routed(10.0, rows=[50], weight=[50.0])
    window.routed(14.0, rows=[5], weight=[5.0])
    assert window.summary(14.9)["e"].rows_per_s == pytest.approx(11.0)
    assert window.summary(15.0)["e"].rows_per_s == pytest.approx(1.0)  # the 10 s bucket left
    assert window.summary(19.0)["e"].rows_per_s == 0.0
    window.routed(30.0, rows=[5], weight=[5.0])  # reuses the slot of the 10 s bucket
    assert window.summary(30.0)["e"].rows_per_s == pytest.approx(1.0)


def test_a_waiting_generation_keeps_the_expert_busy_and_never_seen_is_none() -> None:
    window = DemandWindow(("a", "b"), window_s=5)
    window.wait_started(1.0, "a")
    demand = window.summary(100.0)
    assert (demand["a"].waiting, demand["a"].idle_s) == (1, 0.0)
    assert (demand["b"].waiting, demand["b"].idle_s) == (0, None)
    assert window.as_json(100.0)["window_s"] == 5.0


def test_a_bucket_longer_than_the_window_is_refused() -> None:
    with pytest.raises(ValueError, match="bucket_s <= window_s"):
        DemandWindow(("a",), window_s=1, bucket_s=2)
