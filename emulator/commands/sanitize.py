"""Sanitize and Secure Erase (CXL r3.1 §8.2.9.9.5.1-2): erase in the background, media disabled.

    Sanitize ──▶ media disabled (the dispatcher answers Media Disabled to media commands)
             ──▶ job, per slice: zero a chunk of media and its poison bits
             ──▶ last slice: zero the LSA, forget the poison list, discard event records
             ──▶ media enabled, return Success

Zeroing writes zeros over the media, never punches holes in its file: its pages stay reserved
(emulator/runtime_fs.py), so a host's later write cannot find the disk full and die of SIGBUS.
Rewriting every line also removes all poison. The job paces itself on the link model
(a real sanitize overwrites the whole media): the first n bytes are done no sooner than a write of
n bytes on the idle link completes (`sanitize_ns`); on an untimed link it runs as fast as the
work goes. It cannot be aborted: the spec keeps media disabled after a sanitize
that did not finish, so stopping half-way would only leave the device unusable.

Secure Erase (§8.2.9.9.5.2, opcode 4401h; Linux `cxl sanitize-memdev --erase`, sysfs
`security/erase`) erases the *user data* "by changing the media encryption keys for all user data
areas of the device". cxlemu gives it Sanitize's job shape (media disabled while it runs: a
half-erased device holds neither the old data nor the new), with these differences, each from
what the spec and Linux's ABI text (Documentation/ABI/testing/sysfs-bus-cxl) say of the two:

    Secure Erase ──▶ media disabled while it runs (media commands answer Media Disabled)
                 ──▶ job, per slice: zero a chunk of media and its poison bits
                 ──▶ last slice: forget the poison list and the last scan's results
                 ──▶ media enabled, return Success

- user data only: the LSA and the event logs are kept. Sanitize makes "all user data and
  meta-data, whether it resides in persistent capacity, volatile capacity, or the label storage
  area" unavailable, and QEMU's sanitize also discards the event records;
- not paced at the write bandwidth: a key change does not rewrite the media, so the job runs as
  fast as zeroing the file goes (still in slices, so the mailbox stays responsive);
- the media is re-enabled however the job ends (the "media disabled until a successful Sanitize"
  rule is Sanitize's alone); it cannot be aborted either, a half-erased device being of no use.
- its precondition "security applied to the user data areas disabled or unlocked" always holds:
  cxlemu has no passphrases (Get Security State answers 0).

Poison goes with the data: the erased lines hold new (zero) contents, so no line stays poisoned.
No input payload. The dispatcher's rules refuse it as they refuse Sanitize: Busy while any
background command runs (a Sanitize or Secure Erase included), Media Disabled while the media is.
QEMU does not implement 4401h (its table has Sanitize and Media Operations only). Linux's cxl_pci
waits asynchronously only for Sanitize: it sends Secure Erase with no background poll budget, so
under Linux a Secure Erase must be done by the time its doorbell clears (a real key change is);
cxlemu's own driver waits for it like any background command.
"""
from __future__ import annotations

import mmap
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from emulator.commands.scan import ScanState, paced_slices
from emulator.mailbox import BackgroundJob, Effect, command
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_poison import POISON_LINE
from emulator.spec.retcodes import RetCode
from firmware_model.link import WRITE, LinkParams

if TYPE_CHECKING:
    from emulator.firmware import Firmware

SLICE_BYTES = 32 << 20  # one slice zeroes this much media: a few ms even when writing zeros
_LINES_PER_BITMAP_BYTE = 8


@command(Opcode.SANITIZE, "Sanitize", in_len=0, needs_media=True,
         effects=Effect.IMMEDIATE_DATA_CHANGE | Effect.SECURITY_STATE_CHANGE | Effect.BACKGROUND_OPERATION,
         persistent=True)
def sanitize(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    fw.media_disabled = True
    fw.start_background(Opcode.SANITIZE, _sanitize(fw), abortable=False)
    return RetCode.BACKGROUND_COMMAND_STARTED, b""


def sanitize_ns(link: LinkParams, nbytes: int) -> int:
    """How long rewriting the first ``nbytes`` of the media takes: one write of that many bytes
    at DPA 0 on the device's idle ``link``, the link model's figure (whole transactions, latency
    once; 0 on an untimed link)."""
    return link.duration_ns(WRITE, nbytes)


def _zero_media(fw: Firmware, cost_ns: Callable[[int], float] | None) -> BackgroundJob:
    """Zero the media and its poison bits in slices no faster than ``cost_ns`` (None: as fast as
    the work goes), yielding percent complete. The whole media: static capacity and DC regions."""
    capacity = fw.config.media_bytes
    for lo, hi in paced_slices(capacity, cost_ns, SLICE_BYTES, granule=mmap.PAGESIZE):
        _zero_slice(fw, lo, hi)
        yield 100 * hi // capacity
    return RetCode.SUCCESS


def _sanitize(fw: Firmware) -> BackgroundJob:
    yield from _zero_media(fw, partial(sanitize_ns, fw.config.timing.link_params()))
    fw.lsa[:] = 0
    fw.poison.reset()
    fw.events.discard_all()
    fw.scan_media = ScanState()  # the last scan's findings describe media that no longer exists
    fw.media_disabled = False  # only a sanitize that completed re-enables the media (§8.2.9.9.5.1)
    return RetCode.SUCCESS


@command(Opcode.SECURE_ERASE, "Secure Erase", in_len=0, needs_media=True,
         effects=Effect.IMMEDIATE_DATA_CHANGE | Effect.SECURITY_STATE_CHANGE | Effect.BACKGROUND_OPERATION,
         persistent=True)
def secure_erase(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    fw.media_disabled = True
    fw.start_background(Opcode.SECURE_ERASE, _secure_erase(fw), abortable=False)
    return RetCode.BACKGROUND_COMMAND_STARTED, b""


def _secure_erase(fw: Firmware) -> BackgroundJob:
    """User data only: media and poison go, the LSA and the event logs stay (module docstring)."""
    try:
        yield from _zero_media(fw, None)  # a key change: no pacing at the write bandwidth
        fw.poison.reset()
        fw.scan_media = ScanState()
    finally:
        fw.media_disabled = False
    return RetCode.SUCCESS


def _zero_slice(fw: Firmware, lo: int, hi: int) -> None:
    """Zero media [lo, hi) and clear its lines' poison bits. Slices start and end on page
    boundaries or at the capacity (a multiple of 256 MiB): whole pages and bitmap bytes."""
    if hi <= lo:
        return
    fw.media[lo:hi] = 0
    per_byte = POISON_LINE * _LINES_PER_BITMAP_BYTE
    fw.poison_bits[lo // per_byte:hi // per_byte] = 0
