"""Typed access to a device's BAR (an mmap shared by firmware, hosts and monitors).

Every register access is ONE aligned load or store of the register's width: an element of a
``memoryview`` cast to ``B``/``H``/``I``/``Q`` (CPython reads and writes such an element with one
fixed-size ``memcpy``, which compiles to one ``mov``), so a reader in another process sees the
old or the new value of a register, never a mix and never an intermediate, on x86-64 and arm64.
``struct.pack_into`` is not that: it zero-fills the target before it packs the bytes, and a
firmware in another process polling the doorbell saw the zero — 1-17 lost commands in 200,000
before this module stopped using it.

Ordering between registers follows program order (CPython issues each store as its own C call,
and x86-64 keeps stores in order; arm64 hosts rely on the GIL's and the mailbox lock's barriers);
the mailbox protocol relies on it: payload, then command, then doorbell.

64-bit registers: the spec lets software access a 64-bit register as two 32-bit accesses
(CXL r3.1 §8.2.2, "Accessing Registers"), lower dword first. ``write_half`` does that; the
firmware reads such a register only after the doorbell that follows it (the mailbox Command
register) or through its own latching (HDM decoders are 32-bit registers pairs already), so a
half-written value is never acted on.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

from emulator.spec import registers as R
from emulator.spec.chmu import BITMAP_REL, HOTLIST_REL, INST, INSTANCE_LEN
from emulator.spec.registers import Field, Reg

if sys.byteorder != "little":  # the register file is little-endian (§8.2.2); native casts assume it
    raise ImportError("cxlemu's register file needs a little-endian host")

_CODES = {1: "B", 2: "H", 4: "I", 8: "Q"}


def word_views(buf: Any) -> dict[int, memoryview]:
    """Views of ``buf`` whose elements are 1-, 2-, 4- and 8-byte words: ``views[w][off // w]`` is
    one aligned access of width ``w`` at byte ``off``."""
    raw = memoryview(buf).cast("B")
    return {w: raw if w == 1 else raw[:len(raw) - len(raw) % w].cast(code) for w, code in _CODES.items()}


class RegisterFile:
    """A view of the BAR: registers by `Reg`, fields by name, and raw byte ranges."""

    def __init__(self, buf: Any) -> None:
        self.buf = memoryview(buf).cast("B")
        if len(self.buf) < R.BAR_SIZE:
            raise ValueError(f"BAR buffer of {len(self.buf)} bytes is smaller than BAR_SIZE={R.BAR_SIZE:#x}")
        self._w = word_views(self.buf)

    # raw -------------------------------------------------------------------------------------
    def read(self, offset: int, width: int) -> int:
        """One aligned load of ``width`` bytes at ``offset``."""
        if offset % width:
            raise ValueError(f"register access of {width} bytes at {offset:#x} is not aligned")
        return self._w[width][offset // width]

    def write(self, offset: int, width: int, value: int) -> None:
        """One aligned store of ``width`` bytes at ``offset``."""
        if offset % width:
            raise ValueError(f"register access of {width} bytes at {offset:#x} is not aligned")
        self._w[width][offset // width] = value

    def write_half(self, reg: Reg, upper: bool, value: int) -> None:
        """Write one dword of a 64-bit register, as software may (§8.2.2): two such writes, lower
        first, leave the register as one 64-bit write would."""
        if reg.width != 8:
            raise ValueError(f"{reg.name} is {reg.width} bytes wide: only 64-bit registers are written in halves")
        self.write(reg.offset + (4 if upper else 0), 4, value)

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


class ChmuRegView:
    """Aligned little-endian access to the CHMU register block (``emulator.spec.chmu``), whole-register
    stores like RegisterFile; shared by the device (``emulator.chmu``) and the host (``driver.chmu``)."""

    def __init__(self, region: memoryview) -> None:
        self.buf = memoryview(region).cast("B")
        if len(self.buf) < INST + INSTANCE_LEN:
            raise ValueError(f"CHMU region of {len(self.buf)} bytes is smaller than {INST + INSTANCE_LEN:#x}")
        views = word_views(self.buf)
        self._q, self._h = views[8], views[2]

    def q(self, off: int) -> int:
        return self._q[off >> 3]

    def set_q(self, off: int, v: int) -> None:
        self._q[off >> 3] = v

    def w(self, off: int) -> int:
        return self._h[off >> 1]

    def set_w(self, off: int, v: int) -> None:
        self._h[off >> 1] = v

    def bitmap(self) -> np.ndarray:
        return np.frombuffer(self.buf[INST + BITMAP_REL:INST + HOTLIST_REL], dtype=np.uint8)

    def hotlist(self) -> np.ndarray:
        return np.frombuffer(self.buf[INST + HOTLIST_REL:INST + INSTANCE_LEN], dtype="<u8")
