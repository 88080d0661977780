"""S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO, and a ghost FIFO.

New keys enter the small queue (10 % of capacity); most one-hit wonders leave it quickly into the
ghost queue. A key accessed again while in the small queue (frequency > 1 per the paper's
Algorithm 1) is promoted to main; a key that misses while remembered in the ghost queue goes
straight to main. Main is a FIFO with reinsertion (CLOCK-like): a key with frequency > 0 is moved
back to the tail with frequency - 1. Frequencies saturate at 3 (two bits).

Protected keys are rotated past (small: to its tail; main: reinserted without losing frequency).
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

__all__ = ["S3FIFOPolicy"]

_MAX_FREQ = 3


class S3FIFOPolicy:
    """S3-FIFO eviction; ``small_ratio`` of the capacity is the probationary queue."""

    name = "s3fifo"

    def __init__(self, capacity: int, small_ratio: float = 0.1) -> None:
        self.capacity = check_capacity(capacity)
        if not 0.0 < small_ratio < 1.0:
            raise ValueError(f"small_ratio must be in (0, 1), got {small_ratio}")
        self.small_target = max(1, int(capacity * small_ratio))
        self.small: OrderedDict[Hashable, None] = OrderedDict()
        self.main: OrderedDict[Hashable, None] = OrderedDict()
        self.ghost: OrderedDict[Hashable, None] = OrderedDict()
        self.ghost_limit = max(1, capacity - self.small_target)
        self.freq: dict[Hashable, int] = {}

    def insert(self, key: Hashable, now: int = 0) -> None:
        if key in self.freq:
            raise duplicate(self.name, key)
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None
        self.freq[key] = 0

    def touch(self, key: Hashable, now: int = 0) -> None:
        f = self.freq.get(key)
        if f is None:
            raise missing(self.name, key)
        self.freq[key] = min(f + 1, _MAX_FREQ)

    def remove(self, key: Hashable) -> None:
        if self.freq.pop(key, None) is None:
            raise missing(self.name, key)
        (self.small if key in self.small else self.main).pop(key)

    def evict(self, protected: Container[Hashable] = ()) -> Hashable:
        # Each pass either evicts, moves a key small -> main, or lowers a main key's frequency;
        # a protected key is only rotated once per queue, so the loop is bounded.
        budget = (len(self.small) + len(self.main)) * (_MAX_FREQ + 2) + 2
        rotated: set[Hashable] = set()
        for _ in range(budget):
            from_small = bool(self.small) and (len(self.small) >= self.small_target or not self.main)
            if from_small and any(k not in rotated for k in self.small):
                victim = self._evict_small(protected, rotated)
            elif self.main and any(k not in rotated for k in self.main):
                victim = self._evict_main(protected, rotated)
            elif self.small and any(k not in rotated for k in self.small):
                victim = self._evict_small(protected, rotated)
            else:
                break
            if victim is not None:
                return victim
        raise NoVictimError(f"s3fifo: all {len(self.freq)} resident keys are protected")

    def _evict_small(self, protected: Container[Hashable], rotated: set[Hashable]) -> Hashable | None:
        key, _ = self.small.popitem(last=False)
        if key in protected:
            self.small[key] = None
            rotated.add(key)
            return None
        if self.freq[key] > 1:
            self.main[key] = None
            self.freq[key] = 0
            return None
        del self.freq[key]
        self.ghost[key] = None
        if len(self.ghost) > self.ghost_limit:
            self.ghost.popitem(last=False)
        return key

    def _evict_main(self, protected: Container[Hashable], rotated: set[Hashable]) -> Hashable | None:
        key, _ = self.main.popitem(last=False)
        if key in protected:
            self.main[key] = None
            rotated.add(key)
            return None
        if self.freq[key] > 0:
            self.freq[key] -= 1
            self.main[key] = None
            return None
        del self.freq[key]
        return key

    def __contains__(self, key: object) -> bool:
        return key in self.freq

    def __len__(self) -> int:
        return len(self.freq)
