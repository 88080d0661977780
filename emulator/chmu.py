"""The CHMU register block: a CXL 3.2 Hotness Monitoring Unit over `firmware_model.hotness`.

Layout: the CXL r3.2 CHMU register interface as the Linux CHMU RFC perf driver (2025) reads it —
the spec section number is not verified here; reference/cxl.md summarises the semantics. Offsets
are relative to ``CHMU_OFFSET`` in the BAR, one instance:

    0x0000  common cap 0   version [3:0], number of instances [15:8]
    0x0008  common cap 1   instance length [15:0]
    0x0010  instance 0:
      +0x00 CAP0    MSI [3:0], overflow irq cap [4], fill-threshold irq cap [5], epoch type [7:6],
                    tracked requests [13:8], max epoch scale [19:16] / mult [31:20],
                    min epoch scale [35:32] / mult [47:36], hotlist size [63:48]
      +0x08 CAP1    unit sizes [31:0] (bit N: 2^N x 256 B), downsampling factors [47:32] (bit N: 2^N),
                    epoch [48], always-on [49], randomized downsampling [50], overlap [51]
      +0x10 range bitmap offset (u64, from the instance base)   +0x18 hotlist offset
      +0x40 CFG0    what to track [7:0], randomize [8], irq on overflow [9], irq on fill [10],
                    enable [16], reset counters [17], hotness threshold [63:32]
      +0x48 CFG1    unit size [31:0] (log2 bytes), downsampling [35:32] (log2), mode [47:40]
                    (0 epoch, 1 always-on), epoch scale [51:48], epoch multiplier [63:52]
      +0x50 CFG2    notification fill threshold [15:0]
      +0x60 STATUS  enabled [0], operation in progress [31:16], counter width [39:32],
                    overflow [40], fill threshold reached [41]
      +0x68 HEAD (u16, host)   +0x6A TAIL (u16, device)
      +0x70 range bitmap: one bit per 256 MiB of DPA     +0x1000 hotlist: u64 entries

Shared-memory deviations: RW1C cannot be told apart from "no write" on a shared BAR (see
emulator/component.py), so the host clears STATUS.overflow / fill by writing 0 to the bit; RESET is
set by the host and cleared by the device when done (like the doorbell). Configuration is latched
when ENABLE goes 0 -> 1; an invalid one leaves the unit disabled and ``last_error`` says why.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from emulator.regfile import word_views
from emulator.spec.registers import CHMU_OFFSET, CHMU_SIZE
from firmware_model.hotness import RANGE_GRANULE, HotnessConfig, HotnessUnit

__all__ = ["CHMU_OFFSET", "CHMU_SIZE", "EPOCH_SCALE_NS", "ChmuDevice", "ChmuRegs", "ChmuStatus", "attach",
           "decode_config", "encode_epoch"]

VERSION = 1
INST = 0x10  # instance 0 base
CAP0, CAP1, BITMAP_OFF, HOTLIST_OFF = INST + 0x00, INST + 0x08, INST + 0x10, INST + 0x18
CFG0, CFG1, CFG2, STATUS, HEAD, TAIL = INST + 0x40, INST + 0x48, INST + 0x50, INST + 0x60, INST + 0x68, INST + 0x6A
BITMAP_REL, HOTLIST_REL = 0x70, 0x1000
HOTLIST_ENTRIES = 1024  # RFC default
COUNTER_WIDTH = 16  # RFC default
INSTANCE_LEN = HOTLIST_REL + HOTLIST_ENTRIES * 8
MAX_GRANULES = (HOTLIST_REL - BITMAP_REL) * 8  # 30 720 x 256 MiB = 7.5 TiB
assert INST + INSTANCE_LEN <= CHMU_SIZE

# Epoch scale codes (reference/cxl.md: 100 µs, 1 ms, 10 ms, 100 ms, 1 s) x a 12-bit multiplier.
EPOCH_SCALE_NS = {1: 100_000, 2: 1_000_000, 3: 10_000_000, 4: 100_000_000, 5: 1_000_000_000}
MIN_EPOCH, MAX_EPOCH = (1, 1), (5, 100)  # 100 µs .. 100 s
UNIT_SIZES_LOG2 = range(8, 22)  # 256 B .. 2 MiB
DOWNSAMPLING_LOG2 = range(16)
TRACK = {"r": 4, "w": 5, "rw": 6}  # CFG0.what: reads, writes, both (non-TEE variants 1..3 accepted too)

# CFG0 / STATUS bits
RANDOMIZE, IRQ_OVERFLOW, IRQ_FILL, ENABLE, RESET = 1 << 8, 1 << 9, 1 << 10, 1 << 16, 1 << 17
ST_ENABLED, ST_OVERFLOW, ST_FILL = 1 << 0, 1 << 40, 1 << 41


def _bits(lo: int, hi: int) -> int:
    return ((1 << (hi - lo + 1)) - 1) << lo


class _Regs:
    """Aligned little-endian access to the CHMU region (whole-register stores, like RegisterFile)."""

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
        self.regs = _Regs(region)
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

    def service(self, now_ns: float) -> None:
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

    def _enable(self, cfg0: int, now_ns: float) -> None:
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


@dataclass(frozen=True)
class ChmuStatus:
    enabled: bool
    op_in_progress: int
    counter_width: int
    overflow: bool
    fill_threshold_reached: bool
    head: int
    tail: int
    hotlist_size: int

    @property
    def entries(self) -> int:
        return (self.tail - self.head) % self.hotlist_size


class ChmuRegs:
    """Host side: configure the CHMU and read its hotlist through the registers only."""

    def __init__(self, region: memoryview) -> None:
        self.regs = _Regs(region)

    def capabilities(self) -> dict[str, object]:
        c0, c1 = self.regs.q(CAP0), self.regs.q(CAP1)
        return {
            "version": self.regs.q(0) & 0xF, "instances": (self.regs.q(0) >> 8) & 0xFF,
            "hotlist_size": c0 >> 48,
            "epoch_min_ns": EPOCH_SCALE_NS[(c0 >> 32) & 0xF] * ((c0 >> 36) & 0xFFF),
            "epoch_max_ns": EPOCH_SCALE_NS[(c0 >> 16) & 0xF] * ((c0 >> 20) & 0xFFF),
            "unit_sizes": [256 << n for n in range(32) if c1 >> n & 1],
            "downsampling": [1 << n for n in range(16) if c1 >> (32 + n) & 1],
            "epoch": bool(c1 >> 48 & 1), "always_on": bool(c1 >> 49 & 1), "randomized": bool(c1 >> 50 & 1),
        }

    def configure(self, *, unit_size: int = 4096, threshold: int = 1, mode: str = "epoch",
                  epoch_ns: int = 100_000_000, downsampling: int = 1, randomized: bool = False,
                  track: str = "rw", irq_on_overflow: bool = True, irq_on_fill: bool = False,
                  fill_threshold: int = 0, granules: list[int] | None = None) -> None:
        """Program and (re)start the unit: counters and hotlist are reset when the device applies it.

        ``granules``: indices of the 256 MiB DPA ranges to track (None: all). Raises ConfigError
        (a ValueError) naming the value to change.
        """
        from emulator.spec.errors import ConfigError

        caps = self.capabilities()
        if unit_size not in caps["unit_sizes"]:  # type: ignore[operator]
            raise ConfigError(f"unit size {unit_size} unsupported: use a power of two from 256 B to 2 MiB")
        if downsampling not in caps["downsampling"]:  # type: ignore[operator]
            raise ConfigError(f"downsampling {downsampling} unsupported: use a power of two from 1 to 32768")
        if mode not in ("epoch", "always_on"):
            raise ConfigError(f"mode {mode!r} unknown: use 'epoch' or 'always_on'")
        if track not in TRACK:
            raise ConfigError(f"track {track!r} unknown: use 'r', 'w' or 'rw'")
        if not 1 <= threshold < 1 << 32:
            raise ConfigError(f"threshold {threshold} must be 1..2**32-1")
        if not 0 <= fill_threshold < HOTLIST_ENTRIES:
            raise ConfigError(f"fill threshold {fill_threshold} must be 0..{HOTLIST_ENTRIES - 1} entries")
        scale, mult = encode_epoch(epoch_ns) if mode == "epoch" else (0, 0)
        r = self.regs
        r.set_q(CFG0, r.q(CFG0) & ~(ENABLE | RESET))
        r.set_q(CFG1, (unit_size.bit_length() - 1) | (downsampling.bit_length() - 1) << 32
                | (0 if mode == "epoch" else 1) << 40 | scale << 48 | mult << 52)
        r.set_q(CFG2, fill_threshold)
        bits = np.zeros(r.bitmap().size * 8, dtype=bool)
        if granules is None:
            bits[:] = True
        else:
            bad = [g for g in granules if not 0 <= g < bits.size]
            if bad:
                raise ConfigError(f"range granules {bad} outside 0..{bits.size - 1} (256 MiB each)")
            bits[list(granules)] = True
        r.bitmap()[:] = np.packbits(bits, bitorder="little")
        r.set_q(CFG0, TRACK[track] | (RANDOMIZE if randomized else 0) | (IRQ_OVERFLOW if irq_on_overflow else 0)
                | (IRQ_FILL if irq_on_fill else 0) | ENABLE | RESET | threshold << 32)

    def disable(self) -> None:
        self.regs.set_q(CFG0, self.regs.q(CFG0) & ~ENABLE)

    def reset(self) -> None:
        """Ask the device to clear counters, hotlist and status (it clears RESET when done)."""
        self.regs.set_q(CFG0, self.regs.q(CFG0) | RESET)

    @property
    def busy(self) -> bool:
        """True while a reset / reconfiguration waits for the device."""
        return bool(self.regs.q(CFG0) & RESET)

    def config(self) -> dict[str, object]:
        """The programmed configuration, decoded."""
        c0, c1, c2 = self.regs.q(CFG0), self.regs.q(CFG1), self.regs.q(CFG2)
        scale, mult = (c1 >> 48) & 0xF, c1 >> 52
        bits = np.unpackbits(self.regs.bitmap(), bitorder="little")
        return {
            "enable": bool(c0 & ENABLE), "track": {v: k for k, v in TRACK.items()}.get(c0 & 0xFF, c0 & 0xFF),
            "threshold": c0 >> 32, "randomized": bool(c0 & RANDOMIZE),
            "irq_on_overflow": bool(c0 & IRQ_OVERFLOW), "irq_on_fill": bool(c0 & IRQ_FILL),
            "unit_size": 1 << (c1 & 0xFFFFFFFF) if (c1 & 0xFFFFFFFF) < 64 else 0,
            "downsampling": 1 << ((c1 >> 32) & 0xF),
            "mode": "epoch" if (c1 >> 40) & 0xFF == 0 else "always_on",
            "epoch_ns": EPOCH_SCALE_NS.get(scale, 0) * mult, "fill_threshold": c2 & 0xFFFF,
            "granules": np.flatnonzero(bits).tolist(),
        }

    def status(self) -> ChmuStatus:
        st = self.regs.q(STATUS)
        return ChmuStatus(enabled=bool(st & ST_ENABLED), op_in_progress=(st >> 16) & 0xFFFF,
                          counter_width=(st >> 32) & 0xFF, overflow=bool(st & ST_OVERFLOW),
                          fill_threshold_reached=bool(st & ST_FILL), head=self.regs.w(HEAD),
                          tail=self.regs.w(TAIL), hotlist_size=self.regs.q(CAP0) >> 48)

    def read_hotlist(self, consume: bool = True) -> list[tuple[int, int]]:
        """Entries from head to tail as (DPA, count); ``consume`` advances head past them."""
        st = self.status()
        width = st.counter_width or COUNTER_WIDTH
        unit = self.config()["unit_size"]
        ring = self.regs.hotlist()
        out = []
        for i in range(st.entries):
            e = int(ring[(st.head + i) % st.hotlist_size])
            out.append(((e >> width) * unit, e & ((1 << width) - 1)))  # type: ignore[operator]
        if consume:
            self.regs.set_w(HEAD, st.tail)
        return out

    def consume(self, n: int) -> int:
        """Advance head past the oldest ``n`` entries (at most those published); returns how many
        it consumed. With ``read_hotlist(consume=False)`` it consumes exactly what was read."""
        if n < 0:
            raise ValueError(f"cannot consume {n} hotlist entries")
        st = self.status()
        n = min(n, st.entries)
        if n:
            self.regs.set_w(HEAD, (st.head + n) % st.hotlist_size)
        return n

    def clear_status(self, overflow: bool = False, fill: bool = False) -> None:
        """Clear the overflow / fill-threshold status bits (by writing 0 to them, see module doc)."""
        st = self.regs.q(STATUS)
        self.regs.set_q(STATUS, st & ~((ST_OVERFLOW if overflow else 0) | (ST_FILL if fill else 0)))


def encode_epoch(epoch_ns: int) -> tuple[int, int]:
    """Epoch length -> (scale code, 12-bit multiplier), finest scale first; ConfigError if none fits."""
    from emulator.spec.errors import ConfigError

    lo, hi = (EPOCH_SCALE_NS[s] * m for s, m in (MIN_EPOCH, MAX_EPOCH))
    for scale, unit in sorted(EPOCH_SCALE_NS.items(), key=lambda kv: kv[1]):
        if epoch_ns % unit == 0 and 1 <= epoch_ns // unit < 1 << 12 and lo <= epoch_ns <= hi:
            return scale, epoch_ns // unit
    raise ConfigError(f"epoch {epoch_ns} ns cannot be encoded: use a multiple of 100 us "
                      f"between {lo // 1000} us and {hi // 10**9} s")
