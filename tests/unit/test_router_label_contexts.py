"""The router's label contexts (pure): an expert's classes, then any other label a call names,
the same context for every call on those classes (so calls of any generation merge), rows
that index it, and runs of contexts of their own labels where a context cannot hold them all."""

from __future__ import annotations

import numpy as np

from ddm.serving.wire.protocol import LabelContext, Limits, context_id, decode_request
from ddm.serving.router.fleet.label_contexts import MAX_LABEL_CONTEXTS, LabelContexts

CLASSES = (5, 6, 7, 8, 9)


def test_every_call_on_an_experts_classes_names_one_context_of_them():
    contexts = LabelContexts()
    ((part, made, rows),) = contexts.rows_of(CLASSES, np.array([9, 5, 9]))
    ((_, again, other_rows),) = contexts.rows_of(CLASSES, np.array([6]))
    assert part == slice(None) and again is made
    assert rows.tolist() == [4, 0, 4] and rows.dtype == np.int32 and other_rows.tolist() == [1]
    decoded = decode_request(made.body, Limits())
    assert isinstance(decoded, LabelContext) and decoded.labels.tolist() == list(CLASSES)
    assert made.id == context_id(made.body) == decoded.id


def test_labels_outside_the_classes_extend_the_context_for_the_expert_to_refuse():
    ((_, made, rows),) = LabelContexts().rows_of(CLASSES, np.array([7, 2, 1]))
    assert decode_request(made.body, Limits()).labels.tolist() == [5, 6, 7, 8, 9, 1, 2]
    assert rows.tolist() == [2, 6, 5]


def test_more_labels_than_a_context_holds_go_in_runs_of_their_own_labels():
    classes = tuple(range(300))
    labels = np.arange(600) % 300
    runs = LabelContexts().rows_of(classes, labels)
    assert [part for part, _, _ in runs] == [slice(0, 256), slice(256, 512), slice(512, 768)]
    for part, made, rows in runs:
        held = np.asarray(decode_request(made.body, Limits()).labels)
        np.testing.assert_array_equal(held[rows], labels[part])


def test_only_the_most_recent_label_lists_are_kept():
    contexts = LabelContexts()
    first = contexts.rows_of((0,), np.array([0]))[0][1]
    for label in range(1, MAX_LABEL_CONTEXTS + 1):
        contexts.rows_of((label,), np.array([label]))
    remade = contexts.rows_of((0,), np.array([0]))[0][1]
    assert remade is not first and remade.id == first.id
