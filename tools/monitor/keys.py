"""Single keys from an interactive terminal without blocking the refresh loop.

While active, stdin is in cbreak mode (keys arrive one at a time, unechoed; Ctrl-C still raises
KeyboardInterrupt); the previous mode is restored on exit, also when the loop raises. Where stdin
is not a terminal (a pipe, a test, cron) no mode is touched and `read` only waits.
"""
from __future__ import annotations

import os
import select
import sys
import termios
import time
import tty
from typing import IO, Self

# Arrow keys arrive as escape sequences (xterm / VT100 cursor keys in normal mode).
_SEQUENCES = {"\x1b[C": "right", "\x1b[D": "left", "\x1b[A": "up", "\x1b[B": "down",
              "\x1bOC": "right", "\x1bOD": "left", "\t": "tab", " ": "space"}


class KeyReader:
    """Context manager: ``with KeyReader() as keys: key = keys.read(timeout_s)``."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdin
        self._fd: int | None = None
        self._saved: list | None = None  # termios attributes to restore

    @property
    def interactive(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> Self:
        try:
            fd = self.stream.fileno()
        except (OSError, ValueError, AttributeError):
            return self
        if os.isatty(fd):
            self._saved = termios.tcgetattr(fd)
            tty.setcbreak(fd)
            self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None and self._saved is not None:
            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
        self._fd = self._saved = None

    def read(self, timeout_s: float) -> str | None:
        """The next key ('q', 'left', 'space', ...) or None after `timeout_s` without one."""
        if self._fd is None:
            time.sleep(max(0.0, timeout_s))
            return None
        ready, _, _ = select.select([self._fd], [], [], max(0.0, timeout_s))
        if not ready:
            return None
        data = os.read(self._fd, 16).decode(errors="ignore")
        return _SEQUENCES.get(data, data[:1] or None)
