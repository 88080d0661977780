"""The time of a run of decode steps, in closed form (``tools.sim.instance``'s windows).

``n`` sequences decode together for ``k`` steps; in step ``j`` their computed tokens + 1 sum to
``s0 + n j`` (each grows by one a step), so the step's :class:`~tools.sim.hardware.Batch` is known
without building it step by step. A step cost is piecewise linear in that sum (the roofline: the
larger of a compute line and a memory line; a linear or profiled cost: one line), so the steps'
times are a few linear *segments*, found by checking each stretch's midpoint against the line
through its ends and splitting where it bends (exact for piecewise-linear costs). Sums and the
first step ending after a given time are then arithmetic on the segments.
"""
from __future__ import annotations

import math

from tools.sim.hardware import Batch, StepCost

__all__ = ["DecodeWindow", "decode_step_ns"]


def decode_step_ns(cost: StepCost, n: int, s: float) -> float:
    """One step of ``n`` decoding sequences whose computed tokens + 1 sum to ``s``."""
    return cost.step_ns(Batch(tokens=n, pairs=s, context=int(s), seqs=n, sampled=n, decode_context=int(s)))


class DecodeWindow:
    """Steps 0..k-1 of ``n`` sequences from sum ``s0``: their times as linear segments
    ``(j0, j1, first step's ns, ns added a step)``."""

    __slots__ = ("k", "segments")

    def __init__(self, cost: StepCost, n: int, s0: int, k: int) -> None:
        self.k = k
        self.segments: list[tuple[int, int, float, float]] = []

        def f(j: int) -> float:
            return decode_step_ns(cost, n, s0 + n * j)
        self._split(f, 0, k, f(0), f(k - 1))

    def _split(self, f: object, j0: int, j1: int, a: float, b: float) -> None:
        if j1 - j0 <= 2:
            self.segments.append((j0, j1, a, b - a if j1 - j0 == 2 else 0.0))
            return
        slope = (b - a) / (j1 - 1 - j0)
        mid = (j0 + j1 - 1) // 2
        fm = f(mid)  # type: ignore[operator]
        if abs(fm - (a + slope * (mid - j0))) <= 1e-9 * max(abs(fm), 1.0):
            self.segments.append((j0, j1, a, slope))
            return
        self._split(f, j0, mid + 1, a, fm)
        self._split(f, mid + 1, j1, f(mid + 1), b)  # type: ignore[operator]

    @property
    def first_ns(self) -> float:
        return self.segments[0][2]

    def total(self, j: int) -> float:
        """The time of steps 0..j-1."""
        t = 0.0
        for j0, j1, a, slope in self.segments:
            if j0 >= j:
                break
            m = min(j1, j) - j0
            t += m * a + slope * m * (m - 1) / 2
        return t

    def first_end_after(self, rel: float) -> int:
        """The first step count j (1..k) whose steps take at least ``rel`` ns."""
        t = 0.0
        for j0, j1, a, slope in self.segments:
            m = j1 - j0
            seg = m * a + slope * m * (m - 1) / 2
            if t + seg >= rel:
                lo, hi = 1, m  # the fewest steps of this segment that reach rel
                while lo < hi:
                    mid = (lo + hi) // 2
                    if t + mid * a + slope * mid * (mid - 1) / 2 >= rel:
                        hi = mid
                    else:
                        lo = mid + 1
                return j0 + lo
            t += seg
        return self.k if not math.isnan(t) else 1
