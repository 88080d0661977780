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
from dataclasses import asdict
from typing import Any

import numpy as np

from driver._cmd_events import EventCommands
from driver._cmd_fw import FwCommands
from driver._cmd_generic import GenericCommands
from driver._cmd_memdev import MemdevCommands
from driver._cmd_poison import PoisonCommands
from driver._cmd_dcd import DcdCommands
from driver import ports
from driver.mailbox import MBOX_TIMEOUT_S, MailboxClient
from emulator import liveness
from emulator.chmu_feed import AccessFeed
from emulator.device_dir import DeviceFiles, mbox_lock_name
from emulator.regfile import RegisterFile, find_capabilities
from emulator.spec import registers as R
from emulator.spec.payloads_dcd import DC_BLOCK
from emulator.spec.errors import DeviceGone
from emulator.timing import DataPath, first_poisoned

READY_TIMEOUT_S = 5.0  # Linux waits 60 s for mailbox ready at probe; a local emulator is faster
READY_POLL_S = 0.01


class MemDev(MailboxClient, GenericCommands, MemdevCommands, FwCommands, EventCommands, PoisonCommands, DcdCommands):
    """An open memory device (like /dev/cxl/memN).

    A handle belongs to one boot of its device's firmware (emulator/liveness.py): once that
    firmware stops, dies (even by SIGKILL) or is restarted, the mailbox and every data-path call
    raise ``DeviceGone`` (found within ~20 ms), never touching a stale mapping; while the media is
    disabled (sanitize, secure erase) data-path calls raise ``MediaDisabled``."""

    def __init__(self, files: DeviceFiles, *, timeout_s: float = MBOX_TIMEOUT_S) -> None:
        lock_fd = files.open_lock(mbox_lock_name(files.host))  # first: a missing lock leaves no view of the BAR behind
        self.files = files
        self.host = files.host
        self.config = files.config
        self.bar = files.bar
        regs = RegisterFile(files.bar)
        self._state = liveness.state_view(files.bar)
        self._expected = liveness.serving_word(self._state[0])  # this boot, up, media enabled
        super().__init__(regs, lock_fd, files.name, timeout_s=timeout_s, gone=self._gone_reason)
        self.media = np.frombuffer(files.media, dtype=np.uint8)
        self._poison = np.frombuffer(files.poison, dtype=np.uint8)
        # a device with DC regions: this host's transfers there need its access bits (emulator/dcd.py)
        access = ({"access_bits": files.access_bits(files.host, writable=False), "access_base": files.config.dc_base,
                   "access_block": DC_BLOCK} if files.config.dc_regions else {})
        self.datapath = DataPath.for_device(files, state=(liveness.state_view(files.bar), self._expected), **access)
        self.access_feed = AccessFeed(files.bar, files.path / "chmu.lock")  # what the CHMU counts
        self.capabilities = find_capabilities(regs)
        self._watch = liveness.WATCHER.add(files.path, liveness.state_view(files.bar), self._expected)
        self._claimed = False  # set by open when it claimed the port (driver.ports); released by close

    @classmethod
    def open(cls, name: str, *, host: int = 0, timeout_s: float = MBOX_TIMEOUT_S,
             ready_timeout_s: float = READY_TIMEOUT_S) -> "MemDev":
        """Open a served device by name through host port ``host`` (its BAR, mailbox and link;
        ``NoSuchHost`` past the device's ``hosts``). On a device of several host ports the port
        is claimed for this process (``driver.ports``: ``PortClaimed`` while another process
        holds it); a one-port device is shared by every process, as it always was. Waits for Mailbox
        Ready as Linux's cxl_await_media_ready, and raises ``DeviceGone`` at once when no live
        firmware serves it (never served, stopped, killed, or a zombie)."""
        files = DeviceFiles.open(name, host=host)
        claims = files.config.hosts > 1
        try:
            if claims:
                ports.claim(files)
        except BaseException:
            files.close()
            raise
        try:
            cls._await_ready(files, ready_timeout_s)
            md = cls(files, timeout_s=timeout_s)
        except BaseException:
            if claims:
                ports.release(files)
            files.close()
            raise
        md._claimed = claims
        return md

    @staticmethod
    def _await_ready(files: DeviceFiles, timeout_s: float) -> None:
        """Wait for the firmware's boot to finish (state word up, Mailbox Ready) while its process
        lives; a firmware that is not running fails at once, and its state word is marked down."""
        regs = RegisterFile(files.bar)
        state = liveness.state_view(files.bar)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                reason = liveness.dead_firmware(files.path)
                if reason is not None:
                    liveness.mark_down(state, state[0])
                    raise DeviceGone(files.name, reason)
                if state[0] & liveness.UP and regs.get_field(R.MEMDEV_STATUS, "MBOX_READY"):
                    return
                if time.monotonic() > deadline:
                    raise DeviceGone(files.name, f"mailbox not ready after {timeout_s} s")
                time.sleep(READY_POLL_S)
        finally:
            state.release()

    def _gone_reason(self, thorough: bool) -> str | None:
        """Why this handle may no longer use the device (the mailbox asks; see MailboxClient)."""
        if self._lock_fd < 0:
            return "this handle was closed"
        reason = liveness.gone_reason(self._state[0], self._expected)
        if reason is None and thorough and self._watch is not None and not liveness.WATCHER.check(self._watch):
            reason = liveness.gone_reason(self._state[0], self._expected) or "its firmware stopped"
        return reason

    def identity(self) -> dict[str, Any]:
        """Who the device is, as one record: Identify (§8.2.9.1.1: PCI ids, serial, message size)
        and Identify Memory Device (§8.2.9.9.1.1: firmware revision, capacities, log sizes, poison
        limits). ``cxlemu identify NAME`` prints exactly this (and the name); ``identify()`` and
        ``identify_memdev()`` are the two commands' typed results."""
        return {**asdict(self.identify()), **asdict(self.identify_memdev())}

    @property
    def media_status(self) -> int:
        return self.regs.get_field(R.MEMDEV_STATUS, "MEDIA_STATUS")

    # media ------------------------------------------------------------------------------------
    # Every access goes through the device's timed data path (emulator.timing): it pays the
    # link's latency and bandwidth, shares the link with every other host of the device, and
    # fails on poisoned lines before copying a byte. The untimed calls are for setup/inspection.
    def read(self, dpa: int, size: int) -> bytes:
        """Timed read of `size` bytes at `dpa`; PoisonError if it touches a poisoned line.

        As faithful as ``read_into``: the bytes returned are allocated once and filled by the
        transfer's one copy; a read longer than 4 KiB starts its link time when the call does,
        so the allocation runs inside it (see DataPath.read_bytes)."""
        data = self.datapath.read_bytes(dpa, size)
        self.access_feed.note(dpa, size, False)
        return data

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
        watch, self._watch = self._watch, None
        liveness.WATCHER.remove(watch)
        if watch is not None:
            watch.view.release()  # a check running now on the watcher thread drops it (ValueError)
        self.access_feed.close()
        self.close_mailbox()
        self.media = np.zeros(0, np.uint8)
        self._poison = np.zeros(0, np.uint8)
        self.datapath.close()  # releases its views of the mmaps before they are unmapped
        self._state.release()
        if self._claimed:
            self._claimed = False
            ports.release(self.files)
        self.files.close()

    def __enter__(self) -> "MemDev":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        port = f", host={self.host}" if self.host else ""
        return f"MemDev({self.name!r}{port}, capacity={self.config.capacity:#x})"


def _nbytes(buf: Any) -> int:
    """Size of a bytes-like, numpy array or torch tensor without copying it."""
    n = getattr(buf, "nbytes", None)
    return int(n) if n is not None else memoryview(buf).nbytes
