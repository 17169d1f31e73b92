"""The label contexts the router sends label experts (``docs/protocol.md`` version 4).

A label expert takes the calls a text expert takes, rows of a context named by id, so that
label DDMs ride the same calls, coalescing and pool requests. Its context is the classes the
expert serves (its ``/v1/info`` ``classes``), then any other label a call names (the expert
refuses those, 422, as it always has): the same context at every step of every generation, so
it crosses once per expert replica (again after a 412: evicted, or a restart) and every call
to the expert names one context, merging with other generations' calls as before. Where the
classes and a call's labels are more than a context holds, each run of
:data:`~ddm.deploy.limits.MAX_CONTEXT_ROWS` rows gets a context of its own labels.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ddm.deploy.limits import MAX_CONTEXT_ROWS
from ddm.serving.wire.protocol import LabelContext, context_id, encode_request

__all__ = ["LabelContexts", "MadeLabelContext"]

#: Label lists whose contexts are kept (each a few hundred bytes): a DDM's experts' class
#: lists, and a few more.
MAX_LABEL_CONTEXTS = 64


@dataclass(frozen=True, eq=False)
class MadeLabelContext:
    """A label context: its ``id``, its ``body`` (request id 0, re-stamped when sent) and each
    label's row in it."""

    id: bytes
    body: bytes
    index: Mapping[int, int]

    def rows(self, labels: np.ndarray) -> np.ndarray:
        """The context rows of ``labels`` (B,) -> (B,) int32."""
        return np.array([self.index[label] for label in labels.tolist()], np.int32)


class LabelContexts:
    """The contexts made so far, by label list; the least recently used dropped past
    :data:`MAX_LABEL_CONTEXTS` (dropping one costs only re-making it)."""

    def __init__(self) -> None:
        self._made: OrderedDict[tuple[int, ...], MadeLabelContext] = OrderedDict()

    def rows_of(self, classes: tuple[int, ...], labels: np.ndarray
                ) -> list[tuple[slice, MadeLabelContext, np.ndarray]]:
        """Runs of ``labels`` (B,) each with the context that holds them and their rows in
        it: one run, in the context of ``classes`` and the other labels named, where that
        fits a context."""
        extra = sorted(set(labels.tolist()) - set(classes))
        if len(classes) + len(extra) <= MAX_CONTEXT_ROWS:
            made = self._context((*classes, *extra))
            return [(slice(None), made, made.rows(labels))]
        runs = []
        for start in range(0, len(labels), MAX_CONTEXT_ROWS):
            part = slice(start, start + MAX_CONTEXT_ROWS)
            made = self._context(tuple(sorted(set(labels[part].tolist()))))
            runs.append((part, made, made.rows(labels[part])))
        return runs

    def _context(self, held: tuple[int, ...]) -> MadeLabelContext:
        made = self._made.get(held)
        if made is None:
            body = encode_request(LabelContext(0, np.array(held, np.int64)))
            made = MadeLabelContext(context_id(body), body,
                                    {label: row for row, label in enumerate(held)})
            self._made[held] = made
            while len(self._made) > MAX_LABEL_CONTEXTS:
                self._made.popitem(last=False)
        self._made.move_to_end(held)
        return made
