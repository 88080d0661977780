"""The CHMU, device side: a CXL 3.2 Hotness Monitoring Unit over `firmware_model.hotness`.

The register layout is ``emulator.spec.chmu``; the host's side (configure, read the hotlist) is
``driver.chmu.ChmuRegs``. The device applies the host's configuration, ends epochs and publishes
the hotlist and status on every firmware pass.
Shared-memory deviations: RW1C cannot be told apart from "no write" on a shared BAR (see
emulator/component.py), so the host clears STATUS.overflow / fill by writing 0 to the bit; RESET is
set by the host and cleared by the device when done (like the doorbell). Configuration is latched
when ENABLE goes 0 -> 1; an invalid one leaves the unit disabled and ``last_error`` says why.
"""
from __future__ import annotations

import threading

import numpy as np

from emulator.regfile import ChmuRegView
from emulator.spec.chmu import (
    BITMAP_OFF,
    BITMAP_REL,
    CAP0,
    CAP1,
    CFG0,
    CFG1,
    CFG2,
    CHMU_OFFSET,
    CHMU_SIZE,
    COUNTER_WIDTH,
    DOWNSAMPLING_LOG2,
    ENABLE,
    EPOCH_SCALE_NS,
    HEAD,
    HOTLIST_ENTRIES,
    HOTLIST_OFF,
    HOTLIST_REL,
    INST,
    INSTANCE_LEN,
    IRQ_FILL,
    IRQ_OVERFLOW,
    MAX_EPOCH,
    MAX_GRANULES,
    MIN_EPOCH,
    RANDOMIZE,
    RESET,
    ST_ENABLED,
    ST_FILL,
    ST_OVERFLOW,
    STATUS,
    TAIL,
    TRACK,
    UNIT_SIZES_LOG2,
    VERSION,
)
from firmware_model.hotness import RANGE_GRANULE, HotnessConfig, HotnessUnit

__all__ = ["CFG0", "CHMU_OFFSET", "CHMU_SIZE", "ENABLE", "ChmuDevice", "attach", "decode_config"]


def _cap0() -> int:
    tracked = 0b111111 << 8
    return (1 << 4 | 1 << 5 | tracked | MAX_EPOCH[0] << 16 | MAX_EPOCH[1] << 20
            | MIN_EPOCH[0] << 32 | MIN_EPOCH[1] << 36 | HOTLIST_ENTRIES << 48)


def _cap1() -> int:
    units = sum(1 << (n - 8) for n in UNIT_SIZES_LOG2)
    ds = sum(1 << n for n in DOWNSAMPLING_LOG2)
    return units | ds << 32 | 1 << 48 | 1 << 49 | 1 << 50


def decode_config(cfg0: int, cfg1: int, cfg2: int, bitmap: np.ndarray, capacity: int, seed: int = 0) -> HotnessConfig:
    """Registers -> HotnessConfig; raises ValueError naming the bad field."""
    what = cfg0 & 0xFF
    if what not in (1, 2, 3, 4, 5, 6):
        raise ValueError(f"CFG0.what={what} is reserved: use 4 (reads), 5 (writes) or 6 (both)")
    unit_log2, ds_log2 = cfg1 & 0xFFFFFFFF, (cfg1 >> 32) & 0xF
    mode, scale, mult = (cfg1 >> 40) & 0xFF, (cfg1 >> 48) & 0xF, cfg1 >> 52
    if unit_log2 not in UNIT_SIZES_LOG2:
        raise ValueError(f"CFG1.unit_size={unit_log2} unsupported: use log2 of 256 B .. 2 MiB (8..21)")
    if mode not in (0, 1):
        raise ValueError(f"CFG1.mode={mode} is reserved: use 0 (epoch) or 1 (always-on)")
    epoch_ns = EPOCH_SCALE_NS.get(scale, 0) * mult
    lo, hi = (EPOCH_SCALE_NS[s] * m for s, m in (MIN_EPOCH, MAX_EPOCH))
    if mode == 0 and not lo <= epoch_ns <= hi:
        raise ValueError(f"epoch scale {scale} x {mult} = {epoch_ns} ns is outside {lo}..{hi} ns")
    granules = -(-capacity // RANGE_GRANULE)
    bits = np.unpackbits(bitmap, bitorder="little")[:granules]
    return HotnessConfig(unit_size=1 << unit_log2, threshold=max(1, cfg0 >> 32),
                         mode="epoch" if mode == 0 else "always_on", epoch_ns=epoch_ns or 1,
                         downsampling=1 << ds_log2, randomized=bool(cfg0 & RANDOMIZE), seed=seed,
                         count_reads=what in (1, 3, 4, 6), count_writes=what in (2, 3, 5, 6),
                         hotlist_size=HOTLIST_ENTRIES, counter_width=COUNTER_WIDTH,
                         fill_threshold=cfg2 & 0xFFFF, irq_on_overflow=bool(cfg0 & IRQ_OVERFLOW),
                         irq_on_fill=bool(cfg0 & IRQ_FILL),
                         range_bitmap=None if bits.all() else tuple(np.flatnonzero(bits).tolist()))


class ChmuDevice:
    """Device side: applies host configuration, ends epochs, publishes the hotlist and status."""

    def __init__(self, region: memoryview, capacity: int, *, seed: int = 0) -> None:
        self.regs = ChmuRegView(region)
        self.capacity = capacity
        self.seed = seed
        self.unit = HotnessUnit(capacity)
        self.unit.enabled = False
        self.last_error = ""
        self.interrupts = 0
        self.unit.on_interrupt = self._on_interrupt
        self._lock = threading.Lock()
        self._published_tail = -1
        self._published_status = 0
        self._layout()

    def _layout(self) -> None:
        r = self.regs
        r.buf[:INST + INSTANCE_LEN] = bytes(INST + INSTANCE_LEN)
        r.set_q(0x00, VERSION | 1 << 8)
        r.set_q(0x08, INSTANCE_LEN)
        r.set_q(CAP0, _cap0())
        r.set_q(CAP1, _cap1())
        r.set_q(BITMAP_OFF, BITMAP_REL)
        r.set_q(HOTLIST_OFF, HOTLIST_REL)
        r.set_q(CFG0, TRACK["rw"] | 1 << 32)
        r.set_q(CFG1, 12 | 4 << 48 | 1 << 52)  # 4 KiB units, 100 ms epochs
        granules = min(-(-self.capacity // RANGE_GRANULE), MAX_GRANULES)
        r.bitmap()[:] = np.packbits(np.arange(r.bitmap().size * 8) < granules, bitorder="little")
        self._publish()

    def record(self, dpas: np.ndarray, is_write: np.ndarray | bool = False) -> int:
        """Feed accesses (DPAs) to the unit; returns how many were counted."""
        with self._lock:
            return self.unit.record(dpas, is_write)

    def service(self, now_ns: int) -> None:
        """One runner pass: reset / enable / disable requests, head updates, epoch ends, publish."""
        with self._lock:
            r = self.regs
            cfg0 = r.q(CFG0)
            if cfg0 & RESET:  # counters, hotlist and status cleared; configuration re-latched
                self.last_error = ""
                if cfg0 & ENABLE:
                    self._enable(cfg0, now_ns)
                else:
                    self.unit.configure(self.unit.config, now=now_ns)
                    self.unit.enabled = False
                r.set_q(CFG0, cfg0 & ~RESET)
                self._published_tail = -1
            elif cfg0 & ENABLE and not self.unit.enabled and not self.last_error:
                self._enable(cfg0, now_ns)
            elif not cfg0 & ENABLE:
                self.unit.enabled = False
                self.last_error = ""
            self._take_head()
            self._take_status_clears()
            self.unit.advance(now_ns)
            self._publish()

    def _enable(self, cfg0: int, now_ns: int) -> None:
        try:
            config = decode_config(cfg0, self.regs.q(CFG1), self.regs.q(CFG2), self.regs.bitmap(),
                                   self.capacity, self.seed)
        except ValueError as exc:
            self.last_error = str(exc)
            self.unit.enabled = False
            return
        self.unit.configure(config, now=now_ns)
        self._published_tail = -1

    def _take_head(self) -> None:
        head = self.regs.w(HEAD)
        if head != self.unit.hotlist.head:
            try:
                self.unit.hotlist.set_head(head)
            except ValueError:
                self.regs.set_w(HEAD, self.unit.hotlist.head)  # a bad head is ignored

    def _take_status_clears(self) -> None:
        """A status bit the device published as 1 and now reads 0 was cleared by the host."""
        cleared = self._published_status & ~self.regs.q(STATUS)
        self.unit.clear_status(overflow=bool(cleared & ST_OVERFLOW), level=bool(cleared & ST_FILL))

    def _publish(self) -> None:
        r, ring, s = self.regs, self.unit.hotlist, self.unit.status
        if ring.tail != self._published_tail:
            r.hotlist()[:ring.size] = ring.entries
            r.set_w(TAIL, ring.tail)
            r.set_w(HEAD, ring.head)
            self._published_tail = ring.tail
        st = (ST_ENABLED if self.unit.enabled else 0) | self.unit.config.counter_width << 32
        st |= (ST_OVERFLOW if s.overflow else 0) | (ST_FILL if s.level else 0)
        r.set_q(STATUS, st)
        self._published_status = st

    def _on_interrupt(self, kind: str) -> None:
        self.interrupts += 1  # MSI delivery is the runner's business; the count is telemetry


def attach(fw) -> ChmuDevice:  # fw: emulator.firmware.Firmware
    """Give a firmware its CHMU, serviced on every runner pass (like component.attach)."""
    dev = ChmuDevice(fw.regs.region(CHMU_OFFSET, CHMU_SIZE), fw.config.capacity)
    fw.services.append(dev.service)
    return dev
