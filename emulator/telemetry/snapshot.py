"""The snapshot types of the telemetry page: the dataclass of each section (what a writer
publishes and a reader returns), the entries of its lists, and the snapshot gathering them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from emulator.telemetry.layout import SECTIONS, VERSION_MAJOR


@dataclass(frozen=True)
class EventEntry:
    """One recent event: when, which log (index into LOG_NAMES), a one-line summary."""

    timestamp_ns: int
    log: int
    text: str


@dataclass(frozen=True)
class PoisonEntry:
    """One poisoned DPA range; `source` as in Get Poison List (§8.2.9.9.4.1)."""

    dpa: int
    length: int
    source: int = 0


@dataclass
class FirmwareTelemetry:
    """Section (a): what the firmware runner publishes. `seq`, `updated_ns`, `writer_pid` are
    filled by the reader and ignored by `publish`."""

    uptime_ns: int = 0
    timestamp_ns: int = 0
    capacity_bytes: int = 0
    capacity_used_bytes: int = 0
    media_status: int = 0
    health_status: int = 0
    temperature_c: int = 0
    life_used_pct: int = 0
    poison_count: int = 0
    events_info: int = 0
    events_warn: int = 0
    events_fail: int = 0
    events_fatal: int = 0
    events_dcd: int = 0
    bg_running: int = 0
    bg_opcode: int = 0
    bg_percent: int = 0
    chmu_enabled: int = 0
    chmu_epoch_count: int = 0
    chmu_unit_size: int = 0
    state_save_failures: int = 0  # since layout 1.2
    hotlist: list[tuple[int, int]] = field(default_factory=list)  # (unit index, count)
    recent_events: list[EventEntry] = field(default_factory=list)  # newest first
    recent_poison: list[PoisonEntry] = field(default_factory=list)
    seq: int = 0
    updated_ns: int = 0
    writer_pid: int = 0


@dataclass
class HostTelemetry:
    """Section (b): what the KV shim publishes (counters are totals since the shim started)."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    offloads: int = 0
    prefetch_issued: int = 0
    prefetch_useful: int = 0
    prefetch_late: int = 0
    prefetch_wasted: int = 0
    evictions: int = 0
    stall_ns: int = 0
    tokens_generated: int = 0
    blocks_resident: int = 0
    blocks_total: int = 0
    hbm_bytes: int = 0
    hbm_budget_bytes: int = 0
    dma_sq_depth: int = 0
    dma_cq_depth: int = 0
    prefetch_queue_depth: int = 0
    dedup_chunks: int = 0
    dedup_write_bytes: int = 0
    dedup_load_bytes: int = 0
    cow_copies: int = 0
    chunk_bytes: int = 0
    device_chunks_used: int = 0
    device_chunks_shared: int = 0
    device_saved_bytes: int = 0
    seq: int = 0
    updated_ns: int = 0
    writer_pid: int = 0


@dataclass(frozen=True)
class PoolHost:
    """One host port's row of the pool section (its column ``host_<name>`` at this port's index)."""

    pid: int = 0
    pool_phase: int = 0
    pool_pid: int = 0
    extents: int = 0
    pending_extents: int = 0
    extent_bytes: int = 0
    shared_extent_bytes: int = 0
    sealed: int = 0
    shared: int = 0
    unshared_bytes: int = 0
    quota_bytes: int = 0
    pins: int = 0
    allocations: int = 0
    pool_hits: int = 0
    cross_hits: int = 0
    evicted: int = 0


@dataclass
class PoolTelemetry:
    """Section (c), since layout 1.3: the device's host ports and its shared KV pool, published by
    the firmware runner. ``host_rows`` has one `PoolHost` per port (``hosts`` of them)."""

    hosts: int = 0
    pool_hosts: int = 0
    pool_slots: int = 0
    pool_slot_bytes: int = 0
    pool_used: int = 0
    pool_sealed: int = 0
    pool_shared: int = 0
    pool_evictions: int = 0
    pool_quota_evictions: int = 0
    pool_reaped_allocations: int = 0
    pool_cleared_pins: int = 0
    host_rows: list[PoolHost] = field(default_factory=list)
    seq: int = 0
    updated_ns: int = 0
    writer_pid: int = 0


@dataclass
class TelemetrySnapshot:
    """A consistent copy of each section; None where a section has never been published or could
    not be read, with the reason in `notes`. `link` is the data path's counters object, if any."""

    version: tuple[int, int] | None = None
    firmware: FirmwareTelemetry | None = None
    host: HostTelemetry | None = None
    link: Any = None
    notes: list[str] = field(default_factory=list)
    pool: PoolTelemetry | None = None  # layout 1.3 on, once the firmware published it

    def has(self, section: str, name: str) -> bool:
        """Whether the page's layout version carries field `name` of `section` ("firmware",
        "host", "pool"): a page of an older minor lacks later fields, which then read 0."""
        if section not in SECTIONS:
            raise ValueError(f"unknown telemetry section {section!r}: use one of {sorted(SECTIONS)}")
        fld = SECTIONS[section][0].by_name.get(name)
        if fld is None:
            raise ValueError(f"telemetry section {section!r} has no field {name!r}")
        return (self.version is not None and self.version[0] == VERSION_MAJOR
                and self.version[1] >= fld.since)


_DATACLASS = {"firmware": FirmwareTelemetry, "host": HostTelemetry, "pool": PoolTelemetry}
_COMPOSITE = {"hotlist", "recent_events", "recent_poison", "host_rows"}
