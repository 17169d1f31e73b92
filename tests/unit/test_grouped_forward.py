"""A pool's grouped forward's choices (:mod:`ddm.serving.model.grouped`), as pure rules: the
spec's ``groupedForward`` carried to the pool server, up to which share of one member
``auto`` groups a batch, and how a batch run member by member is cut into forwards that fit
``--max-batch``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ddm.deploy.plan import plan_deployment
from ddm.deploy.spec import SpecError, parse_spec
from ddm.serving.model.grouped import forward_chunks, grouped_up_to


def _pooled(**pool: Any) -> dict[str, Any]:
    """Two text experts in one nvidia pool with ``pool``'s fields."""
    def checkpoint(name: str) -> dict[str, Any]:
        return {"uri": f"image:///opt/ddm/checkpoints/{name}"}

    return {"conditioning": "text",
            "pools": [{"name": "gpu", "accelerator": {"type": "nvidia"}, **pool}],
            "textEncoder": {"checkpoint": checkpoint("clip")},
            "router": {"checkpoint": checkpoint("router")},
            "experts": [{"name": f"expert-{k}", "checkpoint": checkpoint(f"e{k}"),
                         "pool": "gpu"} for k in range(2)]}


def test_a_pool_passes_its_grouped_forward_mode_to_its_server() -> None:
    (pool,) = plan_deployment(parse_spec(_pooled(groupedForward="off"))).pools
    assert pool.args[pool.args.index("--grouped-forward") + 1] == "off"
    # Unset: no flag, the server's default (auto).
    assert "--grouped-forward" not in plan_deployment(parse_spec(_pooled())).pools[0].args


def test_an_unknown_grouped_forward_mode_is_refused_by_its_field() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(_pooled(groupedForward="always"))
    (problem,) = caught.value.problems
    assert problem.startswith("spec.pools[0].groupedForward") and "auto, on, off" in problem


@pytest.mark.parametrize("measured, up_to", [
    ([], 0),
    ([(1, 5.0, 4.0), (2, 6.0, 5.5), (4, 8.0, 9.0), (8, 20.0, 10.0)], 2),
    ([(1, 5.0, 5.0)], 0),  # a tie is not faster
    ([(1, 5.0, 4.0), (2, 6.0, 5.0)], 2)])
def test_auto_groups_up_to_the_last_share_measured_faster_at_every_share_so_far(
        measured: list[tuple[int, float, float]], up_to: int) -> None:
    assert grouped_up_to([{"rows_per_member": rows, "member_by_member_ms": apart,
                           "grouped_ms": together}
                          for rows, apart, together in measured]) == up_to


@pytest.mark.parametrize("costs, limit, chunks", [
    ([1, 1, 1], 4, [[0, 1, 2]]),
    ([2, 2, 1, 2], 4, [[0, 1], [2, 3]]),
    ([2, 1, 2, 2, 1], 3, [[0, 1], [2], [3, 4]]),
    ([], 4, [])])
def test_a_member_s_rows_run_in_forwards_of_at_most_max_batch_rows(
        costs: list[int], limit: int, chunks: list[list[int]]) -> None:
    """A group's batch run member by member: each member's rows (a guided row costs two)
    in forwards that each fit ``--max-batch``, in order."""
    rows = np.arange(len(costs))
    assert [chunk.tolist() for chunk in forward_chunks(rows, np.array(costs), limit)] == chunks
