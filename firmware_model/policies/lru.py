"""Least-recently-used: the default of vLLM's offloading connector and of LMCache."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Hashable

from firmware_model.policies.base import (
    NoVictimError,
    check_capacity,
    duplicate,
    missing,
)

__all__ = ["LRUPolicy"]


class LRUPolicy:
    """Evicts the resident key whose last access is oldest.

    An ``OrderedDict`` keeps keys oldest-first, so insert, touch, remove and an unprotected evict
    are O(1); an evict skips protected keys from the old end.
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        self.capacity = check_capacity(capacity)
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable, now: int = 0) -> None:
        if key in self._order:
            raise duplicate(self.name, key)
        self._order[key] = None

    def touch(self, key: Hashable, now: int = 0) -> None:
        try:
            self._order.move_to_end(key)
        except KeyError:
            raise missing(self.name, key) from None

    def remove(self, key: Hashable) -> None:
        try:
            del self._order[key]
        except KeyError:
            raise missing(self.name, key) from None

    def evict(self, protected: Container[Hashable] = ()) -> Hashable:
        for key in self._order:
            if key not in protected:
                del self._order[key]
                return key
        raise NoVictimError(f"lru: all {len(self._order)} resident keys are protected")

    def order(self) -> list[Hashable]:
        """Resident keys, next victim first (for tests and the monitor)."""
        return list(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)
