"""`cxlemu poison | scan-media | sanitize | events` against a device served in this process:
JSON on stdout, one-line errors with exit 2 for bad arguments and 1 for device refusals."""
from __future__ import annotations

import json
from typing import Any

import pytest
from cli_support import cli, cxlemu

from emulator.spec.payloads_events import EventLog, TransactionType
from tools.cli.main import main


def test_inject_list_clear(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    name = served.name
    assert cli(capsys, "poison", "inject", name, "0x1000").parsed[:2] == (0, {"memdev": name, "dpa": 0x1000,
                                                                                "poisoned": True})
    rc, out, _ = cli(capsys, "poison", "list", name).parsed
    assert rc == 0 and out["media_errors"] == [{"dpa": 0x1000, "length": 64, "source": "injected"}]
    assert (out["overflow"], out["scan_running"]) == (False, False)
    assert cli(capsys, "poison", "list", name, "--dpa", "0x2000", "--length", "4K").json["media_errors"] == []
    data = "ab" * 64
    assert cli(capsys, "poison", "clear", name, "0x1000", "--data", data)[0] == 0
    assert bytes(served.firmware.media[0x1000:0x1040]) == b"\xab" * 64
    assert cli(capsys, "poison", "list", name).json["media_errors"] == []


def test_bad_arguments_exit_2_device_refusals_exit_1(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    name = served.name
    rc, _, err = cli(capsys, "poison", "inject", name, "0x1001")
    assert rc == 2 and err.startswith("cxlemu: error: DPA 0x1001 must be a multiple of 64") and err.count("\n") == 1
    assert cli(capsys, "poison", "inject", name, "zz")[0] == 2
    assert cli(capsys, "poison", "clear", name, "0", "--data", "00")[0] == 2
    assert cli(capsys, "poison", "list", "no-such-device")[0] == 2
    # a separate process, as a user runs it (rich draws its progress bar on a pipe too)
    proc = cxlemu("scan-media", name, "--dpa", hex(served.firmware.config.capacity), "--length", "64")
    assert proc.returncode == 2 and proc.stderr.startswith("cxlemu: error: range [")
    assert proc.stderr.count("\n") == 1  # the range is refused before a progress bar is drawn
    for i in range(256):
        served.firmware.poison.inject(i * 64)
    rc, _, err = cli(capsys, "poison", "inject", name, "0x100000")
    assert rc == 1 and "0x10 Inject Poison Limit Reached" in err and err.count("\n") == 1


def test_scan_media_prints_what_it_found(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    served.firmware.poison.add_latent(0x8000, 128)
    rc, out, _ = cli(capsys, "scan-media", served.name, "--length", "1M").parsed
    assert rc == 0
    assert out["media_errors"] == [{"dpa": 0x8000, "length": 128, "source": "internal"}]
    assert not out["stopped_prematurely"]


def test_sanitize_with_progress(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    served.firmware.media[:4096] = 7
    assert main(["sanitize", served.name]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"memdev": served.name, "sanitized": True} and "100%" in err  # the bar
    assert not served.firmware.media[:4096].any()


def test_sanitize_erase_sends_secure_erase_and_keeps_the_lsa(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    served.firmware.media[:4096] = 7
    served.firmware.lsa[:6] = list(b"label!")
    assert main(["sanitize", served.name, "--erase"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"memdev": served.name, "secure_erased": True} and "secure erase" in err
    assert not served.firmware.media[:4096].any() and bytes(served.firmware.lsa[:6]) == b"label!"


def test_events_show_then_clear(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    fw = served.firmware
    for i in range(3):
        fw.events.general_media(EventLog.FAILURE, 0x40 * i, transaction=TransactionType.HOST_READ)
    fw.events.memory_module(EventLog.INFO, 1, temperature=55)
    rc, out, _ = cli(capsys, "events", served.name).parsed
    assert rc == 0 and sorted(out["logs"]) == ["dcd", "failure", "fatal", "info", "warning"]
    failure = out["logs"]["failure"]
    assert [r["handle"] for r in failure["records"]] == [1, 2, 3] and not failure["more"]
    assert failure["records"][1]["physical_address"] == 0x41 and failure["records"][1]["kind"] == "general_media"
    assert out["logs"]["info"]["records"][0]["temperature"] == 55
    assert cli(capsys, "events", served.name, "--log", "failure").json["logs"]["failure"] == failure  # not cleared
    rc, out, _ = cli(capsys, "events", served.name, "--log", "failure", "--clear").parsed
    assert [r["handle"] for r in out["logs"]["failure"]["records"]] == [1, 2, 3]
    assert fw.events.count(EventLog.FAILURE) == 0 and fw.events.count(EventLog.INFO) == 1
    rc, _, err = cli(capsys, "events", served.name, "--log", "errors")
    assert rc == 2 and "invalid choice" in err


def test_events_human_table(served: Any, capsys: pytest.CaptureFixture[str]) -> None:
    served.firmware.events.general_media(EventLog.WARNING, 0x1000)
    assert main(["events", served.name, "--log", "warning", "--human"]) == 0
    out = capsys.readouterr().out
    assert "warning log" in out and "dpa 0x1000" in out and "general_media" in out
