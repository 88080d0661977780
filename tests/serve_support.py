"""Helpers for tests that run the `cxlemu` CLI in subprocesses: one command, or `cxlemu serve`
started and waited for until its firmware serves the device."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from emulator.device import firmware_pid

ROOT = Path(__file__).resolve().parents[1]


def cxlemu(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`cxlemu ARGS` run to completion, in this environment plus ``env``."""
    return subprocess.run([sys.executable, "-m", "tools.cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def start_server(name: str, *args: str) -> subprocess.Popen[str]:
    """`cxlemu serve --name NAME ARGS`, returned once its firmware serves the device."""
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli.main", "serve", "--name", name, *args],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while firmware_pid(name) != proc.pid:
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read() if proc.stderr else "serve exited")
        assert time.monotonic() < deadline, "cxlemu serve did not come up"
        time.sleep(0.02)
    return proc
