"""Reuse-interval prediction: an online estimate of Belady's choice.

OPT evicts the block whose next use is furthest away. Online, that next use can be *predicted*:
each key keeps an exponential moving average of the gaps between its accesses (in accesses), and
its next use is expected one gap after its last one. A key a little overdue (silent for up to two
gaps) is expected one round later — it skipped a round; a key silent for longer has probably left
the working set (a block that slid out of the attention window), so it is expected as far ahead as
it has been silent, which orders dead keys like LRU. Keys never seen twice get the running mean gap
of all keys. The victim is the key with the furthest predicted use;
among equals, the most recently used.

This is what makes decode traffic tractable: a KV layer loop gives every block the same gap, so the
block just used is predicted furthest away (the oracle's choice, where LRU picks the worst), and
blocks attention visits only every few steps get longer gaps than heavy hitters visited every step.
Gap statistics of evicted keys are remembered (bounded, FIFO) so a returning block keeps them.

Eviction evaluates every resident key (the predicted order of overdue keys changes with time, so no
heap stays valid), vectorised with numpy over slot arrays that mirror the residents' statistics:
O(capacity) but in C, a few microseconds for an arena of thousands of blocks.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable

import numpy as np

from firmware_model.policies.base import (
    NoVictimError,
    check_capacity,
    duplicate,
    missing,
)

__all__ = ["ReusePolicy"]


class ReusePolicy:
    """Evicts the key predicted to be used furthest in the future."""

    name = "reuse"
    #: up to this many residents an eviction compares them in Python; above, one numpy scan
    SCALAR_MAX = 32
    #: slot arrays start this long (or ``capacity``, if smaller) and double when full
    INITIAL_SLOTS = 64

    def __init__(self, capacity: int, alpha: float = 0.25, history: int = 0) -> None:
        """``alpha``: weight of the newest gap in each key's average; ``history``: evicted keys
        whose statistics are kept (0 = 16 x capacity)."""
        self.capacity = check_capacity(capacity)
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if history < 0:
            raise ValueError(f"history must be >= 0 (0 = 16 x capacity), got {history}")
        self.alpha = alpha
        self.history = history or 16 * capacity
        self._clock = 0
        self._mean_gap = 0.0  # running mean over all observed gaps; 0 until one is seen
        self._last: dict[Hashable, int] = {}  # residents and remembered keys
        self._gap: dict[Hashable, float] = {}
        self._remembered: OrderedDict[Hashable, None] = OrderedDict()
        # Residents' statistics mirrored in slot arrays for the vectorised eviction scan. They
        # start at most INITIAL_SLOTS long and double when full (slots are handed out lowest
        # first either way): a capacity is a bound, not an allocation, and callers may pass one
        # far beyond what will ever be resident.
        slots = min(capacity, self.INITIAL_SLOTS)
        self._slot: dict[Hashable, int] = {}
        self._keys: list[Hashable | None] = [None] * slots
        self._free = list(range(slots - 1, -1, -1))
        self._last_a = np.zeros(slots)
        self._gap_a = np.zeros(slots)  # 0: no gap seen yet
        self._alive = np.zeros(slots, dtype=bool)

    def predicted_use(self, key: Hashable) -> float:
        """When ``key`` is expected next (in this policy's access count)."""
        gap = self._gap.get(key) or self._mean_gap or float(self.capacity)
        last = self._last[key]
        silence = self._clock - last
        if silence > 2 * gap:  # long overdue: its pattern ended; the longer the silence, the colder
            return self._clock + silence
        nxt = last + gap
        if nxt < self._clock:  # a little overdue: it skipped a round
            nxt += gap * (int((self._clock - nxt) / gap) + 1)
        return nxt

    def insert(self, key: Hashable, now: int = 0) -> None:
        if key in self._slot:
            raise duplicate(self.name, key)
        self._remembered.pop(key, None)
        if not self._free:
            self._grow()
        i = self._free.pop()
        self._slot[key], self._keys[i], self._alive[i] = i, key, True
        self._access(key)

    def touch(self, key: Hashable, now: int = 0) -> None:
        if key not in self._slot:
            raise missing(self.name, key)
        self._access(key)

    def remove(self, key: Hashable) -> None:
        if key not in self._slot:
            raise missing(self.name, key)
        self._drop(key)

    def evict(self, protected: Container[Hashable] = ()) -> Hashable:
        if len(self._slot) <= self.SCALAR_MAX:
            return self._evict_scalar(protected)
        pred = self._predictions()
        while True:
            i = self._argmax(pred)
            if i < 0:
                raise NoVictimError(f"reuse: all {len(self._slot)} resident keys are protected")
            key = self._keys[i]
            if key not in protected:
                self._drop(key)
                return key
            pred[i] = -np.inf

    def _evict_scalar(self, protected: Container[Hashable]) -> Hashable:
        """:meth:`evict` for a few residents (a KV arena of layer frames holds 2-32): the same
        choice as the numpy scan — furthest prediction, then most recent use — without its
        fixed cost of ~15 array operations (~100 us), which dominated a decode step's
        bookkeeping."""
        best: tuple[float, int] | None = None
        victim: Hashable = None
        for key in self._slot:
            if key in protected:
                continue
            rank = (self.predicted_use(key), self._last[key])
            if best is None or rank > best:
                best, victim = rank, key
        if best is None:
            raise NoVictimError(f"reuse: all {len(self._slot)} resident keys are protected")
        self._drop(victim)
        return victim

    def _predictions(self) -> np.ndarray:
        """Vectorised :meth:`predicted_use` of every slot (-inf for empty slots)."""
        clock = float(self._clock)
        last = self._last_a
        gap = np.where(self._gap_a > 0, self._gap_a, self._mean_gap or float(self.capacity))
        silence = clock - last
        nxt = last + gap
        late = nxt < clock
        nxt[late] += gap[late] * (np.floor((clock - nxt[late]) / gap[late]) + 1)
        nxt = np.where(silence > 2 * gap, clock + silence, nxt)
        nxt[~self._alive] = -np.inf
        return nxt

    def _argmax(self, pred: np.ndarray) -> int:
        """Slot with the furthest prediction; among equals the most recently used; -1 if none."""
        best = pred.max(initial=-np.inf)
        if best == -np.inf:
            return -1
        ties = np.flatnonzero(pred == best)
        return int(ties[np.argmax(self._last_a[ties])]) if ties.size > 1 else int(ties[0])

    def _access(self, key: Hashable) -> None:
        self._clock += 1
        prev = self._last.get(key)
        if prev is not None:
            gap = float(self._clock - prev)
            old = self._gap.get(key)
            self._gap[key] = gap if old is None else self.alpha * gap + (1 - self.alpha) * old
            self._mean_gap = gap if not self._mean_gap else 0.99 * self._mean_gap + 0.01 * gap
        self._last[key] = self._clock
        i = self._slot[key]
        self._last_a[i] = self._clock
        self._gap_a[i] = self._gap.get(key, 0.0)

    def _drop(self, key: Hashable) -> None:
        i = self._slot.pop(key)
        self._keys[i], self._alive[i] = None, False
        self._free.append(i)
        self._remembered[key] = None
        while len(self._remembered) > self.history:
            old, _ = self._remembered.popitem(last=False)
            self._last.pop(old, None)
            self._gap.pop(old, None)

    def _grow(self) -> None:
        """Every slot is taken (more residents than so far, or than ``capacity`` if the caller
        evicts late): double the slot arrays."""
        n = len(self._keys)
        self._keys += [None] * n
        self._free = list(range(2 * n - 1, n - 1, -1))
        self._last_a = np.concatenate([self._last_a, np.zeros(n)])
        self._gap_a = np.concatenate([self._gap_a, np.zeros(n)])
        self._alive = np.concatenate([self._alive, np.zeros(n, dtype=bool)])

    def __contains__(self, key: object) -> bool:
        return key in self._slot

    def __len__(self) -> int:
        return len(self._slot)
