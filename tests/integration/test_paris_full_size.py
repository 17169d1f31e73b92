"""One full-size Paris expert (DiT-XL/2, 606M parameters, random weights) runs a guided step on
the CPU, and the full-size router network runs once; each in a process of its own, whose peak
memory and time docs/paris.md records (``pytest -s`` prints them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("role, parameters, output_shape", [
    ("expert", 605_970_448, [1, 4, 32, 32]), ("router", 129_136_904, [1, 8])])
def test_full_size_network_runs_on_the_cpu(role, parameters, output_shape):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.path.join(root, "src"), root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "tests.support.paris_footprint", role],
                          cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(figures))
    assert figures["parameters"] == parameters
    assert figures["output_shape"] == output_shape
    # The float32 weights must be resident, and one step must not need several copies of them.
    assert figures["float32_weights_mib"] < figures["peak_rss_mib"] - figures["rss_before_mib"]
    assert figures["peak_rss_mib"] - figures["rss_before_mib"] < 3 * figures["float32_weights_mib"]
