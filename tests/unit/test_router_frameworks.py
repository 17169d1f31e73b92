"""A router whose networks all live in pools or model servers loads no ML framework (issue 37):
PyTorch, diffusers and transformers cost a router about 300 MiB of its 380, more than the
router's whole work needs. Each check loads a router's state (``RouterState.load``: what
``ddm serve router`` does at start) in a fresh process and reads its ``sys.modules``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ("torch", "diffusers", "transformers", "jax", "flax")

_CHILD = """
import asyncio, itertools, json, sys
from pathlib import Path
from ddm.deploy.spec import load_manifest
from ddm.runtime.local import plan_local
from ddm.serving.router.api.state import RouterState

ports = itertools.count(47100)
plan = plan_local(load_manifest(Path(sys.argv[1])), lambda: next(ports), next(ports),
                  "127.0.0.1")

async def load():
    state = RouterState(plan.router_config)
    await state.load()
    assert state.loaded and state.network is not None, state.failure
    await state.close()

asyncio.run(load())
print(json.dumps(sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)))
"""


def _frameworks_loaded(manifest: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(manifest), json.dumps(FRAMEWORKS)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_router_whose_networks_are_all_pooled_loads_no_framework() -> None:
    assert _frameworks_loaded(ROOT / "examples" / "text2img-pooled.yaml") == []


def test_a_router_holding_its_network_loads_torch() -> None:
    """The check sees a framework where one is loaded (the router network in the router)."""
    assert "torch" in _frameworks_loaded(ROOT / "examples" / "text2img.yaml")
