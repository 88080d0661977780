"""The single writer of one telemetry section: the claim (host section: one live process), the
seqlock publish, and the checks and encoders that turn dataclass fields into the section's stores."""
from __future__ import annotations

import fcntl
import functools
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any, Self

import numpy as np

from emulator.spec.registers import TELEMETRY_OFFSET
from emulator.telemetry.layout import (
    _HEAD_NAMES,
    _SECTION_HEAD,
    EVENT_TEXT_BYTES,
    EVENTS_MAX,
    HOTLIST_MAX,
    LOG_NAMES,
    MAX_HOSTS,
    POISON_MAX,
    POOL,
    SECTIONS,
)
from emulator.telemetry.page import (
    TelemetryClaimed,
    TelemetryError,
    _u64_cell,
    format_page,
)
from emulator.telemetry.snapshot import (
    _COMPOSITE,
    _DATACLASS,
    EventEntry,
    FirmwareTelemetry,
    HostTelemetry,
    PoisonEntry,
    PoolHost,
)


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (in this pid namespace)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@functools.cache
def _iinfo(fmt: str) -> np.iinfo:
    return np.iinfo(np.dtype(fmt))


def _check_int(section: str, name: str, value: Any, fmt: str) -> int:
    info = _iinfo(fmt)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"telemetry {section}.{name} must be an int, got {type(value).__name__}")
    if not info.min <= int(value) <= info.max:
        raise ValueError(f"telemetry {section}.{name}={value} is outside {info.min}..{info.max}")
    return int(value)


class TelemetryWriter:
    """The single writer of one section of the page.

    ``section`` is "firmware" (the firmware runner) or "host" (a KV shim). The host section is
    claimed on construction: its ``writer_pid`` must be 0, ours, or a dead process, else
    `TelemetryClaimed`; a claim by a new process zeroes the section, since its counters are totals
    since that shim started. Pass ``lock_path`` (the device's ``bar`` file) so that two processes
    claiming at the same instant are serialised by an fcntl lock on that field; without it the
    claim is check-then-set. `publish` never blocks and never waits for readers.
    """

    def __init__(self, region: Any, section: str, *, offset: int = TELEMETRY_OFFSET,
                 lock_path: str | os.PathLike[str] | None = None) -> None:
        if section not in SECTIONS:
            raise ValueError(f"unknown telemetry section {section!r}: use one of {sorted(SECTIONS)}")
        if memoryview(region).readonly:
            raise ValueError("telemetry writer needs a writable mapping of the BAR (open it read-write)")
        format_page(region, offset)
        self.section = section
        self.pid = os.getpid()
        self._layout, rel = SECTIONS[section]
        self._base = offset + rel
        self._seq = _u64_cell(region, self._base)
        self._rec = np.ndarray((), dtype=self._layout.dtype, buffer=region, offset=self._base)
        self._lock_path = lock_path
        self._claimed = False
        self._claim()

    def _claim(self) -> None:
        fd = os.open(self._lock_path, os.O_RDWR) if self._lock_path is not None else None
        pid_at = self._base + self._layout.offsets["writer_pid"]
        try:
            if fd is not None:
                fcntl.lockf(fd, fcntl.LOCK_EX, 4, pid_at)
            current = int(self._rec["writer_pid"])
            if self.section == "host" and current not in (0, self.pid) and _pid_alive(current):
                raise TelemetryClaimed(self.section, current)
            if int(self._seq[0]) & 1:  # the previous writer died mid-publish: the copy is ours now
                self._seq[0] = int(self._seq[0]) + 1
            if self.section == "host" and current != self.pid:
                self._zero_body()  # counters are totals since *this* shim started
            self._rec["writer_pid"] = self.pid
            self._claimed = True
        finally:
            if fd is not None:
                os.close(fd)  # closing drops the lockf lock

    def _zero_body(self) -> None:
        seq = int(self._seq[0])
        self._seq[0] = seq + 1
        for f in self._layout.fields[len(_SECTION_HEAD):]:
            self._rec[f.name] = 0
        self._rec["updated_ns"] = time.time_ns()
        self._seq[0] = seq + 2

    def close(self) -> None:
        """Give up the section (the host section becomes claimable at once) and drop the views of
        the mapping, so its owner can close it."""
        if not self._claimed:
            return
        if int(self._rec["writer_pid"]) == self.pid:
            self._rec["writer_pid"] = 0
        self._claimed = False
        del self._rec, self._seq

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def publish(self, snapshot: FirmwareTelemetry | HostTelemetry | None = None, /,
                **values: Any) -> None:
        """Store `values` (field names of the section's dataclass), or every field of `snapshot`,
        as one atomic update; fields not given keep their values."""
        if not self._claimed:
            raise TelemetryError(f"telemetry writer for {self.section!r} is closed")
        if snapshot is not None:
            if not isinstance(snapshot, _DATACLASS[self.section]) or values:
                raise ValueError(f"publish() takes a {_DATACLASS[self.section].__name__} or "
                                 "keyword fields, not both")
            values = {f.name: getattr(snapshot, f.name) for f in fields(snapshot)
                      if f.name not in _HEAD_NAMES}
        stores = self._encode(values)  # validate everything before the sequence goes odd
        seq = int(self._seq[0])
        self._seq[0] = seq + 1
        try:
            for name, value in stores:
                self._rec[name] = value
            self._rec["updated_ns"] = time.time_ns()
        finally:
            self._seq[0] = seq + 2

    def _encode(self, values: dict[str, Any]) -> list[tuple[str, Any]]:
        stores: list[tuple[str, Any]] = []
        for name, value in values.items():
            if name in _COMPOSITE and name in _ENCODERS[self.section]:
                stores += _ENCODERS[self.section][name](value)
                continue
            fld = next((f for f in self._layout.fields if f.name == name and not f.count), None)
            if fld is None or name in _HEAD_NAMES or name.startswith("reserved"):
                known = [f.name for f in fields(_DATACLASS[self.section]) if f.name not in _HEAD_NAMES]
                raise ValueError(f"telemetry section {self.section!r} has no field {name!r}; "
                                 f"fields: {', '.join(known)}")
            stores.append((name, _check_int(self.section, name, value, fld.fmt)))
        return stores


def _column(name: str, values: list[int], limit: int, fmt: str, section: str = "firmware") -> np.ndarray:
    """`values` checked against `fmt` and zero-padded to the `limit` slots of an array field.
    Checked as one array: a 256-entry hotlist costs microseconds, not a Python loop."""
    name = f"{section}.{name}"
    if len(values) > limit:
        raise ValueError(f"telemetry {name} holds at most {limit} entries, got {len(values)}")
    out = np.zeros(limit, dtype=fmt)
    if not values:
        return out
    bad = next((v for v in values if isinstance(v, bool) or not isinstance(v, (int, np.integer))), None)
    if bad is not None:
        raise TypeError(f"telemetry {name} entries must be ints, got {type(bad).__name__}")
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu":  # ints beyond any numpy integer: compare as Python ints
        arr = np.asarray(values, dtype=object)
    info = _iinfo(fmt)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < info.min or hi > info.max:
        raise ValueError(f"telemetry {name} entry {lo if lo < info.min else hi} is outside "
                         f"{info.min}..{info.max}")
    out[:len(values)] = arr
    return out


def _encode_hotlist(hotlist: Iterable[tuple[int, int]]) -> list[tuple[str, Any]]:
    pairs = [tuple(p) for p in hotlist]
    return [("hot_unit", _column("hotlist", [p[0] for p in pairs], HOTLIST_MAX, "<u8")),
            ("hot_count", _column("hotlist", [p[1] for p in pairs], HOTLIST_MAX, "<u4")),
            ("hotlist_len", len(pairs))]


def _encode_events(events: Iterable[EventEntry]) -> list[tuple[str, Any]]:
    rows = list(events)
    bad = [e.log for e in rows if not 0 <= e.log < len(LOG_NAMES)]
    if bad:
        raise ValueError(f"event log {bad[0]} is not one of 0..{len(LOG_NAMES) - 1} ({', '.join(LOG_NAMES)})")
    text = np.zeros(EVENTS_MAX, dtype=f"S{EVENT_TEXT_BYTES}")
    # Cut at a character boundary so the reader never sees half a UTF-8 sequence.
    text[:len(rows)] = [e.text.encode()[:EVENT_TEXT_BYTES].decode(errors="ignore").encode()
                        for e in rows[:EVENTS_MAX]]
    return [("event_ts", _column("recent_events", [e.timestamp_ns for e in rows], EVENTS_MAX, "<u8")),
            ("event_log", _column("recent_events", [e.log for e in rows], EVENTS_MAX, "<u4")),
            ("event_text", text), ("events_len", len(rows))]


def _encode_poison(records: Iterable[PoisonEntry]) -> list[tuple[str, Any]]:
    rows = list(records)
    return [("poison_dpa", _column("recent_poison", [p.dpa for p in rows], POISON_MAX, "<u8")),
            ("poison_length", _column("recent_poison", [p.length for p in rows], POISON_MAX, "<u8")),
            ("poison_source", _column("recent_poison", [p.source for p in rows], POISON_MAX, "<u4")),
            ("poison_len", len(rows))]


def _encode_host_rows(rows: Iterable[PoolHost]) -> list[tuple[str, Any]]:
    """One `PoolHost` per port, as the section's per-host columns (``host_<field>``). At most 8
    values a column: checked in plain Python, which costs less here than `_column`'s array checks
    (the firmware publishes this into every port's BAR ~10 times a second)."""
    rows = list(rows)
    if len(rows) > MAX_HOSTS:
        raise ValueError(f"telemetry pool.host_rows holds at most {MAX_HOSTS} entries (one per host port), "
                         f"got {len(rows)}")
    if not all(isinstance(r, PoolHost) for r in rows):
        raise TypeError("telemetry pool.host_rows entries must be PoolHost")
    stores: list[tuple[str, Any]] = []
    for name in _POOL_HOST_FIELDS:
        col = f"host_{name}"
        fmt = POOL.by_name[col].fmt
        values = [getattr(r, name) for r in rows]
        lo, hi = int(_iinfo(fmt).min), int(_iinfo(fmt).max)
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"telemetry pool.{col} entries must be ints, got {type(v).__name__}")
            if not lo <= v <= hi:
                raise ValueError(f"telemetry pool.{col} entry {v} is outside {lo}..{hi}")
        out = np.zeros(MAX_HOSTS, dtype=fmt)
        out[:len(values)] = values
        stores.append((col, out))
    return stores


_POOL_HOST_FIELDS = [f.name for f in fields(PoolHost)]
_ENCODERS: dict[str, dict[str, Callable[[Any], list[tuple[str, Any]]]]] = {
    "firmware": {"hotlist": _encode_hotlist, "recent_events": _encode_events, "recent_poison": _encode_poison},
    "host": {}, "pool": {"host_rows": _encode_host_rows}}
