"""Issue 13's "must show": with ``ddm up`` running the shipped example, 300 slow connections
to an expert and 300 to the router do not stop a normal ``POST /v1/generate``, and the server
closes each of them by its documented deadline (the defaults of ``ConnectionLimits``: 10 s for
a request head, 30 s for a body). The keep-alive deadline (75 s) is left to
test_hostile_clients.py, which shortens it.
"""

from __future__ import annotations

import asyncio
import io
import threading
import time
from pathlib import Path

import httpx

from ddm.deploy.spec import load_manifest
from ddm.runtime.local import LocalPlan, free_port, run_local
from ddm.serving.http.connections import ConnectionLimits
from hostile import check_closed_in_time, swarm

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits.yaml"
#: Timer lateness tolerated on a shared two-core machine.
SLACK_S = 3.0
PER_KIND = {"idle": 60, "partial-line": 60, "trickled-head": 60, "slow-body": 100,
            "huge-head": 20}


def test_ddm_up_generates_through_300_slow_connections_on_an_expert_and_300_on_the_router():
    ready, stop, log = threading.Event(), threading.Event(), io.StringIO()
    plans: list[LocalPlan] = []

    def on_ready(plan: LocalPlan) -> None:
        plans.append(plan)
        ready.set()

    thread = threading.Thread(target=run_local, args=(load_manifest(EXAMPLE),), kwargs={
        "router_port": free_port(), "out": log, "on_ready": on_ready, "stop": stop})
    thread.start()
    try:
        while not ready.wait(0.5):
            assert thread.is_alive(), f"ddm up stopped before it was ready:\n{log.getvalue()}"
        plan = plans[0]
        request = {"labels": [3, 8], "steps": 10, "seed": 0}

        def generate() -> float:
            started = time.perf_counter()
            answer = httpx.post(f"{plan.url}/v1/generate", json=request, timeout=60)
            assert answer.status_code == 200, answer.text
            return time.perf_counter() - started

        alone = generate()

        async def attack() -> tuple[list, float, int]:
            attackers, tasks = [], []
            for port, path in ((plan.experts[0].port, "/v1/velocity"),
                               (plan.router.port, "/v1/generate")):
                opened, running = await swarm("127.0.0.1", port, path, PER_KIND)
                attackers += opened
                tasks += running
            attacked = await asyncio.to_thread(generate)
            still_open = sum(a.closed is None for a in attackers)
            await asyncio.wait_for(asyncio.gather(*tasks), 30 + SLACK_S + 10)
            return attackers, attacked, still_open

        attackers, attacked, still_open = asyncio.run(attack())
        assert still_open > 500, "the generation was answered only once the attackers were cut"
        longest = check_closed_in_time(attackers, ConnectionLimits(), SLACK_S)
        print(f"\nddm up: {len(attackers)} attackers, generation {alone:.2f} s alone, "
              f"{attacked:.2f} s under attack; longest-lived per kind: "
              + ", ".join(f"{kind} {seconds:.1f} s" for kind, seconds in longest.items()))
        assert attacked < ConnectionLimits().head_timeout_s
        generate()  # and after
    finally:
        stop.set()
        thread.join(timeout=60)
