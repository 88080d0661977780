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

# §8.2.9.1.2 Background Operation Status Output Payload. Byte 0 packs two fields: bit 0 is
# "background operation in progress", bits 7:1 the percent complete (0..100); byte 1 is reserved.
# QEMU's cmd_infostat_bg_op_sts writes `status = complete_pct << 1 | running`. Use
# `bg_op_status_byte` / `bg_op_status_fields` rather than masking `status` by hand.
BG_OP_STATUS = Layout("Background Operation Status", "8.2.9.1.2", 0x8, [
    ("status", "B"),        # 00h [0] operation in progress, [7:1] percent complete
    ("reserved", "B"),      # 01h
    ("opcode", "H"),        # 02h command opcode of the last background operation
    ("retcode", "H"),       # 04h its return code (valid once it completed)
    ("vendor", "H"),        # 06h vendor-specific extended status
])
BG_OP_RUNNING = 1 << 0
BG_OP_PERCENT_SHIFT = 1
BG_OP_PERCENT_MASK = 0x7F


def bg_op_status_byte(running: bool, percent: int) -> int:
    """Byte 0 of Background Operation Status: percent in [7:1], in-progress in [0]."""
    if not 0 <= percent <= 100:
        raise ValueError(f"percent complete {percent} is outside 0..100")
    return (percent << BG_OP_PERCENT_SHIFT) | (BG_OP_RUNNING if running else 0)


def bg_op_status_fields(status: int) -> tuple[bool, int]:
    """(running, percent) from byte 0 of Background Operation Status."""
    return bool(status & BG_OP_RUNNING), (status >> BG_OP_PERCENT_SHIFT) & BG_OP_PERCENT_MASK


# Identify's PCI IDs. cxlemu answers 1b36:0d93: Red Hat's vendor ID (the one QEMU gives its own
# emulated PCI devices) with the device ID of QEMU's Type-3. QEMU's Type-3 itself
# (hw/mem/cxl_type3.c) is 8086:0d93: PCI_VENDOR_ID_INTEL, device 0x0d93 ("LVF for now"), and its
# Identify reports those. Neither Linux nor cxlemu's driver matches on these IDs (Linux binds
# cxl_pci by class code 0x050210).
CXLEMU_VENDOR_ID = 0x1B36
CXLEMU_DEVICE_ID = 0x0D93
