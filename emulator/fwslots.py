"""Firmware slots: what Get FW Info reports and Transfer / Activate FW change (CXL r3.1 §8.2.9.3).

    slot 1 ── active (the firmware the device booted: `DeviceConfig.fw_revision`)
    slot 2 ── empty  ◀── Transfer FW (Full, or Init → Continue… → End) stores an authenticated package
                         Activate FW online: slot 2 becomes active now; on reset: staged for the next

A partial transfer is one `Transfer`: parts must arrive in order (each at the offset where the
previous one ended; the same part may be resent back to back, as QEMU allows), a new Init or Full
while one is open is refused with FW Transfer In Progress, and more than 30 s between parts
abandons it (QEMU). The package format is cxlemu's (the spec leaves it to the vendor): a 64-byte
header (`payloads_fw.FW_IMAGE_HEADER`) with a CRC-32 of the body, checked when the transfer ends.
"""
from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Generator
from dataclasses import dataclass

from emulator.spec import payloads_fw as F
from emulator.spec.errors import ConfigError
from emulator.spec.retcodes import RetCode

CRC_SLICE = 1 << 20  # bytes authenticated per background slice (~1 ms)


class ImageError(ValueError):
    """A firmware package failed authentication; the message says why."""


def build_image(revision: str, body: bytes = b"") -> bytes:
    """A cxlemu firmware package carrying `revision` (at most 16 ASCII characters)."""
    if not revision.isascii() or not 1 <= len(revision) <= F.FW_REVISION_LEN:
        raise ConfigError(f"firmware revision {revision!r} must be 1-16 ASCII characters")
    if F.FW_IMAGE_HEADER.size + len(body) > F.FW_MAX_SIZE:
        raise ConfigError(f"firmware body of {len(body)} bytes exceeds the {F.FW_MAX_SIZE >> 20} MiB package limit")
    return _pack(revision.encode("ascii"), body)


def _pack(revision: bytes, body: bytes) -> bytes:
    return F.FW_IMAGE_HEADER.pack(magic=F.FW_IMAGE_MAGIC, version=F.FW_IMAGE_VERSION, body_len=len(body),
                                  body_crc32=zlib.crc32(body), revision=revision) + bytes(body)


def authenticate(image: bytes | memoryview) -> Generator[int, None, str]:
    """Check a package in slices (yielding percent); returns its revision or raises ImageError."""
    hdr_size = F.FW_IMAGE_HEADER.size
    if len(image) < hdr_size:
        raise ImageError(f"package of {len(image)} bytes is shorter than its {hdr_size}-byte header")
    hdr = F.FW_IMAGE_HEADER.unpack(image)
    if hdr["magic"] != F.FW_IMAGE_MAGIC or hdr["version"] != F.FW_IMAGE_VERSION:
        raise ImageError("not a cxlemu firmware package (bad magic or header version)")
    if hdr["body_len"] != len(image) - hdr_size:
        raise ImageError(f"header says {hdr['body_len']} body bytes, the package has {len(image) - hdr_size}")
    view, crc = memoryview(image)[hdr_size:], 0
    for start in range(0, len(view), CRC_SLICE):
        crc = zlib.crc32(view[start:start + CRC_SLICE], crc)
        yield min(99, (start + CRC_SLICE) * 100 // max(1, len(view)))
    if crc != hdr["body_crc32"]:
        raise ImageError("body CRC-32 does not match the header")
    revision = hdr["revision"].rstrip(b"\0")
    if not revision:
        raise ImageError("package has an empty revision")
    return revision.decode("ascii", errors="replace")


@dataclass
class Transfer:
    """A partial transfer (Init … End) in progress."""

    buf: bytearray
    prev_offset: int
    prev_len: int
    last_part_ns: int

    @property
    def end(self) -> int:
        return self.prev_offset + self.prev_len


class FwSlots:
    """The slots' packages and revisions, the active and staged slot, and an open transfer."""

    def __init__(self, initial_revision: str, *, slots: int = F.FW_SLOTS,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        if not 2 <= slots <= F.FW_MAX_SLOTS:
            raise ConfigError(f"slots must be 2..{F.FW_MAX_SLOTS} (§8.2.9.3.1), got {slots}")
        self.slots = slots
        self.revisions: list[str | None] = [initial_revision] + [None] * (slots - 1)
        # slot 1 holds the package the device booted (so the host can switch back to it);
        # DeviceConfig admits any 16 UTF-8 bytes as its revision, so pack those bytes as given
        self.images: list[bytes | None] = [_pack(initial_revision.encode(), b"")] + [None] * (slots - 1)
        # each package's CRC-32, kept with it: persistence saves the state every 200 ms, and a
        # 32 MiB package's CRC costs ~15 ms, too long for a firmware service to recompute each time
        self.crcs: list[int | None] = [zlib.crc32(self.images[0])] + [None] * (slots - 1)
        self.active = 1
        self.staged = 0
        self.transfer: Transfer | None = None
        self.clock = clock

    @property
    def active_revision(self) -> str:
        rev = self.revisions[self.active - 1]
        assert rev is not None, "the active slot always holds firmware"
        return rev

    def revision(self, slot: int) -> str | None:
        return self.revisions[slot - 1]

    # validation (the handler's synchronous checks) -------------------------------------------
    def target_slot_error(self, slot: int) -> RetCode | None:
        """FW Invalid Slot for a slot a package may not be written to: 0, past the last, active."""
        if slot == 0 or slot > self.slots or slot == self.active:
            return RetCode.FW_INVALID_SLOT
        return None

    def transfer_open(self) -> bool:
        """A partial transfer is open and not yet timed out (a stale one is dropped here)."""
        if self.transfer is not None and self.clock() - self.transfer.last_part_ns > F.FW_PART_TIMEOUT_NS:
            self.transfer = None
        return self.transfer is not None

    def check_part(self, action: int, slot: int, offset: int, length: int) -> RetCode | None:
        """The Transfer FW checks in QEMU's order, before a part's background job starts."""
        if action not in (F.XFER_FULL, F.XFER_INIT, F.XFER_CONTINUE, F.XFER_END):
            return RetCode.INVALID_INPUT
        if offset + length > F.FW_MAX_SIZE:
            return RetCode.INVALID_INPUT
        if self.transfer_open():
            if action in (F.XFER_FULL, F.XFER_INIT):
                return RetCode.FW_TRANSFER_IN_PROGRESS
            t = self.transfer
            assert t is not None
            if (offset, length) != (t.prev_offset, t.prev_len) and offset != t.end:
                return RetCode.FW_TRANSFER_OUT_OF_ORDER
        elif action in (F.XFER_CONTINUE, F.XFER_END):
            return RetCode.INVALID_INPUT  # no Init (or it timed out: QEMU treats that as no Init)
        if action in (F.XFER_FULL, F.XFER_END):
            return self.target_slot_error(slot)
        if action == F.XFER_INIT and offset != 0:
            return RetCode.INVALID_INPUT
        return None

    def activation_error(self, slot: int) -> RetCode | None:
        if self.transfer_open():
            return RetCode.FW_TRANSFER_IN_PROGRESS
        if self.target_slot_error(slot) is not None or self.revisions[slot - 1] is None:
            return RetCode.FW_INVALID_SLOT
        return None

    # state changes (run inside the background jobs) -----------------------------------------
    def write_part(self, action: int, offset: int, data: bytes) -> None:
        """Store one Init / Continue / End part at `offset` (bytes)."""
        if action == F.XFER_INIT:
            self.transfer = Transfer(bytearray(), 0, 0, self.clock())
        t = self.transfer
        assert t is not None, "check_part admits Continue / End only with an open transfer"
        del t.buf[offset:]  # a resent part replaces what it sent before
        t.buf += data
        t.prev_offset, t.prev_len, t.last_part_ns = offset, len(data), self.clock()

    def abort(self) -> None:
        """Abandon the open transfer (Transfer FW Abort, a failed End, or an aborted part)."""
        self.transfer = None

    def store(self, slot: int, image: bytes, revision: str) -> None:
        self.images[slot - 1], self.revisions[slot - 1] = image, revision
        self.crcs[slot - 1] = zlib.crc32(image)
        if self.staged == slot:  # a new package replaces the one staged from this slot
            self.staged = 0

    def activate(self, slot: int) -> None:
        self.active = slot
        if self.staged == slot:
            self.staged = 0

    def stage(self, slot: int) -> None:
        self.staged = slot

    # persistence (emulator/persist.py): slots are flash, they survive a power cycle -------------
    def to_state(self) -> dict[str, object]:
        """Revisions, active and staged slot; the packages travel separately (``images``)."""
        return {"slots": self.slots, "revisions": list(self.revisions), "active": self.active,
                "staged": self.staged, "crc32": list(self.crcs)}

    def restore(self, state: dict[str, object], images: list[bytes | None]) -> None:
        """Take back what ``to_state`` saved (with the packages it names), then reset as a power
        cycle does: a staged slot becomes active. A slot whose package is missing or does not
        match its CRC is left empty (the active slot keeps the booted firmware)."""
        revisions = list(state.get("revisions", []))  # type: ignore[call-overload]
        crcs = list(state.get("crc32", []))  # type: ignore[call-overload]
        for i in range(min(self.slots, len(revisions), len(images), len(crcs))):
            image = images[i]
            if revisions[i] is None or image is None or zlib.crc32(image) != crcs[i]:
                continue
            self.revisions[i], self.images[i], self.crcs[i] = revisions[i], image, crcs[i]
        active, staged = int(state.get("active", 1)), int(state.get("staged", 0))  # type: ignore[call-overload]
        if 1 <= active <= self.slots and self.revisions[active - 1] is not None:
            self.active = active
        if 1 <= staged <= self.slots and self.revisions[staged - 1] is not None:
            self.staged = staged
        self.cold_reset()

    def cold_reset(self) -> None:
        """What a cold reset does to the slots: a staged slot becomes the active one."""
        if self.staged:
            self.active, self.staged = self.staged, 0
        self.transfer = None
