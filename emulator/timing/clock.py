"""Simulated time for the data path: completion times computed, nobody waits."""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    """What ``DataPath(clock=...)`` needs: the current time in integer nanoseconds."""

    def now_ns(self) -> int: ...


class SimClock:
    """A clock that moves only when told to; ``now_ns`` starts at ``start_ns``."""

    def __init__(self, start_ns: int = 0) -> None:
        if start_ns < 0:
            raise ValueError(f"start_ns must be >= 0, got {start_ns}")
        self._now = int(start_ns)

    def now_ns(self) -> int:
        return self._now

    def advance(self, ns: int) -> int:
        """Move forward by ``ns`` (>= 0); returns the new time."""
        if ns < 0:
            raise ValueError(f"a clock cannot go back: advance({ns})")
        self._now += int(ns)
        return self._now

    def advance_to(self, t_ns: int) -> int:
        """Move to ``t_ns`` if it is later (completion times may lie in the past)."""
        self._now = max(self._now, int(t_ns))
        return self._now


class SimpyClock:
    """Adapter for a simpy ``Environment`` whose time unit is ``ns_per_unit`` nanoseconds."""

    def __init__(self, env: object, ns_per_unit: float = 1.0) -> None:
        self.env = env
        self.ns_per_unit = ns_per_unit

    def now_ns(self) -> int:
        return round(self.env.now * self.ns_per_unit)  # type: ignore[attr-defined]
