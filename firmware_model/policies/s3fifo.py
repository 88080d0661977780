"""S3-FIFO (Yang et al., SOSP'23) as the authors' code in libCacheSim (``S3FIFO``, 0.3.5).

A small probationary FIFO (10 % of the capacity), a main FIFO (the rest) and a ghost FIFO of keys
(90 % of the capacity). A new key enters small, a key remembered by the ghost queue enters main.
Until the first eviction, a new key that finds small full enters main instead (libCacheSim's
current ``S3FIFO.c``; its ``S3FIFOv0.c``, the SOSP'23 artifact, fills small past its share:
``fill_main_first=False``).
A hit adds one to the key's frequency (it counts up to 3: two bits). To make room:

* from main when main holds more than its share or small is empty: the oldest key goes if its
  frequency is 0, else it goes back to main's tail with frequency min(f, 3) - 1 (CLOCK-like);
* otherwise from small: the oldest key moves to main (frequency reset to 0) if it was accessed at
  least twice since insert, and the next one is looked at; the first key accessed less often
  leaves into the ghost queue. If small empties without a victim, main gives one.

The ghost queue is consulted when the key misses, before the victim is chosen: the cache owner
announces the miss with :meth:`on_miss` (the replay loops do), as libCacheSim's ``find`` does; an
unannounced :meth:`insert` consults it then (the victim's choice may then have pushed the key
out of a full ghost queue). Capacities under 20 blocks keep a small queue of at least 1 where
libCacheSim caches nothing (it refuses a key as large as its small queue). Protected keys are rotated past (small: to its tail; main:
reinserted without losing frequency).
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
_MOVE_TO_MAIN = 2  # small -> main at this many hits since insert (libCacheSim's move-to-main-threshold)


class S3FIFOPolicy:
    """S3-FIFO eviction; ``small_ratio`` of the capacity is the probationary queue."""

    name = "s3fifo"

    def __init__(self, capacity: int, small_ratio: float = 0.1, ghost_ratio: float = 0.9,
                 fill_main_first: bool = True) -> None:
        self.capacity = check_capacity(capacity)
        if not 0.0 < small_ratio < 1.0:
            raise ValueError(f"small_ratio must be in (0, 1), got {small_ratio}")
        if ghost_ratio < 0.0:
            raise ValueError(f"ghost_ratio must be >= 0, got {ghost_ratio}")
        self.small_target = max(1, int(capacity * small_ratio))
        self.main_target = capacity - self.small_target
        self.ghost_limit = int(capacity * ghost_ratio)
        self.small: OrderedDict[Hashable, None] = OrderedDict()
        self.main: OrderedDict[Hashable, None] = OrderedDict()
        self.ghost: OrderedDict[Hashable, None] = OrderedDict()
        self.freq: dict[Hashable, int] = {}
        self._pending: tuple[Hashable, bool] | None = None  # the announced miss, and if it was a ghost
        self.fill_main_first = fill_main_first
        self._has_evicted = False

    def on_miss(self, key: Hashable, now: int = 0) -> None:
        """``key`` missed and will be inserted next: take it off the ghost queue now."""
        if self._pending is not None and self._pending[0] == key:
            return
        if key in self.freq:
            raise duplicate(self.name, key)
        self._pending = (key, self.ghost.pop(key, 0) is None)

    def insert(self, key: Hashable, now: int = 0) -> None:
        if key in self.freq:
            raise duplicate(self.name, key)
        pending, self._pending = self._pending, None
        was_ghost = pending[1] if pending is not None and pending[0] == key else self.ghost.pop(key, 0) is None
        to_main = was_ghost or (self.fill_main_first and not self._has_evicted
                                and len(self.small) >= self.small_target)
        (self.main if to_main else self.small)[key] = None
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
        self._has_evicted = True
        if len(self.main) > self.main_target or not self.small:
            order = (self._evict_main, self._evict_small, self._evict_main)
        else:
            order = (self._evict_small, self._evict_main)
        for evict_from in order:  # with protected keys, a queue may have none to give
            victim = evict_from(protected)
            if victim is not None:
                return victim
        raise NoVictimError(f"s3fifo: all {len(self.freq)} resident keys are protected")

    def _evict_small(self, protected: Container[Hashable]) -> Hashable | None:
        rotated: set[Hashable] = set()
        small, freq = self.small, self.freq
        while small:
            key = next(iter(small))
            if key in rotated:
                return None  # every key left in small is protected
            del small[key]
            if key in protected:
                small[key] = None
                rotated.add(key)
            elif freq[key] >= _MOVE_TO_MAIN:
                self.main[key] = None
                freq[key] = 0
            else:
                del freq[key]
                if self.ghost_limit:
                    self.ghost[key] = None
                    if len(self.ghost) > self.ghost_limit:
                        self.ghost.popitem(last=False)
                return key
        return None

    def _evict_main(self, protected: Container[Hashable]) -> Hashable | None:
        main, freq = self.main, self.freq
        passed = 0  # protected keys passed over in a row: all of main once it reaches len(main)
        while main and passed < len(main):
            key = next(iter(main))
            del main[key]
            main[key] = None  # back to the tail unless it leaves below
            if key in protected:
                passed += 1
                continue
            passed = 0
            if freq[key] > 0:
                freq[key] -= 1
            else:
                del main[key]
                del freq[key]
                return key
        return None

    def __contains__(self, key: object) -> bool:
        return key in self.freq

    def __len__(self) -> int:
        return len(self.freq)
