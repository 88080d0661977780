"""`cxlemu region create | list | destroy` and driver.region's named regions, on served devices."""
from __future__ import annotations

import io
import json
import signal
from collections.abc import Iterator

import pytest
from cli_support import cli, cxlemu, serve_process
from rich.console import Console

from driver import MemDev
from driver.region import ROOT_WINDOW_BASE, list_regions, open_region
from emulator.device import DeviceConfig, destroy, serve
from tools.cli.cmd_region import region_table

SZ_256M = 256 << 20


@pytest.fixture
def pair(device_name: str) -> Iterator[tuple[str, str]]:
    """Two 512 MiB devices served in this process (their firmware threads ack the commits)."""
    a, b = f"{device_name}a", f"{device_name}b"
    with serve(DeviceConfig(name=a, capacity=2 * SZ_256M)), serve(DeviceConfig(name=b, capacity=2 * SZ_256M)):
        yield a, b  # their regions die with them; the next create drops the stale records


def test_create_list_use_destroy(pair: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    a, b = pair
    rc, made, _ = cli(capsys, "region", "create", "--memdev", b, "--memdev", a, "--size", "512M",
                      "--granularity", "1024").parsed
    assert rc == 0
    assert made == {
        "region": "region0", "resource": ROOT_WINDOW_BASE, "size": 2 * SZ_256M, "interleave_ways": 2,
        "interleave_granularity": 1024, "decode_state": "commit", "order_known": True,
        "mappings": [{"position": 0, "memdev": b, "decoder": 0}, {"position": 1, "memdev": a, "decoder": 0}],
    }
    rc, second, _ = cli(capsys, "region", "create", "--memdev", a, "--size", "256M").parsed
    assert rc == 0 and second["resource"] == ROOT_WINDOW_BASE + 2 * SZ_256M  # above a's first window
    assert second["mappings"] == [{"position": 0, "memdev": a, "decoder": 1}]
    listed = cli(capsys, "region", "list").json
    assert [r for r in listed if {m["memdev"] for m in r["mappings"]} & {a, b}] == [made, second]

    console = Console(width=200, record=True, file=io.StringIO())
    console.print(region_table([made, second]))
    rows = [line for line in console.export_text().splitlines() if "region" in line and "MiB" in line]
    assert [[cell.strip() for cell in row.split("│")[1:-1]] for row in rows] == [
        ["region0", f"{ROOT_WINDOW_BASE:#x}", "512 MiB", "2", "1024", f"{b}.decoder0, {a}.decoder0"],
        ["region1", f"{ROOT_WINDOW_BASE + 2 * SZ_256M:#x}", "256 MiB", "1", "256", f"{a}.decoder1"],
    ]

    with open_region("region0") as region:
        region.write(ROOT_WINDOW_BASE + 1000, b"x" * 24 + b"across two devices")
        assert region.read(ROOT_WINDOW_BASE + 1024, 18) == b"across two devices"
    with MemDev.open(a) as md:  # HPA chunk 1 is position 1 (a), its DPA 0
        assert md.read(0, 18) == b"across two devices"

    rc, _, err = cli(capsys, "region", "destroy", "region0")
    assert rc == 1 and "decoder 0: reset the decoders above it first" in err
    assert cli(capsys, "region", "destroy", "region1")[0] == 0
    assert cli(capsys, "region", "destroy", "region0")[0] == 0
    assert [r for r in cli(capsys, "region", "list").json if {m["memdev"] for m in r["mappings"]} & {a, b}] == []


@pytest.mark.parametrize("args, message", [
    (("--size", "300M"), "region size 0x12c00000 must be a positive multiple of 2 x 256 MiB"),
    (("--size", "512M", "--granularity", "300"), "interleave granularity 300 must be one of"),
    (("--size", "2G"), "has 512 MiB of DPA left; the region needs 1024 MiB"),
    (("--size", "512M", "--base", "0x1000"), "must be a multiple of 256 MiB"),
    (("--size", "512M", "--base", "0x10000000"), "must lie in the root window"),
    (("--size", "12Q"), "malformed size"),
])
def test_bad_region_arguments_are_one_line_exit_2(pair: tuple[str, str], capsys: pytest.CaptureFixture[str],
                                                   args: tuple[str, ...], message: str) -> None:
    a, b = pair
    rc, out, err = cli(capsys, "region", "create", "--memdev", a, "--memdev", b, *args)
    assert (rc, out) == (2, "")
    assert err.startswith("cxlemu: error: ") and message in err and err.count("\n") == 1
    assert [r for r in list_regions() if {a, b} & set(r.targets)] == []


def test_repeated_unknown_and_overlapping_targets(pair: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    a, b = pair
    rc, _, err = cli(capsys, "region", "create", "--memdev", a, "--memdev", a, "--size", "512M")
    assert rc == 2 and "repeats a device" in err
    rc, _, err = cli(capsys, "region", "create", "--memdev", "nosuchdev", "--size", "256M")
    assert rc == 2 and "no device named 'nosuchdev'" in err
    assert cli(capsys, "region", "create", "--memdev", a, "--size", "256M")[0] == 0
    rc, _, err = cli(capsys, "region", "create", "--memdev", b, "--size", "256M", "--base", hex(ROOT_WINDOW_BASE))
    assert rc == 2 and f"overlaps the region at {ROOT_WINDOW_BASE:#x}" in err
    rc, _, err = cli(capsys, "region", "destroy", "region7")
    assert rc == 2 and "no region named 'region7' (regions: region0)" in err


def test_locked_region_cannot_be_destroyed(pair: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    a, _ = pair
    assert cli(capsys, "region", "create", "--memdev", a, "--size", "256M", "--lock")[0] == 0
    rc, _, err = cli(capsys, "region", "destroy", "region0")
    assert rc == 1 and "locked on commit" in err


@pytest.mark.slow
def test_region_over_two_serve_processes(device_name: str) -> None:
    """Firmware in two other processes acks the commits of a third; this process reads the region."""
    names = [f"{device_name}p", f"{device_name}q"]
    procs = [serve_process(n, "--capacity", "512M") for n in names]
    try:
        made = cxlemu("region", "create", "--memdev", names[0], "--memdev", names[1], "--size", "1G",
                      "--granularity", "16384")
        assert made.returncode == 0, made.stderr
        name = json.loads(made.stdout)["region"]
        with open_region(name) as region:
            region.write(ROOT_WINDOW_BASE + 16384 - 3, b"abcdef")
            assert region.read(ROOT_WINDOW_BASE + 16384 - 3, 6) == b"abcdef"
            assert [md.read(dpa, 3) for md, dpa in zip(region.targets, (16381, 0))] == [b"abc", b"def"]
    finally:
        for proc, name in zip(procs, names):
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
            destroy(name)
