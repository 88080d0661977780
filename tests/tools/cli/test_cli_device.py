"""`cxlemu serve` in a subprocess, driven through the CLI and `MemDev`; one-line errors for bad input."""
from __future__ import annotations

import json
import shutil
import signal
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_support import cxlemu, serve_process

from driver import MemDev
from emulator.device import device_state


@pytest.fixture
def served_subprocess(device_name: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    proc = serve_process(device_name, "--capacity", "1G")
    try:
        yield device_name, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


def test_serve_raw_identify_memdev_reports_capacity(served_subprocess) -> None:
    name, _ = served_subprocess
    out = json.loads(cxlemu("raw", name, "0x4000", check=True).stdout)
    assert out["retcode"] == 0 and out["retcode_name"] == "Success"
    payload = bytes.fromhex(out["payload"])
    assert struct.unpack_from("<Q", payload, 0x10)[0] == 4  # 1 GiB in 256 MiB units


@pytest.mark.slow
def test_serve_list_memdev_and_clean_shutdown(served_subprocess) -> None:
    name, proc = served_subprocess
    records = {r["memdev"]: r for r in json.loads(cxlemu("list", check=True).stdout)}
    assert records[name]["ram_size"] == 1 << 30 and records[name]["state"] == "served"
    assert records[name]["host"] == proc.pid
    with MemDev.open(name) as md:  # the driver talks to a firmware in another process
        assert md.identify().serial == records[name]["serial"]
        md.write_untimed(0x4000_0000 - 8, b"lastword")
        assert md.read_untimed(0x4000_0000 - 8, 8) == b"lastword"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert device_state(name) == "stopped"
    assert json.loads(cxlemu("list", name, check=True).stdout)[0]["state"] == "stopped"
    assert cxlemu("destroy", name).returncode == 0
    assert name not in cxlemu("list", check=True).stdout


def test_serve_refuses_a_served_name(served_subprocess) -> None:
    name, _ = served_subprocess
    proc = cxlemu("serve", "--name", name)
    assert proc.returncode == 2 and proc.stderr.startswith("cxlemu: error:") and "already served" in proc.stderr


def test_raw_device_error_names_the_code(served_subprocess) -> None:
    name, _ = served_subprocess
    proc = cxlemu("raw", name, "0xbeef")
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["retcode_name"] == "Unsupported"
    assert "0x03 Unsupported" in proc.stderr


@pytest.mark.slow
def test_list_reports_an_unreadable_device_and_still_lists_the_others(served_subprocess, runtime_dir) -> None:
    """A device whose config.json this cxlemu cannot take (damaged, or a bandwidth of 0 that an
    older cxlemu wrote for "unthrottled") gets a record saying so and a warning; the others are
    listed as usual, and commands on it fail with one line naming the way out."""
    name, _ = served_subprocess
    broken = Path(runtime_dir) / f"{name}-old"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({
        "capacity": 1 << 28, "fw_revision": "cxlemu-0.1.0", "lsa_size": 131072, "name": broken.name,
        "numa_node": None, "preset": None, "serial": 1,
        "timing": {"read_bandwidth_gbps": 0.0, "read_latency_ns": 0.0, "time_scale": 1.0,
                   "transaction_bytes": 64, "write_bandwidth_gbps": 0.0, "write_latency_ns": 0.0}}))
    try:
        proc = cxlemu("list", check=True)
        records = {r["memdev"]: r for r in json.loads(proc.stdout)}
        assert records[name]["state"] == "served"
        bad = records[broken.name]
        assert bad["state"] == "unreadable" and "read_bandwidth_gbps must be at least" in bad["error"]
        assert f"cxlemu destroy {broken.name}" in bad["error"]
        assert proc.stderr.startswith(f"cxlemu: warning: device '{broken.name}'")
        proc = cxlemu("identify", broken.name)
        assert proc.returncode != 0 and proc.stderr.count("\n") == 1
        assert proc.stderr.startswith("cxlemu: error: device") and "cannot be used" in proc.stderr
        assert cxlemu("destroy", broken.name).returncode == 0
        assert not broken.exists()
    finally:
        shutil.rmtree(broken, ignore_errors=True)


@pytest.mark.parametrize("args, fragment", [
    (("raw", "nosuchdev", "0x4000"), "no device named 'nosuchdev'"),
    (("serve", "--name", "x", "--capacity", "12Q"), "malformed size"),
    (("serve", "--name", "x", "--capacity", "100M"), "multiple of 256 MiB"),
    (("serve", "--name", "x", "--transaction-bytes", "100"), "power of two"),
    (("serve", "--name", "x", "--read-latency-ns", "-5"), "must be >= 0"),
    (("serve", "--name", "x", "--bandwidth-gbps", "0"), "unthrottled link"),
    (("serve", "--name", "x", "--preset", "nope"), "unknown preset 'nope'"),
    (("raw", "nosuchdev", "0x10000"), "out of range"),
    (("raw", "nosuchdev", "zz"), "malformed opcode"),
    (("raw", "nosuchdev", "0x4000", "--payload", "abc"), "malformed hex"),
    (("list", "nosuchdev"), "no device named"),
    (("destroy", "nosuchdev"), "no device named"),
    (("frobnicate",), "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], fragment: str) -> None:
    proc = cxlemu(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cxlemu: error:") and fragment in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_over_a_damaged_state_it_cannot_move_aside_is_one_line_and_exit_2(device_name, monkeypatch, capsys):
    """Issue 24.2: the refusal names the file and the flag that resets it, without a traceback."""
    from emulator.device import DeviceConfig, device_path, serve
    from tools.cli.main import main

    with serve(DeviceConfig(name=device_name, capacity=256 << 20), keep=True):
        pass
    state = device_path(device_name) / "state.json"
    state.write_text('{"version": 1, "poi')

    def denied(src: object, dst: object) -> None:  # a folder the firmware may not rename in
        raise PermissionError(13, "Permission denied", str(src))

    def served_anyway(self: object) -> None:
        raise AssertionError("served over a damaged state")

    monkeypatch.setattr("emulator.persist.os.replace", denied)
    monkeypatch.setattr("emulator.serving.Served.run_foreground", served_anyway)
    try:
        assert main(["serve", "--name", device_name]) == 2
        err = capsys.readouterr().err
        assert err == (f"cxlemu: error: {state} is damaged (Unterminated string starting at: line 1 column 16 "
                       f"(char 15)) and cannot be moved aside (Permission denied): move it away, or serve "
                       f"'{device_name}' with --fresh to start it empty\n")
    finally:
        monkeypatch.undo()
        assert main(["destroy", device_name]) == 0
