"""A pool's grouped forward's choices (:mod:`ddm.serving.model.grouped`), as pure rules: up to
which share of one member ``auto`` groups a batch, and how a batch run member by member is
cut into forwards that fit ``--max-batch``."""

from __future__ import annotations

import numpy as np
import pytest

from ddm.serving.model.grouped import forward_chunks, grouped_up_to


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
