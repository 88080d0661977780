"""Simulated time for the data path: completion times computed, nobody waits. Integer ns.

``SimClock`` moves only when told (``firmware_model.clock.ManualClock``'s kind, in integers);
``SimpyClock`` is ``firmware_model.clock.SimpyClock`` read in integer ns.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from firmware_model import clock as _fm_clock


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


class SimpyClock(_fm_clock.SimpyClock):
    """A simpy ``Environment``'s time whose unit is ``ns_per_unit`` nanoseconds, in integer ns."""

    def __init__(self, env: object, ns_per_unit: float = 1.0) -> None:
        super().__init__(env)  # type: ignore[arg-type]
        self.ns_per_unit = ns_per_unit

    def now_ns(self) -> int:
        return round(self.env.now * self.ns_per_unit)  # type: ignore[attr-defined]
