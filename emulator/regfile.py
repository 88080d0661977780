"""Typed access to a device's BAR (an mmap shared by firmware, hosts and monitors).

Registers are read and written whole (aligned 1/2/4/8-byte accesses through `struct`), so a
reader in another process sees either the old or the new value of a register, never a mix, on
x86-64 and arm64. Ordering between registers follows program order (CPython issues each store
as its own C call); the mailbox protocol relies on it: payload, then command, then doorbell.
"""
from __future__ import annotations

import struct
from typing import Any

from emulator.spec import registers as R
from emulator.spec.registers import Field, Reg

_FMT = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}


class RegisterFile:
    """A view of the BAR: registers by `Reg`, fields by name, and raw byte ranges."""

    def __init__(self, buf: Any) -> None:
        self.buf = memoryview(buf).cast("B")
        if len(self.buf) < R.BAR_SIZE:
            raise ValueError(f"BAR buffer of {len(self.buf)} bytes is smaller than BAR_SIZE={R.BAR_SIZE:#x}")

    # raw -------------------------------------------------------------------------------------
    def read(self, offset: int, width: int) -> int:
        return struct.unpack_from(_FMT[width], self.buf, offset)[0]

    def write(self, offset: int, width: int, value: int) -> None:
        struct.pack_into(_FMT[width], self.buf, offset, value)

    def region(self, offset: int, length: int) -> memoryview:
        return self.buf[offset:offset + length]

    # registers -------------------------------------------------------------------------------
    def get(self, reg: Reg) -> int:
        return self.read(reg.offset, reg.width)

    def set(self, reg: Reg, value: int) -> None:
        self.write(reg.offset, reg.width, value)

    def get_field(self, reg: Reg, name: str) -> int:
        return reg.f(name).get(self.get(reg))

    def set_field(self, reg: Reg, name: str, value: int) -> None:
        fld: Field = reg.f(name)
        self.set(reg, fld.put(self.get(reg), value))

    def set_fields(self, reg: Reg, **values: int) -> None:
        v = self.get(reg)
        for name, fv in values.items():
            v = reg.f(name).put(v, fv)
        self.set(reg, v)


def init_device_registers(regs: RegisterFile) -> None:
    """Lay out the capability array and the reset values of the device registers (§8.2.8)."""
    regs.region(0, R.COMPONENT_OFFSET)[:] = bytes(R.COMPONENT_OFFSET)
    caps = R.DEVICE_CAPABILITIES
    regs.set_fields(R.CAPABILITY_ARRAY, CAP_ID=R.CAP_ID_ARRAY, VERSION=1, CAP_COUNT=len(caps))
    for i, (cap_id, version, offset, length) in enumerate(caps):
        hdr = R.CAP_HEADERS_OFFSET + i * R.CAP_HEADER_STRIDE
        regs.write(hdr, 4, cap_id | (version << 16))
        regs.write(hdr + 4, 4, offset)
        regs.write(hdr + 8, 4, length)
    regs.set_fields(R.MB_CAPS, PAYLOAD_SIZE=R.MAILBOX_PAYLOAD_LOG2, BG_CMD_IRQ=0)


def find_capabilities(regs: RegisterFile) -> dict[int, tuple[int, int]]:
    """Walk the capability array as Linux's cxl_probe_device_regs does: id -> (offset, length)."""
    count = regs.get_field(R.CAPABILITY_ARRAY, "CAP_COUNT")
    found: dict[int, tuple[int, int]] = {}
    for i in range(count):
        hdr = R.CAP_HEADERS_OFFSET + i * R.CAP_HEADER_STRIDE
        cap_id = regs.read(hdr, 4) & 0xFFFF
        found[cap_id] = (regs.read(hdr + 4, 4), regs.read(hdr + 8, 4))
    return found
