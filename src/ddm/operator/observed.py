"""What the operator last saw of its DDMDeployments, their children and their pods: an
informer cache, so that a reconcile reads from memory and sends only the writes it needs.

Fed from two sides: kopf's watches (``handlers`` registers an index handler per watched kind,
so kopf lists everything before any handler runs, and every event updates this first; a
DELETED event, or an object that stops matching the label selector, removes it), and the
operator's own writes (the API server's answer to each), so a run that follows its own
writes sees them even before their events arrive.

Each object is kept by (kind, namespace, name); of two copies of the same object (same uid)
the one with the higher resourceVersion wins, so an event that arrives after the operator's
own newer write never takes it back. A copy may still be behind the API server: whoever
writes from it sends its resourceVersion as a precondition (``kube``), so a stale copy makes a
write fail with a conflict, never overwrite something newer. Thread-safe: kopf's handlers and
the reconcile runs use it from several threads.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Container, Mapping

from ddm.operator import names

#: (kind, namespace, name)
_Key = tuple[str, str, str]


class Observed:
    """The latest known copy of each watched object, by kind, namespace and name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: dict[_Key, dict[str, Any]] = {}
        # (namespace, owner) -> the keys of the objects labelled as that owner's
        self._owned: dict[tuple[str, str], set[_Key]] = {}

    def seen(self, obj: Mapping[str, Any]) -> None:
        """``obj`` (with its ``kind``) as an event or an answer showed it; kept unless the copy
        held is the same object at a newer resourceVersion."""
        meta = obj["metadata"]
        key = (obj["kind"], meta["namespace"], meta["name"])
        with self._lock:
            held = self._objects.get(key)
            if held is not None and _newer(held, obj):
                return
            if held is not None:
                self._unlink(key, held)
            self._objects[key] = copy.deepcopy(dict(obj))
            owner = _owner(obj)
            if owner is not None:
                self._owned.setdefault((meta["namespace"], owner), set()).add(key)

    def gone(self, obj: Mapping[str, Any]) -> None:
        """``obj`` was deleted (or left the watch): forgotten, unless the copy held is another
        object of the same name (created since)."""
        meta = obj["metadata"]
        key = (obj["kind"], meta["namespace"], meta["name"])
        with self._lock:
            held = self._objects.get(key)
            if held is not None and held["metadata"].get("uid") == meta.get("uid"):
                del self._objects[key]
                self._unlink(key, held)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """A copy of the object, or None when none is known."""
        with self._lock:
            held = self._objects.get((kind, namespace, name))
            return copy.deepcopy(held) if held is not None else None

    def owned(self, namespace: str, owner: str, kinds: Container[str]
              ) -> dict[tuple[str, str], dict[str, Any]]:
        """Copies of the objects of ``kinds`` labelled as ``owner``'s, by (kind, name)."""
        with self._lock:
            keys = self._owned.get((namespace, owner), set())
            return {(kind, name): copy.deepcopy(self._objects[(kind, ns, name)])
                    for kind, ns, name in keys if kind in kinds}

    def _unlink(self, key: _Key, held: Mapping[str, Any]) -> None:
        owner = _owner(held)
        if owner is None:
            return
        group = (key[1], owner)
        keys = self._owned.get(group)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._owned[group]


def _owner(obj: Mapping[str, Any]) -> str | None:
    return (obj["metadata"].get("labels") or {}).get(names.DEPLOYMENT_LABEL)


def _newer(held: Mapping[str, Any], incoming: Mapping[str, Any]) -> bool:
    """Whether ``held`` is the same object as ``incoming`` at a later resourceVersion.
    (resourceVersions are opaque to clients in general; the API server's are etcd's revisions,
    integers that only grow, and one that is not an integer is never taken as newer.)"""
    if held["metadata"].get("uid") != incoming["metadata"].get("uid"):
        return False
    try:
        return int(held["metadata"]["resourceVersion"]) > int(
            incoming["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return False
