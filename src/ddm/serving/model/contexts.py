"""An expert's cache of generation contexts: bounded by bytes, least recently used evicted.

A context (``docs/protocol.md``, versions 2 and 4) is a generation's text embeddings or class
labels; the router sends it once per replica and names it by id at every step. The id is the
SHA-256 of its bytes, which the expert computes itself, so a context is content-addressed:
storing the same one twice is a no-op, and a call naming an id not held (evicted, or the
replica restarted) is answered ``UNKNOWN_CONTEXT`` so that the caller re-sends it. No I/O, no
clock; a plain lock, as the server's event loops share it
(:data:`~ddm.serving.model.routes.SERVING_LOOPS`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ddm.conditioning import LABELS, TEXT
from ddm.serving.wire.protocol import UNKNOWN_CONTEXT, Context, LabelContext, ProtocolError


#: What holding a context costs beyond its rows' bytes (its id, the cache's entry, the object
#: and its arrays' headers: about 430 bytes beside a label context's 8 a row), charged with
#: them: else a budget spent on many tiny contexts held fifty times its bytes.
ENTRY_BYTES = 512


@dataclass(frozen=True, eq=False)
class StoredContext:
    """A context's rows, in the dtype they were sent in (owned copies, not views of a request
    body): a text context's ``embeddings`` (N, L, D) and ``negative`` (N or 0, L, D), or a
    label context's ``labels`` (N,) int64; the other kind's fields are None."""

    embeddings: np.ndarray | None = None
    negative: np.ndarray | None = None
    labels: np.ndarray | None = None

    @classmethod
    def of(cls, message: Context | LabelContext) -> StoredContext:
        """Copies of ``message``'s rows."""
        if isinstance(message, LabelContext):
            return cls(labels=np.array(message.labels))
        return cls(np.array(message.embeddings), np.array(message.negative))

    @property
    def kind(self) -> str:
        """Which conditioning the context carries: ``labels`` or ``text``."""
        return LABELS if self.labels is not None else TEXT

    def check_rows(self, rows: np.ndarray) -> None:
        """Refuse (422) a call whose ``rows`` (int32, >= 0) name rows this context lacks."""
        held = len(self.labels if self.labels is not None else self.embeddings)
        if rows.size and int(rows.max()) >= held:
            raise ProtocolError(f"'rows' name row {int(rows.max())} of a context of {held}",
                                422)

    @property
    def held_bytes(self) -> int:
        """What holding the context costs: its rows' bytes and :data:`ENTRY_BYTES`."""
        return ENTRY_BYTES + sum(a.nbytes for a in (self.embeddings, self.negative, self.labels)
                                 if a is not None)


class ContextCache:
    """Contexts by id, at most ``max_bytes`` of them; the least recently used go first."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"a context cache needs a positive size, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.evictions = 0
        self._held: OrderedDict[bytes, StoredContext] = OrderedDict()
        self._lock = threading.Lock()  # guards the three fields above

    def __len__(self) -> int:
        return len(self._held)

    def put(self, identity: bytes, context: Context | LabelContext) -> None:
        """Hold ``context`` (a decoded message, its rows copied) under ``identity``, evicting
        as needed; a context larger than the whole cache is refused (422)."""
        with self._lock:
            if identity in self._held:
                self._held.move_to_end(identity)
                return
        stored = StoredContext.of(context)  # copied unlocked
        if stored.held_bytes > self.max_bytes:
            raise ProtocolError(f"a context of {stored.held_bytes} bytes exceeds this expert's "
                                f"context cache of {self.max_bytes} bytes", 422)
        with self._lock:
            if identity in self._held:  # another loop stored it meanwhile
                self._held.move_to_end(identity)
                return
            while self.bytes + stored.held_bytes > self.max_bytes:
                _, evicted = self._held.popitem(last=False)
                self.bytes -= evicted.held_bytes
                self.evictions += 1
            self._held[identity] = stored
            self.bytes += stored.held_bytes

    def get(self, identity: bytes, kind: str) -> StoredContext:
        """The context ``identity`` names, now the most recently used; ``ProtocolError``
        with status :data:`UNKNOWN_CONTEXT` when it is not held, 422 when it holds another
        ``kind`` of conditioning (``labels`` or ``text``) than the caller's model takes."""
        with self._lock:
            stored = self._held.get(identity)
            if stored is not None:
                self._held.move_to_end(identity)
        if stored is None:
            raise ProtocolError(f"unknown context {identity.hex()[:16]}: send it, then retry",
                                UNKNOWN_CONTEXT)
        if stored.kind != kind:
            raise ProtocolError(f"context {identity.hex()[:16]} holds {stored.kind}; this model "
                                f"is conditioned on {kind}", 422)
        return stored
