"""The CHMU, host side: configure the device's Hotness Monitoring Unit and read its hotlist
through the registers only (layout: ``emulator.spec.chmu``), as the Linux CHMU RFC perf driver
does. The device side is ``emulator.chmu``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from emulator.regfile import ChmuRegView
from emulator.spec.chmu import (
    CAP0,
    CAP1,
    CFG0,
    CFG1,
    CFG2,
    COUNTER_WIDTH,
    ENABLE,
    EPOCH_SCALE_NS,
    HEAD,
    HOTLIST_ENTRIES,
    IRQ_FILL,
    IRQ_OVERFLOW,
    RANDOMIZE,
    RESET,
    ST_ENABLED,
    ST_FILL,
    ST_OVERFLOW,
    STATUS,
    TAIL,
    TRACK,
    encode_epoch,
)
from emulator.spec.errors import ConfigError

__all__ = ["ChmuRegs", "ChmuStatus"]


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
        self.regs = ChmuRegView(region)

    @classmethod
    def of_bar(cls, bar: Any) -> "ChmuRegs":
        """The CHMU of a device's BAR mapping (``MemDev.bar``, ``open_bar``)."""
        from emulator.spec.chmu import CHMU_OFFSET, CHMU_SIZE

        return cls(memoryview(bar)[CHMU_OFFSET:CHMU_OFFSET + CHMU_SIZE])

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
