"""Attach to devices by name and read their telemetry, surviving devices that come and go.

A device is watched, not opened: the monitor maps its ``bar`` read-only and never touches the
mailbox, so watching cannot disturb the firmware or a host. Each poll decides the device's state:

    directory or bar missing ........... "gone" (or "not found" if it was never seen)
    firmware.pid names a dead process .. "gone"   (the firmware crashed or was killed)
    no firmware.pid .................... "stopped" (files kept, nothing serves them)
    firmware.pid alive ................. "served"

A bar file replaced by a new one (device destroyed and created again) is detected by its inode
and mapped afresh, so a device that returns is picked up without restarting the monitor.
"""
from __future__ import annotations

import mmap
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from emulator import device as dev
from emulator.device_dir import bar_name
from emulator.liveness import read_pid
from emulator.spec import registers as R
from emulator.telemetry import TelemetryReader, TelemetrySnapshot
from emulator.timing import linkstate
from tools.monitor.history import LinkHistory

STATES = ("served", "stopped", "gone", "not found")
STALE_AFTER_S = 5.0  # the firmware publishes ~10 times a second


@dataclass
class DeviceView:
    """What one poll saw of one device; everything the render functions need."""

    name: str
    state: str
    detail: str = ""
    snapshot: TelemetrySnapshot | None = None
    link: dict[str, int] | None = None  # linkstate.snapshot(); None before the data path runs
    history: LinkHistory = field(default_factory=LinkHistory)
    capacity_bytes: int = 0  # from config.json, for when the firmware has not published yet
    pid: int | None = None
    telemetry_age_s: float | None = None  # since the firmware last published; None: never

    @property
    def stale(self) -> bool:
        """Served, but the firmware has not published for a while: hung or overloaded."""
        return self.up and self.telemetry_age_s is not None and self.telemetry_age_s > STALE_AFTER_S

    @property
    def up(self) -> bool:
        return self.state == "served"


def _pid_file_pid(path: Path) -> int | None:
    rec = read_pid(path)
    return None if rec is None else rec[0]


def _link_counters(bar: Any) -> dict[str, int] | None:
    """The data path's counters, or None while no timed data path has stamped the page."""
    region = memoryview(bar)[R.LINK_STATE_OFFSET:R.LINK_STATE_OFFSET + R.LINK_STATE_SIZE]
    try:
        if int.from_bytes(region[:8], "little") != linkstate.MAGIC:
            return None
        return linkstate.snapshot(region)
    finally:
        region.release()


class DeviceSource:
    """One watched device: keeps its read-only mapping and counter history across polls."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.history = LinkHistory()
        self._bar: mmap.mmap | None = None
        self._reader: TelemetryReader | None = None
        self._inode: tuple[int, int] | None = None
        self._seen = False
        self._last: TelemetrySnapshot | None = None

    def close(self) -> None:
        """Unmap the BAR (the reader's views are dropped first, so the unmap succeeds)."""
        if self._reader is not None:
            self._reader.close()
        if self._bar is not None:
            self._bar.close()
        self._reader, self._bar, self._inode = None, None, None

    def poll(self, now: float | None = None) -> DeviceView:
        """Look at the device once; never raises for a device that is missing or dying."""
        now = time.monotonic() if now is None else now
        path = dev.device_path(self.name)
        inode = self._bar_inode(path)
        if inode is None:
            self.close()
            self.history.reset()
            state = "gone" if self._seen else "not found"
            detail = "device files removed" if self._seen else f"no device in {dev.runtime_dir()}"
            return DeviceView(self.name, state, detail, self._last, history=self.history)
        if inode != self._inode:
            try:
                self._attach(path, inode)
            except OSError as exc:  # removed between the stat and the open
                self.close()
                return DeviceView(self.name, "gone" if self._seen else "not found",
                                  f"cannot map bar: {exc.strerror}", self._last, history=self.history)
        self._seen = True
        view = DeviceView(self.name, *self._state(path), history=self.history,
                          capacity_bytes=self._capacity(path))
        view.pid = _pid_file_pid(path)
        assert self._reader is not None and self._bar is not None
        view.snapshot = self._last = self._reader.snapshot()
        fw = view.snapshot.firmware
        if fw is not None and fw.updated_ns:
            view.telemetry_age_s = max(0.0, (time.time_ns() - fw.updated_ns) / 1e9)
        view.link = _link_counters(self._bar)
        if view.link is not None:
            self.history.add(now, view.link)
        return view

    @staticmethod
    def _bar_inode(path: Path) -> tuple[int, int] | None:
        try:
            st = os.stat(path / bar_name(0))  # host port 0: the firmware section is the same in every BAR
        except OSError:
            return None
        return (st.st_dev, st.st_ino) if st.st_size >= R.BAR_SIZE else None

    def _attach(self, path: Path, inode: tuple[int, int]) -> None:
        self.close()
        self.history.reset()
        with open(path / bar_name(0), "rb") as f:
            self._bar = mmap.mmap(f.fileno(), R.BAR_SIZE, prot=mmap.PROT_READ)
        self._reader = TelemetryReader(self._bar)
        self._inode = inode

    @staticmethod
    def _state(path: Path) -> tuple[str, str]:
        pid = _pid_file_pid(path)
        if pid is None:
            return "stopped", "not served (no firmware.pid)"
        if dev.firmware_pid(path.name) is None:
            return "gone", f"firmware pid {pid} exited"
        return "served", f"firmware pid {pid}"

    @staticmethod
    def _capacity(path: Path) -> int:
        try:
            return dev.DeviceConfig.from_json((path / "config.json").read_text()).capacity
        except (OSError, ValueError, TypeError):
            return 0


class DeviceSet:
    """The devices a monitor shows: the names given, or every device under the runtime dir
    (re-listed each poll, so devices created later appear)."""

    def __init__(self, names: list[str] | None = None) -> None:
        self.fixed = list(names) if names else None
        self.sources: dict[str, DeviceSource] = {}

    def names(self) -> list[str]:
        if self.fixed is not None:
            return self.fixed
        listed = dev.list_devices()
        # Keep showing devices that went away (as "gone") until they come back.
        return sorted(set(listed) | set(self.sources))

    def poll(self, now: float | None = None) -> list[DeviceView]:
        views = []
        for name in self.names():
            source = self.sources.setdefault(name, DeviceSource(name))
            views.append(source.poll(now))
        return views

    def close(self) -> None:
        for source in self.sources.values():
            source.close()


def timed_transfers(link: dict[str, int], name: str) -> int:
    """Transfers of direction `name` since start that recorded a latency: the histogram's total.
    An untimed link moves data without reading the clock, so it counts a transfer (what the
    bandwidth panel shows) but no latency."""
    return sum(link[f"{name}_hist_{k:02d}"] for k in range(linkstate.HIST_BUCKETS))
