"""`cxlemu bench liveness`: how soon a host learns that its device's firmware was killed.

For each of ``read`` (a timed 64-B ``MemDev.read`` in a loop), ``send`` (Identify in a loop) and
``open`` (``MemDev.open`` in a loop): serve a private device with ``cxlemu serve`` in its own
process, open it, SIGKILL the server (left unreaped: a zombie, as a crashed server is until its
parent waits), and time from the kill to the call's ``DeviceGone``. The target (issue #12): under
100 ms each. What finds it: the state word that the host's watcher thread clears (read), the
mailbox's process check while the doorbell is set (send), the pid file's process (open); see
``emulator/liveness.py``.
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

TARGET_MS = 100.0
CALLS = ("read", "send", "open")


def _serve(name: str) -> subprocess.Popen[bytes]:
    from emulator.device import firmware_pid

    proc = subprocess.Popen([sys.executable, "-m", "tools.cli.main", "serve", "--name", name,
                             "--capacity", "256M"], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while firmware_pid(name) != proc.pid:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"cxlemu serve --name {name} did not come up")
        time.sleep(0.02)
    return proc


def _one(name: str, call: str) -> float:
    """ms from SIGKILL of the server to ``call`` raising DeviceGone."""
    from driver import DeviceGone, MemDev

    proc = _serve(name)
    md = MemDev.open(name)
    try:
        md.write(0, bytes(64))
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            while True:
                if call == "read":
                    md.read(0, 64)
                elif call == "send":
                    md.send(0x0001)
                else:
                    MemDev.open(name).close()
        except DeviceGone:
            return (time.monotonic() - t0) * 1000
    finally:
        md.close()
        proc.wait()


def run(kills: int = 5) -> dict[str, Any]:
    from emulator.device import destroy

    if kills < 1:
        raise ValueError(f"--kills must be >= 1, got {kills}")
    name = f"live-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    times: dict[str, list[float]] = {c: [] for c in CALLS}
    try:
        for _ in range(kills):
            for call in CALLS:
                times[call].append(_one(name, call))
    finally:
        try:
            destroy(name)
        except Exception:  # noqa: BLE001 - nothing was created if the first serve failed
            pass
    rows = [{"call": c, "kills": kills, "min_ms": round(min(t), 2), "median_ms": round(statistics.median(t), 2),
             "max_ms": round(max(t), 2), "target_ms": TARGET_MS, "pass": max(t) < TARGET_MS}
            for c, t in times.items()]
    return {"rows": rows, "ok": all(r["pass"] for r in rows)}
