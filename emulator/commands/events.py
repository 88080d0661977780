"""Event commands: Get Event Records and Clear Event Records (CXL r3.1 §8.2.9.2.2-3).

The logs themselves live in `emulator.events.EventLogs` (`fw.events`, built by the firmware,
which also hooks them to `fw.error_hooks` so a handler that raised leaves a failure-log record);
this module decodes the two commands' payloads. Get / Set Event Interrupt Policy belong to
another group.
"""
from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from emulator.mailbox import Effect, command
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_events import (
    CLEAR_EVENT_RECORDS,
    CLEAR_EVENTS_FLAG_CLEAR_ALL,
    GET_EVENT_RECORDS_IN,
    GET_EVENT_RECORDS_OUT,
    GET_EVENTS_FLAG_MORE,
    GET_EVENTS_FLAG_OVERFLOW,
    MAX_RECORDS_PER_GET,
    EventLog,
)
from emulator.spec.retcodes import RetCode

if TYPE_CHECKING:
    from emulator.firmware import Firmware


def _log_type(value: int) -> EventLog | None:
    try:
        return EventLog(value)
    except ValueError:
        return None


@command(Opcode.GET_EVENT_RECORDS, "Get Event Records", in_len=GET_EVENT_RECORDS_IN.size, needs_media=True)
def get_event_records(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    log = _log_type(GET_EVENT_RECORDS_IN.unpack(payload)["log"])
    if log is None:
        return RetCode.INVALID_INPUT, b""  # QEMU cxl_event_get_records
    batch = fw.events.get(log, MAX_RECORDS_PER_GET)
    flags = (GET_EVENTS_FLAG_MORE if batch.more else 0) | \
            (GET_EVENTS_FLAG_OVERFLOW if batch.overflow_count else 0)
    head = GET_EVENT_RECORDS_OUT.pack(flags=flags, overflow_count=batch.overflow_count,
                                      first_overflow_ts=batch.first_overflow_ns,
                                      last_overflow_ts=batch.last_overflow_ns,
                                      record_count=len(batch.records))
    return RetCode.SUCCESS, head + b"".join(batch.records)


@command(Opcode.CLEAR_EVENT_RECORDS, "Clear Event Records", in_len=None, min_len=CLEAR_EVENT_RECORDS.size,
         effects=Effect.IMMEDIATE_LOG_CHANGE)
def clear_event_records(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    head = CLEAR_EVENT_RECORDS.unpack(payload)
    count = head["handle_count"]
    if len(payload) != CLEAR_EVENT_RECORDS.size + 2 * count:
        return RetCode.INVALID_PAYLOAD_LENGTH, b""
    log = _log_type(head["log"])
    if log is None:
        return RetCode.INVALID_INPUT, b""
    if head["flags"] & CLEAR_EVENTS_FLAG_CLEAR_ALL:
        if count:  # §8.2.9.2.3: the handle count shall be 0 with Clear All Events
            return RetCode.INVALID_INPUT, b""
        return fw.events.clear_all(log), b""
    handles = list(struct.unpack_from(f"<{count}H", payload, CLEAR_EVENT_RECORDS.size))
    return fw.events.clear(log, handles), b""
