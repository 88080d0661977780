"""Least-frequently-used: plain (``lfu``) and with exponential decay (``lfu-decay``, LRFU-style).

Plain LFU (:class:`LFUPolicy`) counts accesses since the key became resident (1 at insert, +1 per
hit) and evicts the smallest count; among equal counts, the key whose last access is oldest (the
order libCacheSim's LFU keeps: a FIFO per frequency). A count is forgotten when its key leaves.

Plain LFU never forgets: a block that was hot an hour ago outlives today's working set. Decay fixes
that: every access adds ``2 ** (tick / half_life)`` to the key's score instead of 1, which is the same
as halving every count each ``half_life`` accesses, without touching every entry. Relative order of
untouched keys never changes, so a heap with lazy invalidation stays valid; scores are renormalised
before the increment overflows a float.

Ties (equal scores) go to the least recently accessed key (:class:`DecayedLFUPolicy`).
"""
from __future__ import annotations

import heapq
from collections.abc import Container, Hashable

from firmware_model.policies.base import (
    NoVictimError,
    check_capacity,
    duplicate,
    missing,
)

__all__ = ["DecayedLFUPolicy", "LFUPolicy"]

_RENORMALISE_AT = 2.0 ** 512


class DecayedLFUPolicy:
    """Evicts the key with the smallest decayed access count."""

    name = "lfu-decay"

    def __init__(self, capacity: int, half_life: float = 0.0) -> None:
        """``half_life``: accesses after which a count is worth half; 0 means 4 × capacity."""
        self.capacity = check_capacity(capacity)
        if half_life < 0:
            raise ValueError(f"half_life must be >= 0 accesses (0 = 4 x capacity), got {half_life}")
        self.half_life = float(half_life or 4 * capacity)
        self._growth = 2.0 ** (1.0 / self.half_life)
        self._increment = 1.0
        self._tick = 0
        self._score: dict[Hashable, tuple[float, int]] = {}
        self._heap: list[tuple[float, int, Hashable]] = []

    def score(self, key: Hashable) -> float:
        """The key's decayed count, in units of one access made now."""
        return self._score[key][0] / self._increment

    def insert(self, key: Hashable, now: int = 0) -> None:
        if key in self._score:
            raise duplicate(self.name, key)
        self._bump(key, 0.0)

    def touch(self, key: Hashable, now: int = 0) -> None:
        entry = self._score.get(key)
        if entry is None:
            raise missing(self.name, key)
        self._bump(key, entry[0])

    def remove(self, key: Hashable) -> None:
        if self._score.pop(key, None) is None:
            raise missing(self.name, key)

    def evict(self, protected: Container[Hashable] = ()) -> Hashable:
        skipped: list[tuple[float, int, Hashable]] = []
        try:
            while self._heap:
                item = heapq.heappop(self._heap)
                score, tick, key = item
                if self._score.get(key) != (score, tick):
                    continue  # stale: the key was touched or removed since
                if key in protected:
                    skipped.append(item)
                    continue
                del self._score[key]
                return key
            raise NoVictimError(f"lfu: all {len(self._score)} resident keys are protected")
        finally:
            for item in skipped:
                heapq.heappush(self._heap, item)

    def _bump(self, key: Hashable, old: float) -> None:
        self._tick += 1
        self._increment *= self._growth
        entry = (old + self._increment, self._tick)
        self._score[key] = entry
        heapq.heappush(self._heap, (entry[0], entry[1], key))
        if self._increment > _RENORMALISE_AT or len(self._heap) > 4 * len(self._score) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        """Drop stale heap entries and, if needed, rescale every score (order is unchanged)."""
        scale = self._increment if self._increment > _RENORMALISE_AT else 1.0
        self._increment /= scale
        self._score = {k: (s / scale, t) for k, (s, t) in self._score.items()}
        self._heap = [(s, t, k) for k, (s, t) in self._score.items()]
        heapq.heapify(self._heap)

    def __contains__(self, key: object) -> bool:
        return key in self._score

    def __len__(self) -> int:
        return len(self._score)


class LFUPolicy(DecayedLFUPolicy):
    """Plain LFU: evicts the key with the fewest accesses, the least recently used among equals."""

    name = "lfu"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.half_life = float("inf")
        self._growth = 1.0  # every access counts 1, forever: integer counts in the floats

    def score(self, key: Hashable) -> float:
        """The key's access count since it became resident."""
        return self._score[key][0]
