"""The host side of the mailbox protocol, as Linux's `__cxl_pci_mbox_send_cmd` speaks it.

    1. doorbell must be clear (else another agent owns the mailbox: Busy)
    2. write Command (opcode, input length), then the payload
    3. ring the doorbell, poll until it clears (timeout: 2 s, Linux's default)
    4. read the return code from Status, the output length from Command, then the output
    5. Background Command Started: poll Background Command Status until 100 %, read its code

Hosts in several threads or processes share one mailbox: an exchange holds a thread lock and an
flock on the device's mbox.lock, so two hosts' commands are serialised, never interleaved.
"""
from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable

from emulator.regfile import RegisterFile
from emulator.spec import registers as R
from emulator.spec.errors import DeviceGone, MailboxError, MailboxTimeout
from emulator.spec.retcodes import RetCode

Progress = Callable[[int], None]

MBOX_TIMEOUT_S = 2.0          # Linux: CXL_MAILBOX_TIMEOUT_MS = 2 * HZ
LIVENESS_POLL_S = 0.01        # how often a waiting host checks that the firmware's process lives
BACKGROUND_TIMEOUT_S = 600.0  # sanitize of a large device can take minutes


class MailboxClient:
    """Raw mailbox exchange over a mapped BAR; typed commands build on `send` and `call`."""

    def __init__(self, regs: RegisterFile, lock_fd: int, name: str, *, timeout_s: float = MBOX_TIMEOUT_S,
                 gone: Callable[[bool], str | None] = lambda thorough: None) -> None:
        """``lock_fd``: an open fd on the device's mbox.lock (``DeviceFiles.open_lock``), closed by
        ``close_mailbox``. ``gone(thorough)``: why the device can no longer answer, or None. Asked
        on every poll of the doorbell with ``thorough=False`` (a look at the state word: must be
        cheap), and every ``LIVENESS_POLL_S`` with ``thorough=True`` (may check the firmware's
        process)."""
        self._lock_fd = lock_fd
        if timeout_s <= 0:
            self.close_mailbox()
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.regs = regs
        self.name = name
        self.timeout_s = timeout_s
        self._gone = gone
        self._tlock = threading.Lock()

    def close_mailbox(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def send(self, opcode: int, payload: bytes = b"", *, wait_background: bool = False,
             progress: Progress | None = None) -> tuple[int, bytes]:
        """One command; returns (retcode, output). Never raises on a device return code.

        With `wait_background`, a Background Command Started is followed to completion and the
        background operation's own return code is returned (output empty)."""
        if not 0 <= opcode <= 0xFFFF:
            raise ValueError(f"opcode {opcode:#x} is outside 0x0000-0xffff")
        payload = bytes(payload)
        if len(payload) > R.MAILBOX_PAYLOAD_SIZE:
            raise ValueError(f"payload of {len(payload)} bytes exceeds the {R.MAILBOX_PAYLOAD_SIZE}-byte mailbox")
        if self._lock_fd < 0:
            raise ValueError(f"{self.name}: send() on a closed handle: open the device again (MemDev.open)")
        reason = self._gone(False)
        if reason is not None:
            raise DeviceGone(self.name, reason)
        with self._tlock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                rc, out = self._exchange(opcode, payload)
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        if rc == RetCode.BACKGROUND_COMMAND_STARTED and wait_background:
            return self.wait_background(progress), b""
        return rc, out

    def call(self, opcode: int, payload: bytes = b"", *, progress: Progress | None = None) -> bytes:
        """A command that must succeed: waits for background completion, raises MailboxError."""
        rc, out = self.send(opcode, payload, wait_background=True, progress=progress)
        if rc != RetCode.SUCCESS:
            raise MailboxError(rc, opcode)
        return out

    def _exchange(self, opcode: int, payload: bytes) -> tuple[int, bytes]:
        regs = self.regs
        if regs.get_field(R.MB_CTRL, "DOORBELL"):
            # Linux: "mailbox queue busy" — a host died mid-command; give the firmware its timeout.
            self._poll_doorbell_clear()
        regs.set(R.MB_CMD, R.MB_CMD.f("LENGTH").put(R.MB_CMD.f("OPCODE").put(0, opcode), len(payload)))
        regs.region(R.MB_PAYLOAD_OFFSET, len(payload))[:] = payload
        regs.set_field(R.MB_CTRL, "DOORBELL", 1)
        self._poll_doorbell_clear()
        rc = regs.get_field(R.MB_STATUS, "RETCODE")
        out_len = min(regs.get_field(R.MB_CMD, "LENGTH"), R.MAILBOX_PAYLOAD_SIZE)
        return rc, bytes(regs.region(R.MB_PAYLOAD_OFFSET, out_len))

    def _poll_doorbell_clear(self) -> None:
        """Wait for the firmware to clear the doorbell. A firmware that stops, dies (SIGKILL, a
        zombie) or restarts meanwhile is found within LIVENESS_POLL_S: the state word on every
        poll, the process every LIVENESS_POLL_S; only a live firmware gets the whole timeout."""
        now = time.monotonic()
        deadline, next_check = now + self.timeout_s, now + LIVENESS_POLL_S
        spins = 0
        doorbell = R.MB_CTRL.f("DOORBELL").mask
        while self.regs.get(R.MB_CTRL) & doorbell:
            spins += 1
            # sleep(0) releases the GIL: an in-process firmware thread runs at once
            time.sleep(0 if spins < 2000 else 0.0001)
            reason = self._gone(False)
            now = time.monotonic()
            if reason is None and now >= next_check:
                reason, next_check = self._gone(True), now + LIVENESS_POLL_S
            if reason is not None:
                raise DeviceGone(self.name, reason)
            if now > deadline:
                raise MailboxTimeout(f"{self.name}: doorbell still set after {self.timeout_s} s")

    def wait_background(self, progress: Progress | None = None, timeout_s: float = BACKGROUND_TIMEOUT_S) -> int:
        """Poll Background Command Status until 100 % (Linux cxl_mbox_background_complete)."""
        deadline = time.monotonic() + timeout_s
        last = -1
        while True:
            v = self.regs.get(R.MB_BG_STATUS)
            percent = R.MB_BG_STATUS.f("PERCENT").get(v)
            running = self.regs.get_field(R.MB_STATUS, "BG_OP")
            if percent != last and progress is not None:
                progress(percent)
            last = percent
            if not running:
                return R.MB_BG_STATUS.f("RETCODE").get(self.regs.get(R.MB_BG_STATUS))
            if time.monotonic() > deadline:
                raise MailboxTimeout(f"{self.name}: background operation still running after {timeout_s} s")
            reason = self._gone(True)
            if reason is not None:
                raise DeviceGone(self.name, f"{reason} during a background operation")
            time.sleep(0.001)
