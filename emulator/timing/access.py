"""A host's access bitmap over a device's Dynamic Capacity: which DC blocks it may transfer.

1 bit per DC block over ``[base, base + 8 * len(bits) * block)``: block i is byte i >> 3, bit
i & 7 (the poison bitmap's convention); a set bit means this host accepted an extent covering the
block.  The firmware alone writes it (set on an Add DC Response, cleared on a release before it
answers); the host's data path maps it read-only and checks it at every transfer, so a released
block fails the next transfer.  DPAs below ``base`` (static capacity) are never checked; a block
past the bitmap counts as clear.  The C core's ``cxl_first_no_extent`` is the same scan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from emulator.spec.errors import ConfigError
from emulator.timing._buffers import host_view, non_negative_int

#: The smallest DC block the check takes: a page, as a host maps an extent through its page
#: tables (QEMU's DC blocks are 2 MiB).
MIN_BLOCK = 4096


@dataclass(frozen=True)
class AccessMap:
    """A validated access bitmap: a read-only byte view, the DC range's base DPA and log2 of its
    block size."""

    bits: memoryview
    base: int
    shift: int

    @classmethod
    def from_args(cls, bits: Any, base: Any, block: Any, media_size: int) -> AccessMap:
        """``DataPath``'s ``access_bits``, ``access_base`` and ``access_block``, checked against
        a media of ``media_size`` bytes: ConfigError saying what to change."""
        block_n = _int(block, "access_block")
        if block_n < MIN_BLOCK or block_n & (block_n - 1):
            raise ConfigError(f"access_block must be a power of two >= {MIN_BLOCK} (the DC block size "
                              f"in bytes), got {block!r}")
        base_n = _int(base, "access_base")
        if base_n % block_n:
            raise ConfigError(f"access_base {base_n:#x} must be a multiple of access_block ({block_n:#x}): "
                              f"the DC range starts on a block boundary")
        if base_n > media_size:
            raise ConfigError(f"access_base {base_n:#x} is past the end of the media ({media_size:#x} B): "
                              f"the DC range starts within it")
        view = host_view(bits, writable=False)
        blocks = -(-(media_size - base_n) // block_n)
        need = -(-blocks // 8)
        if view.nbytes < need:
            have = view.nbytes
            view.release()
            raise ConfigError(f"access_bits has {have} bytes; the {media_size - base_n:#x} B of media "
                              f"from access_base {base_n:#x} in {block_n:#x}-B blocks need {need} "
                              f"(1 bit per block)")
        return cls(view, base_n, block_n.bit_length() - 1)


def _int(value: Any, name: str) -> int:
    n = non_negative_int(value)
    if n is None:
        raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
    return n


def first_without_extent(bits: np.ndarray, base: int, shift: int, dpa: int, n: int) -> int | None:
    """The first DPA of [dpa, dpa+n) in a DC block whose bit is clear in ``bits`` (or past its
    end), or None: where the block starts, or ``dpa`` itself when the transfer starts inside it."""
    end = dpa + n
    if n == 0 or end <= base:
        return None
    first, last = (max(dpa, base) - base) >> shift, (end - 1 - base) >> shift
    nbits = bits.size * 8
    top = min(last, nbits - 1)
    hole = None
    if top >= first:
        window = np.unpackbits(bits[first >> 3:(top >> 3) + 1], bitorder="little")
        clear = np.flatnonzero(window[first & 7:(first & 7) + top - first + 1] == 0)
        if clear.size:
            hole = first + int(clear[0])
    if hole is None and last >= nbits:
        hole = max(first, nbits)
    return None if hole is None else max(dpa, base + (hole << shift))
