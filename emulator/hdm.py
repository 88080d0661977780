"""HDM decode: host physical address (HPA) <-> device physical address (DPA), as pure functions.

The arithmetic of CXL r3.1 §8.2.4.20.13 (implementation notes "Device Decode Logic" and "Host
Bridge Decode Flow"), following QEMU's `cxl_type3_dpa` (hw/mem/cxl_type3.c) for the device side
and Linux's `cxl_calculate_dpa_offset` / `cxl_calculate_position` / `cxl_dpa_to_hpa`
(drivers/cxl/core/region.c) for the host side. Nothing here reads registers or media: the firmware
builds `DecoderSettings` from its committed decoders (`emulator.component.HdmDecoderBlock`) and the
host from what it programmed (`driver.hdm`), so one tested piece of arithmetic serves both.

An interleave set of W ways and granularity G splits the HPA window into G-byte chunks dealt
round-robin to the W devices::

    HPA offset    0      G      2G     3G     4G     5G   ...      (W = 3)
    chunk owner   | pos0 | pos1 | pos2 | pos0 | pos1 | pos2 | ...
    DPA offset    | 0    | 0    | 0    | G    | G    | G    | ...

    position(off)   = (off // G) % W
    dpa_offset(off) = (off // (G * W)) * G + off % G

For W a power of two this is a bit-field removal (QEMU's mask-and-shift); for W = 3, 6, 12 the
upper bits are divided by 3 after the power-of-two part is shifted out, as in QEMU and Linux.

DPA is allocated by the decoders in order (the spec's DPABase accumulation, as QEMU does it):
decoder i covers DPA [sum_{j<i}(skip_j + size_j / ways_j) + skip_i, ... + size_i / ways_i). The
DPA skip (§8.2.4.20.9/11, where a switch's decoder has its target list) leaves a hole before it.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from emulator.spec.errors import ConfigError

# §8.2.4.20.7 HDM Decoder n Control: IW encodings -> ways (0..4 powers of two, 8..10 three times one).
WAYS_BY_IW: dict[int, int] = {0: 1, 1: 2, 2: 4, 3: 8, 4: 16, 8: 3, 9: 6, 10: 12}
IW_BY_WAYS: dict[int, int] = {ways: iw for iw, ways in WAYS_BY_IW.items()}
# §8.2.4.20.7: IG n -> 256 B << n, n = 0..6 (256 B .. 16 KiB).
IG_MAX = 6
GRANULARITIES: tuple[int, ...] = tuple(256 << ig for ig in range(IG_MAX + 1))


def ways_from_iw(iw: int) -> int:
    """Decode an IW field; raises ConfigError for the reserved encodings."""
    try:
        return WAYS_BY_IW[iw]
    except KeyError:
        raise ConfigError(f"interleave-ways encoding {iw} is reserved: use one of {sorted(WAYS_BY_IW)}") from None


def iw_from_ways(ways: int) -> int:
    """Encode interleave ways; raises ConfigError for a count the spec cannot express."""
    try:
        return IW_BY_WAYS[ways]
    except KeyError:
        raise ConfigError(f"{ways} interleave ways is not supported: use one of {sorted(IW_BY_WAYS)}") from None


def granularity_from_ig(ig: int) -> int:
    """Decode an IG field to bytes; raises ConfigError outside 0..6."""
    if not 0 <= ig <= IG_MAX:
        raise ConfigError(f"interleave-granularity encoding {ig} is reserved: use 0..{IG_MAX}")
    return 256 << ig


def ig_from_granularity(granularity: int) -> int:
    """Encode a granularity in bytes; raises ConfigError unless it is 256 B << n, n = 0..6."""
    if granularity not in GRANULARITIES:
        raise ConfigError(f"interleave granularity {granularity} must be one of {list(GRANULARITIES)} bytes")
    return GRANULARITIES.index(granularity)


def _split_ways(iw: int) -> tuple[int, int]:
    """IW -> (log2 of the power-of-two factor, odd factor 1 or 3)."""
    return (iw, 1) if iw < 8 else (iw - 8, 3)


def interleave_position(hpa_offset: int, ig: int, iw: int) -> int:
    """Which member of the interleave set owns `hpa_offset` (Linux `cxl_calculate_position`)."""
    chunk = hpa_offset >> (8 + ig)
    if iw < 8:
        return chunk & ((1 << iw) - 1)
    return chunk % WAYS_BY_IW[iw]


def dpa_offset(hpa_offset: int, ig: int, iw: int) -> int:
    """Offset into the decoder's DPA range of `hpa_offset` (QEMU `cxl_type3_dpa`'s arithmetic)."""
    low = hpa_offset & ((1 << (8 + ig)) - 1)
    shift, odd = _split_ways(iw)
    if odd == 1:
        return ((hpa_offset >> (8 + ig + shift)) << (8 + ig)) | low
    return (((hpa_offset >> (8 + ig + shift)) // 3) << (8 + ig)) | low


def hpa_offset(dpa_off: int, position: int, ig: int, iw: int) -> int:
    """Inverse of `dpa_offset` for the member at `position` (Linux `cxl_dpa_to_hpa`'s arithmetic)."""
    ways = WAYS_BY_IW[iw]
    if not 0 <= position < ways:
        raise ConfigError(f"interleave position {position} is outside 0..{ways - 1} for {ways} ways")
    low = dpa_off & ((1 << (8 + ig)) - 1)
    shift, odd = _split_ways(iw)
    upper = dpa_off >> (8 + ig)
    if odd == 1:
        return (((upper << shift) | position) << (8 + ig)) | low
    return ((((upper * 3) << shift) + position) << (8 + ig)) | low


@dataclass(frozen=True, kw_only=True)
class DecoderSettings:
    """One committed HDM decoder as the decode sees it.

    `base`/`size` are the HPA window; `dpa_skip` the DPA hole left before this decoder's range.
    The registers hold these in 256 MiB units; the arithmetic does not need that, so this type
    only requires the window to hold whole rounds of the interleave (size % (ways * G) == 0),
    which lets tests use small windows.
    """

    base: int
    size: int
    ig: int = 0
    iw: int = 0
    dpa_skip: int = 0

    def __post_init__(self) -> None:
        granularity_from_ig(self.ig)
        ways = ways_from_iw(self.iw)
        if self.base < 0 or self.size < 0 or self.dpa_skip < 0:
            raise ConfigError(f"decoder base {self.base:#x}, size {self.size:#x} and dpa_skip "
                              f"{self.dpa_skip:#x} must be >= 0")
        if self.size % (ways * self.granularity):
            raise ConfigError(f"decoder size {self.size:#x} must be a multiple of ways x granularity "
                              f"({ways} x {self.granularity})")

    @property
    def ways(self) -> int:
        return WAYS_BY_IW[self.iw]

    @property
    def granularity(self) -> int:
        return 256 << self.ig

    @property
    def dpa_size(self) -> int:
        """DPA this decoder consumes on each member device."""
        return self.size // self.ways

    def contains(self, hpa: int) -> bool:
        return self.base <= hpa < self.base + self.size


def dpa_ranges(decoders: Iterable[DecoderSettings]) -> list[tuple[int, int]]:
    """[start, end) of each decoder's DPA range, accumulated in order with the skips (QEMU)."""
    ranges: list[tuple[int, int]] = []
    dpa_base = 0
    for dec in decoders:
        dpa_base += dec.dpa_skip
        ranges.append((dpa_base, dpa_base + dec.dpa_size))
        dpa_base += dec.dpa_size
    return ranges


def hpa_to_dpa(decoders: Iterable[DecoderSettings], hpa: int) -> int | None:
    """The DPA a device with these committed decoders serves `hpa` at, or None if none decodes it.

    Like QEMU, the device does not check that `hpa` belongs to its own interleave position: the
    host bridge only routes it the HPAs of its position.
    """
    decoders = list(decoders)
    for dec, (start, _end) in zip(decoders, dpa_ranges(decoders)):
        if dec.contains(hpa):
            return start + dpa_offset(hpa - dec.base, dec.ig, dec.iw)
    return None


def dpa_to_hpa(decoders: Iterable[DecoderSettings], dpa: int, position: int) -> int | None:
    """The HPA that reaches `dpa` on the member at `position`, or None if no decoder maps `dpa`."""
    decoders = list(decoders)
    for dec, (start, end) in zip(decoders, dpa_ranges(decoders)):
        if start <= dpa < end:
            return dec.base + hpa_offset(dpa - start, position, dec.ig, dec.iw)
    return None


__all__ = [
    "GRANULARITIES", "IG_MAX", "IW_BY_WAYS", "WAYS_BY_IW", "DecoderSettings", "dpa_offset", "dpa_ranges",
    "dpa_to_hpa", "granularity_from_ig", "hpa_offset", "hpa_to_dpa", "ig_from_granularity",
    "interleave_position", "iw_from_ways", "ways_from_iw",
]
