"""Payload layouts of the generic commands (CXL r3.1 §8.2.9.1). Command-group layouts live in
`emulator/spec/payloads_<group>.py`; every one is a `Layout` with its size checked at import."""
from __future__ import annotations

from emulator.spec.layout import Layout

# §8.2.9.1.1 Table 8-43 Identify Output Payload
IDENTIFY = Layout("Identify", "8.2.9.1.1", 0x12, [
    ("vendor_id", "H"), ("device_id", "H"), ("subsys_vendor_id", "H"), ("subsys_id", "H"),
    ("serial", "Q"), ("max_msg_size", "B"), ("component_type", "B"),
])
COMPONENT_TYPE_TYPE3 = 0x03

# §8.2.9.1.2 Table 8-45 Background Operation Status Output Payload
BG_OP_STATUS = Layout("Background Operation Status", "8.2.9.1.2", 0x8, [
    ("status", "B"),        # bit 0: operation in progress
    ("percent", "B"),       # [6:0]
    ("opcode", "H"), ("retcode", "H"), ("vendor", "H"),
])

CXLEMU_VENDOR_ID = 0x1B36  # Red Hat, Inc. — the ID QEMU's emulated CXL devices use
CXLEMU_DEVICE_ID = 0x0D93
