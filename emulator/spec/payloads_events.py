"""Event records and the Get / Clear Event Records payloads (CXL r3.1 §8.2.9.2).

An event record is 128 bytes: a 0x30-byte common header, then 0x50 bytes whose meaning the
header's UUID names (general media, DRAM, memory module, or a vendor's own record)::

    0x00 UUID[16]  0x10 length u8 (=0x80)  0x11 flags u24 ([1:0] severity)  0x14 handle u16
    0x16 related handle u16  0x18 timestamp u64  0x20 maintenance op class u8  0x21 rsvd[15]
    0x30 record-specific data[0x50]

Every layout here is a `Layout` checked against the spec's size at import; the offsets in the
comments are the spec's (Table 8-42 ... 8-56).
"""
from __future__ import annotations

import uuid
from enum import IntEnum

from emulator.spec.layout import Layout
from emulator.spec.payloads_dcd import DC_EVENT, DC_EVENT_UUID
from emulator.spec.registers import MAILBOX_PAYLOAD_SIZE


class EventLog(IntEnum):
    """Event log types, §8.2.9.2.2 Table 8-51 (the Get Event Records input byte)."""

    INFO = 0
    WARNING = 1
    FAILURE = 2
    FATAL = 3
    DYNAMIC_CAPACITY = 4


EVENT_LOG_NAMES = ("info", "warning", "failure", "fatal", "dcd")
# Records each log holds before it overflows (Identify Memory Device reports them at 0x30-0x36,
# the DC log's at 0x43). QEMU holds 8 per log; 64 lets a host that drains 15 records per Get
# Event Records keep up with bursts and is still small enough for tests to overflow. The DC log
# holds 64 too, not QEMU's 8 (CXL_DC_EVENT_LOG_SIZE): an offer logs one record per extent.
EVENT_LOG_SIZES: tuple[int, ...] = (64, 64, 64, 64, 64)
assert len(EVENT_LOG_SIZES) == len(EventLog)

EVENT_RECORD_SIZE = 0x80
EVENT_HEADER_SIZE = 0x30
EVENT_DATA_SIZE = EVENT_RECORD_SIZE - EVENT_HEADER_SIZE

# §8.2.9.2.1 Table 8-42 Common Event Record
EVENT_HEADER = Layout("Common Event Record header", "8.2.9.2.1", EVENT_HEADER_SIZE, [
    ("uuid", "16s"),            # 00h record type
    ("length", "B"),            # 10h 0x80
    ("flags", "3s"),            # 11h u24: [1:0] severity, 2 permanent, 3 maintenance, 4 perf, 5 replace
    ("handle", "H"),            # 14h
    ("related_handle", "H"),    # 16h
    ("timestamp", "Q"),         # 18h device time, ns
    ("maint_op_class", "B"),    # 20h
    ("rsvd", "15s"),            # 21h
])

# Event Record Flags (header 11h)
SEVERITY_MASK = 0x3  # 0 informational, 1 warning, 2 failure, 3 fatal (same numbers as the logs)
FLAG_PERMANENT = 1 << 2
FLAG_MAINTENANCE_NEEDED = 1 << 3
FLAG_PERFORMANCE_DEGRADED = 1 << 4
FLAG_HARDWARE_REPLACEMENT_NEEDED = 1 << 5

# §8.2.9.2.1.1 Table 8-43 General Media Event Record (offsets from the record start)
GENERAL_MEDIA_UUID = uuid.UUID("fbcd0a77-c260-417f-85a9-088b1621eba6")
GENERAL_MEDIA = Layout("General Media Event Record data", "8.2.9.2.1.1", EVENT_DATA_SIZE, [
    ("physical_address", "Q"),  # 30h DPA; bit 0 volatile, bit 1 DPA not repairable
    ("descriptor", "B"),        # 38h
    ("event_type", "B"),        # 39h
    ("transaction_type", "B"),  # 3Ah
    ("validity_flags", "H"),    # 3Bh
    ("channel", "B"),           # 3Dh
    ("rank", "B"),              # 3Eh
    ("device", "3s"),           # 3Fh u24
    ("component_id", "16s"),    # 42h
    ("rsvd", "46s"),            # 52h
])

# §8.2.9.2.1.2 Table 8-44 DRAM Event Record
DRAM_UUID = uuid.UUID("601dcbb3-9c06-4eab-b8af-4e9bfb5c9624")
DRAM = Layout("DRAM Event Record data", "8.2.9.2.1.2", EVENT_DATA_SIZE, [
    ("physical_address", "Q"),  # 30h
    ("descriptor", "B"),        # 38h
    ("event_type", "B"),        # 39h
    ("transaction_type", "B"),  # 3Ah
    ("validity_flags", "H"),    # 3Bh
    ("channel", "B"),           # 3Dh
    ("rank", "B"),              # 3Eh
    ("nibble_mask", "3s"),      # 3Fh u24
    ("bank_group", "B"),        # 42h
    ("bank", "B"),              # 43h
    ("row", "3s"),              # 44h u24
    ("column", "H"),            # 47h
    ("correction_mask", "32s"),  # 49h
    ("rsvd", "23s"),            # 69h
])

# General media / DRAM: Physical Address low bits, Memory Event Descriptor, Type, Transaction Type
PHYS_ADDR_VOLATILE = 1 << 0
DESCRIPTOR_UNCORRECTABLE = 1 << 0
DESCRIPTOR_THRESHOLD = 1 << 1
DESCRIPTOR_POISON_LIST_OVERFLOW = 1 << 2  # the error is not in the poison list: it was full


class MemoryEventType(IntEnum):
    MEDIA_ECC_ERROR = 0
    INVALID_ADDRESS = 1
    DATA_PATH_ERROR = 2


class TransactionType(IntEnum):
    UNKNOWN = 0
    HOST_READ = 1
    HOST_WRITE = 2
    HOST_SCAN_MEDIA = 3
    HOST_INJECT_POISON = 4
    INTERNAL_MEDIA_SCRUB = 5
    INTERNAL_MEDIA_MANAGEMENT = 6


VALID_CHANNEL, VALID_RANK, VALID_DEVICE, VALID_COMPONENT = 1 << 0, 1 << 1, 1 << 2, 1 << 3
# DRAM record validity flags: channel, rank, nibble mask, bank group, bank, row, column, correction mask
DRAM_VALID_NIBBLE, DRAM_VALID_BANK_GROUP, DRAM_VALID_BANK = 1 << 2, 1 << 3, 1 << 4
DRAM_VALID_ROW, DRAM_VALID_COLUMN, DRAM_VALID_CORRECTION_MASK = 1 << 5, 1 << 6, 1 << 7
DRAM_VALID_LOCATION = (VALID_CHANNEL | VALID_RANK | DRAM_VALID_BANK_GROUP | DRAM_VALID_BANK
                       | DRAM_VALID_ROW | DRAM_VALID_COLUMN)

# §8.2.9.2.1.3 Table 8-45 Memory Module Event Record (health fields as Get Health Info, §8.2.9.9.3.1)
MEMORY_MODULE_UUID = uuid.UUID("fe927475-dd59-4339-a586-79bab113b774")
MEMORY_MODULE = Layout("Memory Module Event Record data", "8.2.9.2.1.3", EVENT_DATA_SIZE, [
    ("device_event_type", "B"),             # 30h
    ("health_status", "B"),                 # 31h
    ("media_status", "B"),                  # 32h
    ("additional_status", "B"),             # 33h
    ("life_used", "B"),                     # 34h
    ("temperature", "h"),                   # 35h
    ("dirty_shutdowns", "I"),               # 37h
    ("corrected_volatile_errors", "I"),     # 3Bh
    ("corrected_persistent_errors", "I"),   # 3Fh
    ("rsvd", "61s"),                        # 43h
])


class DeviceEventType(IntEnum):
    HEALTH_STATUS_CHANGE = 0
    MEDIA_STATUS_CHANGE = 1
    LIFE_USED_CHANGE = 2
    TEMPERATURE_CHANGE = 3
    DATA_PATH_ERROR = 4
    LSA_ERROR = 5


# §8.2.9.2.1.4 Vendor Specific Event Record: the firmware reports a command whose handler failed
# (a firmware bug the host saw as Internal Error). The UUID is cxlemu's own (uuid5 of the name).
FIRMWARE_ERROR_UUID = uuid.uuid5(uuid.NAMESPACE_URL, "https://cxlemu/events/firmware-error")
FIRMWARE_ERROR = Layout("cxlemu Firmware Error Record data", "8.2.9.2.1.4", EVENT_DATA_SIZE, [
    ("opcode", "H"),            # 30h the command that failed (0: a firmware service)
    ("text", "78s"),            # 32h exception type and message, UTF-8, NUL padded
])

RECORD_LAYOUTS: dict[uuid.UUID, tuple[str, Layout]] = {
    GENERAL_MEDIA_UUID: ("general_media", GENERAL_MEDIA),
    DRAM_UUID: ("dram", DRAM),
    MEMORY_MODULE_UUID: ("memory_module", MEMORY_MODULE),
    FIRMWARE_ERROR_UUID: ("firmware_error", FIRMWARE_ERROR),
    DC_EVENT_UUID: ("dynamic_capacity", DC_EVENT),
}

# §8.2.9.2.2 Table 8-51 Get Event Records: input is the log byte; output is this header + records.
GET_EVENT_RECORDS_IN = Layout("Get Event Records input", "8.2.9.2.2", 0x1, [("log", "B")])
GET_EVENT_RECORDS_OUT = Layout("Get Event Records output", "8.2.9.2.2", 0x20, [
    ("flags", "B"),                 # 00h bit 0 overflow, bit 1 more event records
    ("rsvd1", "B"),                 # 01h
    ("overflow_count", "H"),        # 02h records dropped since the log overflowed
    ("first_overflow_ts", "Q"),     # 04h
    ("last_overflow_ts", "Q"),      # 0Ch
    ("record_count", "H"),          # 14h
    ("rsvd2", "10s"),               # 16h
])
GET_EVENTS_FLAG_OVERFLOW = 1 << 0
GET_EVENTS_FLAG_MORE = 1 << 1
MAX_RECORDS_PER_GET = (MAILBOX_PAYLOAD_SIZE - GET_EVENT_RECORDS_OUT.size) // EVENT_RECORD_SIZE

# §8.2.9.2.3 Table 8-52 Clear Event Records input: this header, then u16 handles[n].
CLEAR_EVENT_RECORDS = Layout("Clear Event Records input", "8.2.9.2.3", 0x6, [
    ("log", "B"),                   # 00h
    ("flags", "B"),                 # 01h bit 0 clear all (only while the log has overflowed)
    ("handle_count", "B"),          # 02h must be 0 with clear all
    ("rsvd", "3s"),                 # 03h
])
CLEAR_EVENTS_FLAG_CLEAR_ALL = 1 << 0
