"""`cxlemu identify | health | partition | timestamp | lsa | fw ...` against an in-process device."""
from __future__ import annotations

import pytest
from cli_support import cli


def test_identify_partition_health(served, capsys):
    code, ident, _ = cli(capsys, "identify", served.name).parsed
    assert code == 0
    assert ident["memdev"] == served.name and ident["total_bytes"] == 256 << 20
    assert ident["fw_revision"] == served.files.config.fw_revision
    code, part, _ = cli(capsys, "partition", served.name).parsed
    assert (code, part["active_volatile_bytes"], part["active_persistent_bytes"]) == (0, 256 << 20, 0)
    code, health, _ = cli(capsys, "health", served.name).parsed
    assert code == 0
    h = health["health"]
    assert (h["temperature"], h["life_used_percent"], h["media_normal"], h["ext_temperature"]) == (35, 0, True, "normal")
    code, text, _ = cli(capsys, "health", served.name, "--human")
    assert code == 0 and "temperature" in text and "35" in text


def test_timestamp_set_and_get(served, capsys):
    code, ts, _ = cli(capsys, "timestamp", served.name).parsed
    assert (code, ts["timestamp_ns"]) == (0, 0)
    code, ts, _ = cli(capsys, "timestamp", served.name, "--set", "1000000000000000000").parsed
    assert code == 0 and ts["timestamp_ns"] >= 10**18
    assert cli(capsys, "timestamp", served.name, "--set", "soon")[0] == 2


def test_lsa_write_and_read(served, capsys):
    code, res, _ = cli(capsys, "lsa", served.name, "--offset", "0x10", "--write", "deadbeef").parsed
    assert (code, res["written"]) == (0, 4)
    code, res, _ = cli(capsys, "lsa", served.name, "--offset", "16", "--length", "6").parsed
    assert (code, res["data"]) == (0, "deadbeef0000")
    code, _, err = cli(capsys, "lsa", served.name, "--offset", str(128 << 10), "--length", "1")
    assert code == 2 and err.startswith("cxlemu: error:") and "LSA" in err
    assert cli(capsys, "lsa", served.name, "--write", "zz")[0] == 2


def test_fw_pack_update_activate(served, capsys, tmp_path):
    body = tmp_path / "body.bin"
    body.write_bytes(bytes(range(256)) * 30)
    pkg = tmp_path / "fw.pkg"
    code, res, _ = cli(capsys, "fw", "pack", "--revision", "9.9.9", "--body", str(body), "-o", str(pkg)).parsed
    assert code == 0 and res["size"] == 64 + 7680 == pkg.stat().st_size
    code, res, _ = cli(capsys, "fw", "update", served.name, str(pkg)).parsed
    assert (code, res["slot"], res["revision"]) == (0, 2, "9.9.9")
    code, res, _ = cli(capsys, "fw", "activate", served.name, "--slot", "2").parsed
    assert (code, res["active_slot"], res["firmware_version"]) == (0, 2, "9.9.9")
    code, info, _ = cli(capsys, "fw", "info", served.name).parsed
    assert code == 0 and info["revisions"] == [served.files.config.fw_revision, "9.9.9"]
    assert cli(capsys, "identify", served.name).json["fw_revision"] == "9.9.9"


@pytest.mark.parametrize("argv, code, words", [
    (["fw", "activate", "{name}", "--slot", "2"], 1, "0x0b FW Invalid Slot"),  # slot 2 is empty
    (["fw", "pack", "--revision", "x" * 17, "-o", "/dev/null"], 2, "1-16 ASCII"),
    (["fw", "update", "{name}", "/nonexistent/fw.pkg"], 2, "cannot read"),
    (["identify", "no-such-device"], 2, "no device named"),
])
def test_bad_input_is_one_line(served, capsys, argv, code, words):
    got, _, err = cli(capsys, *(a.format(name=served.name) for a in argv))
    assert got == code
    assert err.count("\n") == 1 and err.startswith("cxlemu: error:") and words in err


def test_a_package_failing_authentication_is_a_device_error(served, capsys, tmp_path):
    bad = tmp_path / "bad.pkg"
    bad.write_bytes(b"\x00" * 5000)
    code, _, err = cli(capsys, "fw", "update", served.name, str(bad))
    assert code == 1 and "FW Authentication Failed" in err


def test_alert_config_like_ndctl(served, capsys):
    code, res, _ = cli(capsys, "set-alert-config", served.name, "--over-temperature-threshold", "70",
                       "--over-temperature-alert", "on", "--under-temperature-threshold", "5",
                       "--under-temperature-alert", "on").parsed
    assert code == 0
    a = res["alert_config"]
    assert a["dev_over_temperature_prog_warn_threshold_valid"] and a["dev_under_temperature_prog_warn_threshold_valid"]
    assert not a["life_used_prog_warn_threshold_valid"] and a["life_used_prog_warn_threshold_writable"]
    assert (a["dev_over_temperature_prog_warn_threshold"], a["dev_under_temperature_prog_warn_threshold"]) == (70, 5)
    assert (a["dev_over_temperature_crit_alert_threshold"], a["life_used_crit_alert_threshold"]) == (85, 90)
    code, res, _ = cli(capsys, "set-alert-config", served.name, "--under-temperature-alert", "off").parsed
    assert code == 0 and not res["alert_config"]["dev_under_temperature_prog_warn_threshold_valid"]
    code, res, _ = cli(capsys, "health", served.name, "--alerts").parsed
    assert code == 0 and res["alert_config"]["dev_over_temperature_prog_warn_threshold"] == 70
    assert res["health"]["ext_temperature"] == "normal"


@pytest.mark.parametrize("argv, code, words", [
    (["--over-temperature-threshold", "90", "--over-temperature-alert", "on"], 1, "Invalid Input"),
    (["--life-used-threshold", "30"], 2, "--life-used-alert on"),
    (["--pmem-err-threshold", "3", "--pmem-err-alert", "off"], 2, "--pmem-err-alert off alone"),
    (["--volatile-mem-err-threshold", "70000", "--volatile-mem-err-alert", "on"], 2, "outside 0..65535"),
    ([], 2, "nothing to set"),
])
def test_set_alert_config_bad_input(served, capsys, argv, code, words):
    got, _, err = cli(capsys, "set-alert-config", served.name, *argv)
    assert got == code and err.count("\n") == 1 and words in err
