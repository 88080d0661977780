"""Page access shared by the writer and the reader: the telemetry errors, the seqlock's aligned
uint64 cell, the region size check, and formatting and validating the page header."""
from __future__ import annotations

from typing import Any

import numpy as np

from emulator.spec.errors import CxlemuError
from emulator.spec.registers import TELEMETRY_OFFSET
from emulator.telemetry.layout import (
    _SECTION_HEAD_SIZE,
    FIRMWARE,
    FIRMWARE_OFFSET,
    HEADER,
    HOST,
    HOST_OFFSET,
    MAGIC,
    PAGE_SIZE,
    POOL,
    POOL_OFFSET,
    SECTION_SINCE,
    SECTIONS,
    VERSION_MAJOR,
    VERSION_MINOR,
)


class TelemetryError(CxlemuError):
    """The telemetry page cannot be used as asked."""


class TelemetryClaimed(TelemetryError):
    """Another live process already writes this section."""

    def __init__(self, section: str, pid: int) -> None:
        self.pid = pid
        super().__init__(f"telemetry section {section!r} is written by live process {pid}; "
                         "stop it or publish from that process")


def _u64_cell(region: Any, offset: int) -> np.ndarray:
    """A one-element uint64 view: its loads and stores are single aligned 8-byte accesses."""
    if offset % 8:
        raise ValueError(f"telemetry offset {offset:#x} is not 8-byte aligned; pass a page-aligned BAR")
    return np.ndarray((1,), dtype="<u8", buffer=region, offset=offset)


def _check_region(region: Any, offset: int) -> None:
    size = memoryview(region).nbytes
    if offset < 0 or offset + PAGE_SIZE > size:
        raise ValueError(f"a telemetry page at {offset:#x} needs {offset + PAGE_SIZE:#x} bytes, the "
                         f"region has {size:#x}; pass the whole BAR (or offset=0 for a bare page)")


def format_page(region: Any, offset: int = TELEMETRY_OFFSET) -> None:
    """Write the page header if it is missing, or raise an older minor's header to this one.
    Idempotent; every writer calls it, so concurrent calls write the same bytes. The magic (and,
    on an upgrade, the minor) goes last, so a reader that sees it sees the rest."""
    _check_region(region, offset)
    head = np.ndarray((), dtype=HEADER.dtype, buffer=region, offset=offset)
    values = {"version_major": VERSION_MAJOR, "version_minor": VERSION_MINOR, "page_size": PAGE_SIZE,
              "section_count": len(SECTIONS), "firmware_offset": FIRMWARE_OFFSET,
              "firmware_size": FIRMWARE.size, "host_offset": HOST_OFFSET, "host_size": HOST.size,
              "pool_offset": POOL_OFFSET, "pool_size": POOL.size}
    if int(head["magic"]) == MAGIC:
        problem = _header_problem(head)
        if problem is not None:
            raise TelemetryError(f"{problem}: recreate the device")
        if int(head["version_minor"]) < VERSION_MINOR:  # our sections extend (and follow) the older ones
            for name, value in values.items():
                head[name] = value
            head["version_minor"] = VERSION_MINOR
        return
    for name, value in values.items():
        head[name] = value
    head["magic"] = MAGIC


def page_sections(head: np.ndarray) -> list[str]:
    """The sections a formatted page of this major has: those its minor had added."""
    minor = int(head["version_minor"])
    return [name for name in SECTIONS if SECTION_SINCE[name] <= minor]


def _header_problem(head: np.ndarray) -> str | None:
    """Why a formatted page's header cannot be read or written by this layout (None: it can)."""
    major = int(head["version_major"])
    if major != VERSION_MAJOR:
        return (f"telemetry page has layout version {major}.{int(head['version_minor'])}, this code "
                f"reads and writes {VERSION_MAJOR}.x")
    for name in page_sections(head):
        rel = SECTIONS[name][1]
        at, size = int(head[f"{name}_offset"]), int(head[f"{name}_size"])
        if at != rel or size < _SECTION_HEAD_SIZE:
            return (f"telemetry page header puts the {name} section at {at:#x} (+{size:#x} B), layout "
                    f"{VERSION_MAJOR}.x has it at {rel:#x} (at least {_SECTION_HEAD_SIZE:#x} B)")
    return None
