"""`MemDev`: a host's handle on one device — mailbox, typed commands, media access.

    with MemDev.open("mem0") as md:
        info = md.identify_memdev()
        md.write(0x1000, b"hello")          # timed: pays the device's latency and bandwidth
        data = md.read(0x1000, 5)

Typed command wrappers come from the mixins in `driver/_cmd_*.py`; each returns a dataclass and
raises `MailboxError` on a device return code. `send()` is the raw path and never raises on one.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np

from driver._cmd_events import EventCommands
from driver._cmd_fw import FwCommands
from driver._cmd_generic import GenericCommands
from driver._cmd_memdev import MemdevCommands
from driver._cmd_poison import PoisonCommands
from driver.mailbox import MBOX_TIMEOUT_S, MailboxClient
from emulator.chmu_feed import AccessFeed
from emulator.device import DeviceFiles, firmware_pid
from emulator.regfile import RegisterFile, find_capabilities
from emulator.spec import registers as R
from emulator.spec.errors import DeviceGone
from emulator.timing import DataPath, first_poisoned

READY_TIMEOUT_S = 5.0  # Linux waits 60 s for mailbox ready at probe; a local emulator is faster


class MemDev(MailboxClient, GenericCommands, MemdevCommands, FwCommands, EventCommands, PoisonCommands):
    """An open memory device (like /dev/cxl/memN)."""

    def __init__(self, files: DeviceFiles, *, timeout_s: float = MBOX_TIMEOUT_S) -> None:
        self.files = files
        self.config = files.config
        self.bar = files.bar
        self.media = np.frombuffer(files.media, dtype=np.uint8)
        self._poison = np.frombuffer(files.poison, dtype=np.uint8)
        self.datapath = DataPath.for_device(files)
        self.access_feed = AccessFeed(files.bar, files.path / "chmu.lock")  # what the CHMU counts
        regs = RegisterFile(files.bar)
        super().__init__(regs, files.path / "mbox.lock", files.name, timeout_s=timeout_s,
                         alive=lambda: firmware_pid(files.name) is not None)
        self.capabilities = find_capabilities(regs)

    @classmethod
    def open(cls, name: str, *, timeout_s: float = MBOX_TIMEOUT_S,
             ready_timeout_s: float = READY_TIMEOUT_S) -> "MemDev":
        """Open a served device by name; waits for Mailbox Ready as Linux's cxl_await_media_ready."""
        files = DeviceFiles.open(name)
        try:
            md = cls(files, timeout_s=timeout_s)
            md._await_ready(ready_timeout_s)
        except BaseException:
            files.close()
            raise
        return md

    def _await_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.regs.get_field(R.MEMDEV_STATUS, "MBOX_READY") or firmware_pid(self.name) is None:
            if time.monotonic() > deadline:
                if firmware_pid(self.name) is None:
                    raise DeviceGone(self.name, "no firmware serves it (start it with `cxlemu serve`)")
                raise DeviceGone(self.name, f"mailbox not ready after {timeout_s} s")
            time.sleep(0.01)

    @property
    def media_status(self) -> int:
        return self.regs.get_field(R.MEMDEV_STATUS, "MEDIA_STATUS")

    # media ------------------------------------------------------------------------------------
    # Every access goes through the device's timed data path (emulator.timing): it pays the
    # link's latency and bandwidth, shares the link with every other host of the device, and
    # fails on poisoned lines before copying a byte. The untimed calls are for setup/inspection.
    def read(self, dpa: int, size: int) -> bytes:
        """Timed read of `size` bytes at `dpa`; PoisonError if it touches a poisoned line."""
        out = self._buffer_for(dpa, size, "read")
        self.datapath.read(dpa, out)
        self.access_feed.note(dpa, size, False)
        return bytes(out)

    def read_into(self, dpa: int, out: Any) -> int:
        """Timed read filling `out` (bytearray, numpy array, CPU tensor); returns completion ns."""
        done = self.datapath.read(dpa, out)
        self.access_feed.note(dpa, _nbytes(out), False)
        return done

    def write(self, dpa: int, data: Any) -> int:
        """Timed write of a bytes-like / numpy / CPU tensor at `dpa`; returns completion ns."""
        done = self.datapath.write(dpa, data)
        self.access_feed.note(dpa, _nbytes(data), True)
        return done

    def read_untimed(self, dpa: int, size: int) -> bytes:
        """Read without the link's cost (setup, inspection); poison still fails the read."""
        out = self._buffer_for(dpa, size, "read")
        self.datapath.read_untimed(dpa, out)
        return bytes(out)

    def _buffer_for(self, dpa: int, size: int, what: str) -> bytearray:
        """A buffer for a read of ``size`` bytes at ``dpa``, after checking both (a size past
        the media is refused before anything that large is allocated)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"size must be an int >= 0, got {size!r}")
        self.datapath.check_range(dpa, size, what)
        return bytearray(size)

    def write_untimed(self, dpa: int, data: Any) -> None:
        self.datapath.write_untimed(dpa, data)

    def first_poisoned(self, dpa: int, size: int) -> int | None:
        """DPA of the first poisoned 64-B line in [dpa, dpa+size), or None."""
        return first_poisoned(self._poison, dpa, size)

    def close(self) -> None:
        self.access_feed.close()
        self.close_mailbox()
        self.media = np.zeros(0, np.uint8)
        self._poison = np.zeros(0, np.uint8)
        self.datapath.close()  # releases its views of the mmaps before they are unmapped
        self.files.close()

    def __enter__(self) -> "MemDev":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MemDev({self.name!r}, capacity={self.config.capacity:#x})"


def _nbytes(buf: Any) -> int:
    """Size of a bytes-like, numpy array or torch tensor without copying it."""
    n = getattr(buf, "nbytes", None)
    return int(n) if n is not None else memoryview(buf).nbytes
