"""`cxlemu` argument handling: a bad argument is one line `cxlemu: error: ...` and exit 2, and what a
command shows is what it does (chmu --consume --limit, scan-media ranges, ports, sizes, --version)."""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cli_support import ROOT, cli

from driver.chmu import ChmuRegs
from emulator.chmu import CHMU_OFFSET, CHMU_SIZE, ChmuDevice
from emulator.spec.errors import ConfigError
from tools.cli._common import CliError, parse_port, parse_size
from tools.cli.main import build_parser, version

CAPACITY = 256 << 20  # the `served` fixture's


def one_line_error(rc: int, err: str, message: str) -> None:
    assert (rc, err) == (2, f"cxlemu: error: {message}\n")


# 1. chmu --consume --limit ----------------------------------------------------------------------

@pytest.fixture
def chmu_64(device_name: str) -> Any:
    """A device's files with a CHMU serviced by the test: 64 hot 4-KiB units (0..63) published."""
    from emulator.device import DeviceConfig, DeviceFiles

    files = DeviceFiles.create(DeviceConfig(name=device_name, capacity=CAPACITY))
    region = memoryview(files.bar)[CHMU_OFFSET:CHMU_OFFSET + CHMU_SIZE]
    dev, host = ChmuDevice(region, CAPACITY), ChmuRegs(region)
    host.configure(threshold=1, mode="always_on")
    dev.service(0)
    dev.record(np.arange(64, dtype=np.uint64) * 4096)
    dev.service(1)
    assert host.status().entries == 64
    yield dev, host
    del dev, host
    region.release()
    files.destroy()


def test_chmu_consume_takes_exactly_the_entries_shown(chmu_64, device_name: str, capsys) -> None:
    dev, host = chmu_64
    rc, out, err = cli(capsys, "chmu", device_name, "--consume", "--limit", "3")
    assert (rc, err) == (0, "")
    lines = out.splitlines()
    assert lines[2:] == ["  DPA 0x000000000000  count 1", "  DPA 0x000000001000  count 1",
                         "  DPA 0x000000002000  count 1",
                         "  ... 61 more, not shown nor consumed (--limit N or --json)", "consumed 3 entries"]
    st = host.status()
    assert (st.head, st.tail, st.entries) == (3, 64, 61)
    dev.service(2)  # the device takes the new head
    assert dev.unit.hotlist.head == 3
    rc, out, _ = cli(capsys, "chmu", device_name, "--json", "--consume", "--limit", "5")
    doc = json.loads(out)
    assert rc == 0 and doc["consumed"] == 5
    assert doc["hotlist"] == [{"dpa": u * 4096, "count": 1} for u in range(3, 8)]
    assert host.status().head == 8
    rc, out, _ = cli(capsys, "chmu", device_name)  # without --consume: shows 32, consumes none
    assert rc == 0 and out.count("  DPA ") == 32 and "  ... 24 more, not shown (--limit N or --json)" in out
    assert host.status().head == 8
    rc, out, _ = cli(capsys, "chmu", device_name, "--json", "--consume")  # --json without --limit: all
    doc = json.loads(out)
    assert doc["consumed"] == 56 and [e["dpa"] // 4096 for e in doc["hotlist"]] == list(range(8, 64))
    assert host.status().entries == 0 and host.status().head == 64


@pytest.mark.parametrize("limit, message", [
    ("-5", "argument --limit: must be >= 1, got -5"),
    ("0", "argument --limit: must be >= 1, got 0"),
    ("three", "argument --limit: malformed number 'three': use a whole number >= 1"),
])
def test_chmu_refuses_a_limit_below_one(chmu_64, device_name: str, capsys, limit: str, message: str) -> None:
    _, host = chmu_64
    rc, out, err = cli(capsys, "chmu", device_name, "--consume", "--limit", limit)
    one_line_error(rc, err, message)
    assert out == "" and host.status().head == 0  # nothing consumed


def test_chmu_regs_consume_is_bounded_by_the_published_entries(chmu_64) -> None:
    _, host = chmu_64
    assert host.consume(0) == 0 and host.consume(10) == 10 and host.status().head == 10
    assert host.consume(100) == 54 and host.status().head == 64 and host.consume(1) == 0
    with pytest.raises(ValueError, match="cannot consume -1 hotlist entries"):
        host.consume(-1)


# 2. scan-media ranges ---------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (("--dpa", "0x10000000"),
     "range [0x10000000, end of device) is outside the device: the device is [0x0, 0x10000000), "
     "use a --dpa below 0x10000000"),
    (("--dpa", "0x20000000", "--length", "4K"),
     "range [0x20000000, 0x20001000) is outside the device: the device is [0x0, 0x10000000), "
     "use a --dpa below 0x10000000"),
    (("--length", "0"),
     "range [0x0, 0x0) is empty: the device is [0x0, 0x10000000), use a --length of 64 to 0x10000000 "
     "from --dpa 0x0"),
    (("--dpa", "0x1000", "--length", "0x10000000"),
     "range [0x1000, 0x10001000) ends past the device: the device is [0x0, 0x10000000), use a --length "
     "of at most 0xffff000 from --dpa 0x1000"),
])
def test_scan_media_refuses_an_empty_or_outside_range(served: Any, capsys, argv: tuple[str, ...],
                                                      message: str) -> None:
    rc, out, err = cli(capsys, "scan-media", served.name, *argv)
    one_line_error(rc, err, message)
    assert out == ""


def test_scan_media_takes_the_last_line_and_a_hex_length(served: Any, capsys) -> None:
    rc, out, _ = cli(capsys, "scan-media", served.name, "--dpa", "0xfffffc0", "--length", "64")
    assert rc == 0 and json.loads(out)["media_errors"] == []
    rc, out, _ = cli(capsys, "scan-media", served.name, "--length", "0x10000")
    assert rc == 0 and json.loads(out)["stopped_prematurely"] is False


# 3. exit codes: ports, fw pack -o ---------------------------------------------------------------

@pytest.mark.parametrize("port, message", [
    ("0", "argument --port: port must be 1..65535, got 0"),
    ("65536", "argument --port: port must be 1..65535, got 65536"),
    ("http", "argument --port: malformed port 'http': use a number 1..65535"),
])
def test_exporter_refuses_a_port_outside_1_65535(capsys, port: str, message: str) -> None:
    rc, out, err = cli(capsys, "exporter", "--port", port)
    one_line_error(rc, err, message)


def test_parse_port_is_an_argparse_type_and_a_cli_error() -> None:
    assert (parse_port("1"), parse_port(" 65535 "), parse_port(8080)) == (1, 65535, 8080)
    with pytest.raises(CliError, match=r"^port must be 1\.\.65535, got -1$") as exc:
        parse_port("-1")
    assert isinstance(exc.value, argparse.ArgumentTypeError) and exc.value.exit_code == 2
    parser = build_parser().__class__(prog="t")
    parser.add_argument("--metrics-port", type=parse_port)
    assert parser.parse_args(["--metrics-port", "9100"]).metrics_port == 9100
    with pytest.raises(CliError, match=r"^argument --metrics-port: port must be 1\.\.65535, got 70000$"):
        parser.parse_args(["--metrics-port", "70000"])


def test_fw_pack_unwritable_output_is_a_bad_argument(capsys, tmp_path: Path) -> None:
    rc, out, err = cli(capsys, "fw", "pack", "--revision", "2.0", "-o", "/nonexistent/x")
    one_line_error(rc, err, "cannot write --output /nonexistent/x: No such file or directory")
    rc, out, err = cli(capsys, "fw", "pack", "--revision", "2.0", "-o", str(tmp_path))
    one_line_error(rc, err, f"cannot write --output {tmp_path}: Is a directory")
    rc, out, err = cli(capsys, "fw", "pack", "--revision", "2.0", "-o", str(tmp_path / "fw.bin"))
    assert (rc, err) == (0, "") and json.loads(out)["size"] == (tmp_path / "fw.bin").stat().st_size


# 4. monitor on an empty runtime dir -------------------------------------------------------------

def test_monitor_without_devices_suggests_cxlemu_serve(capsys, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CXLEMU_RUNTIME_DIR", str(tmp_path))
    rc, out, _ = cli(capsys, "monitor", "--frames", "1", "--width", "240")
    assert rc == 0
    assert f"no devices in {tmp_path} (serve one with `cxlemu serve --name NAME --capacity SIZE`)" in out
    assert "cxlemu create" not in out


# 5. CXLEMU_TIMING_COMP_NS -----------------------------------------------------------------------

@pytest.mark.parametrize("value", ["-5", "fast", "nan", "inf", "1e3", "1,2,3", "", "12,"])
def test_comp_ns_override_must_be_decimals_ge_0(monkeypatch, value: str) -> None:
    calibration = pytest.importorskip("emulator.timing.calibration")
    monkeypatch.setenv("CXLEMU_TIMING_COMP_NS", value)
    calibration.calibrated_comp_ns.cache_clear()
    try:
        with pytest.raises(ConfigError) as exc:
            calibration.calibrated_comp_ns()
    finally:
        calibration.calibrated_comp_ns.cache_clear()
    assert str(exc.value) == ("CXLEMU_TIMING_COMP_NS must be one or two numbers of ns (A or A,B), decimals >= 0 "
                              f"such as 15.2 or 15.2,20 (0 disables compensation), got {value!r}")


@pytest.mark.parametrize("value, expected", [("0", (0.0, 0.0)), ("15.2", (15.2, 15.2)),
                                             ("12.5,20", (12.5, 20.0)), (" .5 , 7. ", (0.5, 7.0))])
def test_comp_ns_override_takes_decimals(monkeypatch, value: str, expected: tuple[float, float]) -> None:
    calibration = pytest.importorskip("emulator.timing.calibration")
    monkeypatch.setenv("CXLEMU_TIMING_COMP_NS", value)
    calibration.calibrated_comp_ns.cache_clear()
    try:
        assert calibration.calibrated_comp_ns() == expected
    finally:
        calibration.calibrated_comp_ns.cache_clear()


# 6. sizes in hex --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, size", [
    ("0x10000000", 1 << 28), ("0X10000000", 1 << 28), ("0x10M", 16 << 20), ("0x1G", 1 << 30),
    ("0x2KiB", 2048), ("0x4 k", 4096), ("0x1B", 27), ("0x1 B", 1), ("010", 10), ("1G", 1 << 30), ("4096", 4096),
])
def test_parse_size_takes_decimal_and_hex(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["1.5G", "0x1.5M", "0x", "0xG", "-0x10", "-1", "12Q", "0x10Q", "1 G B"])
def test_parse_size_refuses_the_rest(text: str) -> None:
    with pytest.raises(CliError) as exc:
        parse_size(text)
    assert str(exc.value) == (f"malformed size {text!r}: use a decimal or 0x-prefixed hex number with an "
                              "optional K/M/G/T suffix, e.g. 1G or 0x10000000")
    assert exc.value.exit_code == 2


def test_serve_capacity_in_hex(capsys) -> None:
    from tools.cli.cmd_device import build_config

    args = build_parser().parse_args(["serve", "--name", "x", "--capacity", "0x10000000"])
    assert build_config(args).capacity == 1 << 28
    rc, _, err = cli(capsys, "serve", "--name", "x", "--capacity", "0x1.8G")
    one_line_error(rc, err, "malformed size '0x1.8G': use a decimal or 0x-prefixed hex number with an "
                            "optional K/M/G/T suffix, e.g. 1G or 0x10000000")


# 7. --version -----------------------------------------------------------------------------------

def _pyproject_version() -> str:
    m = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert m
    return m.group(1)


def test_version_prints_the_installed_version(capsys) -> None:
    rc, out, err = cli(capsys, "--version")
    assert (rc, out, err) == (0, f"cxlemu {importlib.metadata.version('cxlemu')}\n", "")
    assert out == f"cxlemu {_pyproject_version()}\n"  # the editable install is this tree


def test_version_falls_back_to_pyproject(monkeypatch) -> None:
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert version() == _pyproject_version()


# bench tier: its arguments are checked before vLLM is needed ------------------------------------

@pytest.mark.parametrize(("argv", "message"), [
    (["--blocks", "16,x"], "--blocks must be sizes >= 1 separated by commas (e.g. 16,64), got '16,x'"),
    (["--blocks", "0"], "--blocks must be sizes >= 1 separated by commas (e.g. 16,64), got '0'"),
    (["--jobs", "0"], "--jobs must be >= 1, got 0"),
])
def test_bench_tier_bad_arguments(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    one_line_error(*cli(capsys, "bench", "tier", *argv)[::2], message)


def test_print_json_writes_nan_and_infinities_as_null(capsys: pytest.CaptureFixture[str]) -> None:
    """JSON has no NaN: a bench figure with no samples must stay parseable by jq and json.loads
    with strict parsing."""
    import json

    from tools.common import print_json

    print_json({"p50": float("nan"), "rows": [1.5, float("inf"), (float("-inf"), 2)], "n": 3})
    out = capsys.readouterr().out
    assert json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON")) == {
        "p50": None, "rows": [1.5, None, [None, 2]], "n": 3}
