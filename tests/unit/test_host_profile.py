"""The benchmarks' host profile (benchmarks/host_profile.py): py-spy's raw samples read as the
interpreter's busy share and where it was busy."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from typing import Any

import pytest

from benchmarks import host_profile as profiles
from benchmarks.gpu_check import time_went

#: py-spy's raw format (``--function``: each frame at the line its function starts), outermost
#: frame first: 60 samples in a request's handling, of which 45 in a forward, and 20 in the
#: event loop's own work; one line of another format ignored.
_LOOP = "<module> (ddm/__main__.py:1);run (asyncio/runners.py:86)"
_SERVE = f"{_LOOP};_serve (ddm/serving/model/routes.py:250)"
RAW = (f"{_SERVE};forward (ddm/models/paris.py:170) 45\n"
       f"{_SERVE} 15\n"
       f"{_LOOP} 20\n"
       "not a sample line\n")


def test_samples_are_read_as_the_interpreters_share_and_where_it_went() -> None:
    figures = profiles.summarise(RAW, seconds=2.0, rate_hz=100)
    assert figures["gil_samples"] == 80
    assert figures["gil_share"] == 0.4  # 80 of 200 samples
    assert figures["self"] == [["forward (ddm/models/paris.py)", 0.562],
                               ["run (asyncio/runners.py)", 0.25],
                               ["_serve (ddm/serving/model/routes.py)", 0.188]]
    # every sample passed through <module> and run: they say nothing and are left out
    assert figures["inclusive"] == [["_serve (ddm/serving/model/routes.py)", 0.75],
                                    ["forward (ddm/models/paris.py)", 0.562]]


def test_no_sample_is_an_idle_interpreter() -> None:
    assert profiles.summarise("", seconds=1.0) == {
        "seconds": 1.0, "gil_samples": 0, "gil_share": 0.0, "self": [], "inclusive": []}


def test_without_py_spy_each_process_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profiles, "py_spy", lambda: None)

    async def level() -> dict[str, Any]:
        async with profiles.host_profile({"router": os.getpid()}) as figures:
            pass
        return figures

    assert asyncio.run(level()) == {"router": {"error": "py-spy is not installed"}}


needs_py_spy = pytest.mark.skipif(profiles.py_spy() is None,
                                  reason="py-spy is not installed (make install)")

#: A process that says when it spins in Python, holding the GIL, until killed.
_SPINNER = """
def spin():
    print("spinning", flush=True)
    while True:
        pass
spin()
"""


@needs_py_spy
def test_a_process_spinning_in_python_is_sampled_busy_in_its_function() -> None:
    spinner = subprocess.Popen([sys.executable, "-c", _SPINNER], stdout=subprocess.PIPE,
                               text=True)
    try:
        assert spinner.stdout is not None and spinner.stdout.readline() == "spinning\n"

        async def level() -> dict[str, Any]:
            async with profiles.host_profile({"spinner": spinner.pid}) as figures:
                await asyncio.sleep(0.5)  # the level: what is sampled
            return figures

        (figures,) = asyncio.run(level()).values()
    finally:
        spinner.kill()
        spinner.wait()
    assert "error" not in figures, figures
    assert figures["seconds"] >= 0.5
    assert figures["gil_samples"] > 0
    # it held the GIL throughout: about 1 (py-spy may get fewer turns on a loaded machine, and
    # samples a little past the level's ends, a tenth of a second here)
    assert 0.2 < figures["gil_share"] <= 1.5, figures
    assert figures["self"][0][0] == "spin (<string>)", figures


@needs_py_spy
def test_a_process_py_spy_cannot_read_is_recorded_not_raised() -> None:
    async def level() -> dict[str, Any]:
        async with profiles.host_profile({"gone": 2 ** 22 + 1}) as figures:  # no such pid
            pass
        return figures

    (said,) = asyncio.run(level()).values()
    # The status is py-spy's 1, or 255 where another waiter in the process reaped it first
    # (asyncio then says it cannot know); what py-spy said is the error either way.
    assert re.match(r"py-spy sampled nothing \(exit \d+\): Error: ", said["error"]), said


def test_the_summary_says_how_busy_each_interpreter_was() -> None:
    level = {"host_profile": {
        "pool-all/0": profiles.summarise(RAW, seconds=2.0, rate_hz=100),
        "router": {"error": "py-spy is not installed"}}}
    assert time_went(level) == (
        "interpreter busy pool-all/0 40% (most in forward (ddm/models/paris.py) 56%, "
        "run (asyncio/runners.py) 25%, _serve (ddm/serving/model/routes.py) 19%), "
        "router not sampled (py-spy is not installed)")
