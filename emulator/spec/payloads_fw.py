"""Payload layouts of the firmware-update commands (CXL r3.1 §8.2.9.3) and cxlemu's image header.

Transfer FW sends a package in parts of any length, each at an offset in 128-byte units; the
device stores it in a slot, and Activate FW makes a slot's firmware the running one. QEMU limits a
package to 32 MiB and keeps 2 slots (hw/cxl/cxl-mailbox-utils.c CXL_FW_SIZE, CXL_FW_SLOTS).
"""
from __future__ import annotations

from emulator.spec.layout import Layout

FW_SLOTS = 2                    # slots this device has (the spec allows 2..4)
FW_MAX_SLOTS = 4                # revision fields in Get FW Info
FW_REVISION_LEN = 0x10          # ASCII, NUL padded
FW_XFER_ALIGN = 128             # §8.2.9.3.2: Offset is in 128-byte units
FW_MAX_SIZE = 32 << 20          # QEMU CXL_FW_SIZE
FW_PART_TIMEOUT_NS = 30 * 10**9  # QEMU: more than 30 s between parts abandons the transfer

# §8.2.9.3.1 Get FW Info Output Payload
FW_INFO = Layout("Get FW Info", "8.2.9.3.1", 0x50, [
    ("slots_supported", "B"),   # 00h
    ("slot_info", "B"),         # 01h [2:0] active slot, [5:3] slot staged for the next reset (0 none)
    ("activation_caps", "B"),   # 02h bit 0: online activation supported
    ("rsvd", "13s"),            # 03h
    ("revision1", "16s"), ("revision2", "16s"), ("revision3", "16s"), ("revision4", "16s"),  # 10h..
])
SLOT_ACTIVE_MASK = 0x7
SLOT_STAGED_SHIFT = 3
FW_CAP_ONLINE_ACTIVATION = 1 << 0

# §8.2.9.3.2 Transfer FW Input Payload: this 80h-byte header, then the part's data.
TRANSFER_FW = Layout("Transfer FW", "8.2.9.3.2", 0x80, [
    ("action", "B"),    # 00h
    ("slot", "B"),      # 01h used by Full and End
    ("rsvd1", "2s"),    # 02h
    ("offset", "I"),    # 04h in 128-byte units
    ("rsvd2", "120s"),  # 08h
])
XFER_FULL, XFER_INIT, XFER_CONTINUE, XFER_END, XFER_ABORT = 0, 1, 2, 3, 4

# §8.2.9.3.3 Activate FW Input Payload
ACTIVATE_FW = Layout("Activate FW", "8.2.9.3.3", 0x2, [("action", "B"), ("slot", "B")])
ACTIVATE_ONLINE, ACTIVATE_ON_RESET = 0, 1

# cxlemu's firmware package: the spec leaves the package format to the vendor. A package is this
# header followed by `body_len` bytes; the device authenticates it (magic, CRC-32 of the body)
# when the transfer ends, and reports FW Authentication Failed otherwise.
FW_IMAGE_MAGIC = b"CXLEMUFW"
FW_IMAGE_VERSION = 1
FW_IMAGE_HEADER = Layout("cxlemu firmware image header", "8.2.9.3.2 (vendor format)", 0x40, [
    ("magic", "8s"),        # 00h "CXLEMUFW"
    ("version", "I"),       # 08h header version, 1
    ("body_len", "I"),      # 0Ch bytes after the header
    ("body_crc32", "I"),    # 10h zlib.crc32 of the body
    ("rsvd", "12s"),        # 14h
    ("revision", "16s"),    # 20h what Get FW Info and Identify Memory Device report once active
    ("rsvd2", "16s"),       # 30h
])
