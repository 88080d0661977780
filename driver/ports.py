"""Claiming a host port: on a device of several host ports (``DeviceConfig.hosts`` > 1), the
process that opens port h holds it until it closes it (a one-port device is shared by every
process, as it always was: ``MemDev.open`` claims nothing there).

    host.<h>.lock   flock'd (exclusive, never blocking) by the claiming process while it has the
                    port open: the kernel drops it when that process dies, even by SIGKILL
    host.<h>.pid    "<pid> <start time>" of the claimer, as firmware.pid (emulator/liveness.py),
                    for `cxlemu list` and for the error a second process gets

A second process opening a claimed port gets ``PortClaimed`` naming the holder; the same process
may open it again (each ``MemDev`` of it shares the one claim, released with the last). An flock
belongs to an open file description, so the claim is kept per process, not per handle.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading

from emulator import liveness
from emulator.device_dir import DeviceFiles, host_lock_name, host_pid_name
from emulator.spec.errors import PortClaimed

_LOCK = threading.Lock()
_CLAIMS: dict[tuple[str, int], list[int]] = {}  # (device dir, host) -> [lock fd, handles, owner pid]


def claim(files: DeviceFiles) -> None:
    """Claim ``files.host`` for this process (again: one more handle on the claim)."""
    key = (str(files.path), files.host)
    with _LOCK:
        held = _CLAIMS.get(key)
        if held is not None and held[2] == os.getpid():
            held[1] += 1
            return
        fd = files.open_lock(host_lock_name(files.host))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            rec = liveness.read_pid(files.path, host_pid_name(files.host))
            raise PortClaimed(files.name, files.host, rec[0] if rec else -1) from None
        liveness.write_pid(files.path, host_pid_name(files.host))
        _CLAIMS[key] = [fd, 1, os.getpid()]


def release(files: DeviceFiles) -> None:
    """One handle fewer on this process's claim of ``files.host``; the last one gives it up."""
    key = (str(files.path), files.host)
    with _LOCK:
        held = _CLAIMS.get(key)
        if held is None or held[2] != os.getpid():
            return
        held[1] -= 1
        if held[1] > 0:
            return
        del _CLAIMS[key]
        with contextlib.suppress(FileNotFoundError):  # the pid file first: then nobody names us
            (files.path / host_pid_name(files.host)).unlink()
        os.close(held[0])  # drops the flock


__all__ = ["claim", "release"]
