"""The telemetry page: documented layout, publish/snapshot round trips, claims, and the seqlock
seen from another process while a writer hammers it."""
from __future__ import annotations

import mmap
import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import emulator.telemetry as T
from emulator.spec.registers import BAR_SIZE, TELEMETRY_OFFSET
from emulator.telemetry import (
    EventEntry,
    HostTelemetry,
    PoisonEntry,
    TelemetryClaimed,
    TelemetryError,
    TelemetryReader,
    TelemetryWriter,
)


def _bar() -> bytearray:
    return bytearray(BAR_SIZE)


def _seq(bar: bytearray, section: str) -> int:
    base = TELEMETRY_OFFSET + T.SECTIONS[section][1]
    return int.from_bytes(bar[base:base + 8], "little")


@pytest.mark.parametrize("name", ["header", "firmware", "host", "pool"])
def test_module_doc_tables_match_packed_layout(name: str) -> None:
    """The tables in the module docstring are exactly the layout the code packs."""
    assert T.layout_table(name) in T.__doc__


def test_layout_offsets_are_fixed() -> None:
    """Offsets that other programs may hard-code: 1.0's are unchanged, 1.1 appended to the host
    section (the page grew from 0x12C0 to 0x1300), 1.3 the pool section after it (to 0x1700)."""
    assert (T.FIRMWARE_OFFSET, T.HOST_OFFSET, T.POOL_OFFSET, T.PAGE_SIZE) == (0x40, 0x1200, 0x1300, 0x1700)
    assert T.FIRMWARE.offsets["capacity_used_bytes"] == 0x38
    assert T.FIRMWARE.offsets["hot_unit"] == 0x98
    assert T.HOST.offsets["stall_ns"] == 0x68
    assert T.HOST.offsets["reserved2"] == 0xA4  # the end of 1.0's host section: 0xA8
    assert (T.HOST.offsets["dedup_chunks"], T.HOST.offsets["device_saved_bytes"], T.HOST.size) == (0xA8, 0xE0, 0xE8)
    assert [f.name for f in T.HOST.fields if f.since == 1] == [
        "dedup_chunks", "dedup_write_bytes", "dedup_load_bytes", "cow_copies", "chunk_bytes",
        "device_chunks_used", "device_chunks_shared", "device_saved_bytes"]
    # 1.2 appended one field to the firmware section, where 1.1's ended (0x1198)
    assert [(f.name, T.FIRMWARE.offsets[f.name]) for f in T.FIRMWARE.fields if f.since == 2] == [
        ("state_save_failures", 0x1198)]
    # 1.3: the header's pool fields where 1.2's header ended, and the pool section's columns
    assert [(f.name, T.HEADER.offsets[f.name]) for f in T.HEADER.fields if f.since == 3] == [
        ("pool_offset", 0x20), ("pool_size", 0x24)]
    assert (T.POOL.offsets["hosts"], T.POOL.offsets["host_pid"], T.POOL.offsets["host_cross_hits"],
            T.POOL.size) == (0x20, 0x70, 0x350, 0x3D0)
    assert all(f.since == 3 for f in T.POOL.fields[5:])


def test_unformatted_and_unpublished_pages_are_reported() -> None:
    """A zero page says so; a formatted page without publishes has no sections yet."""
    bar = _bar()
    reader = TelemetryReader(bar)
    snap = reader.snapshot()
    assert (snap.version, snap.firmware, snap.host) == (None, None, None)
    assert snap.notes == ["telemetry page not formatted: no firmware has published yet"]
    TelemetryWriter(bar, "firmware")
    snap = reader.snapshot()
    assert snap.version == (1, 3) and snap.pool is None
    assert snap.notes == ["firmware has not published telemetry yet", "no KV shim has published telemetry"]


def test_firmware_round_trip_with_lists() -> None:
    """Scalars, hotlist, events and poison come back as published; the header says who wrote it."""
    bar = _bar()
    writer = TelemetryWriter(bar, "firmware")
    events = [EventEntry(123, 2, "general media: uncorrectable at 0x1000"), EventEntry(99, 0, "é" * 30)]
    writer.publish(uptime_ns=7, capacity_bytes=1 << 30, temperature_c=-12, events_fail=1,
                   hotlist=[(5, 40), (1 << 40, 7)], recent_events=events,
                   recent_poison=[PoisonEntry(0x1000, 64, 3)])
    fw = TelemetryReader(bar).snapshot().firmware
    assert fw is not None
    assert (fw.uptime_ns, fw.capacity_bytes, fw.temperature_c, fw.events_fail) == (7, 1 << 30, -12, 1)
    assert fw.hotlist == [(5, 40), (1 << 40, 7)]
    assert fw.recent_events[0] == events[0]
    assert fw.recent_events[1].text == "é" * 24  # cut at 48 bytes on a character boundary
    assert fw.recent_poison == [PoisonEntry(0x1000, 64, 3)]
    assert (fw.seq, fw.writer_pid) == (2, os.getpid())
    plain = [fw.uptime_ns, *fw.hotlist[0], fw.recent_events[0].timestamp_ns, fw.recent_poison[0].dpa]
    assert all(type(v) is int for v in plain)  # plain ints, not numpy scalars
    assert fw.updated_ns > 0


def test_partial_publish_keeps_other_fields() -> None:
    """publish(**some) changes only the named fields, in one sequence step."""
    bar = _bar()
    writer = TelemetryWriter(bar, "host")
    writer.publish(hits=10, misses=3)
    writer.publish(misses=4)
    host = TelemetryReader(bar).snapshot().host
    assert host is not None
    assert (host.hits, host.misses, host.seq) == (10, 4, 6)  # claim (zeroing) + 2 publishes


@settings(max_examples=40, deadline=None)
@given(st.builds(HostTelemetry, **{f: st.integers(0, 2**64 - 1) for f in (
    "hits", "misses", "loads", "offloads", "prefetch_issued", "prefetch_useful", "prefetch_late",
    "prefetch_wasted", "evictions", "stall_ns", "tokens_generated", "blocks_resident", "blocks_total",
    "hbm_bytes", "hbm_budget_bytes", "dedup_chunks", "dedup_write_bytes", "dedup_load_bytes", "cow_copies",
    "chunk_bytes", "device_chunks_used", "device_chunks_shared", "device_saved_bytes")}, dma_sq_depth=st.integers(0, 2**32 - 1),
    dma_cq_depth=st.integers(0, 2**32 - 1), prefetch_queue_depth=st.integers(0, 2**32 - 1)))
def test_host_dataclass_round_trip(snapshot: HostTelemetry) -> None:
    """Any in-range HostTelemetry published whole reads back equal (header fields aside)."""
    bar = _bar()
    with TelemetryWriter(bar, "host") as writer:
        writer.publish(snapshot)
        got = TelemetryReader(bar).snapshot().host
    assert got is not None
    got.seq = got.updated_ns = got.writer_pid = 0
    assert got == snapshot


def _header(bar: bytearray) -> np.ndarray:
    return np.ndarray((), T.HEADER.dtype, bar, TELEMETRY_OFFSET)


def _as_layout_1_0(bar: bytearray) -> None:
    """Make the header say what a 1.0 writer formatted: minor 0, the 1.0 sizes."""
    head = _header(bar)
    head["version_minor"], head["page_size"], head["host_size"] = 0, 0x12C0, 0xA8
    head["firmware_size"] = 0x1198
    head["pool_offset"] = head["pool_size"] = 0  # 1.0's header ended at 0x20


def test_page_of_an_older_minor_lacks_the_new_fields() -> None:
    """A 1.0 page: the reader copies only the 0xA8 bytes its header states (bytes after them read
    0 even when not zero on the page) and says which fields the page lacks."""
    bar = _bar()
    TelemetryWriter(bar, "host").publish(hits=3, dedup_chunks=5, device_saved_bytes=4096)
    _as_layout_1_0(bar)
    snap = TelemetryReader(bar).snapshot()
    assert snap.version == (1, 0) and snap.host is not None
    assert (snap.host.hits, snap.host.dedup_chunks, snap.host.device_saved_bytes) == (3, 0, 0)
    assert snap.has("host", "hits") and snap.has("firmware", "hot_unit")
    assert not snap.has("host", "dedup_chunks") and not snap.has("host", "device_saved_bytes")
    assert not snap.has("firmware", "state_save_failures")
    assert not T.TelemetrySnapshot().has("host", "hits")  # no page read: nothing is known
    with pytest.raises(ValueError, match="has no field 'nope'"):
        snap.has("host", "nope")


def test_writer_raises_an_older_minor_to_its_own() -> None:
    """A 1.3 writer claiming a page an older firmware formatted as 1.0 raises its header's minor
    and sizes (offsets stay, the pool section is added), so readers see what it publishes."""
    bar = _bar()
    TelemetryWriter(bar, "firmware").publish(uptime_ns=1)
    _as_layout_1_0(bar)
    TelemetryWriter(bar, "host").publish(device_chunks_shared=7)
    head = _header(bar)
    assert (int(head["version_minor"]), int(head["page_size"]), int(head["host_size"])) == (3, 0x1700, 0xE8)
    assert (int(head["firmware_size"]), int(head["section_count"])) == (0x119C, 3)
    assert (int(head["firmware_offset"]), int(head["host_offset"])) == (0x40, 0x1200)
    assert (int(head["pool_offset"]), int(head["pool_size"])) == (0x1300, 0x3D0)
    snap = TelemetryReader(bar).snapshot()
    assert snap.version == (1, 3) and snap.has("host", "device_chunks_shared")
    assert snap.host is not None and snap.host.device_chunks_shared == 7
    assert snap.firmware is not None and snap.firmware.uptime_ns == 1


def test_pool_section_round_trip_per_host_columns() -> None:
    """Layout 1.3: the pool section's scalars and one PoolHost per port come back as published;
    columns past ``hosts`` are not rows."""
    bar = _bar()
    rows = [T.PoolHost(pid=41, pool_phase=2, extents=2, extent_bytes=4 << 20, shared_extent_bytes=2 << 20,
                       sealed=5, shared=2, pins=3, allocations=1, pool_hits=9, cross_hits=4),
            T.PoolHost(pool_phase=1, quota_bytes=1 << 20, unshared_bytes=4096, evicted=7)]
    TelemetryWriter(bar, "pool").publish(hosts=2, pool_hosts=2, pool_slots=480, pool_used=6, pool_sealed=5,
                                         pool_shared=2, pool_cleared_pins=8, host_rows=rows)
    pool = TelemetryReader(bar).snapshot().pool
    assert pool is not None
    assert (pool.hosts, pool.pool_hosts, pool.pool_slots, pool.pool_used, pool.pool_cleared_pins) == (2, 2, 480, 6, 8)
    assert pool.host_rows == rows


def test_pool_section_refuses_bad_rows_before_the_write() -> None:
    bar = _bar()
    writer = TelemetryWriter(bar, "pool")
    with pytest.raises(ValueError, match=r"pool.host_rows holds at most 8 entries \(one per host port\), got 9"):
        writer.publish(host_rows=[T.PoolHost()] * 9)
    with pytest.raises(ValueError, match="pool.host_pid entry -1 is outside 0..4294967295"):
        writer.publish(host_rows=[T.PoolHost(pid=-1)])
    with pytest.raises(TypeError, match="pool.host_rows entries must be PoolHost"):
        writer.publish(host_rows=[{"pid": 1}])
    assert _seq(bar, "pool") == 0


def test_page_of_1_2_has_no_pool_section() -> None:
    """A 1.2 header names no pool section: the reader leaves ``pool`` None and says nothing of it,
    whatever bytes lie where 1.3 puts it; ``has`` says its fields are absent."""
    bar = _bar()
    TelemetryWriter(bar, "firmware").publish(uptime_ns=5)
    TelemetryWriter(bar, "pool").publish(hosts=2)
    head = _header(bar)
    head["version_minor"], head["section_count"], head["page_size"] = 2, 2, 0x1300
    head["pool_offset"] = head["pool_size"] = 0
    snap = TelemetryReader(bar).snapshot()
    assert snap.version == (1, 2) and snap.pool is None and snap.firmware is not None
    assert snap.notes == ["no KV shim has published telemetry"]
    assert not snap.has("pool", "host_pins") and snap.has("firmware", "state_save_failures")


def test_newer_minor_is_read_as_far_as_known() -> None:
    """A page of a later minor (longer sections) is read up to this layout's fields."""
    bar = _bar()
    TelemetryWriter(bar, "host").publish(cow_copies=2)
    head = _header(bar)
    head["version_minor"], head["host_size"] = 9, 0x200
    TelemetryWriter(bar, "host")  # leaves a newer header alone
    assert (int(head["version_minor"]), int(head["host_size"])) == (9, 0x200)
    snap = TelemetryReader(bar).snapshot()
    assert snap.version == (1, 9) and snap.host is not None and snap.host.cow_copies == 2


def test_header_that_moves_a_section_is_refused() -> None:
    """Within a major, sections never move: a header saying otherwise is not read or written."""
    bar = _bar()
    TelemetryWriter(bar, "host").publish(hits=1)
    _header(bar)["host_offset"] = 0x1240
    snap = TelemetryReader(bar).snapshot()
    assert snap.host is None and snap.firmware is None
    assert snap.notes == [("telemetry page header puts the host section at 0x1240 (+0xe8 B), layout 1.x "
                           "has it at 0x1200 (at least 0x20 B): cannot read it")]
    with pytest.raises(TelemetryError, match="host section at 0x1240.*: recreate the device"):
        TelemetryWriter(bar, "host")


@pytest.mark.parametrize("kwargs, message", [
    ({"nope": 1}, "has no field 'nope'"),
    ({"seq": 5}, "has no field 'seq'"),
    ({"uptime_ns": -1}, "uptime_ns=-1 is outside 0..18446744073709551615"),
    ({"hotlist": [(1, 1)] * 257}, "hotlist holds at most 256 entries, got 257"),
    ({"hotlist": [(1, 2**32)]}, "hotlist entry 4294967296 is outside 0..4294967295"),
    ({"hotlist": [(2**64, 1)]}, "hotlist entry 18446744073709551616 is outside 0..18446744073709551615"),
    ({"recent_poison": [PoisonEntry(-64, 64)]}, "recent_poison entry -64 is outside 0..18446744073709551615"),
    ({"recent_events": [EventEntry(0, 9, "x")]}, "event log 9 is not one of 0..4"),
])
def test_bad_publish_is_refused_before_the_write(kwargs: dict, message: str) -> None:
    """A bad field raises ValueError naming it, and the section is untouched (seq stays even)."""
    bar = _bar()
    writer = TelemetryWriter(bar, "firmware")
    writer.publish(uptime_ns=1)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        writer.publish(**kwargs)
    assert _seq(bar, "firmware") == 2


def test_publish_refuses_a_non_integer() -> None:
    bar = _bar()
    writer = TelemetryWriter(bar, "firmware")
    with pytest.raises(TypeError, match="firmware.media_status must be an int, got float"):
        writer.publish(media_status=1.5)
    with pytest.raises(TypeError, match="firmware.hotlist entries must be ints, got float"):
        writer.publish(hotlist=[(1.5, 1)])
    with pytest.raises(TypeError, match="firmware.hotlist entries must be ints, got bool"):
        writer.publish(hotlist=[(5, 1), (True, 1)])
    assert _seq(bar, "firmware") == 0


def test_publish_refuses_wrong_dataclass() -> None:
    bar = _bar()
    with pytest.raises(ValueError, match="takes a FirmwareTelemetry"):
        TelemetryWriter(bar, "firmware").publish(HostTelemetry())


def test_unknown_section_and_small_region() -> None:
    with pytest.raises(ValueError, match=r"use one of \['firmware', 'host', 'pool'\]"):
        TelemetryWriter(_bar(), "link")
    with pytest.raises(ValueError, match="pass the whole BAR"):
        TelemetryReader(bytearray(0x1000))


def test_read_only_mapping_cannot_write(tmp_path: Path) -> None:
    path = tmp_path / "bar"
    path.write_bytes(bytes(BAR_SIZE))
    with open(path, "rb") as f:
        ro = mmap.mmap(f.fileno(), BAR_SIZE, prot=mmap.PROT_READ)
    with pytest.raises(ValueError, match="writable mapping"):
        TelemetryWriter(ro, "firmware")


def test_writer_dead_mid_publish_is_reported_then_recovered() -> None:
    """A sequence left odd (writer killed between its two stores) is reported, not waited on
    forever; the next writer to claim the section makes it even again."""
    bar = _bar()
    TelemetryWriter(bar, "host").publish(hits=1)
    base = TELEMETRY_OFFSET + T.HOST_OFFSET
    np.ndarray((1,), "<u8", bar, base)[0] = 3  # what a writer killed after `seq += 1` leaves
    snap = TelemetryReader(bar, max_wait_s=0.001).snapshot()
    assert snap.host is None
    assert f"host section unreadable: writer {os.getpid()} stopped mid-update" in snap.notes
    TelemetryWriter(bar, "host").publish(hits=2)  # same pid: reclaims without zeroing
    host = TelemetryReader(bar).snapshot().host
    assert host is not None and (host.hits, host.seq) == (2, 6)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_host_claim_by_live_process_refused_dead_reclaimed(tmp_path: Path) -> None:
    """A live writer's claim stands; a dead writer's pid is reclaimable; close frees the claim."""
    path = tmp_path / "bar"
    path.write_bytes(bytes(BAR_SIZE))
    with open(path, "r+b") as f:
        bar = mmap.mmap(f.fileno(), BAR_SIZE)
    pid_at = TELEMETRY_OFFSET + T.HOST_OFFSET + T.HOST.offsets["writer_pid"]
    TelemetryWriter(bar, "host").publish(hits=9)  # then its pid is replaced: another process's
    bar[pid_at:pid_at + 4] = os.getppid().to_bytes(4, "little")
    with pytest.raises(TelemetryClaimed, match=f"written by live process {os.getppid()}"):
        TelemetryWriter(bar, "host", lock_path=path)
    bar[pid_at:pid_at + 4] = _dead_pid().to_bytes(4, "little")
    writer = TelemetryWriter(bar, "host", lock_path=path)
    assert int.from_bytes(bar[pid_at:pid_at + 4], "little") == os.getpid()
    host = TelemetryReader(bar).snapshot().host
    assert host is not None and host.hits == 0  # a new shim's totals start from zero
    writer.close()
    assert int.from_bytes(bar[pid_at:pid_at + 4], "little") == 0
    with pytest.raises(TelemetryError, match="closed"):
        writer.publish(hits=1)


# ---------------------------------------------------------------- seqlock across processes

_ROUNDS = 3000


def _torn_reader(path: str, out: multiprocessing.Queue[tuple[int, int, int]]) -> None:
    """Child process: take snapshots until _ROUNDS of them hold data; count invariant breaks."""
    with open(path, "rb") as f:
        bar = mmap.mmap(f.fileno(), BAR_SIZE, prot=mmap.PROT_READ)
    reader = TelemetryReader(bar, max_wait_s=5.0)
    torn = seen = 0
    values: set[int] = set()
    while seen < _ROUNDS:
        fw = reader.snapshot().firmware
        if fw is None:
            continue
        seen += 1
        i = fw.uptime_ns
        values.add(i)
        counts = {c for _, c in fw.hotlist}
        if fw.timestamp_ns != 2 * i or fw.capacity_used_bytes != 3 * i or counts != {i & 0xFFFFFFFF}:
            torn += 1
    out.put((seen, torn, len(values)))


def test_reader_in_other_process_never_sees_a_torn_snapshot(tmp_path: Path) -> None:
    """Writer thread publishes uptime=i, timestamp=2i, used=3i, 256 hotlist counts=i as fast as it
    can; a reader process checks the invariant in every snapshot it takes and sees many values."""
    path = tmp_path / "bar"
    path.write_bytes(bytes(BAR_SIZE))
    with open(path, "r+b") as f:
        bar = mmap.mmap(f.fileno(), BAR_SIZE)
    writer = TelemetryWriter(bar, "firmware")
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_torn_reader, args=(str(path), out))
    child.start()
    stop = threading.Event()

    def hammer() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            writer.publish(uptime_ns=i, timestamp_ns=2 * i, capacity_used_bytes=3 * i,
                           hotlist=[(u, i & 0xFFFFFFFF) for u in range(256)])

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        seen, torn, distinct = out.get(timeout=120)
    finally:
        stop.set()
        thread.join()
        child.join(timeout=30)
    assert (seen, torn) == (_ROUNDS, 0)
    assert distinct > 10  # the reader really ran while the writer was writing
    assert child.exitcode == 0
