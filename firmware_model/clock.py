"""Time as cxlemu's pieces read it: one :class:`Clock` protocol, integer nanoseconds.

The firmware model never reads the wall clock: it is given ``now`` or a :class:`Clock`.

* :class:`ManualClock` — simulated time its owner moves (``advance``, ``set``):
  the timed data path's simulated mode (``DataPath(clock=ManualClock())``), the KV engine's
  tests, the firmware model's own tests;
* :class:`SimpyClock` — a simpy environment's time (one event heap ordered by time, priority and
  insertion sequence, so ties are deterministic; 1 time unit = 1 ns), for the simulator;
* the wall clock, ``emulator.timing.WallClock`` — in the emulator, where DESIGN allows wall time
  (the runner and the timed data path), and the default of the driver's KV engine.
"""
from __future__ import annotations

import math
import numbers
from typing import Protocol, runtime_checkable

import simpy

__all__ = ["Clock", "ManualClock", "SimpyClock"]


@runtime_checkable
class Clock(Protocol):
    """Anything that tells the current time in integer nanoseconds."""

    def now_ns(self) -> int:
        """Current time, ns; never decreases."""


def _ns(name: str, value: object) -> int:
    """An integer ns count: a float would round silently, so it is refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer number of ns, got {value!r}")
    return int(value)


class ManualClock:
    """Simulated time that moves only when its owner says; ``now_ns`` starts at ``start_ns``."""

    __slots__ = ("_now",)

    def __init__(self, start_ns: int = 0) -> None:
        start = _ns("start_ns", start_ns)
        if start < 0:
            raise ValueError(f"start_ns must be >= 0, got {start}")
        self._now = start

    def now_ns(self) -> int:
        return self._now

    def advance(self, delta_ns: int) -> int:
        """Move forward by ``delta_ns`` (>= 0); returns the new time."""
        delta = _ns("delta_ns", delta_ns)
        if delta < 0:
            raise ValueError(f"time only moves forward: advance by >= 0 ns, got {delta}")
        self._now += delta
        return self._now

    def set(self, now_ns: int) -> None:
        """Move to ``now_ns``, which must not be earlier than the time now."""
        now = _ns("now_ns", now_ns)
        if now < self._now:
            raise ValueError(f"time only moves forward: {now} ns is before {self._now} ns")
        self._now = now


class SimpyClock:
    """A simpy environment's time (one time unit: 1 ns) as a :class:`Clock`.

    ``now_ns`` is the whole nanoseconds elapsed (the floor of a fractional simpy time), so a
    deadline ``t`` (integer ns) has passed exactly when ``t <= now_ns()``, as it has when
    ``t <= env.now``."""

    def __init__(self, env: simpy.Environment | None = None) -> None:
        self.env = env if env is not None else simpy.Environment()

    def now_ns(self) -> int:
        return math.floor(self.env.now)

    def run(self, until: float | simpy.Event | None = None) -> None:
        """Advance the simulation (see ``simpy.Environment.run``)."""
        self.env.run(until=until)
