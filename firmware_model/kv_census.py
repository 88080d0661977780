"""A census of the shared KV index (``firmware_model.kv_index``): what each host holds in it now
and the firmware's totals, as the telemetry page publishes them (emulator/fw_telemetry.py).

Pure: one pass of numpy over the slot table and reads of the header and host table, no CAS and
no store, so the firmware may take it between its own passes while hosts go on publishing and
loading. The table changes under it; each count is of one moment of its own column, which is
all a monitor needs (an entry sealed between two columns' reads may count in one and not yet in
the other).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from firmware_model import kv_index as K

__all__ = ["HostCensus", "PoolCensus", "census"]


@dataclass(frozen=True)
class HostCensus:
    """One host of the pool: its record in the host table and its entries in the slot table."""

    phase: int  # K.IDLE, K.JOINING, K.LIVE
    pid: int  # of the process that joined as this host (0: never joined)
    sealed: int  # sealed entries it published
    shared: int  # of them, loaded by another host (``E_READERS`` holds another host's bit)
    pins: int  # pins it holds now: the sum of its pin byte over the table
    allocations: int  # its ALLOC entries: publishes in flight
    unshared_bytes: int  # as the firmware's last pass measured it (``HS_UNSHARED``)
    quota_bytes: int
    hits: int  # its loads that hit (``HS_HITS``, added by the host)
    cross_hits: int  # of them, loads of a block another host published (``HS_CROSS_HITS``)
    evicted: int  # its entries the firmware evicted (``HS_EVICTED``)


@dataclass(frozen=True)
class PoolCensus:
    """The pool: its geometry, its entries now, the firmware's counters, one row per host."""

    slots: int
    slot_bytes: int
    used: int  # entries neither FREE nor TOMB
    sealed: int
    shared: int  # sealed entries loaded by a host other than their publisher
    evictions: int
    quota_evictions: int
    reaped_allocations: int
    cleared_pins: int
    hosts: tuple[HostCensus, ...]


def census(idx: K.KvIndex) -> PoolCensus:
    """Count ``idx`` as it is now (see the module's docstring)."""
    tw = idx.table_words
    states = tw[:, K.E_STATE].copy()  # one read of the column: kinds and owners agree
    kinds, owners = states & np.uint64(0xF), ((states >> np.uint64(4)) & np.uint64(0xF)).astype(np.uint8)
    sealed = kinds == K.SEALED
    shared = sealed & ((tw[:, K.E_READERS] & ~(np.uint64(1) << owners.astype(np.uint64))) != 0)
    allocs = kinds == K.ALLOC
    pins = tw[:, K.E_PINS].copy()
    rows = []
    for h in range(idx.hosts):  # masks over a uint8 column: cheaper than bincount or a byte view here
        mine = owners == h
        word = idx.host_field(h, K.HS_STATE)
        rows.append(HostCensus(
            phase=word >> 32, pid=idx.host_field(h, K.HS_PID),
            sealed=int(np.count_nonzero(sealed & mine)), shared=int(np.count_nonzero(shared & mine)),
            pins=int(((pins >> np.uint64(8 * h)) & np.uint64(0xFF)).sum()),
            allocations=int(np.count_nonzero(allocs & mine)),
            unshared_bytes=idx.host_field(h, K.HS_UNSHARED), quota_bytes=idx.host_field(h, K.HS_QUOTA),
            hits=idx.host_field(h, K.HS_HITS), cross_hits=idx.host_field(h, K.HS_CROSS_HITS),
            evicted=idx.host_field(h, K.HS_EVICTED)))
    w = idx.words
    return PoolCensus(
        slots=idx.slots, slot_bytes=idx.slot_bytes,
        used=int(np.count_nonzero((kinds != K.FREE) & (kinds != K.TOMB))),
        sealed=int(np.count_nonzero(sealed)), shared=int(np.count_nonzero(shared)),
        evictions=int(w[K.H_EVICTIONS]), quota_evictions=int(w[K.H_QUOTA_EVICTIONS]),
        reaped_allocations=int(w[K.H_REAPED_ALLOCS]), cleared_pins=int(w[K.H_CLEARED_PINS]),
        hosts=tuple(rows))
