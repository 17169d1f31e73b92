"""A pool at zero under ``ddm up`` (issue 37 item 4), real processes on loopback: the shipped
text-to-image DDM with experts 0 and 1 alone and experts 2 and 3 in pool ``rare`` at
``minReplicas: 0``, so the router sees both pooled experts missing while the pool is down.

* ``wait``: no pool process while idle; a prompt the router sends to expert-3 waits, wakes the
  pool once, succeeds, and the pool goes back to zero after its scale-down delay.
* ``reroute``: the same prompt is answered at once by the experts that are up (its steps
  named rerouted), and the rerouted demand wakes the pool.
* The memory refusal: the pooled example with a CPU memory limit its members exceed: ``ddm up``
  prints the pool's reason (each member's bytes, the sum, the limit) and exits 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest
import yaml

from tests.support.local_runtime import Log, ddm_up
from tests.support.processes import listening_pid

ROOT = Path(__file__).resolve().parents[2]
TEXT2IMG, POOLED = ROOT / "examples" / "text2img.yaml", ROOT / "examples" / "text2img-pooled.yaml"
#: Drawn by expert-3 (trained on 2, 3 and 7), in pool ``rare``.
RARE_PROMPT = "a thick red seven"
EVENT_TIMEOUT_S = 180.0

pytestmark = pytest.mark.slow


def _manifest(tmp_path: Path, policy: str) -> Path:
    document = yaml.safe_load(TEXT2IMG.read_text())
    spec = document["spec"]
    spec["router"]["missingExpert"] = {"policy": policy, "waitSeconds": 120}
    spec["pools"] = [{"name": "rare", "accelerator": {"type": "cpu"}, "autoscaling": {
        "minReplicas": 0, "maxReplicas": 1, "scaleDownDelaySeconds": 3}}]
    for expert in spec["experts"]:
        if expert["name"] in ("expert-2", "expert-3"):
            for key in ("framework", "accelerator", "replicas", "resources"):
                expert.pop(key, None)  # the pool places it (and serves it with PyTorch)
            expert["pool"] = "rare"
    path = tmp_path / f"text2img-{policy}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def _generate(url: str, log: Log) -> dict[str, Any]:
    answer = httpx.post(f"{url}/v1/generate", timeout=300,
                        json={"prompts": [RARE_PROMPT], "steps": 6, "seed": 0})
    assert answer.status_code == 200, f"{answer.text}\n{log.getvalue()[-3000:]}"
    return answer.json()


def _until(condition: Callable[[], bool], what: str, log: Log) -> None:
    """Poll ``condition()`` until true (the processes are external: nothing else to wait on)."""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen:\n{log.getvalue()[-3000:]}"
        time.sleep(0.2)


def test_under_wait_a_generation_wakes_the_pool_at_zero_once(tmp_path: Path) -> None:
    with ddm_up(_manifest(tmp_path, "wait")) as (plan, log, _):
        (pool,) = plan.pools
        assert pool.name == "pool-rare/0" and listening_pid(pool.port) is None  # idle
        answer = _generate(plan.url, log)
        assert "expert-3" in answer["experts"][0] and answer["waited_s"] > 0, answer
        assert listening_pid(pool.port) is not None
        assert log.getvalue().count("scaling pool rare up from zero") == 1
        _until(lambda: "pool rare is ready (" in log.getvalue(), "the pool ready", log)
        _until(lambda: listening_pid(pool.port) is None, "the pool back at zero", log)
        assert "scaling pool rare to zero: no demand for 3 s" in log.getvalue()
        assert f"{pool.name} exited" not in log.getvalue()  # stopped, not crashed


def test_under_reroute_the_experts_up_answer_and_the_pool_wakes(tmp_path: Path) -> None:
    with ddm_up(_manifest(tmp_path, "reroute")) as (plan, log, _):
        (pool,) = plan.pools
        answer = _generate(plan.url, log)
        assert answer["waited_s"] == 0.0 and any(answer["rerouted"][0]), answer
        assert set(answer["experts"][0]) <= {"expert-0", "expert-1"}, answer
        _until(lambda: "scaling pool rare up from zero" in log.getvalue(),
               "the rerouted rows waking the pool", log)
        _until(lambda: "pool rare is ready (" in log.getvalue(), "the pool ready", log)
        assert listening_pid(pool.port) is not None


def test_a_pool_over_its_memory_limit_stops_ddm_up_saying_why(tmp_path: Path) -> None:
    document = yaml.safe_load(POOLED.read_text())
    document["spec"]["pools"][0]["resources"] = {"limits": {"memory": "1Gi"}}
    path = tmp_path / "text2img-pooled-1gi.yaml"
    path.write_text(yaml.safe_dump(document))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-m", "ddm", "up", str(path)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert "pool-models/0 exited with status 1 before it was ready: pool of expert-0" in said
    assert ("the pool's members do not fit: sum " in said
            and " bytes > limit 1,073,741,824 bytes (--memory-limit-bytes: the pool's "
                "resources.limits.memory); " in said and "; expert-0 " in said)
    assert "all 1 process(es) stopped" in said
