"""The live monitor in a pseudo-terminal: keys switch device and pause, 'q' quits, and the
terminal's mode is restored on the way out."""
from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator

import pytest

from emulator.device import DeviceConfig, serve

ANSI = re.compile(rb"\x1b(\[[0-9;?]*[A-Za-z]|[()][A-Z0-9]|[=>])")


class Terminal:
    """A pty of 140 x 40 with the monitor on its slave side; `expect` reads the screen stream."""

    def __init__(self, *args: str) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
        self.mode_before = termios.tcgetattr(self.slave)
        self.proc = subprocess.Popen([sys.executable, "-m", "tools.cli.main", "monitor", *args],
                                     stdin=self.slave, stdout=self.slave, stderr=self.slave,
                                     env={**os.environ, "TERM": "xterm-256color"})
        self.seen = b""

    def expect(self, text: str, timeout: float = 30.0) -> None:
        """Read until `text` appears (ANSI codes stripped) in output not yet matched."""
        deadline = time.monotonic() + timeout
        while text.encode() not in ANSI.sub(b"", self.seen):
            assert time.monotonic() < deadline, f"{text!r} never shown; got {ANSI.sub(b'', self.seen)[-2000:]!r}"
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                self.seen += os.read(self.master, 65536)
        self.seen = b""

    def send(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)
        os.close(self.slave)


@pytest.fixture
def two_devices(device_name: str) -> Iterator[tuple[str, str]]:
    a, b = f"{device_name}a", f"{device_name}b"
    with serve(DeviceConfig(name=a, capacity=256 << 20)), serve(DeviceConfig(name=b, capacity=256 << 20)):
        yield a, b


def test_keys_switch_pause_quit_and_restore_the_terminal(two_devices: tuple[str, str]) -> None:
    a, b = two_devices
    term = Terminal(a, b, "--interval", "0.2")
    try:
        term.expect(f"cxlemu monitor  {a}: served")
        term.expect("[←/→ device · space pause · q quit]")
        term.send(b"\x1b[C")  # right arrow
        term.expect(f"cxlemu monitor  {b}: served")
        term.send(b" ")
        term.expect("PAUSED")
        term.send(b"\x1b[D")  # left arrow, while paused: still redraws the selection
        term.expect(f"cxlemu monitor  {a}: served")
        term.send(b"q")
        assert term.proc.wait(timeout=30) == 0
        assert termios.tcgetattr(term.slave) == term.mode_before
    finally:
        term.close()


def test_handle_key_wraps_pauses_and_quits() -> None:
    """Selection wraps both ways; space toggles pause; q asks to quit."""
    from tools.monitor.app import Monitor
    from tools.monitor.source import DeviceView

    mon = Monitor(["a", "b", "c"])
    mon.views = [DeviceView(n, "not found") for n in "abc"]
    assert mon.handle_key("left") and mon.selected == 2
    assert mon.handle_key("right") and mon.selected == 0
    assert mon.handle_key("tab") and mon.selected == 1
    assert mon.handle_key("space") and mon.paused
    assert mon.handle_key("p") and not mon.paused
    assert mon.handle_key("x") and (mon.selected, mon.paused) == (1, False)  # unknown keys do nothing
    assert not mon.handle_key("q")


def test_key_reader_without_a_terminal_only_waits() -> None:
    """A pipe is not put in cbreak mode; read() returns None after its timeout."""
    from tools.monitor.keys import KeyReader

    read_fd, write_fd = os.pipe()
    with os.fdopen(read_fd) as stream, KeyReader(stream) as keys:
        assert not keys.interactive
        os.write(write_fd, b"q")  # ignored: keys are read only from a terminal
        assert keys.read(0.0) is None
    os.close(write_fd)
