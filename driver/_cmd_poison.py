"""Typed wrappers of media, poison and sanitize commands (CXL r3.1 §8.2.9.9.4-5).

    md.inject_poison(0x1000)
    plist = md.get_poison_list()                 # whole device; follows "more" to the end
    md.clear_poison(0x1000, bytes(64))
    res = md.scan_media(progress=print)          # background; then its results
    md.sanitize(progress=bar.update)             # background; media disabled meanwhile

Bad arguments (unaligned or out-of-range DPAs, wrong data length) raise ValueError before the
device sees them; device refusals raise MailboxError. `send()` stays the raw path for tests that
want the device's own answer to bad input.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from driver._cmd_base import CommandMixin
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_poison import (
    CLEAR_POISON,
    DPA_RANGE,
    INJECT_POISON,
    MEDIA_ERROR_RECORD,
    POISON_FLAG_MORE,
    POISON_FLAG_OVERFLOW,
    POISON_FLAG_SCAN_RUNNING,
    POISON_LINE,
    POISON_LIST_LIMIT,
    POISON_LIST_OUT,
    SCAN_FLAG_NO_EVENT_LOG,
    SCAN_MEDIA,
    SCAN_MEDIA_CAPS_OUT,
    SCAN_RESULTS_FLAG_MORE,
    SCAN_RESULTS_FLAG_STOPPED,
    SCAN_RESULTS_OUT,
    SOURCE_MASK,
    PoisonSource,
)

Progress = Callable[[int], None]


@dataclass(frozen=True)
class MediaError:
    """A Media Error Record: `dpa` and `length` in bytes."""

    dpa: int
    length: int
    source: str  # unknown, external, internal, injected, vendor

    def to_json(self) -> dict[str, Any]:
        return {"dpa": self.dpa, "length": self.length, "source": self.source}


@dataclass(frozen=True)
class PoisonList:
    records: list[MediaError]
    overflow: bool
    overflow_timestamp: int  # device time the list overflowed (0 unless overflow)
    scan_running: bool


@dataclass(frozen=True)
class ScanMediaResults:
    records: list[MediaError]
    stopped_prematurely: bool
    restart_dpa: int
    restart_length: int  # bytes left to scan


def _source_name(value: int) -> str:
    try:
        return PoisonSource(value).name.lower()
    except ValueError:
        return f"reserved({value})"


def decode_media_errors(buf: bytes, offset: int, count: int) -> list[MediaError]:
    out = []
    for i in range(count):
        r = MEDIA_ERROR_RECORD.unpack(buf, offset + i * MEDIA_ERROR_RECORD.size)
        out.append(MediaError(r["address"] & ~SOURCE_MASK, r["length"] * POISON_LINE,
                              _source_name(r["address"] & SOURCE_MASK)))
    return out


class PoisonCommands(CommandMixin):
    """Mixin: needs `call(opcode, payload, progress=) -> bytes` and `config.capacity`."""

    config: Any


    def _dpa_range(self, dpa: int, length: int | None) -> tuple[int, int]:
        """Validate [dpa, dpa+length) (length None: to the end); returns (dpa, 64-B units)."""
        capacity = self.config.capacity
        length = capacity - dpa if length is None else length
        if dpa < 0 or length < 0 or dpa % POISON_LINE or length % POISON_LINE or dpa + length > capacity:
            raise ValueError(f"range [{dpa:#x}, {dpa + length:#x}) must be 64-B aligned and inside the "
                             f"device's {capacity:#x} bytes")
        return dpa, length // POISON_LINE

    def _line(self, dpa: int) -> int:
        capacity = self.config.capacity
        if dpa < 0 or dpa % POISON_LINE or dpa + POISON_LINE > capacity:
            raise ValueError(f"DPA {dpa:#x} must be a multiple of 64 below the device's {capacity:#x} bytes")
        return dpa

    # poison -----------------------------------------------------------------------------------
    def get_poison_list(self, dpa: int = 0, length: int | None = None) -> PoisonList:
        """Get Poison List over [dpa, dpa+length), repeated while the device says "more" (Linux
        cxl_mem_get_poison stops at the list's size too, against an uncleared more flag)."""
        address, lines = self._dpa_range(dpa, length)
        records: list[MediaError] = []
        while True:
            out = self.call(Opcode.GET_POISON_LIST, DPA_RANGE.pack(address=address, length=lines))
            h = POISON_LIST_OUT.unpack(out)
            records += decode_media_errors(out, POISON_LIST_OUT.size, h["count"])
            if not h["flags"] & POISON_FLAG_MORE or len(records) >= POISON_LIST_LIMIT:
                break
        return PoisonList(records, bool(h["flags"] & POISON_FLAG_OVERFLOW), h["overflow_ts"],
                          bool(h["flags"] & POISON_FLAG_SCAN_RUNNING))

    def inject_poison(self, dpa: int) -> None:
        self.call(Opcode.INJECT_POISON, INJECT_POISON.pack(address=self._line(dpa)))

    def clear_poison(self, dpa: int, data: bytes = bytes(POISON_LINE)) -> None:
        """Clear Poison: the device writes `data` (64 bytes) to the line and unpoisons it."""
        if len(data) != POISON_LINE:
            raise ValueError(f"Clear Poison writes exactly {POISON_LINE} bytes, got {len(data)}")
        self.call(Opcode.CLEAR_POISON, CLEAR_POISON.pack(address=self._line(dpa), data=bytes(data)))

    # scan media -------------------------------------------------------------------------------
    def scan_media_estimate_ms(self, dpa: int = 0, length: int | None = None) -> int:
        """Get Scan Media Capabilities: the device's estimate of a scan's duration."""
        address, lines = self._dpa_range(dpa, length)
        out = self.call(Opcode.GET_SCAN_MEDIA_CAPABILITIES, DPA_RANGE.pack(address=address, length=lines))
        return int(SCAN_MEDIA_CAPS_OUT.unpack(out)["estimated_ms"])

    def scan_media(self, dpa: int = 0, length: int | None = None, *, log_events: bool = True,
                   progress: Progress | None = None) -> ScanMediaResults:
        """Scan Media (background) to completion, then all of Get Scan Media Results."""
        address, lines = self._dpa_range(dpa, length)
        flags = 0 if log_events else SCAN_FLAG_NO_EVENT_LOG
        self.call(Opcode.SCAN_MEDIA, SCAN_MEDIA.pack(address=address, length=lines, flags=flags), progress=progress)
        return self.scan_media_results()

    def scan_media_results(self) -> ScanMediaResults:
        """Get Scan Media Results until no "more" (each answer consumes what it returned)."""
        records: list[MediaError] = []
        while True:
            out = self.call(Opcode.GET_SCAN_MEDIA_RESULTS)
            h = SCAN_RESULTS_OUT.unpack(out)
            records += decode_media_errors(out, SCAN_RESULTS_OUT.size, h["count"])
            if not h["flags"] & SCAN_RESULTS_FLAG_MORE:
                break
        return ScanMediaResults(records, bool(h["flags"] & SCAN_RESULTS_FLAG_STOPPED), h["restart_address"],
                                h["restart_length"] * POISON_LINE)

    # sanitize ---------------------------------------------------------------------------------
    def sanitize(self, progress: Progress | None = None) -> None:
        """Sanitize (background): zeroes media and LSA, clears poison and events; `progress`
        gets each new percent complete while it runs."""
        self.call(Opcode.SANITIZE, progress=progress)

