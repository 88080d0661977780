"""A hotness-tracking unit with the semantics of CXL 3.2's Hotness Monitoring Unit (CHMU).

Facts from the CHMU RFC (QEMU and the Linux perf driver, 2024-2025; not yet in mainline QEMU),
whose register layout is emulator/spec/chmu.py:

* the DPA space is divided into units of ``unit_size`` (a power of two >= 256 B); each unit has a
  saturating counter ``counter_width`` bits wide (RFC default 16);
* a range bitmap with one bit per 256 MiB of DPA selects what is tracked; request types
  (reads, writes) can be filtered; a downsampling factor N counts one access in N, in order or
  at random (seeded here, so runs repeat);
* **epoch mode**: counters start at zero each epoch; at epoch end every unit at or above the
  hotness threshold goes on the hotlist (hottest first), then counters are zeroed;
  **always-on mode**: a unit goes on the hotlist as soon as it reaches the threshold and its
  counter is cleared (the "insert after clear" behaviour), so it is reported again only after
  another ``threshold`` accesses;
* the hotlist is a ring of u64 entries with 16-bit head and tail: the low ``counter_width`` bits
  hold the count, the rest the unit index. Empty when head == tail, full when
  (tail + 1) % len == head, so a ring of N slots holds N - 1 entries; software consumes by
  advancing head. A push onto a full ring is dropped and raises the overflow status (and
  interrupt, if enabled); reaching the notification fill threshold raises the level interrupt.

Counting is batched with numpy (an unbuffered scatter-add over unit indices), so the cost per
access is a few vectorised operations. Time comes in as ``now`` (integer ns), from a
:class:`~firmware_model.clock.Clock` or from a simpy process.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from firmware_model.clock import Clock

__all__ = ["MODES", "RANGE_GRANULE", "HotlistRing", "HotnessConfig", "HotnessStatus", "HotnessUnit"]

RANGE_GRANULE = 256 << 20  # one range-bitmap bit per 256 MiB of DPA (CHMU range configuration)
MODES = ("epoch", "always_on")


@dataclass(frozen=True, kw_only=True)
class HotnessConfig:
    """How one CHMU instance counts; validated so a bad value says what to change."""

    unit_size: int = 4096
    threshold: int = 1
    mode: str = "epoch"
    epoch_ns: int = 100_000_000  # RFC minimum epoch: 100 ms
    downsampling: int = 1
    randomized: bool = False
    seed: int = 0
    count_reads: bool = True
    count_writes: bool = True
    hotlist_size: int = 1024
    counter_width: int = 16
    fill_threshold: int = 0  # entries; 0 = no level notification
    irq_on_overflow: bool = True
    irq_on_fill: bool = True
    range_bitmap: tuple[int, ...] | None = None  # indices of tracked 256 MiB granules; None = all

    def __post_init__(self) -> None:
        us = self.unit_size
        if us < 256 or us & (us - 1):
            raise ValueError(f"unit_size must be a power of two >= 256 B, got {us}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not 1 <= self.counter_width <= 32:
            raise ValueError(f"counter_width must be 1..32 bits, got {self.counter_width}")
        if not 1 <= self.threshold < (1 << 32):
            raise ValueError(f"threshold must be 1..2**32-1 (a u32), got {self.threshold}")
        if self.mode == "epoch" and self.epoch_ns <= 0:
            raise ValueError(f"epoch_ns must be > 0 in epoch mode, got {self.epoch_ns}")
        ds = self.downsampling
        if ds < 1 or ds & (ds - 1):
            raise ValueError(f"downsampling must be a power of two >= 1, got {ds}")
        if not 2 <= self.hotlist_size <= 1 << 16:
            raise ValueError(f"hotlist_size must be 2..65536 (16-bit head/tail), got {self.hotlist_size}")
        if not 0 <= self.fill_threshold < self.hotlist_size:
            raise ValueError(f"fill_threshold must be 0..hotlist_size-1, got {self.fill_threshold}")

    @property
    def counter_max(self) -> int:
        return (1 << self.counter_width) - 1


class HotlistRing:
    """The hotlist: u64 entries, 16-bit head (software) and tail (device)."""

    def __init__(self, size: int, counter_width: int) -> None:
        self.entries = np.zeros(size, dtype=np.uint64)
        self.size = size
        self.counter_width = counter_width
        self.head = 0
        self.tail = 0

    def __len__(self) -> int:
        return (self.tail - self.head) % self.size

    @property
    def full(self) -> bool:
        return (self.tail + 1) % self.size == self.head

    def push(self, unit: int, count: int) -> bool:
        """Append one entry; False (dropped) if the ring is full."""
        if self.full:
            return False
        cmax = (1 << self.counter_width) - 1
        self.entries[self.tail] = (int(unit) << self.counter_width) | min(int(count), cmax)
        self.tail = (self.tail + 1) % self.size
        return True

    def push_many(self, units: np.ndarray, counts: np.ndarray) -> int:
        """Append entries in order until the ring is full; returns how many were accepted."""
        room = self.size - 1 - len(self)
        k = min(room, len(units))
        if k:
            cw = np.uint64(self.counter_width)
            vals = (np.asarray(units[:k], dtype=np.uint64) << cw) | np.minimum(
                np.asarray(counts[:k], dtype=np.uint64), np.uint64((1 << self.counter_width) - 1))
            slots = (self.tail + np.arange(k)) % self.size
            self.entries[slots] = vals
            self.tail = (self.tail + k) % self.size
        return k

    def decode(self, entry: int) -> tuple[int, int]:
        """(unit index, count) of one entry."""
        return int(entry) >> self.counter_width, int(entry) & ((1 << self.counter_width) - 1)

    def peek(self) -> list[tuple[int, int]]:
        """Unconsumed entries, oldest first, decoded."""
        return [self.decode(self.entries[(self.head + i) % self.size]) for i in range(len(self))]

    def consume(self, n: int | None = None) -> list[tuple[int, int]]:
        """Read and advance head past ``n`` entries (all by default), as software does."""
        out = self.peek()[: len(self) if n is None else n]
        self.head = (self.head + len(out)) % self.size
        return out

    def set_head(self, head: int) -> None:
        """Software writes the head register; it may not pass the tail."""
        if not 0 <= head < self.size or (head - self.head) % self.size > len(self):
            raise ValueError(f"head {head} is outside the filled part of the ring "
                             f"(head {self.head}, tail {self.tail}, size {self.size})")
        self.head = head


@dataclass
class HotnessStatus:
    """Status bits (write 1 to clear in the register view) and counters for telemetry."""

    overflow: bool = False
    level: bool = False
    epochs: int = 0
    counted: int = 0
    dropped: int = 0
    interrupts: list[tuple[int, str]] = field(default_factory=list)


class HotnessUnit:
    """Counters, epochs and hotlist of one CHMU instance over ``capacity`` bytes of DPA."""

    def __init__(self, capacity: int, config: HotnessConfig | None = None,
                 on_interrupt: Callable[[str], None] | None = None, clock: Clock | None = None) -> None:
        """``clock``: read when ``record`` / ``configure`` get no explicit ``now``."""
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0 bytes, got {capacity}")
        self.capacity = capacity
        self.on_interrupt = on_interrupt
        self.clock = clock
        self.configure(config or HotnessConfig())

    def configure(self, config: HotnessConfig, now: int | None = None) -> None:
        """Apply a configuration: counters, hotlist and status reset; a new epoch starts at ``now``
        (default: the clock's time, or 0 without a clock)."""
        if now is None:
            now = self.clock.now_ns() if self.clock is not None else 0
        self.config = config
        self._shift = config.unit_size.bit_length() - 1
        self.num_units = -(-self.capacity // config.unit_size)
        self.counters = np.zeros(self.num_units, dtype=np.int64)
        self._scratch = np.zeros(self.num_units if config.mode == "always_on" else 0, dtype=bool)
        self.hotlist = HotlistRing(config.hotlist_size, config.counter_width)
        self.status = HotnessStatus()
        self.epoch_start = now
        self._rng = np.random.default_rng(config.seed)
        self._phase = 0  # position in the 1-in-N sequence of ordered downsampling
        granules = -(-self.capacity // RANGE_GRANULE)
        self._tracked = np.ones(granules, dtype=bool)
        if config.range_bitmap is not None:
            self._tracked[:] = False
            self._tracked[[g for g in config.range_bitmap if 0 <= g < granules]] = True
        self._all_tracked = bool(self._tracked.all())
        self.enabled = True

    @property
    def epoch_end(self) -> int:
        return self.epoch_start + self.config.epoch_ns

    def record(self, dpas: np.ndarray, is_write: np.ndarray | bool = False, now: int | None = None) -> int:
        """Count a batch of accesses (DPAs, optionally per-access write flags); returns how many counted.

        In epoch mode the epochs that finished before this batch end first, by ``now`` or, when it
        is not given, by the clock.
        """
        if now is None and self.clock is not None:
            now = self.clock.now_ns()
        if now is not None:
            self.advance(now)
        if not self.enabled:
            return 0
        dpas = np.asarray(dpas, dtype=np.uint64)
        keep = dpas < self.capacity
        if not self._all_tracked:
            keep &= self._tracked[(dpas >> np.uint64(28)).clip(0, self._tracked.size - 1).astype(np.intp)]
        mask = self._type_mask(dpas.shape[0], is_write)
        if mask is not None:
            keep &= mask
        if not keep.all():
            dpas = dpas[keep]
        units = (dpas >> np.uint64(self._shift)).view(np.intp)  # < 2**63: the bits are the value
        units = self._downsample(units)
        if units.size == 0:
            return 0
        old_new = self._add(units)
        self.status.counted += int(units.size)
        if old_new is not None:
            self._publish_crossed(units, *old_new)
        return int(units.size)

    def _add(self, units: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Add one per occurrence; in always-on mode returns each occurrence's count before and after.

        ``np.add.at`` is the fastest unbuffered scatter-add here (faster than ``bincount`` over a
        large counter array and than sorting). Counters are int64 and saturate lazily: epoch
        mode clips at publication, always-on mode clips the units it touched.
        """
        if self.config.mode != "always_on":
            np.add.at(self.counters, units, 1)
            return None
        old = self.counters[units]
        np.add.at(self.counters, units, 1)
        new = self.counters[units]
        over = new > self.config.counter_max
        if over.any():  # rare: only a unit past 2**width - 1 needs a second scatter
            self.counters[units[over]] = self.config.counter_max
            new = np.minimum(new, self.config.counter_max)
        return old, new

    def advance(self, now: int) -> int:
        """Epoch mode: end every epoch that finished at or before ``now``; returns how many ended."""
        ended = 0
        while self.enabled and self.config.mode == "epoch" and self.epoch_end <= now:
            self.end_epoch()
            ended += 1
        return ended

    def end_epoch(self) -> None:
        """Publish units at or above the threshold (hottest first), zero counters, start the next epoch."""
        np.minimum(self.counters, self.config.counter_max, out=self.counters)
        hot = np.flatnonzero(self.counters >= self.config.threshold)
        order = hot[np.argsort(-self.counters[hot], kind="stable")]
        self._push_all(order, self.counters[order])
        self.counters[:] = 0
        self.epoch_start = self.epoch_end
        self.status.epochs += 1

    def run(self, env: simpy.Environment) -> Generator[Any, Any, None]:
        """A simpy process ending each epoch exactly at its end time (epoch mode)."""
        self.epoch_start = math.floor(env.now)  # whole ns, as a SimpyClock reads it
        while self.enabled and self.config.mode == "epoch":
            yield env.timeout(self.epoch_end - env.now)
            self.end_epoch()

    def clear_status(self, overflow: bool = False, level: bool = False) -> None:
        """Write-1-to-clear of the overflow / level status bits."""
        if overflow:
            self.status.overflow = False
        if level:
            self.status.level = False

    def _type_mask(self, n: int, is_write: np.ndarray | bool) -> np.ndarray | None:
        c = self.config
        if c.count_reads and c.count_writes:
            return None
        writes = np.broadcast_to(np.asarray(is_write, dtype=bool), (n,))
        if not c.count_reads and not c.count_writes:
            return np.zeros(n, dtype=bool)
        return writes if c.count_writes else ~writes

    def _downsample(self, units: np.ndarray) -> np.ndarray:
        n = self.config.downsampling
        if n == 1:
            return units
        if self.config.randomized:
            return units[self._rng.integers(0, n, units.size) == 0]
        first = (-self._phase) % n  # index of the next access to count
        self._phase = (self._phase + units.size) % n
        return units[first::n]

    def _publish_crossed(self, touched: np.ndarray, old: np.ndarray, new: np.ndarray) -> None:
        thr = self.config.threshold
        cand = touched[(old < thr) & (new >= thr)]  # every occurrence of each crossing unit
        # A batch is one counting interval: its crossing units are listed in unit order. Dedupe
        # with a persistent mark array (scatter, scan, unmark) rather than a sort.
        if cand.size > 1:
            self._scratch[cand] = True
            cand = np.flatnonzero(self._scratch)
            self._scratch[cand] = False
        self._push_all(cand, self.counters[cand])
        self.counters[cand] = 0

    def _push_all(self, units: np.ndarray, counts: np.ndarray) -> None:
        c = self.config
        dropped = len(units) - self.hotlist.push_many(units, counts)
        if dropped:
            self.status.dropped += dropped
            if not self.status.overflow:
                self.status.overflow = True
                if c.irq_on_overflow:
                    self._interrupt("overflow")
        if c.fill_threshold and len(self.hotlist) >= c.fill_threshold and not self.status.level:
            self.status.level = True
            if c.irq_on_fill:
                self._interrupt("level")

    def _interrupt(self, kind: str) -> None:
        self.status.interrupts.append((self.epoch_start, kind))
        if self.on_interrupt is not None:
            self.on_interrupt(kind)
