"""The telemetry page layout: version constants, the fields of the header and of each section
packed at natural alignment as numpy structured dtypes, the section offsets, and `layout_table`,
which regenerates the tables of the package docstring (`emulator/telemetry/__init__.py`)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from emulator.device_dir import MAX_HOSTS
from emulator.spec.registers import TELEMETRY_SIZE
from firmware_model import kv_index

MAGIC = 0x544C5843  # "CXLT" little-endian
VERSION_MAJOR, VERSION_MINOR = 1, 3
HOTLIST_MAX = 256
EVENTS_MAX = 16
POISON_MAX = 16
EVENT_TEXT_BYTES = 48
LOG_NAMES = ("info", "warn", "fail", "fatal", "dcd")  # CXL r3.1 §8.2.9.2.2 event log types 0-4
POOL_PHASES = ("out", "joining", "member")  # a host in the KV pool: its host record's phase 0-2
assert (kv_index.IDLE, kv_index.JOINING, kv_index.LIVE) == (0, 1, 2)


@dataclass(frozen=True)
class _Field:
    """One field of a layout: numpy format, element count (0 = scalar), meaning for the doc table,
    and the minor version that added it (a page of an older minor lacks it)."""

    name: str
    fmt: str
    count: int
    meaning: str
    since: int = 0


def _f(name: str, fmt: str, meaning: str, count: int = 0, since: int = 0) -> _Field:
    return _Field(name, fmt, count, meaning, since)


class _Layout:
    """Fields packed in order at natural alignment, as a numpy structured dtype."""

    def __init__(self, name: str, items: Iterable[_Field]) -> None:
        self.name = name
        self.fields = tuple(items)
        self.by_name = {f.name: f for f in self.fields}
        offsets, pos = [], 0
        for f in self.fields:
            align = np.dtype(f.fmt).alignment
            pos = (pos + align - 1) // align * align
            offsets.append(pos)
            pos += self.width(f)
        self.offsets = dict(zip((f.name for f in self.fields), offsets))
        self.size = pos
        self.dtype = np.dtype({
            "names": [f.name for f in self.fields],
            "formats": [(f.fmt, (f.count,)) if f.count else f.fmt for f in self.fields],
            "offsets": offsets, "itemsize": pos})

    @staticmethod
    def width(f: _Field) -> int:
        return np.dtype(f.fmt).itemsize * max(f.count, 1)


_SECTION_HEAD = [
    _f("seq", "<u8", "seqlock: odd while a write is in progress"),
    _f("updated_ns", "<u8", "wall clock (CLOCK_REALTIME ns) of the last publish"),
    _f("writer_pid", "<u4", "pid of the writing process"),
    _f("reserved0", "<u4", "0"),
    _f("reserved1", "<u8", "0"),
]
_HEAD_NAMES = {f.name for f in _SECTION_HEAD}
_SECTION_HEAD_SIZE = 0x20  # seq, updated_ns, writer_pid, reserved: what every section starts with

HEADER = _Layout("header", [
    _f("magic", "<u4", '0x544C5843, "CXLT"'),
    _f("version_major", "<u2", "1; a reader refuses another major"),
    _f("version_minor", "<u2", "3; fields or sections appended bump it (sections never move); "
       "old readers ignore them"),
    _f("page_size", "<u4", "bytes of the page this layout uses"),
    _f("section_count", "<u4", "3 (2 before 1.3)"),
    _f("firmware_offset", "<u4", "0x0040"),
    _f("firmware_size", "<u4", "bytes of the firmware section"),
    _f("host_offset", "<u4", "offset of the host/KV section"),
    _f("host_size", "<u4", "bytes of the host/KV section"),
    # 1.3: the pool section (a page of an older minor has none: these read 0 there)
    _f("pool_offset", "<u4", "offset of the hosts/pool section", since=3),
    _f("pool_size", "<u4", "bytes of the hosts/pool section", since=3),
])

FIRMWARE = _Layout("firmware", _SECTION_HEAD + [
    _f("uptime_ns", "<u8", "ns since the firmware started"),
    _f("timestamp_ns", "<u8", "device timestamp (Set/Get Timestamp, §8.2.9.4)"),
    _f("capacity_bytes", "<u8", "size of the DPA space: static capacity and the DC regions"),
    _f("capacity_used_bytes", "<u8", "bytes of DPA space holding data (allocated blocks)"),
    _f("media_status", "<u4", "Memory Device Status MEDIA_STATUS: 0 not ready, 1 ready, 2 error, 3 disabled"),
    _f("health_status", "<u4", "Get Health Info health status bits (§8.2.9.9.3.1)"),
    _f("temperature_c", "<i4", "device temperature, degrees Celsius (signed)"),
    _f("life_used_pct", "<u4", "life used, percent"),
    _f("poison_count", "<u4", "records in the poison list"),
    *[_f(f"events_{log}", "<u4", f"records in the {desc} event log") for log, desc in zip(
        LOG_NAMES, ("informational", "warning", "failure", "fatal", "dynamic capacity"))],
    _f("bg_running", "<u4", "1 while a background command runs"),
    _f("bg_opcode", "<u4", "opcode of the running or last background command"),
    _f("bg_percent", "<u4", "its percent complete"),
    _f("chmu_enabled", "<u4", "1 when the CHMU counts accesses"),
    _f("chmu_epoch_count", "<u8", "CHMU epochs completed"),
    _f("chmu_unit_size", "<u8", "bytes per CHMU unit (hotlist index x unit size = DPA)"),
    _f("hotlist_len", "<u4", f"valid entries in hot_unit / hot_count (<= {HOTLIST_MAX})"),
    _f("events_len", "<u4", f"valid entries in event_* (<= {EVENTS_MAX}), newest first"),
    _f("poison_len", "<u4", f"valid entries in poison_* (<= {POISON_MAX})"),
    _f("reserved2", "<u4", "0"),
    _f("hot_unit", "<u8", f"u64[{HOTLIST_MAX}] hotlist unit index", HOTLIST_MAX),
    _f("hot_count", "<u4", f"u32[{HOTLIST_MAX}] hotlist access count", HOTLIST_MAX),
    _f("event_ts", "<u8", f"u64[{EVENTS_MAX}] recent event timestamp, ns", EVENTS_MAX),
    _f("event_log", "<u4", f"u32[{EVENTS_MAX}] log: 0 info, 1 warn, 2 fail, 3 fatal, 4 dcd (§8.2.9.2.2)",
       EVENTS_MAX),
    _f("event_text", f"S{EVENT_TEXT_BYTES}",
       f"char[{EVENTS_MAX}][{EVENT_TEXT_BYTES}] recent event summary, UTF-8, NUL padded", EVENTS_MAX),
    _f("poison_dpa", "<u8", f"u64[{POISON_MAX}] poisoned range start DPA", POISON_MAX),
    _f("poison_length", "<u8", f"u64[{POISON_MAX}] poisoned range length, bytes", POISON_MAX),
    _f("poison_source", "<u4",
       f"u32[{POISON_MAX}] source: 0 unknown, 1 external, 2 internal, 3 injected, 7 vendor", POISON_MAX),
    # 1.2: a device whose own state cannot be saved (emulator/persist.py) says so
    _f("state_save_failures", "<u4", "failed saves of the device state (state.json) since the last "
       "that succeeded; 0: saved", since=2),
])

HOST = _Layout("host", _SECTION_HEAD[:2] + [
    _f("writer_pid", "<u4", "pid of the claiming process; 0 or a dead pid: free"),
] + _SECTION_HEAD[3:] + [
    _f("hits", "<u8", "block lookups found resident in the accelerator"),
    _f("misses", "<u8", "block lookups not resident"),
    _f("loads", "<u8", "blocks copied device -> accelerator"),
    _f("offloads", "<u8", "blocks copied accelerator -> device"),
    _f("prefetch_issued", "<u8", "prefetches started"),
    _f("prefetch_useful", "<u8", "prefetched blocks used after they arrived"),
    _f("prefetch_late", "<u8", "prefetched blocks needed before they arrived"),
    _f("prefetch_wasted", "<u8", "prefetched blocks evicted unused"),
    _f("evictions", "<u8", "blocks evicted from the accelerator"),
    _f("stall_ns", "<u8", "time compute waited for KV, ns"),
    _f("tokens_generated", "<u8", "tokens produced"),
    _f("blocks_resident", "<u8", "blocks resident in the accelerator"),
    _f("blocks_total", "<u8", "block slots in the accelerator arena"),
    _f("hbm_bytes", "<u8", "accelerator bytes holding KV"),
    _f("hbm_budget_bytes", "<u8", "accelerator bytes allowed for KV"),
    _f("dma_sq_depth", "<u4", "DMA submission queue entries pending"),
    _f("dma_cq_depth", "<u4", "DMA completion queue entries unreaped"),
    _f("prefetch_queue_depth", "<u4", "prefetches queued, not yet submitted"),
    _f("reserved2", "<u4", "0"),
    # 1.1: prefix sharing (driver/kv/_chunkio.py): what sharing device chunks by chained hash saves
    _f("dedup_chunks", "<u8", "blocks stored by pointing at a device chunk already holding their "
       "bytes (chained-hash hit)", since=1),
    _f("dedup_write_bytes", "<u8", "bytes those hits did not write to the device", since=1),
    _f("dedup_load_bytes", "<u8", "bytes not read from the device: one read of a shared chunk "
       "served every sequence using it", since=1),
    _f("cow_copies", "<u8", "shared chunks copied to a fresh chunk when a sequence diverged "
       "(copy on write)", since=1),
    _f("chunk_bytes", "<u8", "bytes per device chunk (block_tokens tokens of one kv head's K or V)",
       since=1),
    _f("device_chunks_used", "<u8", "device chunks referenced now", since=1),
    _f("device_chunks_shared", "<u8", "device chunks referenced by more than one block now", since=1),
    _f("device_saved_bytes", "<u8", "device bytes saved now: (block references - chunks used) x "
       "chunk_bytes", since=1),
])



def _per_host(name: str, fmt: str, meaning: str) -> _Field:
    """A column of the pool section: one element per host port, index = port."""
    kind = "u32" if fmt == "<u4" else "u64"
    return _f(name, fmt, f"{kind}[{MAX_HOSTS}] {meaning}", MAX_HOSTS, since=3)


# 1.3: several hosts on one device and the shared KV pool (docs/pool-design.md), as the firmware
# knows them: DC extents per port (emulator/dcd.py), the index's counters and host table
# (firmware_model/kv_index.py) and a census of its entries (firmware_model/kv_census.py).
POOL = _Layout("pool", _SECTION_HEAD + [
    _f("hosts", "<u4", "host ports of the device", since=3),
    _f("pool_hosts", "<u4", "hosts the KV pool's index serves; 0: no pool", since=3),
    _f("pool_slots", "<u8", "slots of the pool's index (one block each)", since=3),
    _f("pool_slot_bytes", "<u8", "bytes per slot", since=3),
    _f("pool_used", "<u8", "slots holding an entry: allocated, sealed or being evicted", since=3),
    _f("pool_sealed", "<u8", "sealed entries (blocks every host of the pool may load)", since=3),
    _f("pool_shared", "<u8", "sealed entries loaded by a host other than their publisher", since=3),
    _f("pool_evictions", "<u8", "entries the firmware evicted", since=3),
    _f("pool_quota_evictions", "<u8", "of them, evicted to bring a host under its quota", since=3),
    _f("pool_reaped_allocations", "<u8", "allocations of dead or dropped hosts the firmware dropped", since=3),
    _f("pool_cleared_pins", "<u8", "pin bytes of dead or dropped hosts the firmware cleared", since=3),
    _per_host("host_pid", "<u4", "pid of the process that claimed the port (host.<h>.pid); 0: none"),
    _per_host("host_pool_phase", "<u4", "the host in the pool: " + ", ".join(
        f"{i} {name}" for i, name in enumerate(POOL_PHASES))),
    _per_host("host_pool_pid", "<u4", "pid of the process that joined the pool as this host"),
    _per_host("host_extents", "<u4", "DC extents the port accepted"),
    _per_host("host_pending_extents", "<u4", "DC extents offered to the port, not yet accepted"),
    _per_host("host_extent_bytes", "<u8", "bytes of the accepted extents"),
    _per_host("host_shared_extent_bytes", "<u8", "bytes of them that are tagged (shared capacity)"),
    _per_host("host_sealed", "<u8", "sealed pool entries the host published"),
    _per_host("host_shared", "<u8", "of them, entries another host loaded"),
    _per_host("host_unshared_bytes", "<u8", "bytes of the host's entries no other host loaded (its quota's measure)"),
    _per_host("host_quota_bytes", "<u8", "unshared bytes the host may hold"),
    _per_host("host_pins", "<u8", "pins the host holds now"),
    _per_host("host_allocations", "<u8", "the host's allocations in flight (allocated, not sealed)"),
    _per_host("host_pool_hits", "<u8", "the host's pool loads that hit (verified)"),
    _per_host("host_cross_hits", "<u8", "of them, loads of a block another host published"),
    _per_host("host_evicted", "<u8", "the host's entries the firmware evicted"),
])


def _align64(n: int) -> int:
    return (n + 63) // 64 * 64


FIRMWARE_OFFSET = 0x40
HOST_OFFSET = _align64(FIRMWARE_OFFSET + FIRMWARE.size)
POOL_OFFSET = _align64(HOST_OFFSET + HOST.size)
PAGE_SIZE = _align64(POOL_OFFSET + POOL.size)
SECTIONS = {"firmware": (FIRMWARE, FIRMWARE_OFFSET), "host": (HOST, HOST_OFFSET), "pool": (POOL, POOL_OFFSET)}
SECTION_SINCE = {"firmware": 0, "host": 0, "pool": 3}  # the minor that added each section
# Build-time checks, like QEMU_BUILD_BUG_ON: the documented layout is the one packed here.
assert HEADER.size == 0x28 and FIRMWARE.size == 0x119C and HOST.size == 0xE8
assert HOST_OFFSET == 0x1200 and POOL_OFFSET == 0x1300 and PAGE_SIZE <= TELEMETRY_SIZE


def layout_table(name: str) -> str:
    """The markdown table of layout `name` ("header", "firmware", "host", "pool"), as in the module doc."""
    layout = {"header": HEADER, "firmware": FIRMWARE, "host": HOST, "pool": POOL}[name]
    rows = ["| offset | width | name | meaning |", "|---|---|---|---|"]
    rows += [f"| 0x{layout.offsets[f.name]:04X} | {layout.width(f)} | {f.name} | {f.meaning}"
             f"{f'; since {VERSION_MAJOR}.{f.since}' if f.since else ''} |" for f in layout.fields]
    return "\n".join(rows)

