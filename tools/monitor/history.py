"""Rates from counters: the link counters are totals, the monitor shows bytes per second.

Each poll adds one sample (monotonic time, counters). The rate between two consecutive samples is
the counter delta over the time delta; a counter that goes down means the device was recreated, so
the history restarts rather than showing a negative rate. Samples older than the window (a minute)
are dropped, so memory stays bounded whatever the interval.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from emulator.timing import linkstate

DIRECTIONS = linkstate.DIRECTIONS
SPARK_CHARS = "▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class Rate:
    """Throughput between two samples, ending at time `t` (monotonic seconds)."""

    t: float
    bytes_per_s: tuple[float, float]  # (read, write)
    transfers_per_s: tuple[float, float]


class LinkHistory:
    """The last `window_s` seconds of link counters of one device."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, dict[str, int]]] = deque()
        self.rates: deque[Rate] = deque()

    def reset(self) -> None:
        self.samples.clear()
        self.rates.clear()

    def add(self, now: float, counters: dict[str, int]) -> None:
        """Record counters seen at `now`; derive the rate since the previous sample."""
        if self.samples:
            t0, c0 = self.samples[-1]
            if now <= t0:
                return
            if any(counters[f"{d}_bytes"] < c0[f"{d}_bytes"] for d in DIRECTIONS):
                self.reset()  # counters went backwards: a new device under the same name
            else:
                dt = now - t0
                self.rates.append(Rate(now, *(
                    tuple((counters[f"{d}_{k}"] - c0[f"{d}_{k}"]) / dt for d in DIRECTIONS)
                    for k in ("bytes", "transfers"))))  # type: ignore[arg-type]
        self.samples.append((now, counters))
        while self.samples and self.samples[0][0] < now - self.window_s:
            self.samples.popleft()
        while self.rates and self.rates[0].t < now - self.window_s:
            self.rates.popleft()

    def latest(self) -> Rate | None:
        return self.rates[-1] if self.rates else None

    def series(self, direction: int, bins: int, now: float) -> list[float | None]:
        """Bytes/s in `bins` equal slices of the window ending at `now` (oldest first); a slice
        holding several rates shows their mean, one holding none is None."""
        sums = [0.0] * bins
        counts = [0] * bins
        width = self.window_s / bins
        for rate in self.rates:
            # A rate ending at t covers time just before t: slice i holds t in (start_i, end_i].
            i = math.ceil((rate.t - (now - self.window_s)) / width) - 1
            if 0 <= i < bins:
                sums[i] += rate.bytes_per_s[direction]
                counts[i] += 1
        return [s / c if c else None for s, c in zip(sums, counts)]

    def latency_counts(self, direction: int) -> tuple[list[int], str]:
        """Transfers per log2-ns bucket over the window (or since start with one sample)."""
        name = DIRECTIONS[direction]
        keys = [f"{name}_hist_{k:02d}" for k in range(linkstate.HIST_BUCKETS)]
        if not self.samples:
            return [0] * len(keys), "no samples"
        newest = self.samples[-1][1]
        if len(self.samples) == 1:
            return [newest[k] for k in keys], "since start"
        oldest = self.samples[0][1]
        span = self.samples[-1][0] - self.samples[0][0]
        return [newest[k] - oldest[k] for k in keys], f"last {span:.0f} s"


def sparkline(values: list[float | None], top: float | None = None) -> str:
    """One character per value, scaled to `top` (default: the largest); None is a blank."""
    present = [v for v in values if v is not None]
    top = top if top is not None else max(present, default=0.0)
    out = []
    for v in values:
        if v is None:
            out.append(" ")
        elif top <= 0 or v <= 0:
            out.append(SPARK_CHARS[0])
        else:  # eighths, rounded up: any traffic shows, a quarter of the peak is two eighths
            eighths = math.ceil(min(v / top, 1.0) * len(SPARK_CHARS))
            out.append(SPARK_CHARS[max(eighths, 1) - 1])
    return "".join(out)
