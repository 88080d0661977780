"""The device's five event logs (CXL r3.1 §8.2.9.2) and the API firmware code uses to log.

    fw.events.add(EventLog.FAILURE, record)               # any 128-B record with a header
    fw.events.general_media(EventLog.FAILURE, dpa, ...)   # §8.2.9.2.1.1
    fw.events.memory_module(EventLog.INFO, ...)           # §8.2.9.2.1.3

Each log is a FIFO of at most `EVENT_LOG_SIZES[log]` records. The device stamps every record
with its handle (1, 2, ... skipping 0, which the spec reserves) and its timestamp, as QEMU's
`cxl_event_insert` does. A record that arrives while the log is full is dropped and counted:
the overflow count and the first / last overflow timestamps, which Get Event Records reports
until a Clear Event Records removes something. Bit n of the Device Status register's Event
Status field is set while log n holds records (§8.2.8.3.1).

Handlers run in the firmware runner's thread; a lock makes `add` safe from other firmware
threads too (a DMA engine reporting a poisoned-line hit).
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from emulator.regfile import RegisterFile
from emulator.spec import registers as R
from emulator.spec.layout import u24
from emulator.spec.payloads_events import (
    DRAM,
    DRAM_UUID,
    DRAM_VALID_LOCATION,
    EVENT_HEADER,
    EVENT_LOG_SIZES,
    EVENT_RECORD_SIZE,
    FIRMWARE_ERROR,
    FIRMWARE_ERROR_UUID,
    GENERAL_MEDIA,
    GENERAL_MEDIA_UUID,
    MEMORY_MODULE,
    MEMORY_MODULE_UUID,
    PHYS_ADDR_VOLATILE,
    SEVERITY_MASK,
    EventLog,
    MemoryEventType,
    TransactionType,
)
from emulator.spec.retcodes import RetCode

_HANDLE_OFFSET = EVENT_HEADER.offsets["handle"]
_TIMESTAMP_OFFSET = EVENT_HEADER.offsets["timestamp"]
_U16_MAX = 0xFFFF
_ERROR_TEXT_BYTES = FIRMWARE_ERROR.size - FIRMWARE_ERROR.offsets["text"]


@dataclass
class _Log:
    """One log: records oldest first, each with a one-line summary for observers."""

    capacity: int
    records: deque[tuple[bytes, str]] = field(default_factory=deque)
    next_handle: int = 1
    overflow_count: int = 0
    first_overflow_ns: int = 0
    last_overflow_ns: int = 0

    def reset_overflow(self) -> None:
        self.overflow_count = self.first_overflow_ns = self.last_overflow_ns = 0


@dataclass(frozen=True)
class EventBatch:
    """What Get Event Records reports for one log."""

    records: list[bytes]
    more: bool
    overflow_count: int
    first_overflow_ns: int
    last_overflow_ns: int


def header(record_uuid: bytes, severity: int, flags: int = 0) -> bytes:
    """A common header with handle and timestamp left 0 (the log fills them in)."""
    return EVENT_HEADER.pack(uuid=record_uuid, length=EVENT_RECORD_SIZE,
                             flags=u24((severity & SEVERITY_MASK) | flags))


class EventLogs:
    """The five logs of one host port of a device, mirrored into that port's Device Status
    register.

    A device of several host ports has one ``EventLogs`` per port, made ``peers`` of each other
    (``share_records``): every record the device raises goes into every port's logs, since all of
    them are device-wide facts (a media error, a health alert, a firmware error) that each head of
    a multi-headed device reports to its host, and Sanitize discards them all. Reading and
    clearing (Get / Clear Event Records) act on one port's logs: one host clearing its records
    leaves the others' to them. A one-port device has no peers: exactly one device's logs."""

    def __init__(self, regs: RegisterFile, clock: Callable[[], int],
                 sizes: Iterable[int] = EVENT_LOG_SIZES) -> None:
        self._regs = regs
        self._clock = clock
        self._logs = [_Log(size) for size in sizes]
        if len(self._logs) != len(EventLog):
            raise ValueError(f"need {len(EventLog)} log sizes, got {len(self._logs)}")
        self._lock = threading.Lock()
        self.recent: deque[tuple[int, int, str]] = deque(maxlen=16)  # (timestamp, log, summary)
        self.peers: list[EventLogs] = []  # the other ports' logs (share_records)
        self._publish_status()

    # adding records -----------------------------------------------------------------------------
    def add(self, log: int, record: bytes, summary: str = "") -> int | None:
        """Append a 128-B record to `log` (and to every peer port's); returns its handle here, or
        None if the log was full."""
        handle = self._add(log, record, summary)
        for peer in self.peers:
            peer._add(log, record, summary)
        return handle

    def add_own(self, log: int, record: bytes, summary: str = "") -> int | None:
        """Append a record to this port's log alone: a Dynamic Capacity record is addressed to
        one host (its offer, its release), not a device-wide fact."""
        return self._add(log, record, summary)

    def _add(self, log: int, record: bytes, summary: str) -> int | None:
        log = EventLog(log)
        if len(record) != EVENT_RECORD_SIZE:
            raise ValueError(f"an event record is {EVENT_RECORD_SIZE} bytes, got {len(record)}")
        now = self._clock()
        with self._lock:
            lg = self._logs[log]
            if len(lg.records) >= lg.capacity:
                if lg.overflow_count == 0:
                    lg.first_overflow_ns = now
                lg.overflow_count = min(lg.overflow_count + 1, _U16_MAX)
                lg.last_overflow_ns = now
                return None
            handle = lg.next_handle
            lg.next_handle = lg.next_handle % _U16_MAX + 1  # 1..0xFFFF: 0 is never a handle
            rec = bytearray(record)
            rec[_HANDLE_OFFSET:_HANDLE_OFFSET + 2] = handle.to_bytes(2, "little")
            rec[_TIMESTAMP_OFFSET:_TIMESTAMP_OFFSET + 8] = now.to_bytes(8, "little")
            lg.records.append((bytes(rec), summary))
            self.recent.appendleft((now, int(log), summary))
            self._publish_status()
            return handle

    def general_media(self, log: int, dpa: int, *, event_type: MemoryEventType = MemoryEventType.MEDIA_ECC_ERROR,
                      transaction: TransactionType = TransactionType.UNKNOWN, descriptor: int = 0,
                      volatile: bool = True, flags: int = 0) -> int | None:
        """Log a General Media Event Record (§8.2.9.2.1.1) about the 64-B line at `dpa`."""
        if dpa < 0 or dpa % 64:
            raise ValueError(f"general media DPA {dpa:#x} must be a non-negative multiple of 64")
        body = GENERAL_MEDIA.pack(physical_address=dpa | (PHYS_ADDR_VOLATILE if volatile else 0),
                                  descriptor=descriptor, event_type=int(event_type),
                                  transaction_type=int(transaction))
        summary = f"media {MemoryEventType(event_type).name.lower()} at {dpa:#x} " \
                  f"({TransactionType(transaction).name.lower()})"
        return self.add(log, header(GENERAL_MEDIA_UUID.bytes, int(log), flags) + body, summary)

    def dram(self, log: int, dpa: int, *, channel: int, rank: int, bank_group: int, bank: int, row: int,
             column: int, event_type: MemoryEventType = MemoryEventType.MEDIA_ECC_ERROR,
             transaction: TransactionType = TransactionType.UNKNOWN, descriptor: int = 0,
             volatile: bool = True, flags: int = 0) -> int | None:
        """Log a DRAM Event Record (§8.2.9.2.1.2): a general-media error located in the DRAM
        geometry (channel, rank, bank group, bank, row, column all marked valid)."""
        if dpa < 0 or dpa % 64:
            raise ValueError(f"DRAM event DPA {dpa:#x} must be a non-negative multiple of 64")
        body = DRAM.pack(physical_address=dpa | (PHYS_ADDR_VOLATILE if volatile else 0), descriptor=descriptor,
                         event_type=int(event_type), transaction_type=int(transaction),
                         validity_flags=DRAM_VALID_LOCATION, channel=channel, rank=rank,
                         bank_group=bank_group, bank=bank, row=u24(row), column=column)
        summary = f"dram {MemoryEventType(event_type).name.lower()} at {dpa:#x} (ch {channel} rank {rank} " \
                  f"bg {bank_group} bank {bank} row {row} col {column})"
        return self.add(log, header(DRAM_UUID.bytes, int(log), flags) + body, summary)

    def memory_module(self, log: int, device_event_type: int, *, health_status: int = 0,
                      media_status: int = 0, additional_status: int = 0, life_used: int = 0,
                      temperature: int = 0, dirty_shutdowns: int = 0, corrected_volatile_errors: int = 0,
                      corrected_persistent_errors: int = 0, flags: int = 0) -> int | None:
        """Log a Memory Module Event Record (§8.2.9.2.1.3) carrying a health snapshot."""
        body = MEMORY_MODULE.pack(
            device_event_type=device_event_type, health_status=health_status, media_status=media_status,
            additional_status=additional_status, life_used=life_used, temperature=temperature,
            dirty_shutdowns=dirty_shutdowns, corrected_volatile_errors=corrected_volatile_errors,
            corrected_persistent_errors=corrected_persistent_errors)
        summary = f"memory module event {device_event_type} (health {health_status:#x}, {temperature} C)"
        return self.add(log, header(MEMORY_MODULE_UUID.bytes, int(log), flags) + body, summary)

    def firmware_error(self, opcode: int, exc: BaseException) -> None:
        """`Firmware.error_hooks` entry: a handler that raised becomes a failure-log record."""
        text = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[:_ERROR_TEXT_BYTES]
        body = FIRMWARE_ERROR.pack(opcode=opcode & 0xFFFF, text=text)
        self.add(EventLog.FAILURE, header(FIRMWARE_ERROR_UUID.bytes, EventLog.FAILURE) + body,
                 f"firmware error in {opcode:#06x}: {type(exc).__name__}")

    # host commands ------------------------------------------------------------------------------
    def get(self, log: int, max_records: int) -> EventBatch:
        """Get Event Records (§8.2.9.2.2): the oldest records, without removing them."""
        with self._lock:
            lg = self._logs[EventLog(log)]
            records = [rec for rec, _ in list(lg.records)[:max_records]]
            return EventBatch(records, len(lg.records) > len(records), lg.overflow_count,
                              lg.first_overflow_ns, lg.last_overflow_ns)

    def clear(self, log: int, handles: list[int]) -> RetCode:
        """Clear Event Records by handle (§8.2.9.2.3).

        The spec: the handles must be the oldest records, in temporal order; if one would leave an
        older record behind the device returns Invalid Handle and clears nothing. A handle past the
        end of the log names no record and is invalid too (Linux's mock refuses clearing more than
        it returned). Removing any record ends the overflow condition (QEMU, Linux's mock)."""
        with self._lock:
            lg = self._logs[EventLog(log)]
            if len(handles) > len(lg.records):
                return RetCode.INVALID_HANDLE
            for want, (rec, _) in zip(handles, lg.records):
                if want == 0 or int.from_bytes(rec[_HANDLE_OFFSET:_HANDLE_OFFSET + 2], "little") != want:
                    return RetCode.INVALID_HANDLE
            for _ in handles:
                lg.records.popleft()
            if handles:
                lg.reset_overflow()
            self._publish_status()
            return RetCode.SUCCESS

    def clear_all(self, log: int) -> RetCode:
        """Clear Event Records with Clear All: allowed only while the log has overflowed (§8.2.9.2.3)."""
        with self._lock:
            lg = self._logs[EventLog(log)]
            if lg.overflow_count == 0:
                return RetCode.INVALID_INPUT
            lg.records.clear()
            lg.reset_overflow()
            self._publish_status()
            return RetCode.SUCCESS

    def discard_all(self) -> None:
        """Drop every record and overflow state, here and in every peer port's logs (Sanitize,
        §8.2.9.9.5.1; QEMU discards them too)."""
        for logs in (self, *self.peers):
            logs._discard()

    def _discard(self) -> None:
        with self._lock:
            for lg in self._logs:
                lg.records.clear()
                lg.reset_overflow()
            self.recent.clear()
            self._publish_status()

    # observers ----------------------------------------------------------------------------------
    def count(self, log: int) -> int:
        return len(self._logs[EventLog(log)].records)

    def counts(self) -> tuple[int, ...]:
        """Records per log, in log order (the telemetry page's events_* fields)."""
        return tuple(len(lg.records) for lg in self._logs)

    def _publish_status(self) -> None:
        status = sum(1 << i for i, lg in enumerate(self._logs) if lg.records)
        self._regs.set_field(R.DEVICE_STATUS, "EVENT_STATUS", status)



def share_records(ports: list[EventLogs]) -> None:
    """Make the logs of a device's host ports peers: a record added to one is added to all."""
    for logs in ports:
        logs.peers = [other for other in ports if other is not logs]
