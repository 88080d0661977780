"""Dynamic Capacity state (CXL r3.1 §8.2.9.9.9): per host port the pending offer and the
accepted extents, and the access bitmaps (`access.h<h>`) the hosts' data paths check.

The fabric manager (vendor opcodes, `emulator.commands.dcd`) offers extents to one port; the
host accepts a subset with Add DC Response, or gives accepted ones back with Release DC. The
bitmap of a port always equals the union of its accepted extents: bits are set before an accept
is answered and cleared before a release is answered, and rebuilt from the saved extents at boot.
A shared extent (non-zero tag) may be offered to several ports; each port that accepts it gets
its own bits. Everything here runs in the firmware thread, the only writer of DC state.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from emulator.spec.payloads_dcd import DC_BLOCK, DC_MAX_EXTENTS, DC_TAG_LEN, region_bases
from emulator.spec.retcodes import RetCode

if TYPE_CHECKING:
    from emulator.firmware import Firmware

NO_TAG = bytes(DC_TAG_LEN)


@dataclass(frozen=True)
class Extent:
    """One extent: ``[start_dpa, start_dpa + length)``, its tag (zeros: none) and shared sequence."""

    start_dpa: int
    length: int
    tag: bytes = NO_TAG
    shared_seq: int = 0

    @property
    def end(self) -> int:
        return self.start_dpa + self.length

    def to_state(self) -> list[Any]:
        return [self.start_dpa, self.length, self.tag.hex(), self.shared_seq]

    @classmethod
    def from_state(cls, item: list[Any]) -> "Extent":
        return cls(item[0], item[1], bytes.fromhex(item[2]), item[3])


@dataclass
class PortDc:
    """One host port's DC state: what it was offered and what it accepted."""

    accepted: list[Extent] = field(default_factory=list)
    pending: list[Extent] = field(default_factory=list)
    generation: int = 0  # +1 each time the accepted list changes (Get DC Extent List reports it)


def _overlap(a_lo: int, a_hi: int, b_lo: int, b_hi: int) -> bool:
    return a_lo < b_hi and b_lo < a_hi


def _cut(extents: list[Extent], lo: int, hi: int) -> list[Extent]:
    """``extents`` less the range [lo, hi), an extent split where the range falls inside it."""
    out = []
    for e in extents:
        if not _overlap(e.start_dpa, e.end, lo, hi):
            out.append(e)
            continue
        if e.start_dpa < lo:
            out.append(Extent(e.start_dpa, lo - e.start_dpa, e.tag, e.shared_seq))
        if hi < e.end:
            out.append(Extent(hi, e.end - hi, e.tag, e.shared_seq))
    return out


class DcState:
    """The device's DC regions and every port's extents (``fw.dcd``)."""

    def __init__(self, fw: Firmware) -> None:
        cfg = fw.config
        self.regions = list(zip(region_bases(cfg.capacity, cfg.dc_regions), cfg.dc_regions))
        self.base = cfg.dc_base
        self.ports = [PortDc() for _ in range(cfg.hosts)]
        self.bits = [np.frombuffer(fw.files.access_bits(h), dtype=np.uint8) if cfg.dc_regions else
                     np.zeros(0, np.uint8) for h in range(cfg.hosts)]
        self.rebuild_bits()

    # regions and lists ---------------------------------------------------------------------------
    def region_of(self, dpa: int) -> int | None:
        for i, (base, length) in enumerate(self.regions):
            if base <= dpa < base + length:
                return i
        return None

    def check_list(self, ranges: list[tuple[int, int]]) -> RetCode | None:
        """QEMU's malformed-list checks: inside one region (else Invalid Physical Address),
        block-aligned, non-empty and not overlapping each other (else Invalid Extent List)."""
        for i, (dpa, length) in enumerate(ranges):
            region = self.region_of(dpa)
            if region is None:
                return RetCode.INVALID_PHYSICAL_ADDRESS
            if length <= 0 or dpa % DC_BLOCK or length % DC_BLOCK:
                return RetCode.INVALID_EXTENT_LIST
            base, size = self.regions[region]
            if dpa + length > base + size:
                return RetCode.INVALID_PHYSICAL_ADDRESS
            if any(_overlap(dpa, dpa + length, d, d + n) for d, n in ranges[:i]):
                return RetCode.INVALID_EXTENT_LIST
        return None

    # host side -------------------------------------------------------------------------------------
    def accept(self, host: int, ranges: list[tuple[int, int]]) -> RetCode:
        """Add DC Response: accept ``ranges`` (each inside one pending extent, none overlapping
        what the port holds) and drop the rest of the offer; no ranges declines it."""
        port = self.ports[host]
        if not ranges:
            port.pending = []
            return RetCode.SUCCESS
        if len(port.accepted) + len(ranges) > DC_MAX_EXTENTS:
            return RetCode.RESOURCES_EXHAUSTED  # QEMU checks this first, before the list itself
        bad = self.check_list(ranges)
        if bad is not None:
            return bad
        taken = []
        for dpa, length in ranges:
            offer = next((e for e in port.pending if e.start_dpa <= dpa and dpa + length <= e.end), None)
            if offer is None or any(_overlap(dpa, dpa + length, e.start_dpa, e.end) for e in port.accepted):
                return RetCode.INVALID_PHYSICAL_ADDRESS  # QEMU: not offered, or already held
            taken.append(Extent(dpa, length, offer.tag, offer.shared_seq))
        for e in taken:
            self._set_bits(host, e.start_dpa, e.length, 1)
        port.accepted = sorted(port.accepted + taken, key=lambda e: e.start_dpa)
        port.pending = []
        port.generation += 1
        return RetCode.SUCCESS

    def release(self, host: int, ranges: list[tuple[int, int]]) -> RetCode:
        """Release DC: give back ``ranges`` of accepted extents (bits cleared first)."""
        if not ranges:
            return RetCode.INVALID_INPUT
        bad = self.check_list(ranges)
        if bad is not None:
            return bad
        port = self.ports[host]
        for dpa, length in ranges:
            if self.held(port.accepted, dpa, length) < length:
                return RetCode.INVALID_PHYSICAL_ADDRESS  # QEMU: not (wholly) accepted
        return self.revoke(host, ranges)

    def revoke(self, host: int, ranges: list[tuple[int, int]]) -> RetCode:
        """Drop ``ranges`` from the port's accepted extents, its bits cleared first. Resources
        Exhausted, and nothing changed, when cutting them out would split extents past
        ``DC_MAX_EXTENTS`` (QEMU's release dry run: a range inside an extent leaves two)."""
        port = self.ports[host]
        after = port.accepted
        for dpa, length in ranges:
            after = _cut(after, dpa, dpa + length)
        if len(after) > DC_MAX_EXTENTS:
            return RetCode.RESOURCES_EXHAUSTED
        for dpa, length in ranges:
            self._set_bits(host, dpa, length, 0)
        port.accepted = after
        port.generation += 1
        return RetCode.SUCCESS

    @staticmethod
    def held(extents: list[Extent], dpa: int, length: int) -> int:
        return sum(max(0, min(e.end, dpa + length) - max(e.start_dpa, dpa)) for e in extents)

    # fabric-manager side ---------------------------------------------------------------------------
    def offer(self, host: int, extents: list[Extent]) -> RetCode:
        """Queue an offer for ``host``: Invalid Input while one is pending; an untagged extent must
        not touch any port's extents, a tagged one only those of its tag (shared capacity)."""
        port = self.ports[host]
        if len(port.accepted) + len(extents) > DC_MAX_EXTENTS:
            return RetCode.RESOURCES_EXHAUSTED  # QEMU's FM Initiate DC Add checks this first
        if port.pending:
            return RetCode.INVALID_INPUT
        for e in extents:
            for p in self.ports:
                for held in p.accepted + p.pending:
                    if _overlap(e.start_dpa, e.end, held.start_dpa, held.end) and (
                            e.tag == NO_TAG or held.tag != e.tag or p is port):
                        return RetCode.INVALID_PHYSICAL_ADDRESS
        port.pending = list(extents)
        return RetCode.SUCCESS

    # bitmaps ---------------------------------------------------------------------------------------
    def _set_bits(self, host: int, dpa: int, length: int, value: int) -> None:
        bits = self.bits[host]
        first = (dpa - self.base) // DC_BLOCK
        for block in range(first, first + length // DC_BLOCK):
            if value:
                bits[block >> 3] |= np.uint8(1 << (block & 7))
            else:
                bits[block >> 3] &= np.uint8(~(1 << (block & 7)) & 0xFF)

    def rebuild_bits(self) -> None:
        """Every port's bitmap from its accepted extents (boot: they agree whatever was on disk)."""
        for h, port in enumerate(self.ports):
            self.bits[h][:] = 0
            for e in port.accepted:
                self._set_bits(h, e.start_dpa, e.length, 1)

    # persistence -----------------------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        return {"ports": [{"accepted": [e.to_state() for e in p.accepted],
                           "pending": [e.to_state() for e in p.pending],
                           "generation": p.generation} for p in self.ports]}

    def restore(self, state: dict[str, Any] | None) -> None:
        """The saved extents of each port the device still has, those inside its regions; then the
        bitmaps rebuilt from them."""
        for h, saved in enumerate((state or {}).get("ports", [])[:len(self.ports)]):
            fits = [e for e in map(Extent.from_state, saved["accepted"]) if self.check_list([(e.start_dpa, e.length)]) is None]
            pending = [e for e in map(Extent.from_state, saved["pending"]) if self.check_list([(e.start_dpa, e.length)]) is None]
            self.ports[h] = PortDc(fits, pending, saved["generation"])
        self.rebuild_bits()


def check_dcd_state(state: Any) -> None:
    """Raise ValueError naming what in a loaded "dcd" entry ``DcState.to_state`` would not write."""
    if not isinstance(state, dict) or not isinstance(state.get("ports"), list):
        raise ValueError("dcd.ports is not a list")
    for port in state["ports"]:
        if not isinstance(port, dict) or not isinstance(port.get("generation"), int):
            raise ValueError("dcd.ports holds other than objects with an integer generation")
        for key in ("accepted", "pending"):
            items = port.get(key)
            if not isinstance(items, list) or not all(_extent_ok(i) for i in items):
                raise ValueError(f"dcd.ports[].{key} holds other than [dpa, length, tag hex, shared_seq]")


def _extent_ok(item: Any) -> bool:
    if not (isinstance(item, list) and len(item) == 4 and isinstance(item[2], str)):
        return False
    try:
        tag = bytes.fromhex(item[2])
    except ValueError:
        return False
    return (len(tag) == DC_TAG_LEN and all(isinstance(item[i], int) and not isinstance(item[i], bool)
                                           for i in (0, 1, 3)))
