"""The device's register file (BAR) map: blocks, registers and fields.

CXL r3.1 §8.2.8 (device register interface) and §8.1.9.1 (register locator). cxlemu exposes one BAR
file per device (see HACKING.md); where real hardware finds blocks through the Register Locator
DVSEC in configuration space, cxlemu fixes their offsets here, as a uapi header would.

    0x00000 ┌──────────────────────────────┐
            │ device registers (§8.2.8)     │ cap array 0x0, device status 0x80,
            │                               │ primary mailbox 0x88, memdev status 0x8A8
    0x10000 ├──────────────────────────────┤
            │ component registers (§8.2.4)  │ CXL.cache/mem at +0x1000: RAS, HDM
    0x20000 ├──────────────────────────────┤
            │ CHMU (CXL 3.2 §8.2.8.?)       │
    0x30000 ├──────────────────────────────┤
            │ vendor: link state, telemetry │
    0x40000 └──────────────────────────────┘
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

BAR_SIZE = 0x40000

DEVICE_REGS_OFFSET = 0x00000
COMPONENT_OFFSET = 0x10000
COMPONENT_SIZE = 0x10000
CHMU_OFFSET = 0x20000
CHMU_SIZE = 0x10000
LINK_STATE_OFFSET = 0x30000
LINK_STATE_SIZE = 0x1000
TELEMETRY_OFFSET = 0x31000
TELEMETRY_SIZE = 0xF000

# §8.2.8.1-2: capability IDs in the device capabilities array.
CAP_ID_ARRAY = 0x0000
CAP_ID_DEVICE_STATUS = 0x0001
CAP_ID_PRIMARY_MAILBOX = 0x0002
CAP_ID_MEMDEV_STATUS = 0x4000

# QEMU's layout (hw/cxl/cxl-device-utils.c), which Linux probes without assumptions.
CAP_ARRAY_OFFSET = 0x00
CAP_HEADERS_OFFSET = 0x10
CAP_HEADER_STRIDE = 0x10
DEVICE_STATUS_OFFSET = 0x80
DEVICE_STATUS_LENGTH = 0x8
MAILBOX_OFFSET = 0x88
MAILBOX_REGS_LENGTH = 0x20
MAILBOX_PAYLOAD_LOG2 = 11  # 2 KiB: the mailbox capabilities register reports 2^11
MAILBOX_PAYLOAD_SIZE = 1 << MAILBOX_PAYLOAD_LOG2
MAILBOX_LENGTH = MAILBOX_REGS_LENGTH + MAILBOX_PAYLOAD_SIZE
MEMDEV_STATUS_OFFSET = MAILBOX_OFFSET + MAILBOX_LENGTH  # 0x8A8
MEMDEV_STATUS_LENGTH = 0x8

assert MEMDEV_STATUS_OFFSET == 0x8A8
assert MEMDEV_STATUS_OFFSET + MEMDEV_STATUS_LENGTH <= COMPONENT_OFFSET


class Access(Enum):
    RO = "RO"     # read-only to the host
    RW = "RW"     # read-write
    RW1C = "RW1C"  # write 1 to clear
    RWS = "RWS"   # host sets, device clears (doorbell)


@dataclass(frozen=True)
class Field:
    """A bit field [hi:lo] of a register."""

    name: str
    lo: int
    hi: int

    @property
    def mask(self) -> int:
        return ((1 << (self.hi - self.lo + 1)) - 1) << self.lo

    def get(self, value: int) -> int:
        return (value & self.mask) >> self.lo

    def put(self, value: int, field_value: int) -> int:
        width = self.hi - self.lo + 1
        if field_value < 0 or field_value >> width:
            raise ValueError(f"{self.name}={field_value:#x} does not fit in {width} bits")
        return (value & ~self.mask) | (field_value << self.lo)


@dataclass(frozen=True)
class Reg:
    """One register: absolute BAR offset, width in bytes, fields, host access, spec section."""

    name: str
    offset: int
    width: int
    access: Access
    section: str
    fields: tuple[Field, ...] = field(default=())

    def __post_init__(self) -> None:
        assert self.width in (1, 2, 4, 8), f"{self.name}: width {self.width}"
        assert self.offset % self.width == 0, f"{self.name}: misaligned"
        for f in self.fields:
            assert 0 <= f.lo <= f.hi < self.width * 8, f"{self.name}.{f.name} outside register"

    def f(self, name: str) -> Field:
        for fld in self.fields:
            if fld.name == name:
                return fld
        raise KeyError(f"{self.name} has no field {name}")


def _mb(off: int) -> int:
    return MAILBOX_OFFSET + off


CAPABILITY_ARRAY = Reg("CAPABILITY_ARRAY", CAP_ARRAY_OFFSET, 8, Access.RO, "8.2.8.1",
                       (Field("CAP_ID", 0, 15), Field("VERSION", 16, 23), Field("CAP_COUNT", 32, 47)))

DEVICE_STATUS = Reg("DEVICE_STATUS", DEVICE_STATUS_OFFSET, 4, Access.RO, "8.2.8.3.1",
                    (Field("EVENT_STATUS", 0, 31),))  # bit n: event log n has records

MB_CAPS = Reg("MB_CAPS", _mb(0x00), 4, Access.RO, "8.2.8.4.3",
              (Field("PAYLOAD_SIZE", 0, 4), Field("BG_CMD_IRQ", 6, 6), Field("MSI_NUMBER", 7, 10)))
MB_CTRL = Reg("MB_CTRL", _mb(0x04), 4, Access.RWS, "8.2.8.4.4",
              (Field("DOORBELL", 0, 0), Field("MB_DOORBELL_INT", 1, 1), Field("BG_CMD_IRQ_EN", 2, 2)))
MB_CMD = Reg("MB_CMD", _mb(0x08), 8, Access.RW, "8.2.8.4.5",
             (Field("OPCODE", 0, 15), Field("LENGTH", 16, 36)))
MB_STATUS = Reg("MB_STATUS", _mb(0x10), 8, Access.RO, "8.2.8.4.6",
                (Field("BG_OP", 0, 0), Field("RETCODE", 32, 47), Field("VENDOR", 48, 63)))
MB_BG_STATUS = Reg("MB_BG_STATUS", _mb(0x18), 8, Access.RO, "8.2.8.4.7",
                   (Field("OPCODE", 0, 15), Field("PERCENT", 16, 22),
                    Field("RETCODE", 32, 47), Field("VENDOR", 48, 63)))
MB_PAYLOAD_OFFSET = _mb(0x20)

MEMDEV_STATUS = Reg("MEMDEV_STATUS", MEMDEV_STATUS_OFFSET, 8, Access.RO, "8.2.8.5.1.1",
                    (Field("FATAL", 0, 0), Field("FW_HALT", 1, 1), Field("MEDIA_STATUS", 2, 3),
                     Field("MBOX_READY", 4, 4), Field("RESET_NEEDED", 5, 7)))

# Media status values (§8.2.8.5.1.1).
MEDIA_NOT_READY, MEDIA_READY, MEDIA_ERROR, MEDIA_DISABLED = 0, 1, 2, 3

DEVICE_REGISTERS: tuple[Reg, ...] = (
    CAPABILITY_ARRAY, DEVICE_STATUS, MB_CAPS, MB_CTRL, MB_CMD, MB_STATUS, MB_BG_STATUS, MEMDEV_STATUS,
)

# (capability id, version, offset, length) in array order.
DEVICE_CAPABILITIES: tuple[tuple[int, int, int, int], ...] = (
    (CAP_ID_DEVICE_STATUS, 2, DEVICE_STATUS_OFFSET, DEVICE_STATUS_LENGTH),
    (CAP_ID_PRIMARY_MAILBOX, 1, MAILBOX_OFFSET, MAILBOX_LENGTH),
    (CAP_ID_MEMDEV_STATUS, 1, MEMDEV_STATUS_OFFSET, MEMDEV_STATUS_LENGTH),
)

# Within the CHMU block, past the instance's registers and hotlist: the ring through which hosts
# feed their accesses to the CHMU (emulator/chmu_feed.py).
ACCESS_FEED_OFFSET = CHMU_OFFSET + 0x8000
ACCESS_FEED_SIZE = 0x8000
