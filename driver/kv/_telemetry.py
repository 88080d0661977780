"""The KV shim's counters, published in the device's telemetry page (host section).

One publisher per device per process (it lives with the shared device store): every cache on
that device adds into it, so a monitor attached to the device sees the running generation's
hits, loads, stalls and HBM use, and what prefix sharing saves. Publishing is throttled
(``PERIOD_S``) and never blocks; if another live process already holds the host section, this
one says so once and stays silent.

Prefix sharing, as published::

    block tables of the attached engines          device chunk pool
    (row, piece, block) -> chunk id               (shared by the engines)
      seq 0: [c7, c8, c9 ]  \\
      seq 1: [c7, c8, c12]   >  references 6,  chunks used 4 (c7 c8 c9 c12),
                            /   shared 2 (c7 c8), saved (6 - 4) x chunk_bytes

The counts come from the block tables with numpy, not from the pool: the pool would need a
Python pass over every chunk of the device (a million for a small model on 256 MiB) per publish.
A chunk's references are exactly its entries in the tables, so the two agree (a test checks it).
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["HostPublisher", "count_shared", "host_writer", "sharing_gauges"]

PERIOD_S = 0.1
# host-section field <- engine counter, summed over engines (closed ones included)
_SUMMED = {"hits": "hits", "misses": "misses", "loads": "loads", "offloads": "offloads",
           "prefetch_issued": "prefetch_issued", "prefetch_late": "prefetch_late", "stall_ns": "stall_ns",
           "evictions": "evictions", "prefetch_useful": "prefetch_useful",
           "prefetch_wasted": "prefetch_wasted", "tokens_generated": "tokens_generated",
           "dedup_chunks": "shared_chunks", "dedup_write_bytes": "dedup_write_bytes",
           "dedup_load_bytes": "dedup_load_bytes", "cow_copies": "cow_copies"}
_U64_MAX = 2**64 - 1  # a budget may exceed the page's u8 fields (hbm_budget_bytes=10**30): saturate
_BINCOUNT_SPAN = 16  # bincount while the largest id is below this many times the references


def count_shared(ids: np.ndarray) -> int:
    """Distinct values occurring more than once in ``ids`` (chunk ids, all >= 0).

    A bincount costs the largest id, a sort n log n; the ids of a device's pool span its whole
    capacity, so take whichever is cheaper for these ids (both are exact)."""
    if ids.size < 2:
        return 0
    if int(ids.max()) < _BINCOUNT_SPAN * ids.size:
        return int(np.count_nonzero(np.bincount(ids) > 1))
    s = np.sort(ids)
    dup = s[1:] == s[:-1]  # dup[i]: s[i + 1] repeats s[i]; count each run of repeats once
    return int(np.count_nonzero(dup[1:] & ~dup[:-1]) + dup[0])


def sharing_gauges(engines: Iterable[Any]) -> dict[str, int]:
    """The ``device_*`` gauges and ``chunk_bytes`` for engines sharing one device chunk pool."""
    tables = [st.chunks.ids.ravel() for e in engines if e.pool is not None for st in e.layers]
    pools = {id(e.pool): e for e in engines if e.pool is not None and e.layout is not None}
    if not pools:
        return dict.fromkeys(("chunk_bytes", "device_chunks_used", "device_chunks_shared",
                              "device_saved_bytes"), 0)
    ids = np.concatenate(tables) if tables else np.zeros(0, np.int64)
    ids = ids[ids >= 0]
    chunk_bytes = next(iter(pools.values())).layout.chunk_bytes  # one pool, one chunk size
    used = sum(e.pool.used for e in pools.values())
    return {"chunk_bytes": chunk_bytes, "device_chunks_used": used,
            "device_chunks_shared": count_shared(ids),
            "device_saved_bytes": max(0, int(ids.size) - used) * chunk_bytes}


def host_writer(memdev: Any, what: str) -> Any:
    """A writer of ``memdev``'s host telemetry section, or None (with one warning saying why)
    when another live process holds it."""
    from emulator.device_dir import bar_name
    from emulator.telemetry import TelemetryClaimed, TelemetryWriter

    try:  # the host section of the port's own BAR, claimed through that BAR's file
        return TelemetryWriter(memdev.bar, "host", lock_path=memdev.files.path / bar_name(memdev.host))
    except TelemetryClaimed as exc:
        warnings.warn(f"{what} telemetry not published: {exc}", RuntimeWarning, stacklevel=3)
        return None


class HostPublisher:
    """Sums the counters of the engines attached to one device and publishes them."""

    def __init__(self, memdev: Any, dma: Any) -> None:
        self._dma = dma
        self._engines: list[Any] = []
        self._retired = dict.fromkeys(_SUMMED, 0)
        self._last = 0.0
        self._writer: Any = host_writer(memdev, "KV")

    def attach(self, engine: Any) -> None:
        self._engines.append(engine)

    def detach(self, engine: Any) -> None:
        """The engine closed: keep its totals, drop its live state."""
        if engine in self._engines:
            self._engines.remove(engine)
            for field, counter in _SUMMED.items():
                self._retired[field] += engine.counters.get(counter, 0)
        self.publish(force=True)

    def publish(self, force: bool = False) -> None:
        """Publish now if ``PERIOD_S`` has passed since the last publish (or ``force``)."""
        if self._writer is None:
            return
        now = time.monotonic()
        if not force and now - self._last < PERIOD_S:
            return
        self._last = now
        totals = dict(self._retired)
        resident = frames = hbm = budget = inflight = 0
        for engine in self._engines:
            for field, counter in _SUMMED.items():
                totals[field] += engine.counters.get(counter, 0)
            resident += sum(1 for st in engine.layers if st.frame is not None)
            frames += engine.arena.max_frames
            hbm += engine.arena.bytes_in_use
            budget += engine.arena.budget
            inflight += sum(1 for st in engine.layers if st.load is not None)
        self._writer.publish(**totals, **sharing_gauges(self._engines), blocks_resident=resident,
                             blocks_total=min(frames, _U64_MAX), hbm_bytes=hbm,
                             hbm_budget_bytes=min(budget, _U64_MAX),
                             dma_sq_depth=min(self._dma.pending(), 2**32 - 1),
                             prefetch_queue_depth=inflight)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
