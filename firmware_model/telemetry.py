"""Telemetry counters of the firmware, as one snapshot type the device publishes.

:class:`Counters` is what the firmware increments as it works; :meth:`Counters.snapshot` folds
in the live state of the DMA engine, the prefetch queue and the hotness unit and returns a frozen
:class:`TelemetrySnapshot`. The snapshot is a flat record of unsigned 64-bit integers:
``to_dict()`` gives plain ints (JSON, Prometheus), ``pack()`` / ``unpack()`` give the
little-endian u64 array in :data:`FIELDS` order that a register page can hold.
"""
from __future__ import annotations

import struct
from dataclasses import astuple, dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from firmware_model.dma import DmaScheduler
    from firmware_model.hotness import HotnessUnit
    from firmware_model.prefetch import PrefetchQueue

__all__ = ["FIELDS", "Counters", "TelemetrySnapshot"]


@dataclass(frozen=True, kw_only=True)
class TelemetrySnapshot:
    """Every counter the device reports, at ``time_ns``."""

    time_ns: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    prefetch_issued: int = 0
    prefetch_useful: int = 0
    prefetch_late: int = 0
    prefetch_wasted: int = 0
    prefetch_cancelled: int = 0
    prefetch_outstanding: int = 0
    bytes_read: int = 0  # device -> host
    bytes_written: int = 0  # host -> device
    transfers_read: int = 0
    transfers_written: int = 0
    stall_ns: int = 0
    dma_queued: int = 0
    dma_in_flight: int = 0
    dma_max_queue_depth: int = 0
    chmu_epochs: int = 0
    chmu_hotlist_entries: int = 0
    chmu_dropped: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or not 0 <= v < 1 << 64:
                raise ValueError(f"telemetry field {f.name} must be an int in [0, 2**64), got {v!r}")

    def to_dict(self) -> dict[str, int]:
        return {f.name: int(getattr(self, f.name)) for f in fields(self)}

    def pack(self) -> bytes:
        return _STRUCT.pack(*astuple(self))

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> TelemetrySnapshot:
        return cls(**dict(zip(FIELDS, _STRUCT.unpack_from(data))))

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


FIELDS: tuple[str, ...] = tuple(f.name for f in fields(TelemetrySnapshot))
_STRUCT = struct.Struct(f"<{len(FIELDS)}Q")
assert _STRUCT.size == 8 * len(FIELDS)


class Counters:
    """Mutable counters the firmware bumps; the rest is read from live objects at snapshot time."""

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.stall_ns = 0.0
        self.bytes = {"read": 0, "write": 0}
        self.transfers = {"read": 0, "write": 0}

    def transfer(self, direction: str, nbytes: int) -> None:
        """Count a transfer done outside a modelled DMA engine (e.g. a direct timed read)."""
        self.bytes[direction] += nbytes
        self.transfers[direction] += 1

    def snapshot(self, now_ns: float, *, dma: DmaScheduler | None = None, prefetch: PrefetchQueue | None = None,
                 hotness: HotnessUnit | None = None) -> TelemetrySnapshot:
        b, n = dict(self.bytes), dict(self.transfers)
        values: dict[str, int] = {}
        if dma is not None:
            for d in ("read", "write"):
                b[d] += dma.bytes_done[d]
                n[d] += dma.transfers_done[d]
            values.update(dma_queued=dma.queued, dma_in_flight=dma.in_flight,
                          dma_max_queue_depth=dma.max_queue_depth)
        if prefetch is not None:
            s = prefetch.stats
            values.update(prefetch_issued=s.issued, prefetch_useful=s.useful, prefetch_late=s.late,
                          prefetch_wasted=s.wasted, prefetch_cancelled=s.cancelled,
                          prefetch_outstanding=prefetch.outstanding())
        if hotness is not None:
            values.update(chmu_epochs=hotness.status.epochs, chmu_hotlist_entries=len(hotness.hotlist),
                          chmu_dropped=hotness.status.dropped)
        return TelemetrySnapshot(time_ns=int(now_ns), hits=self.hits, misses=self.misses,
                                 evictions=self.evictions, stall_ns=int(self.stall_ns),
                                 bytes_read=b["read"], bytes_written=b["write"],
                                 transfers_read=n["read"], transfers_written=n["write"], **values)
