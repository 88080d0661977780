"""Event logs: records and payloads decoded by hand at the spec's offsets, overflow accounting,
clear-handle ordering (as Linux's cxl_test mock checks), and the Device Status event bits."""
from __future__ import annotations

import struct
import uuid
from typing import Any

import pytest

from emulator.events import EventLogs
from emulator.firmware import Firmware
from emulator.mailbox import dispatch
from emulator.regfile import RegisterFile
from emulator.spec import registers as R
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_events import (
    DESCRIPTOR_UNCORRECTABLE,
    EVENT_LOG_SIZES,
    FLAG_MAINTENANCE_NEEDED,
    EventLog,
    MemoryEventType,
    TransactionType,
)
from emulator.spec.retcodes import RetCode
from firmware_model.clock import ManualClock

GENERAL_MEDIA = uuid.UUID("fbcd0a77-c260-417f-85a9-088b1621eba6").bytes
MEMORY_MODULE = uuid.UUID("fe927475-dd59-4339-a586-79bab113b774").bytes
FAIL = EventLog.FAILURE




@pytest.fixture
def clock() -> ManualClock:
    """A clock the test sets: exact timestamps in records and overflow fields."""
    return ManualClock(1_000)


@pytest.fixture
def logs(clock: ManualClock) -> EventLogs:
    return EventLogs(RegisterFile(bytearray(R.BAR_SIZE)), clock.now_ns)


def clear_payload(log: int, handles: list[int], flags: int = 0) -> bytes:
    return struct.pack("<BBB3x", log, flags, len(handles)) + struct.pack(f"<{len(handles)}H", *handles)


def handles_of(out: bytes) -> list[int]:
    count = struct.unpack_from("<H", out, 0x14)[0]
    return [struct.unpack_from("<H", out, 0x20 + i * 0x80 + 0x14)[0] for i in range(count)]


def test_general_media_record_at_spec_offsets(fw: Firmware) -> None:
    """Get Event Records header and a General Media record (§8.2.9.2.1.1), decoded by hand."""
    fw.set_timestamp(5_000_000_000)
    handle = fw.events.general_media(FAIL, 0x12340, transaction=TransactionType.HOST_READ,
                                     descriptor=DESCRIPTOR_UNCORRECTABLE, flags=FLAG_MAINTENANCE_NEEDED)
    rc, out = dispatch(fw, Opcode.GET_EVENT_RECORDS, bytes([FAIL]))
    assert rc == RetCode.SUCCESS and len(out) == 0x20 + 0x80
    assert out[0x00] == 0                                        # flags: no overflow, no more
    assert struct.unpack_from("<HQQH", out, 0x02) == (0, 0, 0, 1)  # overflow count/ts, record count
    rec = out[0x20:]
    assert rec[0x00:0x10] == GENERAL_MEDIA
    assert rec[0x10] == 0x80                                     # length
    assert int.from_bytes(rec[0x11:0x14], "little") == 2 | FLAG_MAINTENANCE_NEEDED  # severity failure
    assert struct.unpack_from("<HH", rec, 0x14) == (handle, 0) == (1, 0)
    assert 5_000_000_000 <= struct.unpack_from("<Q", rec, 0x18)[0] < 6_000_000_000
    assert struct.unpack_from("<Q", rec, 0x30)[0] == 0x12340 | 1  # DPA, bit 0 volatile
    assert (rec[0x38], rec[0x39], rec[0x3A]) == (DESCRIPTOR_UNCORRECTABLE, MemoryEventType.MEDIA_ECC_ERROR,
                                                 TransactionType.HOST_READ)


def test_memory_module_record_at_spec_offsets(fw: Firmware) -> None:
    fw.events.memory_module(EventLog.INFO, 3, health_status=0x1, media_status=0, additional_status=0x4,
                            life_used=42, temperature=-7, dirty_shutdowns=9, corrected_volatile_errors=11,
                            corrected_persistent_errors=13)
    rec = dispatch(fw, Opcode.GET_EVENT_RECORDS, bytes([EventLog.INFO]))[1][0x20:]
    assert rec[0x00:0x10] == MEMORY_MODULE and int.from_bytes(rec[0x11:0x14], "little") == 0
    assert (rec[0x30], rec[0x31], rec[0x32], rec[0x33], rec[0x34]) == (3, 0x1, 0, 0x4, 42)
    assert struct.unpack_from("<hIII", rec, 0x35) == (-7, 9, 11, 13)


def test_dram_record_at_spec_offsets(fw: Firmware) -> None:
    fw.events.dram(EventLog.WARNING, 0x8000, channel=3, rank=1, bank_group=2, bank=5, row=0x12345, column=0x3FF,
                   transaction=TransactionType.HOST_WRITE, descriptor=DESCRIPTOR_UNCORRECTABLE)
    rec = dispatch(fw, Opcode.GET_EVENT_RECORDS, bytes([EventLog.WARNING]))[1][0x20:]
    assert rec[0x00:0x10] == uuid.UUID("601dcbb3-9c06-4eab-b8af-4e9bfb5c9624").bytes
    assert int.from_bytes(rec[0x11:0x14], "little") == 1  # severity warning
    assert struct.unpack_from("<Q", rec, 0x30)[0] == 0x8000 | 1
    assert (rec[0x38], rec[0x39], rec[0x3A]) == (DESCRIPTOR_UNCORRECTABLE, 0, TransactionType.HOST_WRITE)
    assert struct.unpack_from("<H", rec, 0x3B)[0] == 0b0111_1011  # channel rank bank-group bank row column
    assert (rec[0x3D], rec[0x3E], rec[0x42], rec[0x43]) == (3, 1, 2, 5)
    assert int.from_bytes(rec[0x44:0x47], "little") == 0x12345
    assert struct.unpack_from("<H", rec, 0x47)[0] == 0x3FF


def test_get_returns_as_many_as_fit_and_flags_more(fw: Firmware) -> None:
    for i in range(20):
        fw.events.general_media(EventLog.WARNING, i * 64)
    out = dispatch(fw, Opcode.GET_EVENT_RECORDS, bytes([EventLog.WARNING]))[1]
    assert len(out) == 0x20 + 15 * 0x80 and out[0] == 0x2  # (2048 - 32) // 128 records, "more"
    assert handles_of(out) == list(range(1, 16))
    assert dispatch(fw, Opcode.GET_EVENT_RECORDS, bytes([EventLog.WARNING]))[1] == out  # get removes nothing
    assert dispatch(fw, Opcode.CLEAR_EVENT_RECORDS, clear_payload(EventLog.WARNING, list(range(1, 16))))[0] == 0
    out = dispatch(fw, Opcode.GET_EVENT_RECORDS, bytes([EventLog.WARNING]))[1]
    assert out[0] == 0 and handles_of(out) == [16, 17, 18, 19, 20]


def test_clear_must_name_the_oldest_records_in_order(fw: Firmware) -> None:
    for i in range(4):
        fw.events.general_media(FAIL, i * 64)
    for bad in ([2], [1, 3], [2, 1], [0], [1, 2, 3, 4, 5]):
        assert dispatch(fw, Opcode.CLEAR_EVENT_RECORDS, clear_payload(FAIL, bad)) == (RetCode.INVALID_HANDLE, b"")
    assert fw.events.count(FAIL) == 4  # a refused clear removes nothing
    assert dispatch(fw, Opcode.CLEAR_EVENT_RECORDS, clear_payload(FAIL, [1, 2])) == (RetCode.SUCCESS, b"")
    assert handles_of(dispatch(fw, Opcode.GET_EVENT_RECORDS, bytes([FAIL]))[1]) == [3, 4]


def test_clear_payload_length_and_log_are_checked(fw: Firmware) -> None:
    fw.events.general_media(FAIL, 0)
    short = clear_payload(FAIL, [1, 2])[:-2]  # says 2 handles, carries 1
    assert dispatch(fw, Opcode.CLEAR_EVENT_RECORDS, short) == (RetCode.INVALID_PAYLOAD_LENGTH, b"")
    assert dispatch(fw, Opcode.CLEAR_EVENT_RECORDS, b"\x02\x00") == (RetCode.INVALID_PAYLOAD_LENGTH, b"")
    assert dispatch(fw, Opcode.CLEAR_EVENT_RECORDS, clear_payload(5, [1])) == (RetCode.INVALID_INPUT, b"")
    assert dispatch(fw, Opcode.GET_EVENT_RECORDS, b"\x05") == (RetCode.INVALID_INPUT, b"")
    assert dispatch(fw, Opcode.GET_EVENT_RECORDS, b"") == (RetCode.INVALID_PAYLOAD_LENGTH, b"")


def test_overflow_counts_dropped_records_with_first_and_last_time(logs: EventLogs, clock: ManualClock) -> None:
    size = EVENT_LOG_SIZES[FAIL]
    handles = [logs.general_media(FAIL, i * 64) for i in range(size)]
    assert handles == list(range(1, size + 1))
    for t in (7_000, 8_000, 9_000):
        clock.set(t)
        assert logs.general_media(FAIL, 0) is None  # dropped
    batch = logs.get(FAIL, 15)
    assert (batch.overflow_count, batch.first_overflow_ns, batch.last_overflow_ns) == (3, 7_000, 9_000)
    assert logs.count(FAIL) == size
    assert logs.clear(FAIL, [1]) == RetCode.SUCCESS  # removing a record ends the overflow
    batch = logs.get(FAIL, 15)
    assert (batch.overflow_count, batch.first_overflow_ns, batch.last_overflow_ns) == (0, 0, 0)


def test_overflow_reported_by_get_event_records(fw: Firmware) -> None:
    for i in range(EVENT_LOG_SIZES[EventLog.FATAL] + 2):
        fw.events.general_media(EventLog.FATAL, i * 64)
    out = dispatch(fw, Opcode.GET_EVENT_RECORDS, bytes([EventLog.FATAL]))[1]
    assert out[0] == 0x3  # overflow | more
    assert struct.unpack_from("<H", out, 0x02)[0] == 2


def test_clear_all_only_after_overflow(logs: EventLogs) -> None:
    logs.general_media(FAIL, 0)
    assert logs.clear_all(FAIL) == RetCode.INVALID_INPUT
    for i in range(EVENT_LOG_SIZES[FAIL]):
        logs.general_media(FAIL, i * 64)
    assert logs.clear_all(FAIL) == RetCode.SUCCESS
    assert logs.count(FAIL) == 0 and logs.get(FAIL, 15).overflow_count == 0


def test_clear_all_with_handles_is_invalid(fw: Firmware) -> None:
    for i in range(EVENT_LOG_SIZES[FAIL] + 1):
        fw.events.general_media(FAIL, i * 64)
    assert dispatch(fw, Opcode.CLEAR_EVENT_RECORDS, clear_payload(FAIL, [1], flags=1))[0] == RetCode.INVALID_INPUT
    assert dispatch(fw, Opcode.CLEAR_EVENT_RECORDS, clear_payload(FAIL, [], flags=1))[0] == RetCode.SUCCESS
    assert fw.events.count(FAIL) == 0


def test_device_status_has_a_bit_per_nonempty_log(fw: Firmware) -> None:
    assert fw.regs.get_field(R.DEVICE_STATUS, "EVENT_STATUS") == 0
    fw.events.general_media(EventLog.WARNING, 0)
    fw.events.general_media(EventLog.DYNAMIC_CAPACITY, 0)
    assert fw.regs.get_field(R.DEVICE_STATUS, "EVENT_STATUS") == 0b10010
    dispatch(fw, Opcode.CLEAR_EVENT_RECORDS, clear_payload(EventLog.WARNING, [1]))
    assert fw.regs.get_field(R.DEVICE_STATUS, "EVENT_STATUS") == 0b10000
    fw.events.discard_all()
    assert fw.regs.get_field(R.DEVICE_STATUS, "EVENT_STATUS") == 0


def test_handler_exception_becomes_a_failure_event(fw: Firmware, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(dpa: int) -> RetCode:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(fw.poison, "inject", broken)  # fault injection into a real handler's path
    assert dispatch(fw, Opcode.INJECT_POISON, struct.pack("<Q", 0)) == (RetCode.INTERNAL_ERROR, b"")
    rec = dispatch(fw, Opcode.GET_EVENT_RECORDS, bytes([FAIL]))[1][0x20:]
    assert rec[0x00:0x10] == uuid.uuid5(uuid.NAMESPACE_URL, "https://cxlemu/events/firmware-error").bytes
    assert struct.unpack_from("<H", rec, 0x30)[0] == Opcode.INJECT_POISON
    assert rec[0x32:0x80].rstrip(b"\0") == b"RuntimeError: injected fault"


def test_add_rejects_a_record_of_the_wrong_size(logs: EventLogs) -> None:
    with pytest.raises(ValueError, match="128 bytes"):
        logs.add(FAIL, bytes(100))
    with pytest.raises(ValueError):
        logs.add(9, bytes(128))


def test_driver_decodes_and_drains(served: Any, memdev: Any) -> None:
    """End to end on a served device: the typed wrappers read, decode and clear like Linux."""
    md = memdev
    for i in range(20):
        served.firmware.events.general_media(FAIL, i * 64, transaction=TransactionType.HOST_WRITE)
    batch = md.get_event_records("failure")
    assert len(batch.records) == 15 and batch.more and not batch.overflow
    first = batch.records[0]
    assert (first.kind, first.handle, first.severity) == ("general_media", 1, 2)
    assert first.fields["physical_address"] == 1 and first.fields["transaction_type"] == 2
    records, batches = md.drain_events("failure")
    assert [r.handle for r in records] == list(range(1, 21))
    assert [len(b.records) for b in batches] == [15, 5, 0]
    assert md.get_event_records(2).records == []
    with pytest.raises(ValueError, match="unknown event log"):
        md.get_event_records("errors")
