"""Helpers for tests that run the `cxlemu` CLI: in this process (`cli`, output read from capsys) or
as a user runs it (`cxlemu`, `serve_process`, in a subprocess from the repo root `ROOT`)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the repo root: the subprocesses' cwd


class CliResult(NamedTuple):
    """What one `cxlemu` command gave: exit code, stdout, stderr, as printed."""

    rc: int
    out: Any  # stdout as printed (a str); `parsed` holds its JSON document here
    err: str

    @property
    def json(self) -> Any:
        """stdout as the one JSON document the command printed."""
        return json.loads(self.out)

    @property
    def parsed(self) -> CliResult:
        """This result with stdout parsed (`json`), to unpack as ``rc, doc, err``."""
        return self._replace(out=self.json)


def cli(capsys: pytest.CaptureFixture[str], *argv: str, check: bool = False) -> CliResult:
    """Run `cxlemu *argv` in this process (`tools.cli.main.main`) and read what it printed;
    `check` fails the test on a nonzero exit, showing stderr."""
    from tools.cli.main import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert not check or rc == 0, err
    return CliResult(rc, out, err)


def cxlemu(*args: str, check: bool = False, timeout: float = 60,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m tools.cli.main *args` in a subprocess, in this environment plus ``env``;
    `check` fails the test on a nonzero exit."""
    proc = subprocess.run([sys.executable, "-m", "tools.cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"cxlemu {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def serve_process(name: str, *args: str) -> subprocess.Popen[str]:
    """`cxlemu serve --name <name> *args` in a subprocess, returned once its firmware is up; the
    caller stops it."""
    from emulator.device import firmware_pid

    proc = subprocess.Popen([sys.executable, "-m", "tools.cli.main", "serve", "--name", name, *args],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while firmware_pid(name) != proc.pid:
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read() if proc.stderr else "serve exited")
        assert time.monotonic() < deadline, "cxlemu serve did not come up"
        time.sleep(0.02)
    return proc


def default_sigint() -> None:
    """Run in the child before exec (``preexec_fn``): a test run started as a background job
    (`pytest &`, as CI scripts may) has SIGINT ignored, children inherit that, and Python then
    installs no KeyboardInterrupt handler; tests send SIGINT as a user's Ctrl-C would."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
