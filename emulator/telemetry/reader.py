"""The reader of the telemetry page: consistent snapshots from any process through the seqlock's
read side, without locks or mailbox commands, decoded into the snapshot dataclasses."""
from __future__ import annotations

import os
import time
from dataclasses import fields
from typing import Any

import numpy as np

from emulator.spec.registers import TELEMETRY_OFFSET
from emulator.telemetry.layout import (
    EVENTS_MAX,
    HEADER,
    HOTLIST_MAX,
    MAGIC,
    MAX_HOSTS,
    POISON_MAX,
    SECTIONS,
    VERSION_MAJOR,
    _Layout,
)
from emulator.telemetry.page import (
    TelemetryError,
    _check_region,
    _header_problem,
    _u64_cell,
    page_sections,
)
from emulator.telemetry.snapshot import (
    _COMPOSITE,
    EventEntry,
    FirmwareTelemetry,
    HostTelemetry,
    PoisonEntry,
    PoolHost,
    PoolTelemetry,
    TelemetrySnapshot,
)


class _Unstable(Exception):
    """A section's sequence stayed odd (or kept moving) for longer than the reader waits."""


class TelemetryReader:
    """Consistent snapshots of the page from any process, without locks or mailbox commands.

    ``region`` is the BAR mapping (read-only is enough). ``link_reader`` returns the data path's
    link counters (or None); it is called once per `snapshot`. A section whose writer stopped
    mid-publish is reported in ``notes`` after ``max_wait_s`` instead of blocking the caller.
    """

    def __init__(self, region: Any, *, offset: int = TELEMETRY_OFFSET,
                 link_reader: Any = None, max_wait_s: float = 0.05) -> None:
        _check_region(region, offset)
        self._mv: memoryview | None = memoryview(region)
        self._offset = offset
        self._seqs = {name: _u64_cell(region, offset + rel)
                      for name, (_, rel) in SECTIONS.items()}
        self.link_reader = link_reader
        self.max_wait_s = max_wait_s

    def close(self) -> None:
        """Drop the views of the mapping, so its owner can close it."""
        if self._mv is not None:
            self._mv.release()
        self._mv = None
        self._seqs = {}

    def snapshot(self) -> TelemetrySnapshot:
        """One consistent copy of each section (sections are consistent each on its own)."""
        if self._mv is None:
            raise TelemetryError("telemetry reader is closed")
        snap = TelemetrySnapshot()
        head = np.frombuffer(bytes(self._mv[self._offset:self._offset + HEADER.size]), HEADER.dtype)[0]
        if int(head["magic"]) != MAGIC:
            snap.notes.append("telemetry page not formatted: no firmware has published yet")
            return snap
        snap.version = (int(head["version_major"]), int(head["version_minor"]))
        if snap.version[0] != VERSION_MAJOR:
            snap.notes.append(f"telemetry layout version {snap.version[0]}.{snap.version[1]} is not "
                              f"{VERSION_MAJOR}.x: upgrade cxlemu to read it")
            return snap
        problem = _header_problem(head)
        if problem is not None:
            snap.notes.append(f"{problem}: cannot read it")
            return snap
        # An older minor's section is shorter: read what it has, its missing fields read 0; a
        # section it lacks altogether stays None.
        sizes = {name: min(int(head[f"{name}_size"]), SECTIONS[name][0].size) for name in page_sections(head)}
        snap.firmware = self._section("firmware", sizes["firmware"], snap.notes)  # type: ignore[assignment]
        snap.host = self._section("host", sizes["host"], snap.notes)  # type: ignore[assignment]
        if "pool" in sizes:
            snap.pool = self._section("pool", sizes["pool"], snap.notes)  # type: ignore[assignment]
        if self.link_reader is not None:
            snap.link = self.link_reader()
        return snap

    def _section(self, name: str, size: int,
                 notes: list[str]) -> FirmwareTelemetry | HostTelemetry | PoolTelemetry | None:
        try:
            seq, raw = self._read_raw(name, size)
        except _Unstable as exc:
            notes.append(f"{name} section unreadable: writer {exc.args[0]} stopped mid-update")
            return None
        if seq == 0:
            if name != "pool":  # the firmware publishes it with its own section: one note says it
                notes.append("firmware has not published telemetry yet" if name == "firmware"
                             else "no KV shim has published telemetry")
            return None
        dtype = self._layout(name).dtype
        raw += bytes(dtype.itemsize - len(raw))
        # Plain Python ints, lists and bytes: callers get no numpy scalars.
        rec = {key: v.tolist() if isinstance(v, np.ndarray) else v
               for key, v in zip(dtype.names or (), np.frombuffer(raw, dtype).tolist()[0])}
        return _DECODERS[name](rec)

    @staticmethod
    def _layout(name: str) -> _Layout:
        return SECTIONS[name][0]

    def _read_raw(self, name: str, size: int) -> tuple[int, bytes]:
        """The seqlock read side: seq (even), copy ``size`` bytes, seq again; retry until both
        loads agree."""
        assert self._mv is not None
        layout, rel = SECTIONS[name]
        base = self._offset + rel
        cell = self._seqs[name]
        deadline = time.monotonic() + self.max_wait_s
        while True:
            before = int(cell[0])
            if not before & 1:
                raw = self._mv[base:base + size].tobytes()
                if int(cell[0]) == before:
                    return before, raw
            if time.monotonic() > deadline:
                pid_at = base + layout.offsets["writer_pid"]
                raise _Unstable(int.from_bytes(self._mv[pid_at:pid_at + 4], "little"))
            os.sched_yield()


_FIRMWARE_SCALARS = [f.name for f in fields(FirmwareTelemetry) if f.name not in _COMPOSITE]
_HOST_SCALARS = [f.name for f in fields(HostTelemetry)]


def _decode_firmware(rec: dict[str, Any]) -> FirmwareTelemetry:
    fw = FirmwareTelemetry(**{name: rec[name] for name in _FIRMWARE_SCALARS})
    n = min(rec["hotlist_len"], HOTLIST_MAX)  # clamp: a bad page must not crash the reader
    fw.hotlist = list(zip(rec["hot_unit"][:n], rec["hot_count"][:n]))
    n = min(rec["events_len"], EVENTS_MAX)
    fw.recent_events = [EventEntry(t, g, x.decode(errors="replace"))
                        for t, g, x in zip(rec["event_ts"][:n], rec["event_log"][:n], rec["event_text"][:n])]
    n = min(rec["poison_len"], POISON_MAX)
    fw.recent_poison = [PoisonEntry(d, ln, src) for d, ln, src in
                        zip(rec["poison_dpa"][:n], rec["poison_length"][:n], rec["poison_source"][:n])]
    return fw


def _decode_host(rec: dict[str, Any]) -> HostTelemetry:
    return HostTelemetry(**{name: rec[name] for name in _HOST_SCALARS})


def _decode_pool(rec: dict[str, Any]) -> PoolTelemetry:
    pool = PoolTelemetry(**{name: rec[name] for name in _POOL_SCALARS})
    n = min(pool.hosts, MAX_HOSTS)  # clamp: a bad page must not crash the reader
    pool.host_rows = [PoolHost(**{f: rec[f"host_{f}"][h] for f in _POOL_HOST_FIELDS}) for h in range(n)]
    return pool


_POOL_SCALARS = [f.name for f in fields(PoolTelemetry) if f.name not in _COMPOSITE]
_POOL_HOST_FIELDS = [f.name for f in fields(PoolHost)]
_DECODERS = {"firmware": _decode_firmware, "host": _decode_host, "pool": _decode_pool}
