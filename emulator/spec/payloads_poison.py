"""Media and poison management payloads (CXL r3.1 §8.2.9.9.4) and Sanitize (§8.2.9.9.5.1).

Poison is tracked per 64-byte line. A Media Error Record names a DPA range: its start, 64-B
aligned, with the error source in bits [2:0], and its length in 64-B units. Sizes are checked at
import; offsets in the comments are the spec's.
"""
from __future__ import annotations

from enum import IntEnum

from emulator.spec.layout import Layout
from emulator.spec.registers import MAILBOX_PAYLOAD_SIZE

POISON_LINE = 64  # bytes per poison granule (§8.2.9.9.4.1: lengths are in 64-B units)
# Identify Memory Device 3Ch "Poison List Maximum Media Error Records" (QEMU: 256).
POISON_LIST_LIMIT = 256
# Identify Memory Device 3Fh "Inject Poison Limit": injected records the device holds at once;
# 0 means no limit beyond the list's (QEMU reports 0, and so does cxlemu).
INJECT_POISON_LIMIT = 0


class PoisonSource(IntEnum):
    """Error Source, Media Error Record bits [2:0] (§8.2.9.9.4.1 Table 8-140)."""

    UNKNOWN = 0
    EXTERNAL = 1
    INTERNAL = 2
    INJECTED = 3
    VENDOR = 7


SOURCE_MASK = 0x7

# §8.2.9.9.4.1 Get Poison List input (also Get Scan Media Capabilities' input, §8.2.9.9.4.4)
DPA_RANGE = Layout("Get Poison List input", "8.2.9.9.4.1", 0x10, [
    ("address", "Q"),           # 00h DPA, 64-B aligned
    ("length", "Q"),            # 08h 64-B units
])

# §8.2.9.9.4.1 Get Poison List output header; records follow at 20h
POISON_LIST_OUT = Layout("Get Poison List output", "8.2.9.9.4.1", 0x20, [
    ("flags", "B"),             # 00h bit 0 more, bit 1 overflow, bit 2 scan media in progress
    ("rsvd1", "B"),             # 01h
    ("overflow_ts", "Q"),       # 02h device time the list overflowed (valid with bit 1)
    ("count", "H"),             # 0Ah records in this output
    ("rsvd2", "20s"),           # 0Ch
])
POISON_FLAG_MORE = 1 << 0
POISON_FLAG_OVERFLOW = 1 << 1
POISON_FLAG_SCAN_RUNNING = 1 << 2

MEDIA_ERROR_RECORD = Layout("Media Error Record", "8.2.9.9.4.1", 0x10, [
    ("address", "Q"),           # 00h DPA | source [2:0]
    ("length", "I"),            # 08h 64-B units
    ("rsvd", "I"),              # 0Ch
])
MAX_POISON_RECORDS_PER_GET = (MAILBOX_PAYLOAD_SIZE - POISON_LIST_OUT.size) // MEDIA_ERROR_RECORD.size

# §8.2.9.9.4.2 Inject Poison input
INJECT_POISON = Layout("Inject Poison input", "8.2.9.9.4.2", 0x8, [("address", "Q")])

# §8.2.9.9.4.3 Clear Poison input: the line's DPA and the 64 bytes written to it
CLEAR_POISON = Layout("Clear Poison input", "8.2.9.9.4.3", 0x48, [
    ("address", "Q"),           # 00h
    ("data", "64s"),            # 08h
])

# §8.2.9.9.4.4 Get Scan Media Capabilities output (input: DPA_RANGE)
SCAN_MEDIA_CAPS_OUT = Layout("Get Scan Media Capabilities output", "8.2.9.9.4.4", 0x4, [
    ("estimated_ms", "I"),      # 00h estimated scan time, ms
])

# §8.2.9.9.4.5 Scan Media input
SCAN_MEDIA = Layout("Scan Media input", "8.2.9.9.4.5", 0x11, [
    ("address", "Q"),           # 00h
    ("length", "Q"),            # 08h 64-B units
    ("flags", "B"),             # 10h bit 0: no event log (do not log the errors found)
])
SCAN_FLAG_NO_EVENT_LOG = 1 << 0

# §8.2.9.9.4.6 Get Scan Media Results output header; Media Error Records follow at 20h
SCAN_RESULTS_OUT = Layout("Get Scan Media Results output", "8.2.9.9.4.6", 0x20, [
    ("restart_address", "Q"),   # 00h where to rescan from when the scan stopped early
    ("restart_length", "Q"),    # 08h what was left, 64-B units
    ("flags", "B"),             # 10h bit 0 more records, bit 1 scan stopped prematurely
    ("rsvd1", "B"),             # 11h
    ("count", "H"),             # 12h
    ("rsvd2", "12s"),           # 14h
])
SCAN_RESULTS_FLAG_MORE = 1 << 0
SCAN_RESULTS_FLAG_STOPPED = 1 << 1
MAX_SCAN_RECORDS_PER_GET = (MAILBOX_PAYLOAD_SIZE - SCAN_RESULTS_OUT.size) // MEDIA_ERROR_RECORD.size

# QEMU's Scan Media cost model (cmd_media_get_scan_media_capabilities): 400 ns to read a line and
# 100 ns to update the poison list, i.e. 0.5 us per 64 B; at least 1 ms is reported.
SCAN_NS_PER_LINE = 500
