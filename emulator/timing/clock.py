"""The wall clock as a :class:`firmware_model.clock.Clock`: the one place outside the C core and
the runner where cxlemu reads real time for a decision (DESIGN: wall-clock time appears only in
the emulator's runner and the timed data path). Simulated time is ``firmware_model.clock``'s
``ManualClock`` / ``SimpyClock``; the protocol is ``firmware_model.clock.Clock``.
"""
from __future__ import annotations

import time

__all__ = ["WallClock"]


class WallClock:
    """The host's monotonic clock, integer ns (what an unsimulated ``DataPath`` runs on). A
    decision taken on it depends on how fast this host computes: tests pass a ``ManualClock``."""

    __slots__ = ()

    def now_ns(self) -> int:
        return time.monotonic_ns()
