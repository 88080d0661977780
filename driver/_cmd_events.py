"""Typed wrappers of the event commands (CXL r3.1 §8.2.9.2): read, decode and clear event logs.

    batch = md.get_event_records("failure")       # oldest records first, not removed
    md.clear_event_records("failure", [r.handle for r in batch.records])
    drained = md.drain_events("failure")          # get + clear until empty (Linux's way)
"""
from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass, field
from typing import Any

from driver._cmd_base import CommandMixin
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_events import (
    CLEAR_EVENT_RECORDS,
    CLEAR_EVENTS_FLAG_CLEAR_ALL,
    EVENT_HEADER,
    EVENT_HEADER_SIZE,
    EVENT_LOG_NAMES,
    EVENT_RECORD_SIZE,
    GET_EVENT_RECORDS_IN,
    GET_EVENT_RECORDS_OUT,
    GET_EVENTS_FLAG_MORE,
    GET_EVENTS_FLAG_OVERFLOW,
    RECORD_LAYOUTS,
    SEVERITY_MASK,
    EventLog,
)

MAX_HANDLES_PER_CLEAR = 0xFF  # the handle count is one byte


@dataclass(frozen=True)
class EventRecord:
    """One decoded 128-B event record; `fields` holds the type-specific data by spec name."""

    log: str
    kind: str                   # general_media, dram, memory_module, firmware_error, or "unknown"
    uuid: str
    handle: int
    related_handle: int
    timestamp: int
    severity: int
    flags: int
    maint_op_class: int
    fields: dict[str, Any]
    raw: bytes = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"log": self.log, "kind": self.kind, "uuid": self.uuid, "handle": self.handle,
                "related_handle": self.related_handle, "timestamp": self.timestamp,
                "severity": self.severity, "flags": self.flags, "maint_op_class": self.maint_op_class,
                **self.fields}


@dataclass(frozen=True)
class EventBatch:
    """One Get Event Records answer."""

    log: str
    records: list[EventRecord]
    more: bool
    overflow: bool
    overflow_count: int
    first_overflow_ts: int
    last_overflow_ts: int


def log_id(log: str | int) -> int:
    """'failure' or 2 -> 2; a ValueError names the valid logs."""
    if isinstance(log, str):
        if log not in EVENT_LOG_NAMES:
            raise ValueError(f"unknown event log {log!r}: use one of {', '.join(EVENT_LOG_NAMES)}")
        return EVENT_LOG_NAMES.index(log)
    if log not in set(EventLog):
        raise ValueError(f"event log {log} is outside 0-{len(EventLog) - 1}")
    return int(log)


_U24_FIELDS = frozenset({"device", "nibble_mask", "row"})
_TEXT_FIELDS = frozenset({"text"})


def _plain(name: str, value: Any) -> Any:
    """A field as JSON would want it: u24 fields as ints, text decoded, other bytes as hex."""
    if not isinstance(value, bytes):
        return value
    if name in _U24_FIELDS:
        return int.from_bytes(value, "little")
    if name in _TEXT_FIELDS:
        return value.rstrip(b"\0").decode("utf-8", "replace")
    return value.hex()


def decode_record(log: str, raw: bytes) -> EventRecord:
    """Split a record into its common header and its type's fields (unknown types: raw hex)."""
    h = EVENT_HEADER.unpack(raw)
    rec_uuid = uuid.UUID(bytes=h["uuid"])
    kind, layout = RECORD_LAYOUTS.get(rec_uuid, ("unknown", None))
    data = raw[EVENT_HEADER_SIZE:]
    if layout is None:
        fields: dict[str, Any] = {"data": data.hex()}
    else:
        fields = {k: _plain(k, v) for k, v in layout.unpack(data).items() if not k.startswith("rsvd")}
    flags = int.from_bytes(h["flags"], "little")
    return EventRecord(log, kind, str(rec_uuid), h["handle"], h["related_handle"], h["timestamp"],
                       flags & SEVERITY_MASK, flags, h["maint_op_class"], fields, bytes(raw))


class EventCommands(CommandMixin):
    """Mixin: needs `call(opcode, payload) -> bytes` (MailboxClient)."""


    def get_event_records(self, log: str | int) -> EventBatch:
        """Get Event Records: the oldest records of one log (as many as fit), not removed."""
        lid = log_id(log)
        out = self.call(Opcode.GET_EVENT_RECORDS, GET_EVENT_RECORDS_IN.pack(log=lid))
        h = GET_EVENT_RECORDS_OUT.unpack(out)
        name = EVENT_LOG_NAMES[lid]
        base = GET_EVENT_RECORDS_OUT.size
        records = [decode_record(name, out[base + i * EVENT_RECORD_SIZE: base + (i + 1) * EVENT_RECORD_SIZE])
                   for i in range(h["record_count"])]
        return EventBatch(name, records, bool(h["flags"] & GET_EVENTS_FLAG_MORE),
                          bool(h["flags"] & GET_EVENTS_FLAG_OVERFLOW), h["overflow_count"],
                          h["first_overflow_ts"], h["last_overflow_ts"])

    def clear_event_records(self, log: str | int, handles: list[int]) -> None:
        """Clear Event Records by handle: they must be the log's oldest, in order."""
        if len(handles) > MAX_HANDLES_PER_CLEAR:
            raise ValueError(f"at most {MAX_HANDLES_PER_CLEAR} handles per Clear Event Records, got {len(handles)}")
        if any(not 0 < h <= 0xFFFF for h in handles):
            raise ValueError(f"event record handles are 1-65535, got {handles}")
        head = CLEAR_EVENT_RECORDS.pack(log=log_id(log), handle_count=len(handles))
        self.call(Opcode.CLEAR_EVENT_RECORDS, head + struct.pack(f"<{len(handles)}H", *handles))

    def clear_all_event_records(self, log: str | int) -> None:
        """Clear Event Records with Clear All (the device allows it only after an overflow)."""
        self.call(Opcode.CLEAR_EVENT_RECORDS,
                  CLEAR_EVENT_RECORDS.pack(log=log_id(log), flags=CLEAR_EVENTS_FLAG_CLEAR_ALL))

    def drain_events(self, log: str | int) -> tuple[list[EventRecord], list[EventBatch]]:
        """Read and clear a log until it is empty, as Linux's cxl_mem_get_records_log does.
        Returns the records and the batches (whose overflow fields say what was lost)."""
        records: list[EventRecord] = []
        batches: list[EventBatch] = []
        while True:
            batch = self.get_event_records(log)
            batches.append(batch)
            if not batch.records:
                return records, batches
            records += batch.records
            self.clear_event_records(log, [r.handle for r in batch.records])
