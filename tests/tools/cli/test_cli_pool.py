"""`cxlemu pool create`: the kv-index extent offered and formatted; bad input in one line."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest
from cli_support import cli

from emulator.device import DeviceConfig, serve

M256 = 256 << 20


@pytest.fixture(scope="module")
def two_ports() -> Iterator[str]:
    """A device the refused commands leave as it was (one for the module)."""
    name = f"poolcli{os.getpid()}"
    with serve(DeviceConfig(name=name, capacity=M256, hosts=2, dc_regions=(M256,))):
        yield name


def test_create_then_refuse_a_second(capsys: pytest.CaptureFixture[str], device_name: str) -> None:
    with serve(DeviceConfig(name=device_name, capacity=M256, hosts=2, dc_regions=(M256,))):
        rc, doc, _ = cli(capsys, "pool", "create", device_name, "--size", "4M", "--slot-bytes", "4K", "--policy", "lfu",
                         "--json").parsed
        assert (rc, doc) == (0, {"start_dpa": M256, "length": 4 << 20, "tag": "kv-index", "policy": "lfu"})
        rc, out, err = cli(capsys, "pool", "create", device_name, "--size", "4M", "--offset", "4M")
        assert rc == 1 and out == "" and "Invalid Input" in err and len(err.strip().splitlines()) == 1
        rc, out, _ = cli(capsys, "dcd", "list", device_name, "--json")
        assert [(e["host"], e["pending"], e["tag"]) for e in json.loads(out)] == [
            (0, True, b"kv-index".ljust(16, b"\0").hex()), (1, True, b"kv-index".ljust(16, b"\0").hex())]


@pytest.mark.parametrize(("argv", "message"), [
    (["--size", "3M"], "multiples of 2 MiB"),
    (["--size", "4M", "--hosts", "0,5"], "hosts must be among 0..1"),
    (["--size", "4M", "--slot-bytes", "100"], "multiple of 64"),
    (["--size", "4M", "--region", "1"], "no DC region 1"),
    (["--size", "4M", "--policy", "nosuch"], "--policy: unknown eviction policy 'nosuch'"),
    (["--size", "4M", "--policy", "opt"], "--policy: the pool's policy must run online"),
    (["--size", "4M", "--policy", "os:getcwd"], "--policy: eviction policy os:getcwd"),
    (["--size", "4M", "--policy", "nosuchmod:Cls"], "importing module 'nosuchmod' failed"),
])
def test_bad_arguments_are_one_line(capsys: pytest.CaptureFixture[str], two_ports: str, argv: list[str],
                                    message: str) -> None:
    rc, out, err = cli(capsys, "pool", "create", two_ports, *argv)
    assert rc == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1
