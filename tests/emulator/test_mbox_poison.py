"""Poison list, inject and clear: payloads decoded by hand at the spec's offsets, the list limit,
the overflow flag, splitting a record on clear, and the bitmap hosts' reads check."""
from __future__ import annotations

import struct
from typing import Any

import pytest

from driver import MailboxError, PoisonError
from emulator.firmware import Firmware
from emulator.mailbox import dispatch
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_events import DESCRIPTOR_POISON_LIST_OVERFLOW, EventLog
from emulator.spec.payloads_poison import PoisonSource
from emulator.spec.retcodes import RetCode

CAPACITY = 256 << 20
LINES = CAPACITY // 64
INJECTED, INTERNAL = PoisonSource.INJECTED, PoisonSource.INTERNAL




def inject(fw: Firmware, dpa: int) -> RetCode:
    return dispatch(fw, Opcode.INJECT_POISON, struct.pack("<Q", dpa))[0]


def clear(fw: Firmware, dpa: int, data: bytes = bytes(64)) -> RetCode:
    return dispatch(fw, Opcode.CLEAR_POISON, struct.pack("<Q", dpa) + data)[0]


def poison_list(fw: Firmware, dpa: int = 0, lines: int = LINES) -> tuple[int, int, list[tuple[int, int, int]]]:
    """(flags, overflow timestamp, [(dpa, length in lines, source)]) decoded at the spec's offsets."""
    rc, out = dispatch(fw, Opcode.GET_POISON_LIST, struct.pack("<QQ", dpa, lines))
    assert rc == RetCode.SUCCESS
    count = struct.unpack_from("<H", out, 0x0A)[0]
    assert len(out) == 0x20 + 16 * count
    recs = []
    for i in range(count):
        addr, length = struct.unpack_from("<QI", out, 0x20 + 16 * i)
        recs.append((addr & ~7, length, addr & 7))
    return out[0], struct.unpack_from("<Q", out, 0x02)[0], recs


def bit(fw: Firmware, dpa: int) -> int:
    line = dpa // 64
    return int(fw.poison_bits[line >> 3]) >> (line & 7) & 1


def test_inject_lists_the_line_with_source_injected(fw: Firmware) -> None:
    assert inject(fw, 0x1000) == RetCode.SUCCESS
    assert inject(fw, 0x40) == RetCode.SUCCESS
    assert poison_list(fw) == (0, 0, [(0x40, 1, INJECTED), (0x1000, 1, INJECTED)])
    assert bit(fw, 0x1000) == 1 and int(fw.poison_bits[0x1000 // 512]) == 1 << ((0x1000 // 64) & 7)
    assert bit(fw, 0x1040) == 0


def test_inject_is_idempotent(fw: Firmware) -> None:
    for _ in range(3):
        assert inject(fw, 0x2000) == RetCode.SUCCESS
    assert poison_list(fw)[2] == [(0x2000, 1, INJECTED)]


def test_inject_and_clear_check_the_address(fw: Firmware) -> None:
    assert inject(fw, 0x1001) == RetCode.INVALID_INPUT
    assert inject(fw, CAPACITY) == RetCode.INVALID_PHYSICAL_ADDRESS
    assert inject(fw, CAPACITY - 64) == RetCode.SUCCESS  # the last line is inside
    assert clear(fw, 0x20) == RetCode.INVALID_INPUT
    assert clear(fw, CAPACITY) == RetCode.INVALID_PHYSICAL_ADDRESS
    assert dispatch(fw, Opcode.GET_POISON_LIST, struct.pack("<QQ", 0x10, 1)) == (RetCode.INVALID_INPUT, b"")
    assert dispatch(fw, Opcode.GET_POISON_LIST, struct.pack("<QQ", 0, LINES + 1))[0] == \
        RetCode.INVALID_PHYSICAL_ADDRESS


def test_clear_writes_the_data_and_unpoisons(fw: Firmware) -> None:
    inject(fw, 0x3000)
    data = bytes(range(64))
    assert clear(fw, 0x3000, data) == RetCode.SUCCESS
    assert poison_list(fw)[2] == [] and bit(fw, 0x3000) == 0
    assert bytes(fw.media[0x3000:0x3040]) == data
    assert clear(fw, 0x5000, b"\x5a" * 64) == RetCode.SUCCESS  # a clean line: just written
    assert bytes(fw.media[0x5000:0x5040]) == b"\x5a" * 64


def test_clear_splits_a_longer_record(fw: Firmware) -> None:
    fw.poison.add(0x2000, 4 * 64, transaction=None)  # one internal record of 4 lines
    assert poison_list(fw)[2] == [(0x2000, 4, INTERNAL)]
    assert clear(fw, 0x2080) == RetCode.SUCCESS  # the third line
    assert poison_list(fw)[2] == [(0x2000, 2, INTERNAL), (0x20C0, 1, INTERNAL)]
    assert [bit(fw, 0x2000 + 64 * i) for i in range(4)] == [1, 1, 0, 1]
    assert clear(fw, 0x2000) == RetCode.SUCCESS  # the head: the record shrinks from the front
    assert poison_list(fw)[2] == [(0x2040, 1, INTERNAL), (0x20C0, 1, INTERNAL)]


def test_get_clips_records_to_the_query(fw: Firmware) -> None:
    fw.poison.add(0x4000, 8 * 64, transaction=None)
    inject(fw, 0x8000)
    assert poison_list(fw, 0x4080, 2)[2] == [(0x4080, 2, INTERNAL)]
    assert poison_list(fw, 0x4100, 0x4000 // 64)[2] == [(0x4100, 4, INTERNAL), (0x8000, 1, INJECTED)]
    assert poison_list(fw, 0x8040, 10)[2] == []


def test_list_limit_refuses_inject_and_more_flag_pages_the_list(fw: Firmware) -> None:
    dpas = [i * 0x1000 for i in range(256)]
    for dpa in dpas:
        assert inject(fw, dpa) == RetCode.SUCCESS
    assert inject(fw, 0x100_0000) == RetCode.INJECT_POISON_LIMIT_REACHED
    assert inject(fw, dpas[7]) == RetCode.SUCCESS  # already listed: still idempotent
    pages = [poison_list(fw) for _ in range(3)]
    assert [(flags, len(recs)) for flags, _, recs in pages] == [(0x1, 126), (0x1, 126), (0x0, 4)]
    assert [r[0] for _, _, recs in pages for r in recs] == dpas  # in DPA order, each once
    assert len(poison_list(fw)[2]) == 126  # a finished walk starts over


def test_full_list_overflows_with_timestamp_and_the_line_stays_poisoned(fw: Firmware) -> None:
    for i in range(256):
        inject(fw, i * 64)
    fw.set_timestamp(10**18)
    assert fw.poison.add(0x10_0000, 64) is False  # found internally, but no room
    flags, ts, recs = poison_list(fw, 0x10_0000, 1)
    assert flags == 0x2 and 10**18 <= ts < 10**18 + 10**9 and recs == []
    assert bit(fw, 0x10_0000) == 1  # still fails host reads
    event = dispatch(fw, Opcode.GET_EVENT_RECORDS, bytes([EventLog.FAILURE]))[1][0x20:]
    assert struct.unpack_from("<Q", event, 0x30)[0] & ~0x3F == 0x10_0000
    assert event[0x38] & DESCRIPTOR_POISON_LIST_OVERFLOW


def test_splitting_a_record_in_a_full_list_overflows(fw: Firmware) -> None:
    fw.poison.add(0x20_0000, 3 * 64, transaction=None)
    for i in range(255):
        inject(fw, i * 64)
    assert clear(fw, 0x20_0040) == RetCode.SUCCESS  # head fragment takes the slot, tail cannot
    flags, _, recs = poison_list(fw, 0x20_0000, 3)
    assert flags & 0x2 and recs == [(0x20_0000, 1, INTERNAL)]
    assert bit(fw, 0x20_0080) == 1  # the tail line is bad though unlisted


def test_report_hit_logs_an_event_and_lists_a_latent_line(fw: Firmware) -> None:
    fw.poison.add_latent(0x7000, 64)
    assert poison_list(fw)[2] == []
    fw.poison.report_hit(0x7010)
    assert poison_list(fw)[2] == [(0x7000, 1, INTERNAL)]
    fw.poison.report_hit(0x7000, write=True)  # listed already: one more event, no new record
    out = dispatch(fw, Opcode.GET_EVENT_RECORDS, bytes([EventLog.FAILURE]))[1]
    assert struct.unpack_from("<H", out, 0x14)[0] == 2
    assert [out[0x20 + i * 0x80 + 0x3A] for i in range(2)] == [1, 2]  # host read, host write


def test_host_read_of_a_poisoned_line_fails_and_returns_nothing(memdev: Any) -> None:
    md = memdev
    md.write(0x1000, b"\x11" * 256)
    md.inject_poison(0x1040)
    with pytest.raises(PoisonError) as err:
        md.read(0x1000, 256)
    assert err.value.dpa == 0x1040
    assert md.read(0x1000, 64) == b"\x11" * 64  # the clean line before it still reads
    plist = md.get_poison_list()
    assert [(r.dpa, r.length, r.source) for r in plist.records] == [(0x1040, 64, "injected")]
    md.clear_poison(0x1040, b"\x22" * 64)
    assert md.read(0x1000, 256) == b"\x11" * 64 + b"\x22" * 64 + b"\x11" * 128
    assert md.get_poison_list().records == []


def test_driver_validates_before_sending_and_raises_device_errors(memdev: Any) -> None:
    md = memdev
    with pytest.raises(ValueError, match="multiple of 64"):
        md.inject_poison(0x1001)
    with pytest.raises(ValueError, match="exactly 64 bytes"):
        md.clear_poison(0, b"short")
    for i in range(256):
        md.inject_poison(i * 64)
    with pytest.raises(MailboxError) as err:
        md.inject_poison(0x10_0000)
    assert err.value.retcode == RetCode.INJECT_POISON_LIMIT_REACHED
    assert len(md.get_poison_list().records) == 256
