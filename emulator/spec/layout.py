"""Payload layouts: named little-endian fields with their spec offsets, size-checked at import.

    IDENTIFY = Layout("Identify", "8.2.9.1.1", 0x12, [
        ("vendor_id", "H"), ("device_id", "H"), ...])

`Layout` is QEMU's `QEMU_BUILD_BUG_ON(sizeof(*id) != 0x12)` in Python: a layout whose fields do
not add up to the spec's size fails at import, not at run time.
"""
from __future__ import annotations

import struct
from typing import Any


class Layout:
    """A fixed-size payload: fields in order (no implicit padding), total size asserted."""

    def __init__(self, name: str, section: str, size: int, fields: list[tuple[str, str]]) -> None:
        self.name = name
        self.section = section
        self.fields = fields
        self.struct = struct.Struct("<" + "".join(fmt for _, fmt in fields))
        if self.struct.size != size:
            raise AssertionError(f"{name} (§{section}) is {self.struct.size:#x} bytes, the spec says {size:#x}")
        self.size = size
        self.offsets: dict[str, int] = {}
        off = 0
        for fname, fmt in fields:
            self.offsets[fname] = off
            off += struct.calcsize("<" + fmt)

    def pack(self, **values: Any) -> bytes:
        """Pack named values; missing fields (reserved) are zero, unknown names are an error."""
        unknown = set(values) - set(self.offsets)
        if unknown:
            raise KeyError(f"{self.name} has no field(s) {sorted(unknown)}")
        args = []
        for fname, fmt in self.fields:
            v = values.get(fname)
            if v is None:
                v = b"" if fmt.endswith("s") else 0
            args.append(v)
        return self.struct.pack(*args)

    def unpack(self, buf: bytes | memoryview, offset: int = 0) -> dict[str, Any]:
        return dict(zip((f for f, _ in self.fields), self.struct.unpack_from(buf, offset)))

    def __repr__(self) -> str:
        return f"Layout({self.name}, {self.size:#x} B, §{self.section})"


def u24(value: int) -> bytes:
    """Three-byte little-endian field (struct has no 24-bit code)."""
    return value.to_bytes(3, "little")
