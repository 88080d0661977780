"""Whether a device's firmware lives, and the state word every host's data path checks.

A device's firmware runs in some process (`cxlemu serve`, or a thread of a host program). Hosts
must learn quickly when it stops, dies or is restarted, and must never touch its media then:

    firmware.pid   "<pid> <start time>": the serving process, and its start time in clock ticks
                   since boot (/proc/<pid>/stat field 22), so a recycled pid is not mistaken for
                   it; a zombie (killed, not yet reaped) is dead
    state word     u64 in the link-state page of the BAR (word CXL_LS_STATE_WORD):

        bits 0-31  boot generation: one more at every serve, so handles of an earlier boot
                   know they are stale (a real device's link goes down across a reset)
        bit  32    UP     a firmware serves the device
        bit  33    MEDIA  its media is enabled (clear during sanitize / secure erase)

The firmware sets the word at boot and at every media state change, and clears UP when it stops.
A firmware killed with SIGKILL cannot: the host side's ``Watcher`` (one daemon thread per host
process, only while it has devices open) checks each open device's firmware process every
``WATCH_INTERVAL_S`` and clears UP on its behalf, with a compare-and-swap so a newer boot's word
is never overwritten. The data path (C core and Python twin) compares the word with what it held
at open on every transfer — one load — and fails with ``DeviceGone`` or ``MediaDisabled``, the
way it fails on a poisoned line; the mailbox checks it on every poll. So a dead firmware is
found within one watch interval plus a check, well under 100 ms.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

# The word's layout and its atomic update live with the link-state page it is a word of (the data
# path below this module checks it); they are this module's API too.
from emulator.timing.linkstate import (
    GEN_MASK,
    KEY,
    MEDIA,
    STATE_WORD,
    UP,
    gone_reason,
    next_generation,
    serving_word,
    state_cas,
    state_view,
)

__all__ = ["GEN_MASK", "KEY", "MEDIA", "PID_FILE", "STATE_WORD", "UP", "WATCHER", "WATCH_INTERVAL_S", "Watcher",
           "dead_firmware", "firmware_pid", "gone_reason", "mark_down", "next_generation", "process_alive",
           "read_pid", "serving_word", "start_time", "state_view", "write_pid"]

PID_FILE = "firmware.pid"
WATCH_INTERVAL_S = 0.02


# ---- the state word --------------------------------------------------------------------------
def mark_down(view: memoryview, generation_word: int) -> bool:
    """Clear UP and MEDIA of the boot ``generation_word`` belongs to, if it is still the current
    one and still up; True if this call did it."""
    current = view[0]
    if current & KEY != (generation_word & GEN_MASK) | UP:
        return False
    return state_cas(view, current, current & GEN_MASK)


# ---- the firmware process --------------------------------------------------------------------
def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of a process from /proc, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return ("?", -1)
    fields = raw[raw.rfind(b")") + 2:].split()  # the command name may hold spaces and ')'
    return fields[0].decode(), int(fields[19])


def start_time(pid: int) -> int:
    """A process's start time (clock ticks since boot), -1 where /proc cannot tell."""
    stat = _proc_stat(pid)
    return -1 if stat is None else stat[1]


_HAVE_PROC = Path("/proc/self/stat").exists()
_DEAD_STATES = ("Z", "X", "x")


def _death(pid: int, started: int) -> str | None:
    """None while ``pid`` is a live process that started at ``started`` (-1: any); else
    "zombie" (killed, not reaped) or "gone". One read of /proc (signal 0 where there is none,
    and then a zombie counts as alive)."""
    if pid <= 0:
        return "gone"
    if _HAVE_PROC:
        stat = _proc_stat(pid)
        if stat is None:
            return "gone"
        if stat[0] in _DEAD_STATES:
            return "zombie"
        return None if started < 0 or stat[1] < 0 or stat[1] == started else "gone"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        pass
    return None


def process_alive(pid: int, started: int = -1) -> bool:
    """Whether ``pid`` is a live process (not a zombie) that started at ``started`` (-1: any)."""
    return _death(pid, started) is None


def write_pid(device_dir: Path, fname: str = PID_FILE) -> None:
    """Record this process as the device's firmware (or, ``fname``, as the claimer of a host
    port: ``host.<h>.pid``), written whole, then renamed into place."""
    pid = os.getpid()
    tmp = device_dir / f".{fname}.{pid}"
    tmp.write_text(f"{pid} {start_time(pid)}\n")
    os.replace(tmp, device_dir / fname)


def read_pid(device_dir: Path, fname: str = PID_FILE) -> tuple[int, int] | None:
    """(pid, start time) from the device's pid file ``fname``, or None when there is none."""
    try:
        parts = (device_dir / fname).read_text().split()
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else -1
    except (OSError, ValueError, IndexError):
        return None


def firmware_pid(device_dir: Path, fname: str = PID_FILE) -> int | None:
    """The pid of the live process serving the device (``fname``: that pid file's, e.g. a host
    port's claimer), or None (none recorded, exited, zombie)."""
    rec = read_pid(device_dir, fname)
    if rec is None or not process_alive(*rec):
        return None
    return rec[0]


def dead_firmware(device_dir: Path) -> str | None:
    """Why the firmware recorded in ``device_dir`` is not running, or None if it runs."""
    rec = read_pid(device_dir)
    if rec is None:
        return "no firmware serves it (start it with `cxlemu serve`)"
    pid, started = rec
    death = _death(pid, started)
    if death == "zombie":
        return f"its firmware (pid {pid}) was killed and is a zombie"
    if death is not None:
        return f"its firmware (pid {pid}) is no longer running"
    return None


# ---- the host side's watcher -----------------------------------------------------------------
class _Watch:
    __slots__ = ("expected", "pid", "started", "view")

    def __init__(self, view: memoryview, expected: int, pid: int, started: int) -> None:
        self.view, self.expected, self.pid, self.started = view, expected, pid, started


class Watcher:
    """One daemon thread per host process that clears UP of open devices whose firmware died."""

    def __init__(self, interval_s: float = WATCH_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._watches: set[_Watch] = set()
        self._thread: threading.Thread | None = None
        self._owner = 0  # the pid that started the thread (a forked child starts its own)

    def add(self, device_dir: Path, view: memoryview, expected: int) -> _Watch | None:
        rec = read_pid(device_dir)
        if rec is None:
            return None
        watch = _Watch(view, expected, *rec)
        with self._lock:
            self._watches.add(watch)
            if self._thread is None or not self._thread.is_alive() or self._owner != os.getpid():
                self._owner = os.getpid()
                self._thread = threading.Thread(target=self._run, name="cxlemu-liveness", daemon=True)
                self._thread.start()
        return watch

    def remove(self, watch: _Watch | None) -> None:
        if watch is None:
            return
        with self._lock:
            self._watches.discard(watch)

    def check(self, watch: _Watch) -> bool:
        """Check one device now; True while its firmware lives."""
        if watch.view[0] & KEY != watch.expected & KEY:
            return False
        if process_alive(watch.pid, watch.started):
            return True
        mark_down(watch.view, watch.expected)
        return False

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            with self._lock:
                watches = list(self._watches)
                if not watches:
                    self._thread = None
                    return
            for watch in watches:
                try:
                    if not self.check(watch):
                        self.remove(watch)
                except (ValueError, IndexError):  # its handle was closed meanwhile
                    self.remove(watch)


WATCHER = Watcher()
