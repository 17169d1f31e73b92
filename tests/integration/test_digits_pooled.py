"""The shipped digits DDM in one pool (issues 36 and 37): ``ddm up examples/digits-pooled.yaml``
runs exactly one model process (``ddm serve pool``, holding both label experts) beside the
router, and draws the same digits as the unpooled deployment (``examples/digits.yaml``, one
process per expert) within 2/255: the pooled example serves with PyTorch the expert the
unpooled one serves with JAX."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from ddm.runtime.local import LocalPlan
from tests.support.local_runtime import Log, ddm_up, one_pool_beside_the_router

REPOSITORY = Path(__file__).resolve().parents[2]
POOLED = REPOSITORY / "examples" / "digits-pooled.yaml"
UNPOOLED = REPOSITORY / "examples" / "digits.yaml"
#: One request whose rows go to both experts, drawn with the shipped defaults (40 steps, top-1).
REQUEST = {"labels": [1, 4, 6, 9], "seed": 3}
#: Pixels may differ by this much in 0..255 (PyTorch against JAX for one expert).
TOLERANCE = 2

pytestmark = pytest.mark.slow


def _draw(url: str, log: Log) -> np.ndarray:
    answer = httpx.post(f"{url}/v1/generate", timeout=300, json=REQUEST)
    assert answer.status_code == 200, answer.text + log.getvalue()[-2000:]
    return np.stack([_pixels(png) for png in answer.json()["images"]]).astype(np.int16)


def _pixels(png: str) -> np.ndarray:
    """A base64 PNG of ``/v1/generate`` (greyscale digits) as uint8 ``(H, W)``."""
    with Image.open(io.BytesIO(base64.b64decode(png))) as image:
        return np.asarray(image)


@pytest.fixture(scope="module")
def pooled() -> Iterator[tuple[LocalPlan, Log]]:
    with ddm_up(POOLED) as (plan, log, _):
        yield plan, log


def test_one_model_process_beside_the_router(pooled: tuple[LocalPlan, Log]) -> None:
    info = one_pool_beside_the_router(*pooled)
    assert {name: member["classes"] for name, member in info["members"].items()} == {
        "digits-0-4": [0, 1, 2, 3, 4], "digits-5-9": [5, 6, 7, 8, 9]}


def test_the_same_digits_as_the_unpooled_deployment(pooled: tuple[LocalPlan, Log]) -> None:
    plan, log = pooled
    from_pool = _draw(plan.url, log)
    with ddm_up(UNPOOLED) as (unpooled_plan, unpooled_log, _):
        assert len(unpooled_plan.servers) == 2
        alone = _draw(unpooled_plan.url, unpooled_log)
    assert int(np.abs(from_pool - alone).max()) <= TOLERANCE
