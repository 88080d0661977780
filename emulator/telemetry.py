"""The telemetry page: counters in the BAR that observers read without asking the firmware.

The page lives at BAR offset ``TELEMETRY_OFFSET`` (0x31000, at most ``TELEMETRY_SIZE`` = 0xF000 B),
a vendor-specific block (CXL r3.1 §8.2.8.2 reserves capability IDs 0x8000-0xFFFF for vendors).
It holds sections, each with exactly one writer and its own seqlock, so a writer never waits for a
reader and a reader in another process gets a consistent copy without a lock or a mailbox command.

Layout version 1.1 (offsets in the page; all fields little-endian; `layout_table()` regenerates the
tables below and a test checks that they match this text):

Page header (0x0000, 64 B; written identically by every writer, see `format_page`):

| offset | width | name | meaning |
|---|---|---|---|
| 0x0000 | 4 | magic | 0x544C5843, "CXLT" |
| 0x0004 | 2 | version_major | 1; a reader refuses another major |
| 0x0006 | 2 | version_minor | 1; fields appended to a section bump it (sections never move); old readers ignore them |
| 0x0008 | 4 | page_size | bytes of the page this layout uses |
| 0x000C | 4 | section_count | 2 |
| 0x0010 | 4 | firmware_offset | 0x0040 |
| 0x0014 | 4 | firmware_size | bytes of the firmware section |
| 0x0018 | 4 | host_offset | offset of the host/KV section |
| 0x001C | 4 | host_size | bytes of the host/KV section |

Firmware section (0x0040; single writer: the firmware runner, ~10 times per second):

| offset | width | name | meaning |
|---|---|---|---|
| 0x0000 | 8 | seq | seqlock: odd while a write is in progress |
| 0x0008 | 8 | updated_ns | wall clock (CLOCK_REALTIME ns) of the last publish |
| 0x0010 | 4 | writer_pid | pid of the writing process |
| 0x0014 | 4 | reserved0 | 0 |
| 0x0018 | 8 | reserved1 | 0 |
| 0x0020 | 8 | uptime_ns | ns since the firmware started |
| 0x0028 | 8 | timestamp_ns | device timestamp (Set/Get Timestamp, §8.2.9.4) |
| 0x0030 | 8 | capacity_bytes | size of the DPA space |
| 0x0038 | 8 | capacity_used_bytes | bytes of DPA space holding data (allocated blocks) |
| 0x0040 | 4 | media_status | Memory Device Status MEDIA_STATUS: 0 not ready, 1 ready, 2 error, 3 disabled |
| 0x0044 | 4 | health_status | Get Health Info health status bits (§8.2.9.9.3.1) |
| 0x0048 | 4 | temperature_c | device temperature, degrees Celsius (signed) |
| 0x004C | 4 | life_used_pct | life used, percent |
| 0x0050 | 4 | poison_count | records in the poison list |
| 0x0054 | 4 | events_info | records in the informational event log |
| 0x0058 | 4 | events_warn | records in the warning event log |
| 0x005C | 4 | events_fail | records in the failure event log |
| 0x0060 | 4 | events_fatal | records in the fatal event log |
| 0x0064 | 4 | events_dcd | records in the dynamic capacity event log |
| 0x0068 | 4 | bg_running | 1 while a background command runs |
| 0x006C | 4 | bg_opcode | opcode of the running or last background command |
| 0x0070 | 4 | bg_percent | its percent complete |
| 0x0074 | 4 | chmu_enabled | 1 when the CHMU counts accesses |
| 0x0078 | 8 | chmu_epoch_count | CHMU epochs completed |
| 0x0080 | 8 | chmu_unit_size | bytes per CHMU unit (hotlist index x unit size = DPA) |
| 0x0088 | 4 | hotlist_len | valid entries in hot_unit / hot_count (<= 256) |
| 0x008C | 4 | events_len | valid entries in event_* (<= 16), newest first |
| 0x0090 | 4 | poison_len | valid entries in poison_* (<= 16) |
| 0x0094 | 4 | reserved2 | 0 |
| 0x0098 | 2048 | hot_unit | u64[256] hotlist unit index |
| 0x0898 | 1024 | hot_count | u32[256] hotlist access count |
| 0x0C98 | 128 | event_ts | u64[16] recent event timestamp, ns |
| 0x0D18 | 64 | event_log | u32[16] log: 0 info, 1 warn, 2 fail, 3 fatal, 4 dcd (§8.2.9.2.2) |
| 0x0D58 | 768 | event_text | char[16][48] recent event summary, UTF-8, NUL padded |
| 0x1058 | 128 | poison_dpa | u64[16] poisoned range start DPA |
| 0x10D8 | 128 | poison_length | u64[16] poisoned range length, bytes |
| 0x1158 | 64 | poison_source | u32[16] source: 0 unknown, 1 external, 2 internal, 3 injected, 7 vendor |

Host/KV section (0x1200; single writer: the one KV shim process that claimed it):

| offset | width | name | meaning |
|---|---|---|---|
| 0x0000 | 8 | seq | seqlock: odd while a write is in progress |
| 0x0008 | 8 | updated_ns | wall clock (CLOCK_REALTIME ns) of the last publish |
| 0x0010 | 4 | writer_pid | pid of the claiming process; 0 or a dead pid: free |
| 0x0014 | 4 | reserved0 | 0 |
| 0x0018 | 8 | reserved1 | 0 |
| 0x0020 | 8 | hits | block lookups found resident in the accelerator |
| 0x0028 | 8 | misses | block lookups not resident |
| 0x0030 | 8 | loads | blocks copied device -> accelerator |
| 0x0038 | 8 | offloads | blocks copied accelerator -> device |
| 0x0040 | 8 | prefetch_issued | prefetches started |
| 0x0048 | 8 | prefetch_useful | prefetched blocks used after they arrived |
| 0x0050 | 8 | prefetch_late | prefetched blocks needed before they arrived |
| 0x0058 | 8 | prefetch_wasted | prefetched blocks evicted unused |
| 0x0060 | 8 | evictions | blocks evicted from the accelerator |
| 0x0068 | 8 | stall_ns | time compute waited for KV, ns |
| 0x0070 | 8 | tokens_generated | tokens produced |
| 0x0078 | 8 | blocks_resident | blocks resident in the accelerator |
| 0x0080 | 8 | blocks_total | block slots in the accelerator arena |
| 0x0088 | 8 | hbm_bytes | accelerator bytes holding KV |
| 0x0090 | 8 | hbm_budget_bytes | accelerator bytes allowed for KV |
| 0x0098 | 4 | dma_sq_depth | DMA submission queue entries pending |
| 0x009C | 4 | dma_cq_depth | DMA completion queue entries unreaped |
| 0x00A0 | 4 | prefetch_queue_depth | prefetches queued, not yet submitted |
| 0x00A4 | 4 | reserved2 | 0 |
| 0x00A8 | 8 | dedup_chunks | blocks stored by pointing at a device chunk already holding their bytes (chained-hash hit); since 1.1 |
| 0x00B0 | 8 | dedup_write_bytes | bytes those hits did not write to the device; since 1.1 |
| 0x00B8 | 8 | dedup_load_bytes | bytes not read from the device: one read of a shared chunk served every sequence using it; since 1.1 |
| 0x00C0 | 8 | cow_copies | shared chunks copied to a fresh chunk when a sequence diverged (copy on write); since 1.1 |
| 0x00C8 | 8 | chunk_bytes | bytes per device chunk (block_tokens tokens of one kv head's K or V); since 1.1 |
| 0x00D0 | 8 | device_chunks_used | device chunks referenced now; since 1.1 |
| 0x00D8 | 8 | device_chunks_shared | device chunks referenced by more than one block now; since 1.1 |
| 0x00E0 | 8 | device_saved_bytes | device bytes saved now: (block references - chunks used) x chunk_bytes; since 1.1 |

Link counters (bytes and transfers per direction, link_free, latency histogram) are not here: the
timed data path keeps them with atomic adds in the link-state block at 0x30000 (`emulator.timing`).

Prefix sharing (host section from 0x00A8): ``dedup_*`` and ``cow_copies`` are totals since the shim
started, like the counters above; ``device_*`` describe the shim's device chunks at the publish. A
chunk referenced by n blocks (sequences of one batch, or caches of one process on the device) counts
once in ``device_chunks_used``, once in ``device_chunks_shared`` when n > 1, and saves
(n - 1) x ``chunk_bytes`` of device memory in ``device_saved_bytes``.

Versions. Within a major version a section never moves and never shrinks: a minor version only
appends fields (1.1 appended the prefix-sharing fields of the host section). A reader refuses
another major and sections whose header offsets are not these; it reads each section's
``*_size`` bytes as the header states them, so a field the page's minor lacks reads 0 and
`TelemetrySnapshot.has` says it is absent (the monitor and the exporter then show nothing rather
than a false zero), and the fields of a newer minor it does not know are ignored. A writer finding
a page of an older minor (an older firmware formatted it) raises the header's minor and sizes to
its own; a page of a newer minor it leaves alone, and writes the prefix of it that it knows.

Why the seqlock is sound here. A writer does ``seq += 1`` (odd), stores the fields, ``seq += 1``
(even); a reader loads ``seq`` (retrying while odd), copies the section, loads ``seq`` again and keeps
the copy only if both loads are equal. This needs (1) each ``seq`` access to be one aligned 8-byte
load or store, so it is never torn: it is a numpy ``uint64`` element at an 8-aligned offset of a
page-aligned mapping (``struct`` is not used for it: it assembles integers byte by byte); (2) the
writer's stores to become visible in program order and the reader's loads to happen in program
order. x86-64 (TSO, Intel SDM vol. 3A §9.2.2) keeps stores ordered with stores and loads with
loads; string moves (``rep movs`` inside memcpy) may reorder among themselves, which is why the SDM
(§9.2.4) says to publish through "a discrete semaphore variable after any string operations" --
exactly ``seq``. The C compiler cannot move the field stores across the ``seq`` store because each
happens in a separate call through the CPython interpreter into numpy, opaque to the optimiser.
CPython's GIL orders threads of one process but not processes, so the protocol is needed in both
cases (a thread switch can land between two stores). On weakly ordered CPUs (arm64) this argument
does not hold and fences would be needed; cxlemu targets x86-64 hosts.
"""
from __future__ import annotations

import fcntl
import functools
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any, Self

import numpy as np

from emulator.spec.errors import CxlemuError
from emulator.spec.registers import TELEMETRY_OFFSET, TELEMETRY_SIZE

__all__ = [
    "LOG_NAMES",
    "EventEntry",
    "FirmwareTelemetry",
    "HostTelemetry",
    "PoisonEntry",
    "TelemetryClaimed",
    "TelemetryError",
    "TelemetryReader",
    "TelemetrySnapshot",
    "TelemetryWriter",
    "format_page",
    "layout_table",
]

MAGIC = 0x544C5843  # "CXLT" little-endian
VERSION_MAJOR, VERSION_MINOR = 1, 1
HOTLIST_MAX = 256
EVENTS_MAX = 16
POISON_MAX = 16
EVENT_TEXT_BYTES = 48
LOG_NAMES = ("info", "warn", "fail", "fatal", "dcd")  # CXL r3.1 §8.2.9.2.2 event log types 0-4


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
    _f("version_minor", "<u2", "1; fields appended to a section bump it (sections never move); "
       "old readers ignore them"),
    _f("page_size", "<u4", "bytes of the page this layout uses"),
    _f("section_count", "<u4", "2"),
    _f("firmware_offset", "<u4", "0x0040"),
    _f("firmware_size", "<u4", "bytes of the firmware section"),
    _f("host_offset", "<u4", "offset of the host/KV section"),
    _f("host_size", "<u4", "bytes of the host/KV section"),
])

FIRMWARE = _Layout("firmware", _SECTION_HEAD + [
    _f("uptime_ns", "<u8", "ns since the firmware started"),
    _f("timestamp_ns", "<u8", "device timestamp (Set/Get Timestamp, §8.2.9.4)"),
    _f("capacity_bytes", "<u8", "size of the DPA space"),
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


def _align64(n: int) -> int:
    return (n + 63) // 64 * 64


FIRMWARE_OFFSET = 0x40
HOST_OFFSET = _align64(FIRMWARE_OFFSET + FIRMWARE.size)
PAGE_SIZE = _align64(HOST_OFFSET + HOST.size)
SECTIONS = {"firmware": (FIRMWARE, FIRMWARE_OFFSET), "host": (HOST, HOST_OFFSET)}
# Build-time checks, like QEMU_BUILD_BUG_ON: the documented layout is the one packed here.
assert HEADER.size == 0x20 and FIRMWARE.size == 0x1198 and HOST.size == 0xE8
assert HOST_OFFSET == 0x1200 and PAGE_SIZE == 0x1300 <= TELEMETRY_SIZE


def layout_table(name: str) -> str:
    """The markdown table of layout `name` ("header", "firmware", "host"), as in the module doc."""
    layout = {"header": HEADER, "firmware": FIRMWARE, "host": HOST}[name]
    rows = ["| offset | width | name | meaning |", "|---|---|---|---|"]
    rows += [f"| 0x{layout.offsets[f.name]:04X} | {layout.width(f)} | {f.name} | {f.meaning}"
             f"{f'; since {VERSION_MAJOR}.{f.since}' if f.since else ''} |" for f in layout.fields]
    return "\n".join(rows)


# ---------------------------------------------------------------------------- snapshot types


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


@dataclass
class TelemetrySnapshot:
    """A consistent copy of each section; None where a section has never been published or could
    not be read, with the reason in `notes`. `link` is the data path's counters object, if any."""

    version: tuple[int, int] | None = None
    firmware: FirmwareTelemetry | None = None
    host: HostTelemetry | None = None
    link: Any = None
    notes: list[str] = field(default_factory=list)

    def has(self, section: str, name: str) -> bool:
        """Whether the page's layout version carries field `name` of `section` ("firmware",
        "host"): a page of an older minor lacks later fields, which then read 0."""
        if section not in SECTIONS:
            raise ValueError(f"unknown telemetry section {section!r}: use one of {sorted(SECTIONS)}")
        fld = SECTIONS[section][0].by_name.get(name)
        if fld is None:
            raise ValueError(f"telemetry section {section!r} has no field {name!r}")
        return (self.version is not None and self.version[0] == VERSION_MAJOR
                and self.version[1] >= fld.since)


_DATACLASS = {"firmware": FirmwareTelemetry, "host": HostTelemetry}
_COMPOSITE = {"hotlist", "recent_events", "recent_poison"}


class TelemetryError(CxlemuError):
    """The telemetry page cannot be used as asked."""


class TelemetryClaimed(TelemetryError):
    """Another live process already writes this section."""

    def __init__(self, section: str, pid: int) -> None:
        self.pid = pid
        super().__init__(f"telemetry section {section!r} is written by live process {pid}; "
                         "stop it or publish from that process")


# ---------------------------------------------------------------------------- page access


def _u64_cell(region: Any, offset: int) -> np.ndarray:
    """A one-element uint64 view: its loads and stores are single aligned 8-byte accesses."""
    if offset % 8:
        raise ValueError(f"telemetry offset {offset:#x} is not 8-byte aligned; pass a page-aligned BAR")
    return np.ndarray((1,), dtype="<u8", buffer=region, offset=offset)


def _check_region(region: Any, offset: int) -> None:
    size = memoryview(region).nbytes
    if offset < 0 or offset + PAGE_SIZE > size:
        raise ValueError(f"a telemetry page at {offset:#x} needs {offset + PAGE_SIZE:#x} bytes, the "
                         f"region has {size:#x}; pass the whole BAR (or offset=0 for a bare page)")


def format_page(region: Any, offset: int = TELEMETRY_OFFSET) -> None:
    """Write the page header if it is missing, or raise an older minor's header to this one.
    Idempotent; every writer calls it, so concurrent calls write the same bytes. The magic (and,
    on an upgrade, the minor) goes last, so a reader that sees it sees the rest."""
    _check_region(region, offset)
    head = np.ndarray((), dtype=HEADER.dtype, buffer=region, offset=offset)
    values = {"version_major": VERSION_MAJOR, "version_minor": VERSION_MINOR, "page_size": PAGE_SIZE,
              "section_count": len(SECTIONS), "firmware_offset": FIRMWARE_OFFSET,
              "firmware_size": FIRMWARE.size, "host_offset": HOST_OFFSET, "host_size": HOST.size}
    if int(head["magic"]) == MAGIC:
        problem = _header_problem(head)
        if problem is not None:
            raise TelemetryError(f"{problem}: recreate the device")
        if int(head["version_minor"]) < VERSION_MINOR:  # our sections extend the older ones
            for name in ("page_size", "firmware_size", "host_size"):
                head[name] = values[name]
            head["version_minor"] = VERSION_MINOR
        return
    for name, value in values.items():
        head[name] = value
    head["magic"] = MAGIC


def _header_problem(head: np.ndarray) -> str | None:
    """Why a formatted page's header cannot be read or written by this layout (None: it can)."""
    major = int(head["version_major"])
    if major != VERSION_MAJOR:
        return (f"telemetry page has layout version {major}.{int(head['version_minor'])}, this code "
                f"reads and writes {VERSION_MAJOR}.x")
    for name, (_, rel) in SECTIONS.items():
        at, size = int(head[f"{name}_offset"]), int(head[f"{name}_size"])
        if at != rel or size < _SECTION_HEAD_SIZE:
            return (f"telemetry page header puts the {name} section at {at:#x} (+{size:#x} B), layout "
                    f"{VERSION_MAJOR}.x has it at {rel:#x} (at least {_SECTION_HEAD_SIZE:#x} B)")
    return None


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (in this pid namespace)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@functools.cache
def _iinfo(fmt: str) -> np.iinfo:
    return np.iinfo(np.dtype(fmt))


def _check_int(section: str, name: str, value: Any, fmt: str) -> int:
    info = _iinfo(fmt)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"telemetry {section}.{name} must be an int, got {type(value).__name__}")
    if not info.min <= int(value) <= info.max:
        raise ValueError(f"telemetry {section}.{name}={value} is outside {info.min}..{info.max}")
    return int(value)


class TelemetryWriter:
    """The single writer of one section of the page.

    ``section`` is "firmware" (the firmware runner) or "host" (a KV shim). The host section is
    claimed on construction: its ``writer_pid`` must be 0, ours, or a dead process, else
    `TelemetryClaimed`; a claim by a new process zeroes the section, since its counters are totals
    since that shim started. Pass ``lock_path`` (the device's ``bar`` file) so that two processes
    claiming at the same instant are serialised by an fcntl lock on that field; without it the
    claim is check-then-set. `publish` never blocks and never waits for readers.
    """

    def __init__(self, region: Any, section: str, *, offset: int = TELEMETRY_OFFSET,
                 lock_path: str | os.PathLike[str] | None = None) -> None:
        if section not in SECTIONS:
            raise ValueError(f"unknown telemetry section {section!r}: use one of {sorted(SECTIONS)}")
        if memoryview(region).readonly:
            raise ValueError("telemetry writer needs a writable mapping of the BAR (open it read-write)")
        format_page(region, offset)
        self.section = section
        self.pid = os.getpid()
        self._layout, rel = SECTIONS[section]
        self._base = offset + rel
        self._seq = _u64_cell(region, self._base)
        self._rec = np.ndarray((), dtype=self._layout.dtype, buffer=region, offset=self._base)
        self._lock_path = lock_path
        self._claimed = False
        self._claim()

    def _claim(self) -> None:
        fd = os.open(self._lock_path, os.O_RDWR) if self._lock_path is not None else None
        pid_at = self._base + self._layout.offsets["writer_pid"]
        try:
            if fd is not None:
                fcntl.lockf(fd, fcntl.LOCK_EX, 4, pid_at)
            current = int(self._rec["writer_pid"])
            if self.section == "host" and current not in (0, self.pid) and _pid_alive(current):
                raise TelemetryClaimed(self.section, current)
            if int(self._seq[0]) & 1:  # the previous writer died mid-publish: the copy is ours now
                self._seq[0] = int(self._seq[0]) + 1
            if self.section == "host" and current != self.pid:
                self._zero_body()  # counters are totals since *this* shim started
            self._rec["writer_pid"] = self.pid
            self._claimed = True
        finally:
            if fd is not None:
                os.close(fd)  # closing drops the lockf lock

    def _zero_body(self) -> None:
        seq = int(self._seq[0])
        self._seq[0] = seq + 1
        for f in self._layout.fields[len(_SECTION_HEAD):]:
            self._rec[f.name] = 0
        self._rec["updated_ns"] = time.time_ns()
        self._seq[0] = seq + 2

    def close(self) -> None:
        """Give up the section (the host section becomes claimable at once) and drop the views of
        the mapping, so its owner can close it."""
        if not self._claimed:
            return
        if int(self._rec["writer_pid"]) == self.pid:
            self._rec["writer_pid"] = 0
        self._claimed = False
        del self._rec, self._seq

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def publish(self, snapshot: FirmwareTelemetry | HostTelemetry | None = None, /,
                **values: Any) -> None:
        """Store `values` (field names of the section's dataclass), or every field of `snapshot`,
        as one atomic update; fields not given keep their values."""
        if not self._claimed:
            raise TelemetryError(f"telemetry writer for {self.section!r} is closed")
        if snapshot is not None:
            if not isinstance(snapshot, _DATACLASS[self.section]) or values:
                raise ValueError(f"publish() takes a {_DATACLASS[self.section].__name__} or "
                                 "keyword fields, not both")
            values = {f.name: getattr(snapshot, f.name) for f in fields(snapshot)
                      if f.name not in _HEAD_NAMES}
        stores = self._encode(values)  # validate everything before the sequence goes odd
        seq = int(self._seq[0])
        self._seq[0] = seq + 1
        try:
            for name, value in stores:
                self._rec[name] = value
            self._rec["updated_ns"] = time.time_ns()
        finally:
            self._seq[0] = seq + 2

    def _encode(self, values: dict[str, Any]) -> list[tuple[str, Any]]:
        stores: list[tuple[str, Any]] = []
        for name, value in values.items():
            if name in _COMPOSITE and self.section == "firmware":
                stores += _ENCODERS[name](value)
                continue
            fld = next((f for f in self._layout.fields if f.name == name and not f.count), None)
            if fld is None or name in _HEAD_NAMES or name.startswith("reserved"):
                known = [f.name for f in fields(_DATACLASS[self.section]) if f.name not in _HEAD_NAMES]
                raise ValueError(f"telemetry section {self.section!r} has no field {name!r}; "
                                 f"fields: {', '.join(known)}")
            stores.append((name, _check_int(self.section, name, value, fld.fmt)))
        return stores


def _column(name: str, values: list[int], limit: int, fmt: str) -> np.ndarray:
    """`values` checked against `fmt` and zero-padded to the `limit` slots of an array field.
    Checked as one array: a 256-entry hotlist costs microseconds, not a Python loop."""
    if len(values) > limit:
        raise ValueError(f"telemetry firmware.{name} holds at most {limit} entries, got {len(values)}")
    out = np.zeros(limit, dtype=fmt)
    if not values:
        return out
    bad = next((v for v in values if isinstance(v, bool) or not isinstance(v, (int, np.integer))), None)
    if bad is not None:
        raise TypeError(f"telemetry firmware.{name} entries must be ints, got {type(bad).__name__}")
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu":  # ints beyond any numpy integer: compare as Python ints
        arr = np.asarray(values, dtype=object)
    info = _iinfo(fmt)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < info.min or hi > info.max:
        raise ValueError(f"telemetry firmware.{name} entry {lo if lo < info.min else hi} is outside "
                         f"{info.min}..{info.max}")
    out[:len(values)] = arr
    return out


def _encode_hotlist(hotlist: Iterable[tuple[int, int]]) -> list[tuple[str, Any]]:
    pairs = [tuple(p) for p in hotlist]
    return [("hot_unit", _column("hotlist", [p[0] for p in pairs], HOTLIST_MAX, "<u8")),
            ("hot_count", _column("hotlist", [p[1] for p in pairs], HOTLIST_MAX, "<u4")),
            ("hotlist_len", len(pairs))]


def _encode_events(events: Iterable[EventEntry]) -> list[tuple[str, Any]]:
    rows = list(events)
    bad = [e.log for e in rows if not 0 <= e.log < len(LOG_NAMES)]
    if bad:
        raise ValueError(f"event log {bad[0]} is not one of 0..{len(LOG_NAMES) - 1} ({', '.join(LOG_NAMES)})")
    text = np.zeros(EVENTS_MAX, dtype=f"S{EVENT_TEXT_BYTES}")
    # Cut at a character boundary so the reader never sees half a UTF-8 sequence.
    text[:len(rows)] = [e.text.encode()[:EVENT_TEXT_BYTES].decode(errors="ignore").encode()
                        for e in rows[:EVENTS_MAX]]
    return [("event_ts", _column("recent_events", [e.timestamp_ns for e in rows], EVENTS_MAX, "<u8")),
            ("event_log", _column("recent_events", [e.log for e in rows], EVENTS_MAX, "<u4")),
            ("event_text", text), ("events_len", len(rows))]


def _encode_poison(records: Iterable[PoisonEntry]) -> list[tuple[str, Any]]:
    rows = list(records)
    return [("poison_dpa", _column("recent_poison", [p.dpa for p in rows], POISON_MAX, "<u8")),
            ("poison_length", _column("recent_poison", [p.length for p in rows], POISON_MAX, "<u8")),
            ("poison_source", _column("recent_poison", [p.source for p in rows], POISON_MAX, "<u4")),
            ("poison_len", len(rows))]


_ENCODERS: dict[str, Callable[[Any], list[tuple[str, Any]]]] = {
    "hotlist": _encode_hotlist, "recent_events": _encode_events, "recent_poison": _encode_poison}


class _Unstable(Exception):
    """A section's sequence stayed odd (or kept moving) for longer than the reader waits."""


class TelemetryReader:
    """Consistent snapshots of the page from any process, without locks or mailbox commands.

    ``region`` is the BAR mapping (read-only is enough). ``link_reader`` returns the data path's
    link counters (or None); it is called once per `snapshot`. A section whose writer stopped
    mid-publish is reported in ``notes`` after ``max_wait_s`` instead of blocking the caller.
    """

    def __init__(self, region: Any, *, offset: int = TELEMETRY_OFFSET,
                 link_reader: Any = None, max_wait_s: float = 0.05) -> None:
        _check_region(region, offset)
        self._mv: memoryview | None = memoryview(region)
        self._offset = offset
        self._seqs = {name: _u64_cell(region, offset + rel)
                      for name, (_, rel) in SECTIONS.items()}
        self.link_reader = link_reader
        self.max_wait_s = max_wait_s

    def close(self) -> None:
        """Drop the views of the mapping, so its owner can close it."""
        if self._mv is not None:
            self._mv.release()
        self._mv = None
        self._seqs = {}

    def snapshot(self) -> TelemetrySnapshot:
        """One consistent copy of each section (sections are consistent each on its own)."""
        if self._mv is None:
            raise TelemetryError("telemetry reader is closed")
        snap = TelemetrySnapshot()
        head = np.frombuffer(bytes(self._mv[self._offset:self._offset + HEADER.size]), HEADER.dtype)[0]
        if int(head["magic"]) != MAGIC:
            snap.notes.append("telemetry page not formatted: no firmware has published yet")
            return snap
        snap.version = (int(head["version_major"]), int(head["version_minor"]))
        if snap.version[0] != VERSION_MAJOR:
            snap.notes.append(f"telemetry layout version {snap.version[0]}.{snap.version[1]} is not "
                              f"{VERSION_MAJOR}.x: upgrade cxlemu to read it")
            return snap
        problem = _header_problem(head)
        if problem is not None:
            snap.notes.append(f"{problem}: cannot read it")
            return snap
        # An older minor's section is shorter: read what it has, its missing fields read 0.
        sizes = {name: min(int(head[f"{name}_size"]), layout.size) for name, (layout, _) in SECTIONS.items()}
        snap.firmware = self._section("firmware", sizes["firmware"], snap.notes)  # type: ignore[assignment]
        snap.host = self._section("host", sizes["host"], snap.notes)  # type: ignore[assignment]
        if self.link_reader is not None:
            snap.link = self.link_reader()
        return snap

    def _section(self, name: str, size: int, notes: list[str]) -> FirmwareTelemetry | HostTelemetry | None:
        try:
            seq, raw = self._read_raw(name, size)
        except _Unstable as exc:
            notes.append(f"{name} section unreadable: writer {exc.args[0]} stopped mid-update")
            return None
        if seq == 0:
            notes.append("firmware has not published telemetry yet" if name == "firmware"
                         else "no KV shim has published telemetry")
            return None
        dtype = self._layout(name).dtype
        raw += bytes(dtype.itemsize - len(raw))
        # Plain Python ints, lists and bytes: callers get no numpy scalars.
        rec = {key: v.tolist() if isinstance(v, np.ndarray) else v
               for key, v in zip(dtype.names or (), np.frombuffer(raw, dtype).tolist()[0])}
        return _decode_firmware(rec) if name == "firmware" else _decode_host(rec)

    @staticmethod
    def _layout(name: str) -> _Layout:
        return SECTIONS[name][0]

    def _read_raw(self, name: str, size: int) -> tuple[int, bytes]:
        """The seqlock read side: seq (even), copy ``size`` bytes, seq again; retry until both
        loads agree."""
        assert self._mv is not None
        layout, rel = SECTIONS[name]
        base = self._offset + rel
        cell = self._seqs[name]
        deadline = time.monotonic() + self.max_wait_s
        while True:
            before = int(cell[0])
            if not before & 1:
                raw = self._mv[base:base + size].tobytes()
                if int(cell[0]) == before:
                    return before, raw
            if time.monotonic() > deadline:
                pid_at = base + layout.offsets["writer_pid"]
                raise _Unstable(int.from_bytes(self._mv[pid_at:pid_at + 4], "little"))
            os.sched_yield()


_FIRMWARE_SCALARS = [f.name for f in fields(FirmwareTelemetry) if f.name not in _COMPOSITE]
_HOST_SCALARS = [f.name for f in fields(HostTelemetry)]


def _decode_firmware(rec: dict[str, Any]) -> FirmwareTelemetry:
    fw = FirmwareTelemetry(**{name: rec[name] for name in _FIRMWARE_SCALARS})
    n = min(rec["hotlist_len"], HOTLIST_MAX)  # clamp: a bad page must not crash the reader
    fw.hotlist = list(zip(rec["hot_unit"][:n], rec["hot_count"][:n]))
    n = min(rec["events_len"], EVENTS_MAX)
    fw.recent_events = [EventEntry(t, g, x.decode(errors="replace"))
                        for t, g, x in zip(rec["event_ts"][:n], rec["event_log"][:n], rec["event_text"][:n])]
    n = min(rec["poison_len"], POISON_MAX)
    fw.recent_poison = [PoisonEntry(d, ln, src) for d, ln, src in
                        zip(rec["poison_dpa"][:n], rec["poison_length"][:n], rec["poison_source"][:n])]
    return fw


def _decode_host(rec: dict[str, Any]) -> HostTelemetry:
    return HostTelemetry(**{name: rec[name] for name in _HOST_SCALARS})
