"""Scan Media: capabilities, the background scan, its results (CXL r3.1 §8.2.9.9.4.4-6).

The emulated media has no ECC to check: the poison bitmap is the truth about which lines are bad,
so the scan reads the bitmap, slice by slice, and takes as long as QEMU's cost model says a device
would: 0.5 us per 64-B line (`SCAN_NS_PER_LINE`, times the device's time_scale). Each slice covers
the lines that elapsed time allows, so the duration Get Scan Media Capabilities estimates is the
duration the scan takes, and progress is honest.

    Scan Media(range) ──▶ job: for each slice ──▶ bad runs in the bitmap ──▶ list new ones
                                                  (source Internal, failure event unless the
                                                   no-event-log flag) + remember for results
    Request Abort ──▶ job closed: results say "stopped prematurely" and where to restart
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from emulator.commands.poison import check_range, encode_records
from emulator.mailbox import BackgroundJob, Effect, command
from emulator.poison import PoisonRecord
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_events import TransactionType
from emulator.spec.payloads_poison import (
    DPA_RANGE,
    MAX_SCAN_RECORDS_PER_GET,
    POISON_LINE,
    SCAN_FLAG_NO_EVENT_LOG,
    SCAN_MEDIA,
    SCAN_MEDIA_CAPS_OUT,
    SCAN_NS_PER_LINE,
    SCAN_RESULTS_FLAG_MORE,
    SCAN_RESULTS_FLAG_STOPPED,
    SCAN_RESULTS_OUT,
    PoisonSource,
)
from emulator.spec.retcodes import RetCode

if TYPE_CHECKING:
    from emulator.firmware import Firmware

MAX_LINES_PER_SLICE = 1 << 18  # 16 MiB of media, 32 KiB of bitmap: well under 5 ms of work
PACED_NAP_S = 0.0005  # FirmwareRunner's idle_sleep_s: how long an idle firmware leaves the mailbox


@dataclass
class ScanState:
    """The last scan's results, consumed as Get Scan Media Results returns them (QEMU)."""

    has_run: bool = False
    results: list[PoisonRecord] = field(default_factory=list)
    stopped: bool = False
    restart_dpa: int = 0
    restart_lines: int = 0

    def note(self, rec: PoisonRecord) -> None:
        """Append a found range, joining one a slice boundary cut in two."""
        last = self.results[-1] if self.results else None
        if last is not None and last.end == rec.dpa and last.source == rec.source:
            self.results[-1] = PoisonRecord(last.dpa, last.length + rec.length, last.source)
        else:
            self.results.append(rec)


def paced_slices(total: int, cost_ns: Callable[[int], float] | None, max_per_slice: int,
                 granule: int = 1) -> Iterator[tuple[int, int]]:
    """Split [0, total) into slices done no faster than ``cost_ns(n)``, the ns by which the first
    ``n`` units may be done (it grows with ``n``; None or 0 for all: as fast as the work goes),
    each ending on a multiple of `granule` or at `total`.

    A paced job that is ahead of its schedule naps (at most the runner's own idle nap) until a
    slice's worth of work is due, rather than yielding empty slices in a busy loop; a slice can
    still be empty, and the mailbox is never kept waiting longer than an idle firmware keeps it."""
    t0 = time.monotonic_ns()
    done = 0
    cost = cost_ns if cost_ns is not None and cost_ns(total) > 0 else None
    chunk = total if cost is None else max(granule, _units_within(cost, PACED_NAP_S * 1e9, total))
    while done < total:
        allowed = total
        if cost is not None:
            wait_ns = t0 + cost(min(total, done + chunk)) - time.monotonic_ns()
            if wait_ns > 0:
                time.sleep(min(wait_ns / 1e9, PACED_NAP_S))
            allowed = _units_within(cost, time.monotonic_ns() - t0, total)
        hi = min(allowed, done + max_per_slice)
        if hi < total:
            hi = max(done, hi - hi % granule)
        yield done, hi
        done = hi


def _units_within(cost_ns: Callable[[int], float], budget_ns: float, total: int) -> int:
    """The most units, up to ``total``, done within ``budget_ns`` (bisection: ``cost_ns`` need
    not be linear, the link model's is not)."""
    lo, hi = 0, total
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost_ns(mid) <= budget_ns:
            lo = mid
        else:
            hi = mid - 1
    return lo


def scan_ns_per_line(fw: Firmware) -> float:
    return SCAN_NS_PER_LINE * fw.config.timing.time_scale


def _linear(ns_per_unit: float) -> Callable[[int], float]:
    return lambda n: n * ns_per_unit


def scan_running(fw: Firmware) -> bool:
    return fw.background_running and fw.background_status[2] == Opcode.SCAN_MEDIA


@command(Opcode.GET_SCAN_MEDIA_CAPABILITIES, "Get Scan Media Capabilities", in_len=DPA_RANGE.size,
         needs_media=True)
def get_scan_media_capabilities(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    q = DPA_RANGE.unpack(payload)
    refused = check_range(fw, q["address"], q["length"])
    if refused is not None:
        return refused, b""
    estimate_ms = max(1, round(q["length"] * scan_ns_per_line(fw) / 1e6))  # QEMU: at least 1 ms
    return RetCode.SUCCESS, SCAN_MEDIA_CAPS_OUT.pack(estimated_ms=min(estimate_ms, 0xFFFF_FFFF))


@command(Opcode.SCAN_MEDIA, "Scan Media", in_len=SCAN_MEDIA.size, needs_media=True,
         effects=Effect.BACKGROUND_OPERATION | Effect.REQUEST_ABORT_SUPPORTED, persistent=True)
def scan_media(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    q = SCAN_MEDIA.unpack(payload)
    refused = check_range(fw, q["address"], q["length"])
    if refused is not None:
        return refused, b""
    fw.scan_media = state = ScanState(has_run=True)  # a new scan discards the last one's results
    log_events = not q["flags"] & SCAN_FLAG_NO_EVENT_LOG
    fw.start_background(Opcode.SCAN_MEDIA, _scan(fw, state, q["address"], q["length"], log_events))
    return RetCode.BACKGROUND_COMMAND_STARTED, b""


def _scan(fw: Firmware, state: ScanState, start: int, lines: int, log_events: bool) -> BackgroundJob:
    transaction = TransactionType.HOST_SCAN_MEDIA if log_events else None
    end = start + lines * POISON_LINE

    def found(lo: int, hi: int) -> None:
        fw.poison.add(lo, hi - lo, PoisonSource.INTERNAL, transaction=transaction)
        for rec in fw.poison.describe(lo, hi):
            state.note(rec)

    done = 0
    pending: tuple[int, int] | None = None  # a run reaching a slice's end may go on in the next
    try:
        for lo, hi in paced_slices(lines, _linear(scan_ns_per_line(fw)), MAX_LINES_PER_SLICE):
            if hi > lo:
                a, b = start + lo * POISON_LINE, start + hi * POISON_LINE
                runs = fw.poison.bad_runs(a, b)
                if pending is not None and runs and runs[0][0] == pending[1]:
                    runs[0] = (pending[0], runs[0][1])
                elif pending is not None:
                    found(*pending)
                pending = runs.pop() if runs and runs[-1][1] == b < end else None
                for run in runs:
                    found(*run)
                done = hi
            yield 100 * done // lines
    finally:
        if pending is not None:
            found(*pending)
        if done < lines:  # aborted (GeneratorExit) or failed: say where to pick up
            state.stopped = True
            state.restart_dpa, state.restart_lines = start + done * POISON_LINE, lines - done
    if fw.poison.overflowed and fw.poison.all_listed():
        fw.poison.clear_overflow()  # only a scan that found room for everything clears it (QEMU)
    return RetCode.SUCCESS


@command(Opcode.GET_SCAN_MEDIA_RESULTS, "Get Scan Media Results", in_len=0, needs_media=True)
def get_scan_media_results(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
    state: ScanState = fw.scan_media
    if not state.has_run:
        return RetCode.UNSUPPORTED, b""  # QEMU: no Scan Media since reset
    if scan_running(fw):
        return RetCode.BUSY, b""  # the results are not complete yet
    batch = state.results[:MAX_SCAN_RECORDS_PER_GET]
    del state.results[:len(batch)]
    flags = (SCAN_RESULTS_FLAG_MORE if state.results else 0) | (SCAN_RESULTS_FLAG_STOPPED if state.stopped else 0)
    head = SCAN_RESULTS_OUT.pack(restart_address=state.restart_dpa, restart_length=state.restart_lines,
                                 flags=flags, count=len(batch))
    return RetCode.SUCCESS, head + encode_records(batch)
