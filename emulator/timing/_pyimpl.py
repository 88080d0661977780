"""The pure-Python twin of the C core (``_datapath.c``): same arithmetic, same counters.

Its link arithmetic (charged bytes, occupancy, reservation, completion) is the firmware model's
(``firmware_model.link``), applied to the link-state words in shared memory; the C core is
checked against both by the differential tests (tests/firmware_model/test_link_model.py). It is the fallback
when the extension is not built. Link-state updates are atomic within a process (one lock);
across processes only the C core's compare-and-swap is — a process sharing a link should use
``impl="c"``.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from emulator.timing import linkstate as ls
from emulator.timing._buffers import host_view
from emulator.timing.access import AccessMap, first_without_extent
from emulator.timing.config import LinkParams
from firmware_model import link as _link

E_RANGE, E_POISON, E_GONE, E_DISABLED, E_NO_EXTENT = -1, -2, -3, -4, -5
_U64 = (1 << 64) - 1
_LINK_LOCK = threading.Lock()
_SLEEP_ABOVE_NS, _SLEEP_MARGIN_NS = 20_000_000, 5_000_000


def wait_until(deadline: int) -> None:
    """Sleep only the bulk of a very long wait (timer wake-ups are late by up to ms on a
    VM), spin the rest (mirrors ``cxl_wait_until``)."""
    remaining = deadline - time.monotonic_ns()
    if remaining > _SLEEP_ABOVE_NS:
        time.sleep((remaining - _SLEEP_MARGIN_NS) / 1e9)
    while time.monotonic_ns() < deadline:
        pass


def first_poisoned(poison_bits: np.ndarray, dpa: int, n: int) -> int | None:
    """DPA of the first poisoned 64-B line in [dpa, dpa+n) of a poison bitmap (line i: byte i>>3,
    bit i&7), or None. Lines past the bitmap's end count as clean."""
    if n == 0:
        return None
    first, last = dpa >> 6, min((dpa + n - 1) >> 6, poison_bits.size * 8 - 1)
    if last < first:
        return None
    chunk = poison_bits[first >> 3:(last >> 3) + 1]
    if not chunk.any():
        return None
    bits = np.unpackbits(chunk, bitorder="little")[(first & 7):(first & 7) + last - first + 1]
    hits = np.flatnonzero(bits)
    return int(first + hits[0]) << 6 if hits.size else None


class PyCore:
    """Timed transfers over a media buffer; errors come back as (code, dpa) like the C core."""

    def __init__(self, media: memoryview, poison: memoryview | None, link: memoryview,
                 params: LinkParams, comp_ns: int = 0, state: tuple[memoryview, int] | None = None,
                 media_link: memoryview | None = None, access: AccessMap | None = None) -> None:
        self.state = state
        # the shared media block (as the C core: used only where params limit the media)
        self.media_link = media_link if params.media_limited else None
        self.media = media
        self.size = media.nbytes
        self.poison = np.frombuffer(poison, dtype=np.uint8) if poison is not None else None
        # the DC access bitmap (a read-only view, read afresh at every transfer) and its range
        self.access = None if access is None else np.frombuffer(access.bits, dtype=np.uint8)
        self.access_base, self.access_shift = (0, 0) if access is None else (access.base, access.shift)
        self.link = link
        self.params = params
        self.comp_ns = comp_ns
        self.err_dpa = 0

    def close(self) -> None:
        self.poison = self.access = None

    # -- validation ---------------------------------------------------------------------
    def first_poison(self, dpa: int, n: int) -> int | None:
        """DPA of the first poisoned 64-B line in [dpa, dpa+n), or None."""
        return None if self.poison is None else first_poisoned(self.poison, dpa, n)

    def _validate(self, d: int, dpa: int, n: int, check_poison: bool) -> int:
        if self.state is not None and self.state[0][0] != self.state[1]:
            self._count_error(d)
            return E_DISABLED if self.state[0][0] & ls.KEY == self.state[1] & ls.KEY else E_GONE
        if dpa > self.size or n > self.size - dpa:
            self._count_error(d)
            return E_RANGE
        if self.access is not None:  # before poison, as the C core
            hole = first_without_extent(self.access, self.access_base, self.access_shift, dpa, n)
            if hole is not None:
                self.err_dpa = hole
                self._count_error(d)
                return E_NO_EXTENT
        if check_poison:
            bad = self.first_poison(dpa, n)
            if bad is not None:
                self.err_dpa = bad
                self._count_error(d)
                return E_POISON
        return 0

    # -- link accounting ----------------------------------------------------------------
    def _add(self, word: int, value: int) -> None:
        self.link[word] = (self.link[word] + value) & _U64

    def _count_error(self, d: int) -> None:
        with _LINK_LOCK:
            self._add(ls.dir_word(d) + ls.ERRORS, 1)

    def _reserve(self, d: int, req: int, occ: int) -> int:
        """Caller holds _LINK_LOCK."""
        word = ls.dir_word(d) + ls.FREE
        start = _link.reserve(self.link[word], req, occ)
        if occ:
            self.link[word] = start + occ
        return start

    def _hold(self, d: int, dpa: int, n: int, req: int, count: bool) -> tuple[int, int]:
        """Reserve direction d's link and the shared media for a transfer (the model's
        ``Link._hold`` on the shared words); (link occupancy, when both are released).
        Caller holds _LINK_LOCK."""
        occ = self.params.occupancy(d, dpa, n)
        occ_m = self.params.media_occupancy(d, dpa, n) if self.media_link is not None else 0
        if occ_m == 0:
            start = self._reserve(d, req, occ)
            return occ, start + occ
        word, media = ls.dir_word(d) + ls.FREE, self.media_link
        start = _link.reserve_shared(self.link[word], media[word], req, occ, occ_m)
        if occ:
            self.link[word] = start + occ
        media[word] = start + occ_m
        base = ls.dir_word(d)
        for off, value in ((ls.BYTES, n), (ls.TRANSFERS, 1), (ls.BUSY_NS, occ_m)) if count else \
                ((ls.BUSY_NS, occ_m),):
            media[base + off] = (media[base + off] + value) & _U64
        return occ, start + max(occ, occ_m)

    # -- transfers ----------------------------------------------------------------------
    def transfer(self, d: int, dpa: int, buf: Any, now: int, wait: bool) -> int:
        """Read (d=0: media→host) or write (d=1: host→media); now < 0 means real time."""
        real = now < 0
        host = host_view(buf, writable=d == ls.DIR_READ)
        n = host.nbytes
        # as the C core: a real-time transfer longer than the short path is requested before its
        # validation (a poison scan), which so runs inside its link time; a short one after it
        req = time.monotonic_ns() if real and n > ls.SHORT_BYTES and not self.params.untimed else None
        rc = self._validate(d, dpa, n, check_poison=(d == ls.DIR_READ))
        if rc:
            return rc
        base = ls.dir_word(d)
        if self.params.untimed:
            if n:
                self._copy(d, dpa, host)
                with _LINK_LOCK:
                    self._add(base + ls.BYTES, n)
                    self._add(base + ls.TRANSFERS, 1)
            return 0 if real else now
        if req is None:
            req = time.monotonic_ns() if real else now
        if n == 0:
            return req
        lat = self.params.lat_ns[d]
        with _LINK_LOCK:
            occ, link_done = self._hold(d, dpa, n, req, count=True)
            completion = link_done + lat
            for off, value in ((ls.BYTES, n), (ls.TRANSFERS, 1), (ls.BUSY_NS, occ),
                               (ls.LATENCY_NS, completion - req),
                               (ls.HIST + ls.hist_bucket(completion - req), 1)):
                self._add(base + off, value)
        self._copy(d, dpa, host)
        if real and wait:
            copied = time.monotonic_ns() if lat else 0
            wait_until(max(link_done, copied) + lat - self.comp_ns)
        return completion

    def _copy(self, d: int, dpa: int, host: memoryview) -> None:
        if d == ls.DIR_READ:
            host[:] = self.media[dpa:dpa + host.nbytes]
        else:
            self.media[dpa:dpa + host.nbytes] = host

    def copy(self, src: int, dst: int, n: int, now: int, wait: bool) -> int:
        """Device-internal copy: holds both directions, pays both latencies once."""
        rc = self._validate(ls.DIR_READ, src, n, check_poison=True) or \
            self._validate(ls.DIR_WRITE, dst, n, check_poison=False)
        if rc:
            return rc
        real = now < 0
        if self.params.untimed:
            if n:
                self.media[dst:dst + n] = bytes(self.media[src:src + n])
                with _LINK_LOCK:
                    self._add(ls.COPY_WORD + ls.BYTES, n)
                    self._add(ls.COPY_WORD + ls.TRANSFERS, 1)
            return 0 if real else now
        req = time.monotonic_ns() if real else now
        if n == 0:
            return req
        lat = self.params.lat_ns[ls.DIR_READ] + self.params.lat_ns[ls.DIR_WRITE]
        with _LINK_LOCK:
            occ_r, done_r = self._hold(ls.DIR_READ, src, n, req, count=False)
            occ_w, done_w = self._hold(ls.DIR_WRITE, dst, n, req, count=False)
            link_done = max(done_r, done_w)
            self._add(ls.COPY_WORD + ls.BYTES, n)
            self._add(ls.COPY_WORD + ls.TRANSFERS, 1)
            self._add(ls.dir_word(ls.DIR_READ) + ls.BUSY_NS, occ_r)
            self._add(ls.dir_word(ls.DIR_WRITE) + ls.BUSY_NS, occ_w)
        self.media[dst:dst + n] = bytes(self.media[src:src + n])
        if real and wait:
            copied = time.monotonic_ns() if lat else 0
            wait_until(max(link_done, copied) + lat - self.comp_ns)
        return link_done + lat

    def untimed(self, d: int, dpa: int, host: memoryview) -> int:
        rc = self._validate(d, dpa, host.nbytes, check_poison=(d == ls.DIR_READ))
        if rc == 0:
            self._copy(d, dpa, host)
        return rc
