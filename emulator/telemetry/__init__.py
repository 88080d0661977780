"""The telemetry page: counters in the BAR that observers read without asking the firmware.

The page lives at BAR offset ``TELEMETRY_OFFSET`` (0x31000, at most ``TELEMETRY_SIZE`` = 0xF000 B),
a vendor-specific block (CXL r3.1 §8.2.8.2 reserves capability IDs 0x8000-0xFFFF for vendors).
It holds sections, each with exactly one writer and its own seqlock, so a writer never waits for a
reader and a reader in another process gets a consistent copy without a lock or a mailbox command.

Layout version 1.3 (offsets in the page; all fields little-endian; `layout_table()` regenerates the
tables below and a test checks that they match this text):

Page header (0x0000, 64 B; written identically by every writer, see `format_page`):

| offset | width | name | meaning |
|---|---|---|---|
| 0x0000 | 4 | magic | 0x544C5843, "CXLT" |
| 0x0004 | 2 | version_major | 1; a reader refuses another major |
| 0x0006 | 2 | version_minor | 3; fields or sections appended bump it (sections never move); old readers ignore them |
| 0x0008 | 4 | page_size | bytes of the page this layout uses |
| 0x000C | 4 | section_count | 3 (2 before 1.3) |
| 0x0010 | 4 | firmware_offset | 0x0040 |
| 0x0014 | 4 | firmware_size | bytes of the firmware section |
| 0x0018 | 4 | host_offset | offset of the host/KV section |
| 0x001C | 4 | host_size | bytes of the host/KV section |
| 0x0020 | 4 | pool_offset | offset of the hosts/pool section; since 1.3 |
| 0x0024 | 4 | pool_size | bytes of the hosts/pool section; since 1.3 |

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
| 0x0030 | 8 | capacity_bytes | size of the DPA space: static capacity and the DC regions |
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
| 0x1198 | 4 | state_save_failures | failed saves of the device state (state.json) since the last that succeeded; 0: saved; since 1.2 |

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

Hosts/pool section (0x1300, since 1.3; single writer: the firmware runner, with its own section):

| offset | width | name | meaning |
|---|---|---|---|
| 0x0000 | 8 | seq | seqlock: odd while a write is in progress |
| 0x0008 | 8 | updated_ns | wall clock (CLOCK_REALTIME ns) of the last publish |
| 0x0010 | 4 | writer_pid | pid of the writing process |
| 0x0014 | 4 | reserved0 | 0 |
| 0x0018 | 8 | reserved1 | 0 |
| 0x0020 | 4 | hosts | host ports of the device; since 1.3 |
| 0x0024 | 4 | pool_hosts | hosts the KV pool's index serves; 0: no pool; since 1.3 |
| 0x0028 | 8 | pool_slots | slots of the pool's index (one block each); since 1.3 |
| 0x0030 | 8 | pool_slot_bytes | bytes per slot; since 1.3 |
| 0x0038 | 8 | pool_used | slots holding an entry: allocated, sealed or being evicted; since 1.3 |
| 0x0040 | 8 | pool_sealed | sealed entries (blocks every host of the pool may load); since 1.3 |
| 0x0048 | 8 | pool_shared | sealed entries loaded by a host other than their publisher; since 1.3 |
| 0x0050 | 8 | pool_evictions | entries the firmware evicted; since 1.3 |
| 0x0058 | 8 | pool_quota_evictions | of them, evicted to bring a host under its quota; since 1.3 |
| 0x0060 | 8 | pool_reaped_allocations | allocations of dead or dropped hosts the firmware dropped; since 1.3 |
| 0x0068 | 8 | pool_cleared_pins | pin bytes of dead or dropped hosts the firmware cleared; since 1.3 |
| 0x0070 | 32 | host_pid | u32[8] pid of the process that claimed the port (host.<h>.pid); 0: none; since 1.3 |
| 0x0090 | 32 | host_pool_phase | u32[8] the host in the pool: 0 out, 1 joining, 2 member; since 1.3 |
| 0x00B0 | 32 | host_pool_pid | u32[8] pid of the process that joined the pool as this host; since 1.3 |
| 0x00D0 | 32 | host_extents | u32[8] DC extents the port accepted; since 1.3 |
| 0x00F0 | 32 | host_pending_extents | u32[8] DC extents offered to the port, not yet accepted; since 1.3 |
| 0x0110 | 64 | host_extent_bytes | u64[8] bytes of the accepted extents; since 1.3 |
| 0x0150 | 64 | host_shared_extent_bytes | u64[8] bytes of them that are tagged (shared capacity); since 1.3 |
| 0x0190 | 64 | host_sealed | u64[8] sealed pool entries the host published; since 1.3 |
| 0x01D0 | 64 | host_shared | u64[8] of them, entries another host loaded; since 1.3 |
| 0x0210 | 64 | host_unshared_bytes | u64[8] bytes of the host's entries no other host loaded (its quota's measure); since 1.3 |
| 0x0250 | 64 | host_quota_bytes | u64[8] unshared bytes the host may hold; since 1.3 |
| 0x0290 | 64 | host_pins | u64[8] pins the host holds now; since 1.3 |
| 0x02D0 | 64 | host_allocations | u64[8] the host's allocations in flight (allocated, not sealed); since 1.3 |
| 0x0310 | 64 | host_pool_hits | u64[8] the host's pool loads that hit (verified); since 1.3 |
| 0x0350 | 64 | host_cross_hits | u64[8] of them, loads of a block another host published; since 1.3 |
| 0x0390 | 64 | host_evicted | u64[8] the host's entries the firmware evicted; since 1.3 |

Link counters (bytes and transfers per direction, link_free, latency histogram) are not here: the
timed data path keeps them with atomic adds in the link-state block at 0x30000 (`emulator.timing`).

Prefix sharing (host section from 0x00A8): ``dedup_*`` and ``cow_copies`` are totals since the shim
started, like the counters above; ``device_*`` describe the shim's device chunks at the publish. A
chunk referenced by n blocks (sequences of one batch, or caches of one process on the device) counts
once in ``device_chunks_used``, once in ``device_chunks_shared`` when n > 1, and saves
(n - 1) x ``chunk_bytes`` of device memory in ``device_saved_bytes``.

Hosts and the pool (section from 0x1300): the device-wide part is the KV index's (its slots, a
census of its entries now, the firmware's counters since the index was formatted; all 0 and
``pool_hosts`` 0 without a pool); one column element per host port, ``hosts`` of them valid. A
host's DC extents are the port's accepted ones (emulator/dcd.py); its pool row is its record in
the index's host table (its hits are the host's own atomic adds) and its entries in the slot table.

Versions. Within a major version a section never moves and never shrinks: a minor version only
appends fields or sections (1.1 appended the prefix-sharing fields of the host section, 1.2
state_save_failures to the firmware section, 1.3 the pool section and its header fields). A reader
refuses another major and sections whose header offsets are not these; a section the page's
minor lacks reads as None; it reads each section's
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

The code is split by role: `layout` (field tables, offsets, versions, `layout_table`), `snapshot`
(the dataclasses a writer publishes and a reader returns), `page` (errors, the seqlock's cell,
header format and checks), `writer` (`TelemetryWriter`) and `reader` (`TelemetryReader`). This
package re-exports their names, so ``emulator.telemetry`` is the one import path.
"""
from __future__ import annotations

# Besides __all__, the layout's geometry: tools and tests read it from here.
from emulator.telemetry.layout import (  # noqa: F401
    EVENT_TEXT_BYTES,
    EVENTS_MAX,
    FIRMWARE,
    FIRMWARE_OFFSET,
    HEADER,
    HOST,
    HOST_OFFSET,
    HOTLIST_MAX,
    LOG_NAMES,
    MAGIC,
    PAGE_SIZE,
    POISON_MAX,
    POOL,
    POOL_OFFSET,
    POOL_PHASES,
    SECTION_SINCE,
    SECTIONS,
    VERSION_MAJOR,
    VERSION_MINOR,
    layout_table,
)
from emulator.telemetry.page import TelemetryClaimed, TelemetryError, format_page
from emulator.telemetry.reader import TelemetryReader
from emulator.telemetry.snapshot import (
    EventEntry,
    FirmwareTelemetry,
    HostTelemetry,
    PoisonEntry,
    PoolHost,
    PoolTelemetry,
    TelemetrySnapshot,
)
from emulator.telemetry.writer import TelemetryWriter

__all__ = [
    "LOG_NAMES",
    "POOL_PHASES",
    "EventEntry",
    "FirmwareTelemetry",
    "HostTelemetry",
    "PoisonEntry",
    "PoolHost",
    "PoolTelemetry",
    "TelemetryClaimed",
    "TelemetryError",
    "TelemetryReader",
    "TelemetrySnapshot",
    "TelemetryWriter",
    "format_page",
    "layout_table",
]
