"""`cxlemu dcd add | release | list` and `serve --dc-region`: the fabric manager's side from the CLI."""
from __future__ import annotations

import json

import pytest
from cli_support import cli

from driver import MemDev
from emulator.device import DeviceConfig, load_config, serve

M256 = 256 << 20


def test_add_list_release_from_the_cli(device_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with serve(DeviceConfig(name=device_name, capacity=M256, hosts=2, dc_regions=(M256,))):
        cli(capsys, "dcd", "add", device_name, "--host", "1", "--region", "0", "--tag", "kv",
            "--extent", "0x10000000:4M", check=True)
        listed = json.loads(cli(capsys, "dcd", "list", device_name, "--json", check=True).out)
        assert listed == [{"host": 1, "pending": True, "start_dpa": M256, "length": 4 << 20,
                           "tag": b"kv".ljust(16, b"\0").hex(), "shared_seq": 1}]
        with MemDev.open(device_name, host=1) as h1:
            h1.accept([(M256, 4 << 20)])
        text = cli(capsys, "dcd", "list", device_name, check=True).out
        assert text == "host 1 accepted 0x10000000+4 MiB tag 'kv' seq 1\n"
        cli(capsys, "dcd", "release", device_name, "--host", "1", "--region", "0", "--extent", "0x10000000:4M",
            "--forced", check=True)
        assert json.loads(cli(capsys, "dcd", "list", device_name, "--json", check=True).out) == []


@pytest.mark.parametrize("argv, message", [
    (["--extent", "0x10000000"], "malformed extent '0x10000000'"),
    (["--extent", "0x10000000:3M"], "multiples of 2 MiB"),
    (["--extent", "0x200000:4M"], "start at DPA 0x10000000 or later"),
    (["--region", "9", "--extent", "0x10000000:4M"], "region must be 0..7"),
])
def test_bad_arguments_are_one_line_exit_2(device_name: str, capsys: pytest.CaptureFixture[str],
                                           argv: list[str], message: str) -> None:
    with serve(DeviceConfig(name=device_name, capacity=M256, dc_regions=(M256,))):
        args = ["dcd", "add", device_name, "--host", "0", *(["--region", "0"] if "--region" not in argv else []), *argv]
        res = cli(capsys, *args)
        assert res.rc == 2 and res.err.count("\n") == 1 and message in res.err and res.err.startswith("cxlemu: error:")


def test_a_device_without_regions_says_how_to_get_one(device_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with serve(DeviceConfig(name=device_name, capacity=M256)):
        res = cli(capsys, "dcd", "add", device_name, "--host", "0", "--region", "0", "--extent", "0x10000000:2M")
        assert res.rc == 2 and "serve it with --dc-region SIZE" in res.err


def test_serve_dc_region_is_stored_and_a_change_needs_reconfigure(device_name: str) -> None:
    from cli_support import cxlemu, serve_process

    proc = serve_process(device_name, "--capacity", "256M", "--dc-region", "256M", "--dc-region", "512M")
    try:
        assert load_config(device_name).dc_regions == (M256, 2 * M256)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    refused = cxlemu("serve", "--name", device_name, "--dc-region", "256M")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "--reconfigure" in refused.stderr
