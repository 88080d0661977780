"""Regions: an HPA window decoded onto one memdev or interleaved across several.

    HPA  base ──────────────────────────────────────────────────── base + size
          │ G │ G │ G │ G │ ...      chunk k goes to target k mod ways (§8.2.4.20.13)
          t0  t1  t0  t1                   each target's decoder maps it to its own DPA

A region is programmed the way Linux's region driver does it: every target gets its next free
HDM decoder with the same base, size, IG and IW (driver.hdm), so each device decodes the chunks of
its position. `Region.read` / `Region.write` do what the host bridge and the devices do together:
cut the range at chunk boundaries, pick the target of each chunk, translate to DPA and call the
target's `read(dpa, size)` / `write(dpa, data)`.

HPA is host-virtual here: nothing maps the window into the CPU's address space. The emulated
platform's root decoder (a CEDT CFMWS window, `ROOT_WINDOW_BASE` + `ROOT_WINDOW_SIZE`) and its
host-bridge target lists are the only state not kept in the devices: on real hardware they live in
the host, and a device's endpoint decoder does not know its own position. cxlemu keeps them in
`$CXLEMU_RUNTIME_DIR/cxl_root.json` (name, base and target order of each region), under an flock.
Everything else `list_regions` reads back from the decoders in the devices' BARs.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from driver.hdm import DecoderError, DecoderState, HdmDecoders
from emulator.device_dir import list_devices, open_bar, runtime_dir
from emulator.hdm import (
    DecoderSettings,
    dpa_offset,
    dpa_ranges,
    hpa_offset,
    ig_from_granularity,
    interleave_position,
    iw_from_ways,
)
from emulator.runtime_fs import ensure_runtime_dir, open_private_file
from emulator.spec.component_regs import HDM_DECODER_ALIGN
from emulator.spec.errors import ConfigError, DeviceFileDamaged, PoisonError

ROOT_WINDOW_BASE = 1 << 40   # 1 TiB: above any DRAM a test host has, like QEMU's cxl-fmw windows
ROOT_WINDOW_SIZE = 1 << 44   # 16 TiB
_ROOT_FILE = "cxl_root.json"


class RegionPoisonError(PoisonError):
    """A region read touched a poisoned line: where it is in HPA and on which target (like the HPA and
    DPA that Linux's cxl_poison trace event reports)."""

    def __init__(self, dpa: int, hpa: int, position: int) -> None:
        super().__init__(dpa)
        self.hpa = hpa
        self.position = position
        self.args = (f"poisoned line at HPA {hpa:#x} (target {position}, DPA {dpa:#x}): read returned no data",)


class RegionTarget(Protocol):
    """What a region needs of a memdev (driver.memdev.MemDev has these)."""

    bar: Any

    def read(self, dpa: int, size: int) -> bytes: ...

    def write(self, dpa: int, data: Any) -> None: ...


def _window_settings(base: int, size: int, ways: int, granularity: int) -> DecoderSettings:
    """The decoder every target of a region gets; ConfigError names the bad argument."""
    iw, ig = iw_from_ways(ways), ig_from_granularity(granularity)
    if size <= 0 or size % (ways * HDM_DECODER_ALIGN):
        raise ConfigError(f"region size {size:#x} must be a positive multiple of {ways} x 256 MiB "
                          f"for {ways} interleave ways")
    if base < 0 or base % HDM_DECODER_ALIGN:
        raise ConfigError(f"region base {base:#x} must be a multiple of 256 MiB")
    return DecoderSettings(base=base, size=size, ig=ig, iw=iw)


class Region:
    """An HPA window over targets in interleave order, with byte-granular read and write."""

    def __init__(self, targets: Sequence[RegionTarget], *, base: int, size: int, granularity: int,
                 name: str | None = None) -> None:
        self.window = _window_settings(base, size, len(targets), granularity)
        self.targets = list(targets)
        self.name = name
        self._dpa_start = [self._find_decoder(t, i) for i, t in enumerate(self.targets)]

    @property
    def base(self) -> int:
        return self.window.base

    @property
    def size(self) -> int:
        return self.window.size

    @property
    def ways(self) -> int:
        return self.window.ways

    @property
    def granularity(self) -> int:
        return self.window.granularity

    def _find_decoder(self, target: RegionTarget, position: int) -> int:
        """DPA start of this window's committed decoder on `target` (with DPA accumulation)."""
        committed = [state.settings for state in HdmDecoders(target.bar).committed()]
        for settings, (start, _end) in zip(committed, dpa_ranges(committed)):
            if settings == self.window:
                return start
        raise DecoderError(f"target {position} has no committed decoder for [{self.base:#x}, "
                           f"+{self.size:#x}) at {self.ways} ways x {self.granularity} B")

    def translate(self, hpa: int) -> tuple[int, int]:
        """HPA -> (position of the target, DPA on it)."""
        self._check_range(hpa, 1)
        off, w = hpa - self.base, self.window
        pos = interleave_position(off, w.ig, w.iw)
        return pos, self._dpa_start[pos] + dpa_offset(off, w.ig, w.iw)

    def _check_range(self, hpa: int, size: int) -> None:
        if size < 0 or hpa < self.base or hpa + size > self.base + self.size:
            raise ValueError(f"[{hpa:#x}, +{size:#x}) is outside the region [{self.base:#x}, +{self.size:#x})")

    def _pieces(self, start: int, end: int, origin: int) -> Iterator[tuple[int, int, int, int]]:
        """(position, dpa, offset in the caller's buffer, length) per chunk in HPA offsets
        [start, end); the caller's buffer begins at offset `origin`."""
        w = self.window
        off = start
        while off < end:
            n = min(w.granularity - off % w.granularity, end - off)
            pos = interleave_position(off, w.ig, w.iw)
            yield pos, self._dpa_start[pos] + dpa_offset(off, w.ig, w.iw), off - origin, n
            off += n

    def _split(self, hpa: int, size: int) -> tuple[int, int, int, int]:
        """HPA offsets (start, body start, body end, end): the body is whole interleave rounds."""
        self._check_range(hpa, size)
        start = hpa - self.base
        end = start + size
        round_bytes = self.ways * self.granularity
        body_start = min(-(-start // round_bytes) * round_bytes, end)
        body_end = max(end // round_bytes * round_bytes, body_start)
        return start, body_start, body_end, end

    def _body(self, body_start: int, body_end: int) -> Iterator[tuple[int, int, int]]:
        """(position, first DPA, rounds) of each target's contiguous share of whole rounds.

        Chunk p of consecutive rounds sits at consecutive DPA on target p, so a span of whole
        rounds is one transfer per target plus a (rounds, ways, G) reshuffle on the host.
        """
        w = self.window
        rounds = (body_end - body_start) // (w.ways * w.granularity)
        if rounds == 0:
            return
        first_round = dpa_offset(body_start, w.ig, w.iw)  # the same for every position of a round
        for pos in range(w.ways):
            yield pos, self._dpa_start[pos] + first_round, rounds

    def read(self, hpa: int, size: int) -> bytes:
        """Read `size` bytes at `hpa`; a poisoned line raises the target's PoisonError."""
        start, body_start, body_end, end = self._split(hpa, size)
        out = np.empty(size, dtype=np.uint8)
        for pos, dpa, at, n in self._pieces(start, body_start, start):
            out[at:at + n] = self._read_target(pos, dpa, n)
        for pos, dpa, at, n in self._pieces(body_end, end, start):
            out[at:at + n] = self._read_target(pos, dpa, n)
        body = out[body_start - start:body_end - start].reshape(-1, self.ways, self.granularity)
        for pos, dpa, rounds in self._body(body_start, body_end):
            share = self._read_target(pos, dpa, rounds * self.granularity)
            body[:, pos, :] = share.reshape(rounds, self.granularity)
        return out.tobytes()

    def _read_target(self, pos: int, dpa: int, size: int) -> np.ndarray:
        try:
            data = self.targets[pos].read(dpa, size)
        except PoisonError as exc:
            w = self.window
            hpa = self.base + hpa_offset(exc.dpa - self._dpa_start[pos], pos, w.ig, w.iw)
            raise RegionPoisonError(exc.dpa, hpa, pos) from exc
        return np.frombuffer(data, dtype=np.uint8)

    def write(self, hpa: int, data: Any) -> None:
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        start, body_start, body_end, end = self._split(hpa, src.size)
        for pos, dpa, at, n in self._pieces(start, body_start, start):
            self.targets[pos].write(dpa, src[at:at + n])
        for pos, dpa, at, n in self._pieces(body_end, end, start):
            self.targets[pos].write(dpa, src[at:at + n])
        body = src[body_start - start:body_end - start].reshape(-1, self.ways, self.granularity)
        for pos, dpa, _rounds in self._body(body_start, body_end):
            self.targets[pos].write(dpa, np.ascontiguousarray(body[:, pos, :]).reshape(-1))

    def __repr__(self) -> str:
        return (f"Region({self.name!r}, base={self.base:#x}, size={self.size:#x}, ways={self.ways}, "
                f"granularity={self.granularity})")


def program_region(targets: Sequence[RegionTarget], *, base: int, size: int, granularity: int = 256,
                   lock: bool = False, name: str | None = None) -> Region:
    """Commit the next free decoder of every target for the window; all or nothing.

    A target whose commit fails has the decoders already committed on the others reset (in
    reverse), so a failed region leaves no half-programmed devices.
    """
    if len({id(t) for t in targets}) != len(targets) or not targets:
        raise ConfigError("a region needs one or more distinct memdevs")
    settings = _window_settings(base, size, len(targets), granularity)
    done: list[tuple[HdmDecoders, int]] = []
    try:
        for target in targets:
            hdm = HdmDecoders(target.bar)
            index = len(hdm.committed())
            hdm.enable()
            hdm.commit(index, settings, lock=lock)
            done.append((hdm, index))
    except BaseException:
        for hdm, index in reversed(done):
            with contextlib.suppress(DecoderError):
                hdm.reset(index)
        raise
    return Region(targets, base=base, size=size, granularity=granularity, name=name)


def destroy_region(region: Region) -> None:
    """Reset the region's decoder on every target; all or nothing.

    Every target is checked first (its decoder for the window must be its top committed one and
    not locked), so a refusal leaves the region whole rather than half reset.
    """
    plan: list[tuple[HdmDecoders, int]] = []
    for position, target in enumerate(region.targets):
        hdm = HdmDecoders(target.bar)
        committed = hdm.committed()
        mine = [state for state in committed if state.settings == region.window]
        if not mine:
            raise DecoderError(f"target {position} has no committed decoder for the region")
        if mine[0].index != len(committed) - 1:
            raise DecoderError(f"target {position}: decoder {mine[0].index}: reset the decoders above it "
                               "first (they uncommit in reverse order)")
        if mine[0].locked:
            raise DecoderError(f"target {position}: decoder {mine[0].index} is locked on commit: "
                               "it stays until the device is reset")
        plan.append((hdm, mine[0].index))
    for hdm, index in reversed(plan):
        hdm.reset(index)


# ---- the root decoder: regions by name, across all devices ------------------------------------------

@dataclass(frozen=True)
class RegionInfo:
    """A region as `cxlemu region list` shows it (read back from the devices' decoders)."""

    name: str | None
    base: int
    size: int
    interleave_ways: int
    interleave_granularity: int
    targets: list[str]          # memdev names in interleave position order
    decoders: list[int]         # decoder index on each target
    order_known: bool           # False when no root-decoder record gives the positions


def _root_path() -> Path:
    return runtime_dir() / _ROOT_FILE


@contextlib.contextmanager
def root_lock() -> Iterator[None]:
    """Serialise region creation and removal between hosts (Linux's cxl_region_rwsem)."""
    fd = open_private_file(ensure_runtime_dir() / "cxl_root.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read_root() -> list[dict[str, Any]]:
    try:
        return list(json.loads(_root_path().read_text())["regions"])
    except FileNotFoundError:
        return []


def _write_root(records: list[dict[str, Any]]) -> None:
    tmp = _root_path().with_suffix(".tmp")
    tmp.write_text(json.dumps({"regions": records}, indent=2))
    tmp.replace(_root_path())


def _committed_by_device() -> dict[str, list[DecoderState]]:
    """Committed decoders of every device under the runtime dir (devices without HDM skipped)."""
    found: dict[str, list[DecoderState]] = {}
    for name in list_devices():
        with contextlib.suppress(OSError, DecoderError, LookupError, DeviceFileDamaged):
            bar = open_bar(name)
            try:
                snapshot = bytearray(bar)  # a copy: no view may outlive the mapping
            finally:
                bar.close()
            found[name] = HdmDecoders(snapshot).committed()
    return found


def list_regions() -> list[RegionInfo]:
    """Every region some device decodes, grouped by window, ordered by base."""
    groups: dict[DecoderSettings, list[tuple[str, int]]] = {}
    for device, states in _committed_by_device().items():
        for state in states:
            groups.setdefault(state.settings, []).append((device, state.index))
    records = {rec["base"]: rec for rec in _read_root()}
    regions = []
    for window, members in sorted(groups.items(), key=lambda item: item[0].base):
        by_name = dict(members)
        record = records.get(window.base)
        if record is not None and record["size"] == window.size and sorted(record["targets"]) == sorted(by_name):
            name, order, known = record["name"], list(record["targets"]), True
        else:  # no record (or a stale one): the devices alone cannot tell their positions
            name, order, known = None, sorted(by_name), window.ways == 1
        regions.append(RegionInfo(
            name=name, base=window.base, size=window.size, interleave_ways=window.ways,
            interleave_granularity=window.granularity, targets=order, decoders=[by_name[t] for t in order],
            order_known=known))
    return regions


def _allocate_base(size: int, ways: int, targets: Sequence[str], taken: list[tuple[int, int]],
                   below: dict[str, int]) -> int:
    """Lowest base in the root window aligned to ways x 256 MiB (as Linux's alloc_hpa aligns), that
    overlaps no region and lies above the targets' own windows (a device's decoders ascend in HPA)."""
    align = ways * HDM_DECODER_ALIGN
    candidate = max([ROOT_WINDOW_BASE] + [below.get(t, 0) for t in targets])
    candidate = -(-candidate // align) * align
    for start, end in sorted(taken):
        if candidate + size <= start:
            break
        candidate = max(candidate, -(-end // align) * align)
    return candidate


def _check_base(base: int, size: int, taken: list[tuple[int, int]]) -> None:
    if base < ROOT_WINDOW_BASE or base + size > ROOT_WINDOW_BASE + ROOT_WINDOW_SIZE:
        raise ConfigError(f"region [{base:#x}, +{size:#x}) must lie in the root window "
                          f"[{ROOT_WINDOW_BASE:#x}, +{ROOT_WINDOW_SIZE:#x})")
    for start, end in taken:
        if base < end and start < base + size:
            raise ConfigError(f"region [{base:#x}, +{size:#x}) overlaps the region at {start:#x}: "
                              "pick another --base or leave it out")


def _check_free_dpa(memdev: Any, states: list[DecoderState], needed: int) -> None:
    used = sum(s.dpa_skip + s.settings.dpa_size for s in states)
    free = memdev.config.capacity - used
    if needed > free:
        raise ConfigError(f"memdev {memdev.name!r} has {free >> 20} MiB of DPA left; the region needs "
                          f"{needed >> 20} MiB on each of its targets")


def create_region(memdevs: Sequence[Any], *, size: int, granularity: int = 256, base: int | None = None,
                  lock: bool = False) -> Region:
    """Create a region over open MemDevs (in interleave order), named and recorded in the root decoder.

    `base` None picks the lowest free, aligned HPA in the root window.
    """
    names = [md.name for md in memdevs]
    if len(set(names)) != len(names):
        raise ConfigError(f"memdevs {names} repeat a device: each may appear once in a region")
    _window_settings(base or ROOT_WINDOW_BASE, size, len(memdevs), granularity)  # argument errors first
    with root_lock():
        committed = _committed_by_device()
        taken = [(s.base, s.base + s.size) for states in committed.values() for s in states]
        tops = {dev: states[-1].base + states[-1].size for dev, states in committed.items() if states}
        if base is None:
            base = _allocate_base(size, len(memdevs), names, taken, tops)
        _check_base(base, size, taken)
        for md in memdevs:
            _check_free_dpa(md, committed.get(md.name, []), size // len(memdevs))
        live = {info.base for info in list_regions()}
        records = [rec for rec in _read_root() if rec["base"] in live]  # drop regions whose devices reset
        used = {rec["name"] for rec in records}
        name = next(f"region{i}" for i in range(len(used) + 1) if f"region{i}" not in used)
        region = program_region(memdevs, base=base, size=size, granularity=granularity, lock=lock, name=name)
        records.append({"name": name, "base": base, "size": size, "targets": names})
        _write_root(records)
    return region


def find_region(name: str) -> RegionInfo:
    """The region called `name`; ConfigError listing the names there are otherwise."""
    regions = list_regions()
    for info in regions:
        if info.name == name:
            return info
    known = ", ".join(str(r.name) for r in regions if r.name) or "none"
    raise ConfigError(f"no region named {name!r} (regions: {known})")


@contextlib.contextmanager
def open_region(name: str) -> Iterator[Region]:
    """Open a recorded region's memdevs and yield the Region over them; closes them on exit."""
    from driver.memdev import MemDev

    info = find_region(name)
    if not info.order_known:
        raise ConfigError(f"region {name!r} has no recorded interleave order")
    with contextlib.ExitStack() as stack:
        memdevs = [stack.enter_context(MemDev.open(t)) for t in info.targets]
        yield Region(memdevs, base=info.base, size=info.size, granularity=info.interleave_granularity,
                     name=info.name)


def remove_region(name: str) -> None:
    """Reset a recorded region's decoders and forget it (the region must be its targets' top decoder)."""
    with root_lock():
        with open_region(name) as region:
            destroy_region(region)
        _write_root([rec for rec in _read_root() if rec["name"] != name])


__all__ = [
    "ROOT_WINDOW_BASE", "ROOT_WINDOW_SIZE", "Region", "RegionInfo", "RegionPoisonError", "RegionTarget", "create_region",
    "destroy_region", "find_region", "list_regions", "open_region", "program_region", "remove_region",
    "root_lock",
]
