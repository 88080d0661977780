"""Belady's OPT (MIN): evict the resident key whose next use lies furthest in the future.

Offline only: it is given the whole access sequence up front and must then be driven with exactly
that sequence (one :meth:`insert` or :meth:`touch` per access, in order); it checks this and raises
on a mismatch, so a scoring run can never silently compare against the wrong future. Under demand
fill (every miss is inserted) no policy gets more hits on the same sequence and capacity — the
upper bound every other policy is scored against.

Next-use positions are precomputed in one backward pass (O(n)); eviction pops a max-heap of
(next use, key) with lazy invalidation, O(log n).
"""
from __future__ import annotations

import heapq
from collections.abc import Container, Hashable, Sequence

from firmware_model.policies.base import (
    NoVictimError,
    check_capacity,
    duplicate,
    missing,
)

__all__ = ["BeladyPolicy", "next_use_positions"]


def next_use_positions(keys: Sequence[Hashable]) -> list[int]:
    """``out[i]`` = the next index j > i with ``keys[j] == keys[i]``, or ``len(keys)`` if none."""
    n = len(keys)
    out = [n] * n
    last: dict[Hashable, int] = {}
    for i in range(n - 1, -1, -1):
        out[i] = last.get(keys[i], n)
        last[keys[i]] = i
    return out


class BeladyPolicy:
    """OPT over a known future; ``position`` is the index of the next access it expects."""

    name = "opt"

    def __init__(self, capacity: int, future: Sequence[Hashable] = ()) -> None:
        self.capacity = check_capacity(capacity)
        self._future = list(future)
        self._next = next_use_positions(self._future)
        self.position = 0
        self._resident: dict[Hashable, int] = {}  # key -> its next use
        self._heap: list[tuple[int, int, Hashable]] = []  # (-next use, tiebreak, key)

    def insert(self, key: Hashable, now: int = 0) -> None:
        if key in self._resident:
            raise duplicate(self.name, key)
        self._advance(key)

    def touch(self, key: Hashable, now: int = 0) -> None:
        if key not in self._resident:
            raise missing(self.name, key)
        self._advance(key)

    def remove(self, key: Hashable) -> None:
        if self._resident.pop(key, None) is None:
            raise missing(self.name, key)

    def evict(self, protected: Container[Hashable] = ()) -> Hashable:
        skipped: list[tuple[int, int, Hashable]] = []
        try:
            while self._heap:
                item = heapq.heappop(self._heap)
                key = item[2]
                if self._resident.get(key) != -item[0]:
                    continue  # stale entry
                if key in protected:
                    skipped.append(item)
                    continue
                del self._resident[key]
                return key
            raise NoVictimError(f"opt: all {len(self._resident)} resident keys are protected")
        finally:
            for item in skipped:
                heapq.heappush(self._heap, item)

    def _advance(self, key: Hashable) -> None:
        i = self.position
        if i >= len(self._future) or self._future[i] != key:
            expected = self._future[i] if i < len(self._future) else "<end of sequence>"
            raise ValueError(f"opt: access {i} is {key!r} but the future given says {expected!r}; "
                             "drive BeladyPolicy with exactly the sequence it was built from")
        nxt = self._next[i]
        self.position = i + 1
        self._resident[key] = nxt
        heapq.heappush(self._heap, (-nxt, i, key))
        if len(self._heap) > 4 * len(self._resident) + 64:
            self._heap = [(-n, j, k) for j, (k, n) in enumerate(self._resident.items())]
            heapq.heapify(self._heap)

    def __contains__(self, key: object) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self._resident)
