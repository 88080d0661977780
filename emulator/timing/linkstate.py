"""The link-state page: where a device's link lives, shared by every process that maps the BAR.

It sits in the BAR's vendor area (``LINK_STATE_OFFSET``, ``LINK_STATE_SIZE`` in
``emulator.spec.registers``) so the monitor and exporter read the counters without asking
anyone.  All fields are little-endian u64, updated with atomic operations by the C core
(the pure-Python twin takes a process-wide lock instead).

::

    word   0  magic "CXLLINK1"          word 1  layout version
    word   8  read direction  (64 words) ─┐ +0 link_free ns (CLOCK_MONOTONIC)  +1 bytes
    word  72  write direction (64 words) ─┘ +2 transfers  +3 busy ns (link occupancy)
                                            +4 latency ns (sum of completion − request)
                                            +5 errors (range / poison)
                                            +8..+47 histogram: transfers whose completion −
                                                    request is in [2^k, 2^(k+1)) ns (k=0 also 0)
    word 136  device-internal copies: +1 bytes, +2 transfers
    word 160  the device state word: bits 0-31 boot generation, bit 32 UP, bit 33 MEDIA

The device's shared media (several hosts on one device, docs/pool-design.md section 1) is a block
of the same layout in its own file, ``MEDIA_LINK_FILE`` in the device directory, mapped by every
host: its directions' link_free is the media's free time, its counters the media's bytes,
transfers and busy ns (``media_words``, ``open_media``).

The word offsets repeat ``_datapath.h``; ``tests/emulator/timing/test_timing_datapath.py`` checks both agree.
The state word is set by the firmware and checked by every transfer here; why and when it
changes (boots, a dead firmware marked down) is ``emulator.liveness``'s.
"""
from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

from emulator.runtime_fs import open_private_file
from emulator.spec.registers import LINK_STATE_OFFSET, LINK_STATE_SIZE

MAGIC = int.from_bytes(b"CXLLINK1", "little")
VERSION = 1
DIRECTIONS = ("read", "write")
DIR_READ, DIR_WRITE = 0, 1

COPY_WORD = 136
FREE, BYTES, TRANSFERS, BUSY_NS, LATENCY_NS, ERRORS, HIST = 0, 1, 2, 3, 4, 5, 8
HIST_BUCKETS = 40
#: a real-time transfer of at most this many bytes takes the short path: its request time is
#: taken after its copy; a longer one's when the call begins (CXL_SHORT_BYTES)
SHORT_BYTES = 4096
USED_BYTES = (COPY_WORD + 8) * 8
_FIELDS = {"link_free_ns": FREE, "bytes": BYTES, "transfers": TRANSFERS,
           "busy_ns": BUSY_NS, "latency_ns": LATENCY_NS, "errors": ERRORS}


def dir_word(direction: int) -> int:
    """First u64 word of a direction's block."""
    return 8 + direction * 64


def words(region: memoryview) -> memoryview:
    """The page as a writable array of u64 words; rejects a region too small or misaligned."""
    mv = memoryview(region)
    if mv.readonly:
        raise ValueError("link_state must be a writable buffer (the BAR's link-state region)")
    if mv.nbytes < USED_BYTES:
        raise ValueError(f"link_state must be at least {USED_BYTES} bytes, got {mv.nbytes}")
    return mv.cast("B").cast("Q")


def initialize(w: memoryview) -> None:
    """Stamp magic and version on a zeroed page; a page already stamped is left as is
    (another process shares it).  A page with foreign contents is refused."""
    if w[0] == 0 and w[1] == 0:
        w[1] = VERSION
        w[0] = MAGIC
    elif w[0] != MAGIC or w[1] != VERSION:
        raise ValueError(f"link_state holds magic {w[0]:#x} version {w[1]}, not a cxlemu link "
                         f"page (magic {MAGIC:#x} version {VERSION}): wrong BAR offset?")


# ---- the shared media block -------------------------------------------------------------------
#: the device-wide media block's file in a device directory (LINK_STATE_SIZE bytes)
MEDIA_LINK_FILE = "media.link"


def media_words(region: Any) -> memoryview:
    """A media block (a ``MEDIA_LINK_FILE`` mapping, or any writable buffer of at least
    ``USED_BYTES``) as u64 words, stamped on first use: what ``DataPath(media=...)`` takes."""
    w = words(region)
    initialize(w)
    return w


def open_media(directory: Path) -> mmap.mmap:
    """Map ``directory``/``MEDIA_LINK_FILE``, creating it zeroed (``LINK_STATE_SIZE`` bytes, this
    user's only) if absent, and stamp it; every host of the device maps the same file."""
    fd = open_private_file(Path(directory) / MEDIA_LINK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        if os.fstat(fd).st_size < LINK_STATE_SIZE:
            os.ftruncate(fd, LINK_STATE_SIZE)
        mm = mmap.mmap(fd, LINK_STATE_SIZE, mmap.MAP_SHARED)
    finally:
        os.close(fd)
    w = media_words(mm)
    w.release()
    return mm


def snapshot(region: memoryview | bytes) -> dict[str, int]:
    """Counters as a flat dict: ``read_bytes``, ``write_link_free_ns``, ``read_hist_07``
    (transfers that took 128–255 ns), ``copy_bytes``, ...  Works on a read-only mapping."""
    raw = bytes(memoryview(region)[:USED_BYTES])
    w = struct.unpack_from(f"<{USED_BYTES // 8}Q", raw)
    out: dict[str, int] = {}
    for d, name in enumerate(DIRECTIONS):
        base = dir_word(d)
        for field, off in _FIELDS.items():
            out[f"{name}_{field}"] = w[base + off]
        for k in range(HIST_BUCKETS):
            out[f"{name}_hist_{k:02d}"] = w[base + HIST + k]
    out["copy_bytes"] = w[COPY_WORD + BYTES]
    out["copy_transfers"] = w[COPY_WORD + TRANSFERS]
    return out


def hist_bucket(ns: int) -> int:
    """Histogram bucket of a duration: floor(log2 ns), 0 for 0, capped at the last."""
    return min(max(ns.bit_length() - 1, 0), HIST_BUCKETS - 1)


# ---- the device state word -------------------------------------------------------------------
STATE_WORD = 160  # CXL_LS_STATE_WORD in _datapath.h (tests check they agree)
GEN_MASK = 0xFFFF_FFFF
UP = 1 << 32
MEDIA = 1 << 33
KEY = GEN_MASK | UP  # what must match for the device to be the same, live boot


def state_view(bar: Any) -> memoryview:
    """The BAR's state word as a one-element u64 view (writable where the BAR is)."""
    off = LINK_STATE_OFFSET + 8 * STATE_WORD
    return memoryview(bar).cast("B")[off:off + 8].cast("Q")


def serving_word(generation: int, media: bool = True) -> int:
    return (generation & GEN_MASK) | UP | (MEDIA if media else 0)


def next_generation(word: int) -> int:
    """The generation of a new boot after one that left ``word`` (never 0: 0 is 'never served')."""
    return (word & GEN_MASK) % GEN_MASK + 1


def state_cas(view: memoryview, expect: int, value: int) -> bool:
    """Compare-and-swap the state word (atomic across processes with the C core built)."""
    try:
        from emulator.timing._cdatapath import ffi, lib  # type: ignore[import-not-found]
    except ImportError:  # the pure-Python fallback: a plain check-then-store
        if view[0] != expect:
            return False
        view[0] = value
        return True
    ptr = ffi.cast("uint64_t *", ffi.from_buffer("uint8_t[]", view.cast("B")))
    return bool(lib.cxl_state_cas(ptr, expect, value))


class WordCas:
    """Compare-and-swap on the u64 words of a shared buffer (a mapped extent of the media), the
    same atomic operation as ``state_cas``: ``cas(i, expect, value)`` on word ``i``. Holds the
    buffer exported until ``release``."""

    def __init__(self, buffer: Any) -> None:
        self._words: memoryview | None = None
        try:
            from emulator.timing._cdatapath import ffi, lib  # type: ignore[import-not-found]
        except ImportError:  # the pure-Python fallback: a plain check-then-store, as state_cas's
            self._words = memoryview(buffer).cast("B").cast("Q")
            self._ffi, self._ptr, self._fn = None, None, None
            return
        self._ffi, self._fn = ffi, lib.cxl_state_cas
        self._ptr = ffi.cast("uint64_t *", ffi.from_buffer("uint8_t[]", buffer, require_writable=True))

    def __call__(self, i: int, expect: int, value: int) -> bool:
        if self._fn is not None:
            return bool(self._fn(self._ptr + i, expect, value))
        assert self._words is not None, "WordCas used after release"
        if self._words[i] != expect:
            return False
        self._words[i] = value
        return True

    def release(self) -> None:
        """Let go of the buffer (before its mapping closes)."""
        if self._words is not None:
            self._words.release()
        self._ptr = self._fn = self._words = None


def gone_reason(word: int, expected: int) -> str | None:
    """Why a handle opened when the word read ``expected`` may no longer use the device, or None."""
    if word & KEY == expected & KEY:
        return None
    if word & GEN_MASK != expected & GEN_MASK:
        return "its firmware was restarted since this handle was opened: open the device again"
    return "its firmware stopped"
