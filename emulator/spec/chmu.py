"""The CHMU register block's layout: a CXL 3.2 Hotness Monitoring Unit, one instance, at
``CHMU_OFFSET`` in the BAR. Shared by the device (``emulator.chmu``) and the host
(``driver.chmu``), as a uapi header is.

Layout: the CXL r3.2 CHMU register interface as the Linux CHMU RFC perf driver (2025) reads it —
the spec section number is not verified here. Offsets are relative to ``CHMU_OFFSET`` in the BAR,
one instance:

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

from emulator.spec.errors import ConfigError
from emulator.spec.registers import CHMU_OFFSET, CHMU_SIZE  # noqa: F401  (CHMU_OFFSET: with the layout)

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

# Epoch scale codes (the CHMU RFC: 100 µs, 1 ms, 10 ms, 100 ms, 1 s) x a 12-bit multiplier.
EPOCH_SCALE_NS = {1: 100_000, 2: 1_000_000, 3: 10_000_000, 4: 100_000_000, 5: 1_000_000_000}
MIN_EPOCH, MAX_EPOCH = (1, 1), (5, 100)  # 100 µs .. 100 s
UNIT_SIZES_LOG2 = range(8, 22)  # 256 B .. 2 MiB
DOWNSAMPLING_LOG2 = range(16)
TRACK = {"r": 4, "w": 5, "rw": 6}  # CFG0.what: reads, writes, both (non-TEE variants 1..3 accepted too)

# CFG0 / STATUS bits
RANDOMIZE, IRQ_OVERFLOW, IRQ_FILL, ENABLE, RESET = 1 << 8, 1 << 9, 1 << 10, 1 << 16, 1 << 17
ST_ENABLED, ST_OVERFLOW, ST_FILL = 1 << 0, 1 << 40, 1 << 41


def encode_epoch(epoch_ns: int) -> tuple[int, int]:
    """Epoch length -> (scale code, 12-bit multiplier), finest scale first; ConfigError if none fits."""
    lo, hi = (EPOCH_SCALE_NS[s] * m for s, m in (MIN_EPOCH, MAX_EPOCH))
    for scale, unit in sorted(EPOCH_SCALE_NS.items(), key=lambda kv: kv[1]):
        if epoch_ns % unit == 0 and 1 <= epoch_ns // unit < 1 << 12 and lo <= epoch_ns <= hi:
            return scale, epoch_ns // unit
    raise ConfigError(f"epoch {epoch_ns} ns cannot be encoded: use a multiple of 100 us "
                      f"between {lo // 1000} us and {hi // 10**9} s")
