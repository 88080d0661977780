"""Time as the firmware sees it: a :class:`Clock` it reads, never the wall clock.

``SimpyClock`` is driven by a simpy environment (one event heap ordered by time, priority and
insertion sequence, so ties are deterministic); tests run it and assert ``env.now`` exactly.
``ManualClock`` is set by its owner — the emulator's runner passes the device time in it.
Times are nanoseconds. (The timed data path's integer clocks, ``emulator.timing.SimClock`` — a
manual one — and ``emulator.timing.SimpyClock``, are of the same two kinds.)
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import simpy

__all__ = ["Clock", "ManualClock", "SimpyClock"]


@runtime_checkable
class Clock(Protocol):
    """Anything that tells the current time in nanoseconds."""

    def now_ns(self) -> float:
        """Current time, ns; never decreases."""


class SimpyClock:
    """A clock that is the simulated time of a simpy environment (one time unit: 1 ns)."""

    def __init__(self, env: simpy.Environment | None = None) -> None:
        self.env = env if env is not None else simpy.Environment()

    def now_ns(self) -> float:
        return self.env.now

    def run(self, until: float | simpy.Event | None = None) -> None:
        """Advance the simulation (see ``simpy.Environment.run``)."""
        self.env.run(until=until)


class ManualClock:
    """A clock its owner moves forward explicitly (``advance`` / ``set``)."""

    def __init__(self, start_ns: float = 0) -> None:
        self._now = start_ns

    def now_ns(self) -> float:
        return self._now

    def advance(self, delta_ns: float) -> float:
        if delta_ns < 0:
            raise ValueError(f"time only moves forward: advance by >= 0 ns, got {delta_ns}")
        self._now += delta_ns
        return self._now

    def set(self, now_ns: float) -> None:
        if now_ns < self._now:
            raise ValueError(f"time only moves forward: {now_ns} ns is before {self._now} ns")
        self._now = now_ns
