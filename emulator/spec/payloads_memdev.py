"""Payload layouts of the memory-device, timestamp, log and event-policy commands.

CXL r3.1 §8.2.9.2.4-5 (event interrupt policy), §8.2.9.4 (timestamp), §8.2.9.5 (logs), §8.2.9.9.1-3
(identify, partition, LSA, health, alerts), §8.2.9.9.6 (security state). Every layout's size is
checked at import (see `emulator.spec.layout`); offsets in the comments are the spec's.
"""
from __future__ import annotations

import uuid

from emulator.spec.layout import Layout

# §8.2.9.9.1.1: capacities are reported in 256 MiB units, so a device's capacity is a multiple of it
CAPACITY_UNIT = 256 << 20

# §8.2.9.9.1.1 Identify Memory Device Output Payload. r3.0 added the Dynamic Capacity Event Log
# Size at 43h, making it 0x45 bytes. QEMU's cmd_identify_memory_device answers 0x45 (it fills
# dc_event_log_size); Linux's struct cxl_mbox_identify stops at qos_telemetry_caps, 0x43 bytes
# (CXL_CMD(IDENTIFY, 0, 0x43, ...) in drivers/cxl/core/mbox.c), and copies only those 0x43 of a
# longer answer. cxlemu answers 0x45, as QEMU does.
IDENTIFY_MEMDEV = Layout("Identify Memory Device", "8.2.9.9.1.1", 0x45, [
    ("fw_revision", "16s"),          # 00h ASCII, NUL padded
    ("total_capacity", "Q"),         # 10h 256 MiB units
    ("volatile_capacity", "Q"),      # 18h
    ("persistent_capacity", "Q"),    # 20h
    ("partition_align", "Q"),        # 28h 0: not partitionable
    ("info_event_log_size", "H"),    # 30h records
    ("warning_event_log_size", "H"),  # 32h
    ("failure_event_log_size", "H"),  # 34h
    ("fatal_event_log_size", "H"),   # 36h
    ("lsa_size", "I"),               # 38h bytes
    ("poison_list_max_mer", "3s"),   # 3Ch u24 records
    ("inject_poison_limit", "H"),    # 3Fh 0: no limit beyond the list's
    ("poison_caps", "B"),            # 41h
    ("qos_telemetry_caps", "B"),     # 42h
    ("dc_event_log_size", "H"),      # 43h
])
# Poison Handling Capabilities: bit 0 injects persistent poison, bit 1 scans for
# poison, bit 2 media failure injection (r3.2), bit 3 "poison list overflow timestamp reported".
POISON_CAP_INJECTS_PERSISTENT = 1 << 0
POISON_CAP_SCANS_MEDIA = 1 << 1

# §8.2.9.9.2.1 Get Partition Info Output Payload (256 MiB units)
PARTITION_INFO = Layout("Get Partition Info", "8.2.9.9.2.1", 0x20, [
    ("active_volatile", "Q"), ("active_persistent", "Q"),
    ("next_volatile", "Q"), ("next_persistent", "Q"),
])

# §8.2.9.9.2.3 Get LSA Input Payload; the output is the data.
GET_LSA = Layout("Get LSA", "8.2.9.9.2.3", 0x8, [("offset", "I"), ("length", "I")])
# §8.2.9.9.2.4 Set LSA Input Payload: this header, then the data.
SET_LSA = Layout("Set LSA", "8.2.9.9.2.4", 0x8, [("offset", "I"), ("rsvd", "I")])

# §8.2.9.9.3.1 Get Health Info Output Payload
HEALTH_INFO = Layout("Get Health Info", "8.2.9.9.3.1", 0x12, [
    ("health_status", "B"),          # 00h bit 0 maintenance needed, 1 performance degraded, 2 replace
    ("media_status", "B"),           # 01h 0 normal, 1 not ready, ... (§8.2.9.9.3.1)
    ("additional_status", "B"),      # 02h [1:0] life used, [3:2] temperature, 4 vol errs, 5 pers errs
    ("life_used", "B"),              # 03h percent; 0xFF not implemented
    ("temperature", "h"),            # 04h degrees Celsius, two's complement
    ("dirty_shutdowns", "I"),        # 06h
    ("corrected_volatile_errors", "I"),    # 0Ah
    ("corrected_persistent_errors", "I"),  # 0Eh
])
HEALTH_MAINTENANCE_NEEDED = 1 << 0
HEALTH_PERFORMANCE_DEGRADED = 1 << 1
HEALTH_REPLACEMENT_NEEDED = 1 << 2
MEDIA_STATUS_NORMAL = 0
MEDIA_STATUS_NOT_READY = 1
# Additional Status, 2-bit levels for life used [1:0] and temperature [3:2]
LEVEL_NORMAL, LEVEL_WARNING, LEVEL_CRITICAL = 0, 1, 2
ADDITIONAL_VOLATILE_ERRORS_WARNING = 1 << 4
ADDITIONAL_PERSISTENT_ERRORS_WARNING = 1 << 5

# §8.2.9.9.3.2 Get Alert Configuration Output Payload
ALERT_CONFIG = Layout("Get Alert Configuration", "8.2.9.9.3.2", 0x10, [
    ("valid_alerts", "B"),                   # 00h which programmable warnings are enabled
    ("programmable_alerts", "B"),            # 01h which warnings the device lets the host program
    ("life_used_critical", "B"),             # 02h percent (device-fixed)
    ("life_used_warning", "B"),              # 03h percent (programmable)
    ("over_temp_critical", "h"),             # 04h degrees Celsius (device-fixed)
    ("under_temp_critical", "h"),            # 06h
    ("over_temp_warning", "h"),              # 08h (programmable)
    ("under_temp_warning", "h"),             # 0Ah
    ("corrected_volatile_warning", "H"),     # 0Ch errors (programmable)
    ("corrected_persistent_warning", "H"),   # 0Eh
])
# §8.2.9.9.3.3 Set Alert Configuration Input Payload
SET_ALERT_CONFIG = Layout("Set Alert Configuration", "8.2.9.9.3.3", 0xC, [
    ("valid_actions", "B"),          # 00h which fields of this payload to apply
    ("enable_actions", "B"),         # 01h for each valid one: 1 enable, 0 disable the warning
    ("life_used_warning", "B"),      # 02h
    ("rsvd", "B"),                   # 03h
    ("over_temp_warning", "h"),      # 04h
    ("under_temp_warning", "h"),     # 06h
    ("corrected_volatile_warning", "H"),    # 08h
    ("corrected_persistent_warning", "H"),  # 0Ah
])
ALERT_LIFE_USED = 1 << 0
ALERT_OVER_TEMP = 1 << 1
ALERT_UNDER_TEMP = 1 << 2
ALERT_CORRECTED_VOLATILE = 1 << 3
ALERT_CORRECTED_PERSISTENT = 1 << 4
ALERT_ALL = 0x1F

# §8.2.9.9.6.1 Get Security State Output Payload (bits)
SECURITY_STATE = Layout("Get Security State", "8.2.9.9.6.1", 0x4, [("state", "I")])
SECURITY_USER_PASS_SET = 1 << 0
SECURITY_MASTER_PASS_SET = 1 << 1
SECURITY_LOCKED = 1 << 2
SECURITY_FROZEN = 1 << 3

# §8.2.9.4.1-2 Get / Set Timestamp: ns since midnight 1 Jan 1970 UTC, u64
TIMESTAMP = Layout("Timestamp", "8.2.9.4", 0x8, [("timestamp", "Q")])
# The device clock is that u64 counting on: it wraps modulo 2**64 (a host may set any value,
# even one ns before the wrap), so every record, log and page stamped with it holds it.
TIMESTAMP_MODULUS = 1 << 64

# §8.2.9.5.1 Get Supported Logs Output Payload: this header, then entries.
SUPPORTED_LOGS = Layout("Get Supported Logs", "8.2.9.5.1", 0x8, [("entries", "H"), ("rsvd", "6s")])
SUPPORTED_LOG_ENTRY = Layout("Supported Log Entry", "8.2.9.5.1", 0x14, [("uuid", "16s"), ("size", "I")])
# §8.2.9.5.2 Get Log Input Payload; the output is the log's bytes.
GET_LOG = Layout("Get Log", "8.2.9.5.2", 0x18, [("uuid", "16s"), ("offset", "I"), ("length", "I")])
# §8.2.9.5.2.1 Command Effects Log entry
CEL_ENTRY = Layout("CEL Entry", "8.2.9.5.2.1", 0x4, [("opcode", "H"), ("effects", "H")])
# §8.2.9.5.2.1: the CEL's UUID (QEMU cel_uuid, Linux DEFINE_CXL_CEL_UUID). UUIDs go on the wire in
# the byte order Linux's uuid_t and QEMU's QemuUUID use: the 16 bytes as written, big-endian.
CEL_UUID = uuid.UUID("0da9c0b5-bf41-4b78-8f79-96b1623b3f17")

# §8.2.9.2.4 Event Interrupt Policy (Get output; Set input, DC byte optional)
EVENT_INT_POLICY = Layout("Event Interrupt Policy", "8.2.9.2.4", 0x5, [
    ("info", "B"), ("warning", "B"), ("failure", "B"), ("fatal", "B"), ("dynamic_capacity", "B"),
])
EVENT_INT_POLICY_BASE_SIZE = 4  # Linux CXL_EVENT_INT_POLICY_BASE_SIZE: the DC byte may be omitted
INT_MODE_MASK = 0x3
INT_MODE_NONE, INT_MODE_MSI, INT_MODE_FW = 0, 1, 2  # 3 is reserved
INT_MSGNUM_SHIFT = 4
