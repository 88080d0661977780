"""Adaptive Replacement Cache, as Megiddo & Modha, FAST'03, Fig. 4.

ARC keeps two resident lists — T1 (seen once recently) and T2 (seen at least twice) — and two ghost
lists of keys recently evicted from each (B1, B2). A miss that hits a ghost list moves the target
size ``p`` of T1 toward the list that would have kept it (cases II and III), *then* REPLACE picks
the victim: T1's LRU key when |T1| > p, or when |T1| == p and the missing key was in B2, else T2's.
A miss on all four lists (case IV) first trims the ghost directory: if |T1| + |B1| == c, B1's LRU
key goes (or, with B1 empty, T1's LRU key leaves without a ghost); else if the four lists hold 2c
keys, B2's LRU key goes; then REPLACE.

The paper sees the missing key before it chooses a victim; the split API here (``evict`` before
``insert``) does not, so the cache owner announces the miss first with :meth:`on_miss` (the replay
loops do: ``on_miss(x)``, ``evict()`` when full, ``insert(x)``). That order gives the paper's
decisions exactly (and libCacheSim's ARC hit counts). An ``insert`` that was not announced (a
prefetch, a caller that does not know the hook) adapts ``p`` at insert time instead: its victim was
chosen one adaptation late.
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
_NEW, _FROM_B1, _FROM_B2 = 0, 1, 2


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
        self._pending: tuple[Hashable, int] | None = None  # the announced miss and where it was

    def on_miss(self, key: Hashable, now: int = 0) -> None:
        """``key`` missed and will be inserted next: adapt ``p`` now, before the victim is chosen."""
        if self._pending is not None and self._pending[0] == key:
            return
        if key in self.t1 or key in self.t2:
            raise duplicate(self.name, key)
        self._pending = (key, self._adapt(key))

    def _adapt(self, key: Hashable) -> int:
        """Cases II / III: a ghost hit moves ``p`` and takes the key off its ghost list."""
        if key in self.b1:
            self.p = min(self.p + max(len(self.b2) / len(self.b1), 1.0), float(self.capacity))
            del self.b1[key]
            return _FROM_B1
        if key in self.b2:
            self.p = max(self.p - max(len(self.b1) / len(self.b2), 1.0), 0.0)
            del self.b2[key]
            return _FROM_B2
        return _NEW

    def insert(self, key: Hashable, now: int = 0) -> None:
        if key in self.t1 or key in self.t2:
            raise duplicate(self.name, key)
        pending, self._pending = self._pending, None
        where = pending[1] if pending is not None and pending[0] == key else self._adapt(key)
        (self.t1 if where == _NEW else self.t2)[key] = None
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
        pending = self._pending
        if pending is not None and pending[1] != _NEW:
            return self._replace(protected, in_b2=pending[1] == _FROM_B2)
        c = self.capacity
        if len(self.t1) + len(self.b1) >= c:  # case IV(A): L1 holds c keys
            if self.b1:
                self.b1.popitem(last=False)
            else:  # T1 alone fills L1: its LRU key leaves without a ghost
                victim = self._pop_lru(self.t1, protected)
                if victim is not None:
                    return victim
        elif len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) >= 2 * c and self.b2:
            self.b2.popitem(last=False)  # case IV(B)
        return self._replace(protected, in_b2=False)

    def _replace(self, protected: Container[Hashable], in_b2: bool) -> Hashable:
        """REPLACE(x, p): T1's LRU key to B1 if |T1| > p (or == p with x in B2), else T2's to B2."""
        t1 = len(self.t1)
        from_t1 = (t1 > 0 and (t1 > self.p or (in_b2 and t1 == self.p))) or not self.t2
        order = ((self.t1, self.b1), (self.t2, self.b2))
        for resident, ghost in (order if from_t1 else order[::-1]):
            victim = self._pop_lru(resident, protected)
            if victim is not None:
                ghost[victim] = None
                return victim
        raise NoVictimError(f"arc: all {len(self)} resident keys are protected")

    @staticmethod
    def _pop_lru(resident: _Lru[Hashable, None], protected: Container[Hashable]) -> Hashable | None:
        for key in resident:
            if key not in protected:
                del resident[key]
                return key
        return None

    def _trim_ghosts(self) -> None:
        """Keep ARC's bounds (|T1| + |B1| <= c, all four <= 2c) after a :meth:`remove` left room."""
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            (self.b2 or self.b1).popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)
