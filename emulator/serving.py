"""Serving a device: its firmware (``emulator.firmware``) over its files
(``emulator.device_dir``), in a thread of this process or in the foreground of ``cxlemu serve``.

    provision(config)  ──▶ DeviceFiles (the stopped device as it was, reconfigured, or new)
    bind_media         ──▶ media on the configured NUMA node; numa_node file written
    files.reserve()    ──▶ every page of the files allocated (there): a full disk never SIGBUSes
    Firmware(files)    ──▶ boot: registers reset, state restored, state word UP
    start()            ──▶ firmware.pid written, runner thread polling the doorbell
    stop()             ──▶ state word down, pid file removed, files closed (kept) or destroyed
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

from emulator import liveness, numa
from emulator.device_dir import DeviceConfig, DeviceFiles, provision
from emulator.firmware import Firmware, FirmwareRunner


class Served:
    """A device served in this process: its files, its firmware and the runner thread."""

    def __init__(self, config: DeviceConfig, *, keep: bool = False, fresh: bool = False,
                 reconfigure: bool = False) -> None:
        self.files = provision(config, fresh=fresh, reconfigure=reconfigure)
        try:
            self.numa_notice = bind_media(self.files)
            self.files.reserve()  # after the binding: the pages are allocated on the node
            self.firmware = Firmware(self.files)
        except BaseException:
            # a full disk or a refused boot (persist.StateError) leaves the device stopped, its
            # files closed: a serve that can go ahead finds it as it was
            self.files.close()
            raise
        self.runner = FirmwareRunner(self.firmware)
        self.keep = keep
        self._thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        return self.files.name

    def start(self) -> "Served":
        write_pid(self.files.path)
        self._thread = self.runner.start_thread()
        return self

    def run_foreground(self) -> None:
        """Serve from the calling thread until `runner.stop()` (a signal handler calls it)."""
        write_pid(self.files.path)
        try:
            self.runner.run()
        finally:
            self.stop()

    def stop(self) -> None:
        self.runner.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.firmware.close()  # down first: hosts fail fast instead of finding no pid file
        with contextlib.suppress(FileNotFoundError):
            (self.files.path / liveness.PID_FILE).unlink()
        if self.keep:
            self.files.close()
        else:
            self.files.destroy()


def bind_media(files: DeviceFiles) -> str | None:
    """Bind the media to the configured NUMA node; returns a one-line notice when it cannot.

    The effective node is recorded in the device directory (`numa_node`) for `cxlemu list`."""
    notice = numa.bind(files.media, files.config.numa_node)
    node = numa.numa_node_of(files.media)
    (files.path / "numa_node").write_text(f"{-1 if node is None else node}\n")
    return notice


def write_pid(path: Path) -> None:
    liveness.write_pid(path)


@contextlib.contextmanager
def serve(config: DeviceConfig, *, keep: bool = False, fresh: bool = False,
          reconfigure: bool = False) -> Iterator[Served]:
    """Serve a device with its firmware in a thread of this process (destroyed on exit unless
    keep). A stopped device of that name is served as it was (see ``provision``)."""
    served = Served(config, keep=keep, fresh=fresh, reconfigure=reconfigure).start()
    try:
        yield served
    finally:
        served.stop()


__all__ = ["Served", "bind_media", "serve", "write_pid"]
