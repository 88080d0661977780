"""The access feed: how host accesses reach the device's CHMU.

On hardware the CHMU sits in the controller and sees every request. Here hosts touch the media
through mmaps in their own processes, so each host appends the DPAs it touches to a ring in the
CHMU block of the BAR, and the firmware drains the ring into the hotness unit on every pass.

    BAR + ACCESS_FEED_OFFSET:
      +0x00 head     u64  next entry the firmware reads (firmware writes)
      +0x08 tail     u64  next entry a host writes (hosts write, under the feed lock)
      +0x10 dropped  u64  entries lost because the ring was full (hosts write, under the lock)
      +0x40 entries  u64[FEED_ENTRIES]: DPA | is_write << 63

Hosts batch entries locally (one lock per FLUSH_ENTRIES accesses) and feed nothing while the
CHMU is disabled, so an idle CHMU costs a host one register read per access. A transfer counts
one access per FEED_GRANULE it touches, the way a DMA burst touches each page once. Producers
serialise on an flock; the single consumer only moves head, so no entry is read half-written
(x86-64 orders the entry store before the tail store; see the argument in emulator/telemetry/__init__.py).
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import numpy as np

from emulator.chmu import CFG0, ENABLE
from emulator.spec.registers import ACCESS_FEED_OFFSET, ACCESS_FEED_SIZE, CHMU_OFFSET

HEADER = 0x40
FEED_ENTRIES = (ACCESS_FEED_SIZE - HEADER) // 8
FEED_GRANULE = 4096
FLUSH_ENTRIES = 256
WRITE_BIT = np.uint64(1 << 63)
_HEAD, _TAIL, _DROPPED = 0, 1, 2


def _words(bar: Any) -> tuple[np.ndarray, np.ndarray]:
    raw = np.frombuffer(bar, dtype=np.uint64, count=ACCESS_FEED_SIZE // 8, offset=ACCESS_FEED_OFFSET)
    return raw[:HEADER // 8], raw[HEADER // 8: HEADER // 8 + FEED_ENTRIES]


class AccessFeed:
    """Host side: note accesses; they reach the ring in batches while the CHMU is enabled."""

    def __init__(self, bar: Any, lock_path: Path) -> None:
        self._header, self._ring = _words(bar)
        self._cfg0 = np.frombuffer(bar, dtype=np.uint64, count=1, offset=CHMU_OFFSET + CFG0)
        self._pending: list[np.ndarray] = []
        self._count = 0
        self._fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)

    @property
    def enabled(self) -> bool:
        return bool(int(self._cfg0[0]) & ENABLE)

    def note(self, dpa: int, nbytes: int, is_write: bool) -> None:
        """One transfer of `nbytes` at `dpa`; ignored while the CHMU is disabled."""
        if nbytes <= 0 or not int(self._cfg0[0]) & ENABLE:
            return
        first, last = dpa // FEED_GRANULE, (dpa + nbytes - 1) // FEED_GRANULE
        pages = np.arange(first, last + 1, dtype=np.uint64) * np.uint64(FEED_GRANULE)
        if first == last:
            pages[0] = dpa  # a small access keeps its exact DPA (units may be smaller than a page)
        if is_write:
            pages |= WRITE_BIT
        self._pending.append(pages)
        self._count += pages.size
        if self._count >= FLUSH_ENTRIES:
            self.flush()

    def note_many(self, dpas: np.ndarray, nbytes: np.ndarray, is_write: bool) -> None:
        """:meth:`note` of every transfer ``(dpas[i], nbytes[i])``, in order, in a few array
        operations (hot-page attention reads hundreds of scattered pages a layer)."""
        if not int(self._cfg0[0]) & ENABLE:
            return
        dpas, nbytes = np.asarray(dpas, np.int64).ravel(), np.asarray(nbytes, np.int64).ravel()
        keep = nbytes > 0
        dpas, nbytes = dpas[keep], nbytes[keep]
        first = dpas // FEED_GRANULE
        span = (dpas + nbytes - 1) // FEED_GRANULE - first + 1  # granules each transfer touches
        if (span == 1).all():  # every access within one granule (a KV page's chunks): their DPAs
            pages = dpas.astype(np.uint64)
        else:
            at = np.cumsum(span) - span  # where each transfer's entries begin
            granule = np.repeat(first, span) + np.arange(span.sum()) - np.repeat(at, span)
            pages = (granule * FEED_GRANULE).astype(np.uint64)
            single = span == 1  # a small access keeps its exact DPA
            pages[at[single]] = dpas[single].astype(np.uint64)
        if is_write:
            pages |= WRITE_BIT
        if pages.size:
            self._pending.append(pages)
            self._count += pages.size
            if self._count >= FLUSH_ENTRIES:
                self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        entries = np.concatenate(self._pending)
        self._pending, self._count = [], 0
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            head, tail = int(self._header[_HEAD]), int(self._header[_TAIL])
            room = FEED_ENTRIES - (tail - head)
            take = min(room, entries.size)
            idx = (tail + np.arange(take)) % FEED_ENTRIES
            self._ring[idx] = entries[:take]
            self._header[_TAIL] = tail + take  # after the entries: the firmware reads up to tail
            if take < entries.size:
                self._header[_DROPPED] += np.uint64(entries.size - take)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd >= 0:
            self.flush()
            os.close(self._fd)
            self._fd = -1


class FeedDrain:
    """Firmware side: a runner service moving fed accesses into the CHMU."""

    def __init__(self, bar: Any, chmu: Any) -> None:
        self._header, self._ring = _words(bar)
        self.chmu = chmu
        self.drained = 0

    def service(self, now_ns: int) -> bool:
        """Drain the ring into the CHMU; True if there was anything (the runner then keeps its
        shortest nap, so a streaming host does not overrun the ring)."""
        head, tail = int(self._header[_HEAD]), int(self._header[_TAIL])
        if tail == head:
            return False
        entries = self._ring[(head + np.arange(tail - head)) % FEED_ENTRIES]
        self._header[_HEAD] = tail
        writes = (entries & WRITE_BIT) != 0
        dpas = entries & ~WRITE_BIT
        if writes.any():
            self.chmu.record(dpas[writes], True)
        if (~writes).any():
            self.chmu.record(dpas[~writes], False)
        self.drained += entries.size
        return True

    @property
    def dropped(self) -> int:
        return int(self._header[_DROPPED])
