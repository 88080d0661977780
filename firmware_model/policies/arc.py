"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03), adapted to a split evict / insert API.

ARC keeps two resident lists — T1 (seen once recently) and T2 (seen at least twice) — and two ghost
lists of keys recently evicted from each (B1, B2). A miss that hits a ghost list moves the target
size ``p`` of T1 toward the list that would have kept it; eviction takes T1's LRU key when T1 is over
its target, else T2's.

The original algorithm adapts ``p`` *before* choosing a victim, because it sees the missing key
first. Here the cache owner calls :meth:`evict` before :meth:`insert` (as with vLLM's
``ARCOffloadingPolicy``), so the adaptation lands one miss later and the "x in B2 and |T1| == p"
tie-break is dropped. Ghost directory sizes keep ARC's bounds: |T1| + |B1| <= c and the four lists
together <= 2c.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable

from firmware_model.policies.base import (
    NoVictimError,
    check_capacity,
    duplicate,
    missing,
)

__all__ = ["ARCPolicy"]

_Lru = OrderedDict  # oldest first


class ARCPolicy:
    """ARC over resident keys; ghosts remember only keys, never data."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = check_capacity(capacity)
        self.p = 0.0  # target size of T1
        self.t1: _Lru[Hashable, None] = _Lru()
        self.t2: _Lru[Hashable, None] = _Lru()
        self.b1: _Lru[Hashable, None] = _Lru()
        self.b2: _Lru[Hashable, None] = _Lru()

    def insert(self, key: Hashable, now: int = 0) -> None:
        if key in self.t1 or key in self.t2:
            raise duplicate(self.name, key)
        c = self.capacity
        if key in self.b1:
            self.p = min(self.p + max(len(self.b2) / len(self.b1), 1.0), float(c))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(self.p - max(len(self.b1) / len(self.b2), 1.0), 0.0)
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._trim_ghosts()

    def touch(self, key: Hashable, now: int = 0) -> None:
        if key in self.t1:
            del self.t1[key]
        elif key in self.t2:
            del self.t2[key]
        else:
            raise missing(self.name, key)
        self.t2[key] = None

    def remove(self, key: Hashable) -> None:
        for lst in (self.t1, self.t2):
            if key in lst:
                del lst[key]
                return
        raise missing(self.name, key)

    def evict(self, protected: Container[Hashable] = ()) -> Hashable:
        prefer_t1 = bool(self.t1) and (len(self.t1) > self.p or not self.t2)
        order = ((self.t1, self.b1), (self.t2, self.b2))
        for resident, ghost in (order if prefer_t1 else order[::-1]):
            for key in resident:
                if key not in protected:
                    del resident[key]
                    ghost[key] = None
                    self._trim_ghosts()
                    return key
        raise NoVictimError(f"arc: all {len(self)} resident keys are protected")

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            (self.b2 or self.b1).popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)
