"""Persistent commands across processes and a kill -9: a device never forgets what it acknowledged.

A host process injects poison line after line and prints each DPA once the device answered
Success; the firmware's process is killed (SIGKILL) in the middle of the stream and served again.
Every acknowledged line must be in the Get Poison List of the new boot, nothing else but the one
command in flight (run and saved, the answer never read), and the list must agree with the bitmap
the data path checks: a listed line fails a read, a line never injected reads back.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from cli_support import ROOT, serve_process

from driver import MemDev, PoisonError
from emulator.device import destroy

STRIDE = 4096  # lines a page apart: each is a record of its own (adjacent lines would coalesce)
INJECTS = 200  # below the list's 256 records (Identify's limit): nothing overflows
KILL_AFTER = 100

HOST = """
import sys, time
from driver import MemDev
with MemDev.open(sys.argv[1]) as md:
    for i in range(int(sys.argv[2])):
        md.inject_poison(i * int(sys.argv[3]))
        print(i * int(sys.argv[3]), flush=True)  # acknowledged: the device answered Success
        time.sleep(0.001)  # paced, so the kill lands in the middle of the stream
"""


def test_every_acknowledged_inject_survives_a_kill_9_and_the_list_matches_the_bitmap(device_name: str) -> None:
    server = serve_process(device_name, "--capacity", "256M")
    host = subprocess.Popen([sys.executable, "-c", HOST, device_name, str(INJECTS), str(STRIDE)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    acked: list[int] = []
    try:
        assert host.stdout is not None
        while len(acked) < KILL_AFTER:
            line = host.stdout.readline()
            assert line, f"the host stopped after {len(acked)} injects: {host.stderr.read() if host.stderr else ''}"
            acked.append(int(line))
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
        out, err = host.communicate(timeout=60)
        acked += [int(x) for x in out.split()]
        assert host.returncode != 0 and "DeviceGone" in err, err  # it saw the firmware go, mid-stream
        assert KILL_AFTER <= len(acked) < INJECTS

        server = serve_process(device_name)  # as it was
        with MemDev.open(device_name) as md:
            listed = md.get_poison_list()
            dpas = [r.dpa for r in listed.records]
            assert not listed.overflow and len(dpas) == len(set(dpas))
            assert set(acked) <= set(dpas)  # nothing acknowledged is forgotten
            assert len(dpas) - len(acked) <= 1  # at most the one in flight at the kill
            for dpa in dpas:  # the list and the bitmap agree
                with pytest.raises(PoisonError):
                    md.read(dpa, 64)
            assert md.read(max(dpas) + STRIDE, 64) == bytes(64)  # a line never injected
    finally:
        for proc in (host, server):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        destroy(device_name)
