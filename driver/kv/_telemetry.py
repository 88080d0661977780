"""The KV shim's counters, published in the device's telemetry page (host section).

One publisher per device per process (it lives with the shared device store): every cache on
that device adds into it, so a monitor attached to the device sees the running generation's
hits, loads, stalls and HBM use. Publishing is throttled (``PERIOD_S``) and never blocks; if
another live process already holds the host section, this one says so once and stays silent.
"""
from __future__ import annotations

import time
import warnings
from typing import Any

__all__ = ["HostPublisher"]

PERIOD_S = 0.1
_SUMMED = ("hits", "misses", "loads", "offloads", "prefetch_issued", "prefetch_late", "stall_ns",
           "evictions", "prefetch_useful", "prefetch_wasted", "tokens_generated")


class HostPublisher:
    """Sums the counters of the engines attached to one device and publishes them."""

    def __init__(self, memdev: Any, dma: Any) -> None:
        from emulator.telemetry import TelemetryClaimed, TelemetryWriter

        self._dma = dma
        self._engines: list[Any] = []
        self._retired = dict.fromkeys(_SUMMED, 0)
        self._last = 0.0
        try:
            self._writer: Any = TelemetryWriter(memdev.bar, "host", lock_path=memdev.files.path / "bar")
        except TelemetryClaimed as exc:
            warnings.warn(f"KV telemetry not published: {exc}", RuntimeWarning, stacklevel=3)
            self._writer = None

    def attach(self, engine: Any) -> None:
        self._engines.append(engine)

    def detach(self, engine: Any) -> None:
        """The engine closed: keep its totals, drop its live state."""
        if engine in self._engines:
            self._engines.remove(engine)
            for k in _SUMMED:
                self._retired[k] += engine.counters.get(k, 0)
        self.publish(force=True)

    def publish(self, force: bool = False) -> None:
        if self._writer is None:
            return
        now = time.monotonic()
        if not force and now - self._last < PERIOD_S:
            return
        self._last = now
        totals = dict(self._retired)
        resident = frames = hbm = budget = inflight = 0
        for engine in self._engines:
            for k in _SUMMED:
                totals[k] += engine.counters.get(k, 0)
            resident += sum(1 for st in engine.layers if st.frame is not None)
            frames += engine.arena.max_frames
            hbm += engine.arena.bytes_in_use
            budget += engine.arena.budget
            inflight += sum(1 for st in engine.layers if st.load is not None)
        self._writer.publish(hits=totals["hits"], misses=totals["misses"], loads=totals["loads"],
                             offloads=totals["offloads"], prefetch_issued=totals["prefetch_issued"],
                             prefetch_useful=totals["prefetch_useful"], prefetch_late=totals["prefetch_late"],
                             prefetch_wasted=totals["prefetch_wasted"], evictions=totals["evictions"],
                             stall_ns=totals["stall_ns"], tokens_generated=totals["tokens_generated"],
                             blocks_resident=resident, blocks_total=frames, hbm_bytes=hbm,
                             hbm_budget_bytes=budget, dma_sq_depth=min(self._dma.pending(), 2**32 - 1),
                             prefetch_queue_depth=inflight)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
