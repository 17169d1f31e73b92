"""An expert's ``_ddm.trained_on``: derived from the partition's fit at import, read back
exactly, and refused by name when malformed."""

from __future__ import annotations

import pytest

from ddm.checkpoints.format import CheckpointError
from ddm.models.trained_on import TrainedOn

#: A fit as ``ddm.training.text2img.partition`` records it: 3 clusters, digits 0-3.
FIT = {"images": 40, "k": 3, "cluster_sizes": [14, 16, 10],
       "digits_per_cluster": [[9, 1, 0, 4], [1, 9, 6, 0], [0, 0, 4, 6]]}


def test_a_cluster_holds_the_digits_it_has_most_of():
    assert [TrainedOn.from_fit(FIT, k).digits for k in range(3)] == [(0,), (1, 2), (3,)]
    summary = TrainedOn.from_fit(FIT, 1)
    assert (summary.clusters, summary.images, summary.training_images) == (3, 16, 40)
    assert TrainedOn.from_declaration("x", summary.declaration()) == summary


@pytest.mark.parametrize("change, problem", [
    ({"images": -1}, "trained_on.images must be a non-negative integer"),
    ({"digits": [10]}, "trained_on.digits must be a list of digits 0-9"),
    ({"data": ""}, "trained_on.data must be a short text"),
    ({"extra": 1}, "must be an object with exactly"),
])
def test_a_malformed_declaration_is_refused_naming_the_field(change, problem):
    block = TrainedOn.from_fit(FIT, 0).declaration() | change
    with pytest.raises(CheckpointError, match=problem):
        TrainedOn.from_declaration("expert_0", block)
