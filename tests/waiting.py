"""Waiting for the cluster (or a server) to reach a state: poll with a deadline, never sleep
a fixed time, and fail saying what was awaited, what was last seen, and why if one can say."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout_s: float, what: str,
             explain: Callable[[], str] = lambda: "", interval_s: float = 0.2) -> T:
    """Poll ``check`` until it returns something truthy; fail with ``what`` at the deadline
    (and what ``explain`` says then, e.g. the logs of the processes involved)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}; last: {result!r}\n"
                        f"{explain()}", pytrace=False)
        time.sleep(interval_s)
