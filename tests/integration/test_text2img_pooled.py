"""The shipped text-to-image DDM in one pool (issue 37): ``ddm up examples/text2img-pooled.yaml``
runs exactly one model process (``ddm serve pool``, holding the four experts, the text encoder,
the decoder and the router network) beside the router, and answers the same requests with the
same pixels as the unpooled deployment (``examples/text2img.yaml``, six model processes) within
2/255: the pooled example serves with PyTorch the two experts the unpooled one serves with
JAX."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from ddm.runtime.local import LocalPlan
from ddm.threads import usable_cpus
from tests.support.local_runtime import Log, ddm_up, one_pool_beside_the_router
from tests.support.text2img_served import png_rgb

REPOSITORY = Path(__file__).resolve().parents[2]
POOLED = REPOSITORY / "examples" / "text2img-pooled.yaml"
UNPOOLED = REPOSITORY / "examples" / "text2img.yaml"
#: (prompt, seed) pairs, drawn with the shipped defaults (30 steps, top-1, guidance 4).
REQUESTS = (("a thick red seven", 0), ("a thin blue two", 1), ("a green four", 2))
#: Pixels may differ by this much in 0..255 (PyTorch against JAX for two experts).
TOLERANCE = 2

pytestmark = pytest.mark.slow


def _draw(url: str, log: Log) -> list[np.ndarray]:
    images = []
    for prompt, seed in REQUESTS:
        answer = httpx.post(f"{url}/v1/images/generations", timeout=300,
                            json={"prompt": prompt, "n": 1, "seed": seed})
        assert answer.status_code == 200, answer.text + log.getvalue()[-2000:]
        images.append(png_rgb(answer.json()["data"][0]["b64_json"]))
    return images


@pytest.fixture(scope="module")
def pooled() -> Iterator[tuple[LocalPlan, Log]]:
    with ddm_up(POOLED) as (plan, log, _):
        yield plan, log


def test_one_model_process_beside_the_router(pooled: tuple[LocalPlan, Log]) -> None:
    info = one_pool_beside_the_router(*pooled)
    assert sorted(info["members"]) == ["decoder", "expert-0", "expert-1", "expert-2",
                                       "expert-3", "router-network", "text-encoder"]
    # ddm up's one thread per model, for seven members, up to the machine's CPUs: shared.
    assert info["pool"]["cpu_threads"] == min(7, usable_cpus())


def test_the_same_pixels_as_the_unpooled_deployment(pooled: tuple[LocalPlan, Log]) -> None:
    plan, log = pooled
    from_pool = _draw(plan.url, log)
    with ddm_up(UNPOOLED) as (unpooled_plan, unpooled_log, _):
        assert len(unpooled_plan.servers) == 6
        alone = _draw(unpooled_plan.url, unpooled_log)
    for (prompt, seed), a, b in zip(REQUESTS, from_pool, alone):
        difference = int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())
        assert difference <= TOLERANCE, (prompt, seed, difference)
