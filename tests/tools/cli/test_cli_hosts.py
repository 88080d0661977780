"""`cxlemu serve --hosts N`: a device of several host ports, kept across serves like its capacity;
`list` shows each port's claimer, `raw` and the memdev commands go through `--host`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from cli_support import cli, cxlemu, serve_process

from driver import MemDev
from emulator.device import device_path, load_config


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def _claims(record: dict) -> list[dict]:
    return [{"host": r["host"], "pid": r["pid"]} for r in record["hosts"]]


def _ports(name: str) -> list[str]:
    return sorted(p.name for p in Path(device_path(name)).glob("bar*"))


def test_hosts_are_kept_across_serves_refused_changed_and_reset_by_fresh(device_name: str) -> None:
    name = device_name
    proc = serve_process(name, "--capacity", "256M", "--hosts", "2")
    try:
        assert load_config(name).hosts == 2 and _ports(name) == ["bar", "bar.h1"]
        with MemDev.open(name, host=1):
            record = json.loads(cxlemu("list", name, check=True).stdout)[0]
            # the test process claimed port 1; the CLI's own look at the device claims nothing
            assert _claims(record) == [{"host": 0, "pid": None}, {"host": 1, "pid": os.getpid()}]
            claimed = cxlemu("raw", name, "0x0001", "--host", "1")
            assert claimed.returncode == 1 and claimed.stderr.count("\n") == 1
            assert f"host port 1 is claimed by pid {os.getpid()}" in claimed.stderr
        raw = json.loads(cxlemu("raw", name, "0x0001", "--host", "1", check=True).stdout)
        assert raw["retcode"] == 0 and len(bytes.fromhex(raw["payload"])) == 18
        ident = [json.loads(cxlemu("identify", name, "--host", h, check=True).stdout) for h in ("1", "0")]
        assert ident[0] == ident[1] and ident[0]["memdev"] == name  # one device behind both ports
        bad = cxlemu("raw", name, "0x0001", "--host", "2")
        assert bad.returncode == 2 and bad.stdout == ""
        assert bad.stderr == (f"cxlemu: error: device {name!r} has 2 host ports (0..1): no host 2 "
                              f"(`cxlemu serve --hosts N --reconfigure` adds ports)\n")
    finally:
        _stop(proc)
    stopped = json.loads(cxlemu("list", name, check=True).stdout)[0]["hosts"]
    assert stopped[1] == {"host": 1, "pid": None, "extents": None, "extent_bytes": None,
                          "shared_extent_bytes": None, "pool": None}  # not served: the page says nothing

    proc = serve_process(name)  # without --hosts: as it was
    try:
        assert load_config(name).hosts == 2
        assert len(json.loads(cxlemu("list", name, check=True).stdout)[0]["hosts"]) == 2
    finally:
        _stop(proc)

    refused = cxlemu("serve", "--name", name, "--hosts", "3")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert refused.stderr.startswith(f"cxlemu: error: device {name!r} exists with another configuration "
                                     f"(hosts: 2 -> 3): serve it as it is")
    assert load_config(name).hosts == 2 and _ports(name) == ["bar", "bar.h1"]

    proc = serve_process(name, "--fresh")
    try:
        assert load_config(name).hosts == 1 and _ports(name) == ["bar"]
        assert _claims(json.loads(cxlemu("list", name, check=True).stdout)[0]) == [{"host": 0, "pid": None}]
    finally:
        _stop(proc)
    assert cxlemu("destroy", name).returncode == 0


def test_reconfigure_adds_and_removes_host_ports(device_name: str) -> None:
    name = device_name
    _stop(serve_process(name, "--capacity", "256M"))
    assert _ports(name) == ["bar"]
    _stop(serve_process(name, "--hosts", "3", "--reconfigure"))
    assert load_config(name).hosts == 3 and _ports(name) == ["bar", "bar.h1", "bar.h2"]
    assert (Path(device_path(name)) / "mbox.h2.lock").is_file()
    _stop(serve_process(name, "--hosts", "1", "--reconfigure"))
    assert load_config(name).hosts == 1 and _ports(name) == ["bar"]
    assert not (Path(device_path(name)) / "mbox.h2.lock").exists()
    assert cxlemu("destroy", name).returncode == 0


def test_bad_host_counts_and_ports_are_one_line_errors(device_name: str) -> None:
    for args, message in ((("serve", "--name", device_name, "--hosts", "9"), "host count must be 1..8, got 9"),
                          (("serve", "--name", device_name, "--hosts", "0"), "host count must be 1..8, got 0"),
                          (("raw", device_name, "0x0001", "--host", "x"), "malformed host port 'x'"),
                          (("identify", device_name, "--host", "-1"), "host port must be 0..7, got -1")):
        proc = cxlemu(*args)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("cxlemu: error: argument --host") and message in proc.stderr


def test_list_shows_each_ports_extents_and_pool_state(device_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 25.7: `list` adds per port its accepted DC extents (count, bytes, tagged bytes) and its
    state in the KV pool, from the firmware's telemetry page (an 8 MiB pool offered to both ports,
    host 0 joined, host 1 not)."""
    import time

    from driver.pool import KvPool
    from emulator.device import DeviceConfig, serve

    config = DeviceConfig(name=device_name, capacity=256 << 20, hosts=2, dc_regions=(256 << 20,))
    with serve(config), MemDev.open(device_name, host=0) as md:
        md.fm_create_pool(8 << 20, slot_bytes=4096)
        with KvPool.open(md):
            deadline = time.monotonic() + 10
            while True:  # the firmware publishes the page ~10 times a second
                hosts = json.loads(cli(capsys, "list", device_name, check=True).out)[0]["hosts"]
                if hosts[0]["pool"] == "member" or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
    assert hosts == [
        {"host": 0, "pid": os.getpid(), "extents": 1, "extent_bytes": 8 << 20, "shared_extent_bytes": 8 << 20,
         "pool": "member"},
        {"host": 1, "pid": None, "extents": 0, "extent_bytes": 0, "shared_extent_bytes": 0, "pool": "out"}]
