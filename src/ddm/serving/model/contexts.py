"""An expert's cache of generation contexts: bounded by bytes, least recently used evicted.

A context (``docs/protocol.md``, version 2) is a generation's text embeddings; the router sends
it once per replica and names it by id at every step. The id is the SHA-256 of its bytes, which
the expert computes itself, so a context is content-addressed: storing the same one twice is a
no-op, and a call naming an id not held (evicted, or the replica restarted) is answered
``UNKNOWN_CONTEXT`` so that the caller re-sends it. No I/O, no clock; a plain lock, as the
server's event loops share it (:data:`~ddm.serving.model.routes.SERVING_LOOPS`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ddm.serving.wire.protocol import UNKNOWN_CONTEXT, ProtocolError


@dataclass(frozen=True, eq=False)
class StoredContext:
    """A context's ``embeddings`` (N, L, D) and ``negative`` (N or 0, L, D), in the dtype they
    were sent in (owned copies, not views of a request body)."""

    embeddings: np.ndarray
    negative: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.embeddings.nbytes + self.negative.nbytes


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

    def put(self, identity: bytes, embeddings: np.ndarray, negative: np.ndarray) -> None:
        """Hold the context ``identity`` names (copies the arrays), evicting as needed; a
        context larger than the whole cache is refused (422)."""
        with self._lock:
            if identity in self._held:
                self._held.move_to_end(identity)
                return
        stored = StoredContext(np.array(embeddings), np.array(negative))  # copied unlocked
        if stored.nbytes > self.max_bytes:
            raise ProtocolError(f"a context of {stored.nbytes} bytes exceeds this expert's "
                                f"context cache of {self.max_bytes} bytes", 422)
        with self._lock:
            if identity in self._held:  # another loop stored it meanwhile
                self._held.move_to_end(identity)
                return
            while self.bytes + stored.nbytes > self.max_bytes:
                _, evicted = self._held.popitem(last=False)
                self.bytes -= evicted.nbytes
                self.evictions += 1
            self._held[identity] = stored
            self.bytes += stored.nbytes

    def get(self, identity: bytes) -> StoredContext:
        """The context ``identity`` names, now the most recently used; ``ProtocolError``
        with status :data:`UNKNOWN_CONTEXT` when it is not held."""
        with self._lock:
            stored = self._held.get(identity)
            if stored is not None:
                self._held.move_to_end(identity)
        if stored is None:
            raise ProtocolError(f"unknown context {identity.hex()[:16]}: send it, then retry",
                                UNKNOWN_CONTEXT)
        return stored
