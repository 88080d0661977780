"""Dynamic Capacity commands (4800h-4803h) and the fabric manager's (C000h-C002h): exact bytes at
the reference's offsets, each return code, the per-port extents, the access bitmaps and events."""
from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest
from mbox_support import firmware

from emulator.dcd import Extent
from emulator.firmware import Firmware
from emulator.mailbox import dispatch
from emulator.spec import payloads_dcd as D
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_events import EVENT_HEADER, EventLog
from emulator.spec.retcodes import RetCode

M256 = 256 << 20
MB2 = 2 << 20
BASE = M256  # dc_base of a 256 MiB device
TAG = bytes(range(1, 17))


@pytest.fixture
def fw2(device_name: str) -> Iterator[Firmware]:
    """Two host ports, 256 MiB static, DC regions of 256 MiB and 512 MiB."""
    with firmware(capacity=M256, name=device_name, hosts=2, dc_regions=(M256, 2 * M256)) as fw:
        yield fw


def on(fw: Firmware, host: int, opcode: int, payload: bytes = b"") -> tuple[RetCode, bytes]:
    fw.port = fw.ports[host]
    try:
        return dispatch(fw, opcode, payload)
    finally:
        fw.port = fw.ports[0]


def response(*ranges: tuple[int, int], count: int | None = None) -> bytes:
    head = struct.pack("<IB3x", len(ranges) if count is None else count, 0)
    return head + b"".join(struct.pack("<QQ8x", dpa, n) for dpa, n in ranges)


def fm(host: int, region: int, *extents: tuple[int, int], tag: bytes = bytes(16), forced: bool = False) -> bytes:
    head = struct.pack("<BBBxI16s", host, region, int(forced), len(extents), tag)
    return head + b"".join(struct.pack("<QQ", off, n) for off, n in extents)


def access(fw: Firmware, host: int) -> bytes:
    return (fw.files.path / f"access.h{host}").read_bytes()


def test_get_dc_config_bytes(fw2: Firmware) -> None:
    rc, out = on(fw2, 0, Opcode.GET_DC_CONFIG, bytes([8, 0]))
    assert rc == RetCode.SUCCESS and len(out) == 8 + 2 * 40 + 16
    assert out[:8] == bytes([2, 2, 0, 0, 0, 0, 0, 0])
    assert struct.unpack_from("<QQQQIB3x", out, 8) == (BASE, 1, M256, MB2, 0, 0)
    assert struct.unpack_from("<QQQQIB3x", out, 48) == (2 * M256, 2, 2 * M256, MB2, 0, 0)
    assert struct.unpack_from("<IIII", out, 88) == (512, 512, 512, 512)
    rc, out = on(fw2, 0, Opcode.GET_DC_CONFIG, bytes([1, 1]))
    assert out[:2] == bytes([2, 1]) and struct.unpack_from("<Q", out, 8)[0] == 2 * M256 and len(out) == 64


def test_get_dc_config_codes(fw2: Firmware) -> None:
    assert on(fw2, 0, Opcode.GET_DC_CONFIG, bytes([1, 2]))[0] == RetCode.INVALID_INPUT
    assert on(fw2, 0, Opcode.GET_DC_CONFIG, bytes([1]))[0] == RetCode.INVALID_PAYLOAD_LENGTH
    assert on(fw2, 0, Opcode.GET_DC_EXTENT_LIST, bytes(4))[0] == RetCode.INVALID_PAYLOAD_LENGTH


def test_add_event_accept_list_release_flow(fw2: Firmware) -> None:
    assert on(fw2, 1, Opcode.FM_ADD_DC, fm(0, 0, (0, 2 * MB2), (8 * MB2, MB2)))[0] == RetCode.SUCCESS
    batch = fw2.ports[0].events.get(EventLog.DYNAMIC_CAPACITY, 10)
    assert len(batch.records) == 2 and fw2.ports[1].events.count(EventLog.DYNAMIC_CAPACITY) == 0
    first, last = batch.records
    assert first[:16] == D.DC_EVENT_UUID.bytes and first[0x10] == 0x80
    assert (first[0x30], first[0x34], first[0x35]) == (D.DcEventType.ADD_CAPACITY, 0, 1)  # More
    assert last[0x35] == 0
    assert struct.unpack_from("<QQ", first, 0x38) == (BASE, 2 * MB2)
    assert struct.unpack_from("<QQ", last, 0x38) == (BASE + 8 * MB2, MB2)
    # accept the first extent only: bits 0 and 1 set, the rest of the offer dropped
    assert on(fw2, 0, Opcode.ADD_DC_RESPONSE, response((BASE, 2 * MB2)))[0] == RetCode.SUCCESS
    assert access(fw2, 0) == b"\x03" + bytes(47) and access(fw2, 1) == bytes(48)
    rc, out = on(fw2, 0, Opcode.GET_DC_EXTENT_LIST, struct.pack("<II", 10, 0))
    assert rc == RetCode.SUCCESS
    assert out == struct.pack("<III4x", 1, 1, 1) + struct.pack("<QQ16sH6x", BASE, 2 * MB2, bytes(16), 0)
    assert on(fw2, 1, Opcode.GET_DC_EXTENT_LIST, struct.pack("<II", 10, 0))[1] == struct.pack("<III4x", 0, 0, 0)
    # the FM asks it back; the host releases half of it
    assert on(fw2, 1, Opcode.FM_RELEASE_DC, fm(0, 0, (0, MB2)))[0] == RetCode.SUCCESS
    rec = fw2.ports[0].events.get(EventLog.DYNAMIC_CAPACITY, 10).records[-1]
    assert rec[0x30] == D.DcEventType.RELEASE_CAPACITY and access(fw2, 0)[0] == 3  # not yet
    assert on(fw2, 0, Opcode.RELEASE_DC, response((BASE, MB2)))[0] == RetCode.SUCCESS
    assert access(fw2, 0)[0] == 2
    assert fw2.dcd.ports[0].accepted == [Extent(BASE + MB2, MB2)] and fw2.dcd.ports[0].generation == 2


def test_accept_codes(fw2: Firmware) -> None:
    on(fw2, 0, Opcode.FM_ADD_DC, fm(0, 0, (0, 4 * MB2)))
    assert on(fw2, 0, Opcode.ADD_DC_RESPONSE, response((BASE, MB2), count=2))[0] == RetCode.INVALID_PAYLOAD_LENGTH
    assert on(fw2, 0, Opcode.ADD_DC_RESPONSE, response((0, MB2)))[0] == RetCode.INVALID_PHYSICAL_ADDRESS
    assert on(fw2, 0, Opcode.ADD_DC_RESPONSE, response((BASE + 4096, MB2)))[0] == RetCode.INVALID_EXTENT_LIST
    overlapping = response((BASE, 2 * MB2), (BASE + MB2, MB2))
    assert on(fw2, 0, Opcode.ADD_DC_RESPONSE, overlapping)[0] == RetCode.INVALID_EXTENT_LIST
    assert on(fw2, 0, Opcode.ADD_DC_RESPONSE, response((BASE + 4 * MB2, MB2)))[0] == RetCode.INVALID_PHYSICAL_ADDRESS
    assert on(fw2, 0, Opcode.ADD_DC_RESPONSE, response((BASE + M256 - MB2, 2 * MB2)))[0] == \
        RetCode.INVALID_PHYSICAL_ADDRESS  # runs past region 0
    assert on(fw2, 0, Opcode.ADD_DC_RESPONSE, response())[0] == RetCode.SUCCESS  # declined
    assert fw2.dcd.ports[0].pending == [] and access(fw2, 0) == bytes(48)


def test_release_codes(fw2: Firmware) -> None:
    assert on(fw2, 0, Opcode.RELEASE_DC, response())[0] == RetCode.INVALID_INPUT
    assert on(fw2, 0, Opcode.RELEASE_DC, response((BASE, MB2)))[0] == RetCode.INVALID_PHYSICAL_ADDRESS


def test_fm_codes(fw2: Firmware) -> None:
    assert on(fw2, 0, Opcode.FM_ADD_DC, fm(2, 0, (0, MB2)))[0] == RetCode.INVALID_INPUT  # no host 2
    assert on(fw2, 0, Opcode.FM_ADD_DC, fm(0, 2, (0, MB2)))[0] == RetCode.INVALID_INPUT  # no region 2
    assert on(fw2, 0, Opcode.FM_ADD_DC, fm(0, 0, (M256, MB2)))[0] == RetCode.INVALID_PHYSICAL_ADDRESS
    assert on(fw2, 0, Opcode.FM_ADD_DC, fm(0, 0, (0, 4096)))[0] == RetCode.INVALID_EXTENT_LIST
    assert on(fw2, 0, Opcode.FM_ADD_DC, fm(0, 0, (0, MB2))[:-1])[0] == RetCode.INVALID_PAYLOAD_LENGTH
    assert on(fw2, 0, Opcode.FM_ADD_DC, fm(0, 0, (0, MB2)))[0] == RetCode.SUCCESS
    assert on(fw2, 0, Opcode.FM_ADD_DC, fm(0, 0, (MB2, MB2)))[0] == RetCode.INVALID_INPUT  # one pending
    assert on(fw2, 0, Opcode.FM_ADD_DC, fm(1, 0, (0, MB2)))[0] == RetCode.INVALID_PHYSICAL_ADDRESS  # untagged: host 0's


def test_shared_extent_accepted_by_both_sets_both_bitmaps(fw2: Firmware) -> None:
    for h in (0, 1):
        assert on(fw2, 0, Opcode.FM_ADD_DC, fm(h, 1, (0, 8 * MB2), tag=TAG))[0] == RetCode.SUCCESS
        assert on(fw2, h, Opcode.ADD_DC_RESPONSE, response((2 * M256, 8 * MB2)))[0] == RetCode.SUCCESS
    # region 1 starts at block 128: byte 16
    assert access(fw2, 0) == access(fw2, 1) == bytes(16) + b"\xff" + bytes(31)
    rc, out = on(fw2, 1, Opcode.GET_DC_EXTENT_LIST, struct.pack("<II", 1, 0))
    assert out[16:] == struct.pack("<QQ16sH6x", 2 * M256, 8 * MB2, TAG, 1)
    # a forced release from host 0 revokes at once; host 1 keeps its bits
    assert on(fw2, 1, Opcode.FM_RELEASE_DC, fm(0, 1, (0, 8 * MB2), tag=TAG, forced=True))[0] == RetCode.SUCCESS
    assert access(fw2, 0) == bytes(48) and access(fw2, 1)[16] == 0xFF
    assert fw2.ports[0].events.get(EventLog.DYNAMIC_CAPACITY, 10).records[-1][0x30] == \
        D.DcEventType.FORCED_CAPACITY_RELEASE


def test_fm_list_shows_every_port(fw2: Firmware) -> None:
    on(fw2, 0, Opcode.FM_ADD_DC, fm(0, 0, (0, MB2)))
    on(fw2, 0, Opcode.ADD_DC_RESPONSE, response((BASE, MB2)))
    on(fw2, 0, Opcode.FM_ADD_DC, fm(1, 0, (4 * MB2, MB2)))
    rc, out = on(fw2, 1, Opcode.FM_LIST_DC)
    assert rc == RetCode.SUCCESS and out[:8] == struct.pack("<I4x", 2)
    assert out[8:56] == struct.pack("<BB2xIQQ16sH6x", 0, 0, 1, BASE, MB2, bytes(16), 0)
    assert out[56:104] == struct.pack("<BB2xIQQ16sH6x", 1, 1, 0, BASE + 4 * MB2, MB2, bytes(16), 0)


def test_extents_and_bitmaps_survive_a_restart(device_name: str) -> None:
    from emulator.device import DeviceConfig, DeviceFiles

    cfg = DeviceConfig(name=device_name, capacity=M256, hosts=2, dc_regions=(M256,))
    files = DeviceFiles.create(cfg)
    try:
        fw = Firmware(files)
        on(fw, 0, Opcode.FM_ADD_DC, fm(1, 0, (2 * MB2, MB2)))
        on(fw, 1, Opcode.ADD_DC_RESPONSE, response((BASE + 2 * MB2, MB2)))
        assert fw.persist.save()
        fw.close()
        (files.path / "access.h1").write_bytes(b"\xff" * 16)  # a stale bitmap is rebuilt from the extents
        fw = Firmware(files)
        assert fw.dcd.ports[1].accepted == [Extent(BASE + 2 * MB2, MB2)]
        assert access(fw, 1) == b"\x04" + bytes(15) and access(fw, 0) == bytes(16)
        fw.close()
    finally:
        files.destroy()


def test_a_device_without_regions_does_not_offer_dc(fw: Firmware) -> None:
    assert dispatch(fw, Opcode.GET_DC_CONFIG, bytes([1, 0]))[0] == RetCode.UNSUPPORTED


def test_sanitize_zeroes_the_dc_regions_too(fw2: Firmware) -> None:
    from mbox_support import run

    fw2.media[BASE + 3 * M256 - 64:BASE + 3 * M256] = 0xAB  # the last line of region 1
    assert run(fw2, Opcode.SANITIZE)[0] == RetCode.SUCCESS
    assert not fw2.media[BASE:].any()


def test_a_damaged_dcd_entry_is_set_aside_and_the_bitmaps_cleared(device_name: str) -> None:
    import json

    from emulator.device import DeviceConfig, DeviceFiles

    files = DeviceFiles.create(DeviceConfig(name=device_name, capacity=M256, dc_regions=(M256,)))
    try:
        fw = Firmware(files)
        state = fw.persist.snapshot()
        fw.close()
        state["dcd"] = {"ports": [{"accepted": [[BASE, MB2, "zz", 0]], "pending": [], "generation": 1}]}
        (files.path / "state.json").write_text(json.dumps(state))
        (files.path / "access.h0").write_bytes(b"\x01" + bytes(15))
        fw = Firmware(files)
        assert fw.dcd.ports[0].accepted == [] and access(fw, 0) == bytes(16)
        assert len(list(files.path.glob("state.json.bad-*"))) == 1
        fw.close()
    finally:
        files.destroy()


def test_the_telemetry_page_counts_the_dc_regions_in_the_capacity(fw2: Firmware) -> None:
    """The media file holds the DC regions too and "used" counts its blocks: a capacity of the
    static part alone put the monitor's bar past 100 %."""
    from emulator.telemetry import TelemetryReader

    fw2.telemetry.publish(fw2.clock.now_ns())
    pages = [TelemetryReader(p.bar).snapshot().firmware for p in fw2.ports]
    assert [page.capacity_bytes for page in pages] == [4 * M256, 4 * M256]
    assert all(page.capacity_used_bytes <= page.capacity_bytes for page in pages)


# Resources Exhausted (0x1D), as QEMU answers it: a port holds at most DC_MAX_EXTENTS (512) extents.
@pytest.fixture
def fw_big(device_name: str) -> Iterator[Firmware]:
    """One host port and a 2 GiB region (1024 blocks): room for 512 extents with gaps."""
    with firmware(capacity=M256, name=device_name, dc_regions=(8 * M256,)) as fw:
        yield fw


def _clear_dc_log(fw: Firmware, host: int) -> None:
    logs = fw.ports[host].events
    batch = logs.get(EventLog.DYNAMIC_CAPACITY, 64)
    assert logs.clear(EventLog.DYNAMIC_CAPACITY, [EVENT_HEADER.unpack(r)["handle"] for r in batch.records]) \
        == RetCode.SUCCESS


def _hold(fw: Firmware, blocks: list[int], *, first_len: int = MB2) -> None:
    """Port 0 offered and accepting one extent at each block of region 0 (64 per round, the log's size);
    the first extent is ``first_len`` long."""
    for at in range(0, len(blocks), 64):
        chunk = [(b * MB2, first_len if b == blocks[0] else MB2) for b in blocks[at:at + 64]]
        assert on(fw, 0, Opcode.FM_ADD_DC, fm(0, 0, *chunk))[0] == RetCode.SUCCESS
        assert on(fw, 0, Opcode.ADD_DC_RESPONSE, response(*[(BASE + o, n) for o, n in chunk]))[0] == RetCode.SUCCESS
        _clear_dc_log(fw, 0)


def test_an_offer_past_the_extents_a_port_can_hold_is_resources_exhausted(fw_big: Firmware) -> None:
    _hold(fw_big, [2 * i for i in range(510)])  # 510 extents, every other block
    rc, out = on(fw_big, 0, Opcode.GET_DC_CONFIG, bytes([1, 0]))
    assert struct.unpack_from("<IIII", out, 48) == (512, 2, 512, 512)
    # 510 + 3 > 512: QEMU's FM add checks the count first, so an overlapping offer says so too
    assert on(fw_big, 0, Opcode.FM_ADD_DC, fm(0, 0, (1 * MB2, MB2), (3 * MB2, MB2), (5 * MB2, MB2)))[0] == \
        RetCode.RESOURCES_EXHAUSTED
    assert on(fw_big, 0, Opcode.FM_ADD_DC, fm(0, 0, (0, MB2), (3 * MB2, MB2), (5 * MB2, MB2)))[0] == \
        RetCode.RESOURCES_EXHAUSTED
    assert fw_big.dcd.ports[0].pending == [] and fw_big.ports[0].events.count(EventLog.DYNAMIC_CAPACITY) == 0
    assert on(fw_big, 0, Opcode.FM_ADD_DC, fm(0, 0, (1 * MB2, MB2), (3 * MB2, MB2)))[0] == RetCode.SUCCESS


def test_an_offer_that_would_overflow_the_dc_event_log_is_resources_exhausted(fw_big: Firmware) -> None:
    """cxlemu's own rule: the record that closes a More chain must fit the 64-record log."""
    assert on(fw_big, 0, Opcode.FM_ADD_DC, fm(0, 0, *[(2 * i * MB2, MB2) for i in range(65)]))[0] == \
        RetCode.RESOURCES_EXHAUSTED
    assert fw_big.dcd.ports[0].pending == [] and fw_big.ports[0].events.count(EventLog.DYNAMIC_CAPACITY) == 0
    assert on(fw_big, 0, Opcode.FM_ADD_DC, fm(0, 0, *[(2 * i * MB2, MB2) for i in range(64)]))[0] == RetCode.SUCCESS
    assert fw_big.ports[0].events.count(EventLog.DYNAMIC_CAPACITY) == 64


def test_accepting_past_the_limit_is_resources_exhausted_before_the_list_is_checked(fw_big: Firmware) -> None:
    _hold(fw_big, [0] + [3 + 2 * i for i in range(509)], first_len=3 * MB2)  # 510; the first: blocks 0-2
    assert on(fw_big, 0, Opcode.FM_ADD_DC, fm(0, 0, (1021 * MB2, MB2), (1023 * MB2, MB2)))[0] == RetCode.SUCCESS
    assert on(fw_big, 0, Opcode.RELEASE_DC, response((BASE + MB2, MB2)))[0] == RetCode.SUCCESS  # splits: 511 held
    assert len(fw_big.dcd.ports[0].accepted) == 511
    offered = response((BASE + 1021 * MB2, MB2), (BASE + 1023 * MB2, MB2))
    assert on(fw_big, 0, Opcode.ADD_DC_RESPONSE, offered)[0] == RetCode.RESOURCES_EXHAUSTED
    misaligned = response((BASE + 1021 * MB2, MB2), (BASE + 4096, MB2))
    assert on(fw_big, 0, Opcode.ADD_DC_RESPONSE, misaligned)[0] == RetCode.RESOURCES_EXHAUSTED  # QEMU's order
    assert len(fw_big.dcd.ports[0].pending) == 2 and access(fw_big, 0)[127] == 0x0A  # blocks 1017, 1019 only
    assert on(fw_big, 0, Opcode.ADD_DC_RESPONSE, response((BASE + 1023 * MB2, MB2)))[0] == RetCode.SUCCESS
    assert len(fw_big.dcd.ports[0].accepted) == 512 and access(fw_big, 0)[127] == 0x8A


def test_a_release_that_splits_past_the_limit_is_resources_exhausted(fw_big: Firmware) -> None:
    _hold(fw_big, [0] + [3 + 2 * i for i in range(511)], first_len=3 * MB2)  # 512; the first: blocks 0-2
    bits = access(fw_big, 0)
    assert on(fw_big, 0, Opcode.RELEASE_DC, response((BASE + MB2, MB2)))[0] == RetCode.RESOURCES_EXHAUSTED
    forced = fm(0, 0, (MB2, MB2), forced=True)
    assert on(fw_big, 0, Opcode.FM_RELEASE_DC, forced)[0] == RetCode.RESOURCES_EXHAUSTED
    assert access(fw_big, 0) == bits and fw_big.dcd.ports[0].accepted[0] == Extent(BASE, 3 * MB2)
    assert fw_big.ports[0].events.count(EventLog.DYNAMIC_CAPACITY) == 0  # no Forced Release logged
    # cutting an end leaves one extent: no more than before
    assert on(fw_big, 0, Opcode.RELEASE_DC, response((BASE, MB2)))[0] == RetCode.SUCCESS
    assert fw_big.dcd.ports[0].accepted[0] == Extent(BASE + MB2, 2 * MB2) and access(fw_big, 0)[0] == 0b1010_1110  # blocks 1, 2, 3, 5, 7
