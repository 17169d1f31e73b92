"""The quick lane's selection (``make test-fast``) names real modules: a module renamed or
moved would otherwise slip back into the lane unnoticed."""

from __future__ import annotations

from tests.conftest import SLOW_MODULES, TESTS


def test_every_module_the_quick_lane_leaves_out_exists() -> None:
    assert [path for path in SLOW_MODULES if not (TESTS / path).is_file()] == []
