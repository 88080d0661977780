"""Poison: the list the device reports (CXL r3.1 §8.2.9.9.4) and the bitmap hosts' reads check.

Two views of one truth, kept in step here and nowhere else:

    bitmap (device file `poison`)      every bad 64-B line: line i -> byte i>>3, bit i&7.
                                       Hosts' reads fail on a set bit (driver/memdev.py).
    list   (this object)               what the device knows and reports: at most
                                       POISON_LIST_LIMIT records {dpa, length, source}, sorted
                                       by DPA, never overlapping. Every listed line is set in
                                       the bitmap; the bitmap may hold more.

Lines set in the bitmap but not listed are either *latent* (the media went bad and nobody has
looked: `add_latent`, a fault-injection hook) or were dropped because the list was full (then
the overflow flag and timestamp are set). Scan Media reads the bitmap and lists what it finds
with source Internal; a data-path hit (`report_hit`) lists the line and logs an event. Only a
scan that leaves nothing unlisted clears the overflow flag (as QEMU's `__do_scan_media`).
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from emulator.spec.payloads_events import (
    DESCRIPTOR_POISON_LIST_OVERFLOW,
    DESCRIPTOR_UNCORRECTABLE,
    EventLog,
    MemoryEventType,
    TransactionType,
)
from emulator.spec.payloads_poison import (
    INJECT_POISON_LIMIT,
    POISON_LINE,
    POISON_LIST_LIMIT,
    PoisonSource,
)
from emulator.spec.retcodes import RetCode

if TYPE_CHECKING:
    from emulator.firmware import Firmware

_POPCOUNT = np.array([i.bit_count() for i in range(256)], dtype=np.uint8)


@dataclass(frozen=True)
class PoisonRecord:
    """One listed range: `dpa` and `length` in bytes, both multiples of 64."""

    dpa: int
    length: int
    source: PoisonSource

    @property
    def end(self) -> int:
        return self.dpa + self.length


class PoisonList:
    """The device's poison list and bitmap. Methods returning RetCode are the mailbox's view."""

    def __init__(self, fw: Firmware, *, limit: int = POISON_LIST_LIMIT,
                 inject_limit: int = INJECT_POISON_LIMIT) -> None:
        self._fw = fw  # media and bitmap are read through fw: Firmware.close() drops its views
        self.capacity = fw.config.capacity
        self.limit = limit
        self.inject_limit = inject_limit  # 0: bounded only by the list (Identify 3Fh)
        self._records: list[PoisonRecord] = []
        self._starts: list[int] = []
        self.overflowed = False
        self.overflow_ns = 0
        self._resume: tuple[int, int, int] | None = None  # (query start, query end, next DPA)
        self._lock = threading.RLock()

    # observers ----------------------------------------------------------------------------------
    @property
    def records(self) -> list[PoisonRecord]:
        with self._lock:
            return list(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def is_poisoned(self, dpa: int) -> bool:
        line = dpa // POISON_LINE
        return bool(self._fw.poison_bits[line >> 3] >> (line & 7) & 1)

    def all_listed(self) -> bool:
        """True when every bad line in the bitmap is listed (popcount against listed lengths)."""
        with self._lock:
            bad = int(_POPCOUNT[self._fw.poison_bits].sum(dtype=np.int64))
            return bad * POISON_LINE == sum(r.length for r in self._records)

    # mailbox commands ---------------------------------------------------------------------------
    def check_line(self, dpa: int) -> RetCode | None:
        """Inject / Clear Poison address rules: 64-B aligned, inside the DPA space."""
        if dpa % POISON_LINE:
            return RetCode.INVALID_INPUT
        if dpa + POISON_LINE > self.capacity:
            return RetCode.INVALID_PHYSICAL_ADDRESS
        return None

    def inject(self, dpa: int) -> RetCode:
        """Inject Poison (§8.2.9.9.4.2): idempotent; a full list refuses with Inject Poison Limit."""
        refused = self.check_line(dpa)
        if refused is not None:
            return refused
        with self._lock:
            if self._covering(dpa) is not None:
                return RetCode.SUCCESS
            if len(self._records) >= self.limit or (self.inject_limit and self._injected() >= self.inject_limit):
                return RetCode.INJECT_POISON_LIMIT_REACHED
            self._set_lines(dpa, POISON_LINE, True)
            self._insert(PoisonRecord(dpa, POISON_LINE, PoisonSource.INJECTED))
            return RetCode.SUCCESS

    def clear(self, dpa: int, data: bytes) -> RetCode:
        """Clear Poison (§8.2.9.9.4.3): write `data` to the line, unpoison it, and cut it out of
        its record (splitting a longer one). Clearing a clean line only writes it (QEMU)."""
        refused = self.check_line(dpa)
        if refused is not None:
            return refused
        if len(data) != POISON_LINE:
            raise ValueError(f"Clear Poison writes {POISON_LINE} bytes, got {len(data)}")
        with self._lock:
            self._fw.media[dpa:dpa + POISON_LINE] = np.frombuffer(data, dtype=np.uint8)
            self._set_lines(dpa, POISON_LINE, False)
            i = self._covering(dpa)
            if i is None:
                return RetCode.SUCCESS
            rec = self._remove(i)
            if rec.dpa < dpa:
                self._insert(PoisonRecord(rec.dpa, dpa - rec.dpa, rec.source))
            if dpa + POISON_LINE < rec.end:
                tail = PoisonRecord(dpa + POISON_LINE, rec.end - dpa - POISON_LINE, rec.source)
                if len(self._records) < self.limit:
                    self._insert(tail)
                else:  # the head fragment took the last slot: the tail stays bad, unlisted
                    self._set_overflow()
            return RetCode.SUCCESS

    def get(self, start: int, length: int, max_records: int) -> tuple[list[PoisonRecord], bool]:
        """Get Poison List (§8.2.9.9.4.1): records overlapping [start, start+length), clipped to it.

        When more overlap than fit, "more" is set and the device remembers where it stopped: the
        next Get with the same range continues there, as the spec asks hosts to repeat the command
        until "more" clears (Linux `cxl_mem_get_poison`). The cursor is a DPA, so it survives
        records being added or cleared between the calls."""
        end = start + length
        with self._lock:
            resume = self._resume
            cursor = resume[2] if resume is not None and resume[:2] == (start, end) else start
            first = max(0, bisect.bisect_right(self._starts, cursor) - 1)
            out: list[PoisonRecord] = []
            more = False
            for rec in self._records[first:]:
                if rec.dpa >= end:
                    break
                if rec.end <= cursor:
                    continue
                if len(out) == max_records:
                    more = True
                    break
                lo, hi = max(rec.dpa, cursor), min(rec.end, end)
                out.append(PoisonRecord(lo, hi - lo, rec.source))
            self._resume = (start, end, out[-1].end) if more else None
            return out, more

    # firmware API -------------------------------------------------------------------------------
    def add(self, dpa: int, length: int, source: PoisonSource = PoisonSource.INTERNAL, *,
            transaction: TransactionType | None = TransactionType.INTERNAL_MEDIA_SCRUB) -> bool:
        """The device found [dpa, dpa+length) bad: poison it, list what is not listed yet, and
        (unless `transaction` is None) log a General Media failure event per new range. Returns
        False if the list had no room for all of it (overflow flag set, lines still poisoned)."""
        self._check_range(dpa, length)
        with self._lock:
            self._set_lines(dpa, length, True)
            complete = True
            for lo, hi in self._uncovered(dpa, dpa + length):
                listed = len(self._records) < self.limit
                if listed:
                    self._insert(PoisonRecord(lo, hi - lo, source))
                else:
                    self._set_overflow()
                    complete = False
                if transaction is not None:
                    self._log_error(lo, transaction, listed)
            return complete

    def add_latent(self, dpa: int, length: int) -> None:
        """Fault injection: the media under [dpa, dpa+length) goes bad unnoticed. Reads fail; the
        list learns of it only from Scan Media or a data-path hit."""
        self._check_range(dpa, length)
        self._set_lines(dpa, length, True)

    def report_hit(self, dpa: int, *, write: bool = False) -> None:
        """The data path touched a poisoned line: log a failure event; list the line if new."""
        line = dpa - dpa % POISON_LINE
        self._check_range(line, POISON_LINE)
        transaction = TransactionType.HOST_WRITE if write else TransactionType.HOST_READ
        with self._lock:
            if self._covering(line) is not None:
                self._log_error(line, transaction, True)
            else:
                self.add(line, POISON_LINE, PoisonSource.INTERNAL, transaction=transaction)

    def reset(self) -> None:
        """Forget all poison, listed or not (Sanitize rewrote every line)."""
        with self._lock:
            self._records.clear()
            self._starts.clear()
            self._fw.poison_bits[:] = 0
            self.overflowed, self.overflow_ns, self._resume = False, 0, None

    # persistence (emulator/persist.py): the list survives a restart, as the bitmap file does ------
    def to_state(self) -> dict[str, object]:
        with self._lock:
            return {"records": [[r.dpa, r.length, int(r.source)] for r in self._records],
                    "overflowed": self.overflowed, "overflow_ns": self.overflow_ns}

    def restore(self, state: dict[str, object]) -> None:
        """Take back a list ``to_state`` saved; records outside the DPA space (the device was
        reconfigured smaller) are dropped, and every record's lines are set in the bitmap."""
        with self._lock:
            self._records.clear()
            self._starts.clear()
            for dpa, length, source in state.get("records", []):  # type: ignore[union-attr]
                if dpa % POISON_LINE or length <= 0 or length % POISON_LINE or dpa + length > self.capacity:
                    continue
                if self._uncovered(dpa, dpa + length) != [(dpa, dpa + length)] or len(self._records) >= self.limit:
                    continue
                self._insert(PoisonRecord(dpa, length, PoisonSource(source)))
                self._set_lines(dpa, length, True)
            self.overflowed = bool(state.get("overflowed", False))
            self.overflow_ns = int(state.get("overflow_ns", 0))  # type: ignore[call-overload]

    def relist_from_bitmap(self, chunk_lines: int = 1 << 26) -> int:
        """List every run of bad lines in the bitmap as one record of source Unknown (where the
        poison came from was in the lost state file), replacing the list; past the limit the
        overflow flag is set. For a lost state file. Returns the records listed."""
        runs: list[tuple[int, int]] = []
        step = chunk_lines * POISON_LINE  # a slice at a time: a 1 TiB device has a 2 GiB bitmap
        for lo in range(0, self.capacity, step):
            hi = min(self.capacity, lo + step)
            if not self._fw.poison_bits[lo // POISON_LINE >> 3:(hi // POISON_LINE + 7) >> 3].any():
                continue
            for a, b in self.bad_runs(lo, hi):
                if runs and runs[-1][1] == a:  # a run across the slices' border is one range
                    a = runs.pop()[0]
                runs.append((a, b))
        with self._lock:
            self._records.clear()
            self._starts.clear()
            self.overflowed, self.overflow_ns, self._resume = False, 0, None
            for a, b in runs:
                if len(self._records) == self.limit:
                    self._set_overflow()
                    break
                self._insert(PoisonRecord(a, b - a, PoisonSource.UNKNOWN))
            return len(self._records)

    def clear_overflow(self) -> None:
        with self._lock:
            self.overflowed, self.overflow_ns = False, 0

    def bad_runs(self, start: int, end: int) -> list[tuple[int, int]]:
        """Maximal runs [lo, hi) of poisoned lines in [start, end) according to the bitmap."""
        first, last = start // POISON_LINE, end // POISON_LINE
        if last <= first:
            return []
        bits = self._fw.poison_bits[first >> 3:(last + 7) >> 3]
        lines = np.unpackbits(bits, bitorder="little")[first & 7:(first & 7) + last - first]
        edges = np.flatnonzero(np.diff(np.concatenate(([0], lines.view(np.int8), [0]))))
        return [((first + int(a)) * POISON_LINE, (first + int(b)) * POISON_LINE)
                for a, b in zip(edges[::2], edges[1::2])]

    def describe(self, lo: int, hi: int) -> list[PoisonRecord]:
        """[lo, hi) as the list sees it: listed parts clipped, with their sources; unlisted parts
        as Internal (what Scan Media reports for a range of bad lines)."""
        with self._lock:
            i = max(0, bisect.bisect_right(self._starts, lo) - 1)
            parts = [PoisonRecord(max(r.dpa, lo), min(r.end, hi) - max(r.dpa, lo), r.source)
                     for r in self._records[i:] if r.dpa < hi and r.end > lo]
            parts += [PoisonRecord(a, b - a, PoisonSource.INTERNAL) for a, b in self._uncovered(lo, hi)]
            return sorted(parts, key=lambda r: r.dpa)

    def source_of(self, dpa: int) -> PoisonSource | None:
        with self._lock:
            i = self._covering(dpa)
            return None if i is None else self._records[i].source

    # internals ----------------------------------------------------------------------------------
    def _check_range(self, dpa: int, length: int) -> None:
        if dpa < 0 or length <= 0 or dpa % POISON_LINE or length % POISON_LINE or dpa + length > self.capacity:
            raise ValueError(f"poison range [{dpa:#x}, {dpa + length:#x}) must be 64-B aligned, non-empty "
                             f"and inside the {self.capacity:#x}-byte DPA space")

    def _injected(self) -> int:
        return sum(1 for r in self._records if r.source == PoisonSource.INJECTED)

    def _covering(self, dpa: int) -> int | None:
        i = bisect.bisect_right(self._starts, dpa) - 1
        return i if i >= 0 and self._records[i].end > dpa else None

    def _uncovered(self, lo: int, hi: int) -> list[tuple[int, int]]:
        pieces: list[tuple[int, int]] = []
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        cur = lo
        for rec in self._records[i:]:
            if rec.dpa >= hi:
                break
            if rec.dpa > cur:
                pieces.append((cur, rec.dpa))
            cur = max(cur, rec.end)
        if cur < hi:
            pieces.append((cur, hi))
        return pieces

    def _insert(self, rec: PoisonRecord) -> None:
        i = bisect.bisect_left(self._starts, rec.dpa)
        self._starts.insert(i, rec.dpa)
        self._records.insert(i, rec)

    def _remove(self, i: int) -> PoisonRecord:
        del self._starts[i]
        return self._records.pop(i)

    def _set_overflow(self) -> None:
        if not self.overflowed:  # the time the device found the list full (§8.2.9.9.4.1)
            self.overflowed, self.overflow_ns = True, self._fw.timestamp_ns()

    def _log_error(self, dpa: int, transaction: TransactionType, listed: bool) -> None:
        descriptor = DESCRIPTOR_UNCORRECTABLE | (0 if listed else DESCRIPTOR_POISON_LIST_OVERFLOW)
        self._fw.events.general_media(EventLog.FAILURE, dpa, event_type=MemoryEventType.MEDIA_ECC_ERROR,
                                      transaction=transaction, descriptor=descriptor)

    def _set_lines(self, dpa: int, length: int, poisoned: bool) -> None:
        """Set or clear the bitmap bits of the lines in [dpa, dpa+length), whole bytes at once."""
        bits = self._fw.poison_bits
        first, last = dpa // POISON_LINE, (dpa + length) // POISON_LINE
        while first < last and first & 7:
            self._set_bit(bits, first, poisoned)
            first += 1
        while last > first and last & 7:
            last -= 1
            self._set_bit(bits, last, poisoned)
        if first < last:
            bits[first >> 3:last >> 3] = 0xFF if poisoned else 0

    @staticmethod
    def _set_bit(bits: np.ndarray, line: int, poisoned: bool) -> None:
        if poisoned:
            bits[line >> 3] |= np.uint8(1 << (line & 7))
        else:
            bits[line >> 3] &= np.uint8(~(1 << (line & 7)) & 0xFF)
