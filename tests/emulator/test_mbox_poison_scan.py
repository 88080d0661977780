"""Scan Media: capabilities, the background scan finding latent errors, its results decoded by
hand at the spec's offsets, Busy while it runs, abort, and the overflow it can clear."""
from __future__ import annotations

import struct
from typing import Any

import pytest

from emulator.device import DeviceConfig, DeviceFiles
from emulator.firmware import Firmware
from emulator.mailbox import dispatch
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_events import EventLog, TransactionType
from emulator.spec.payloads_poison import PoisonSource
from emulator.spec.retcodes import RetCode

CAPACITY = 256 << 20
MIB_LINES = (1 << 20) // 64
INJECTED, INTERNAL = PoisonSource.INJECTED, PoisonSource.INTERNAL




def scan(fw: Firmware, dpa: int, lines: int, flags: int = 0) -> RetCode:
    """Scan Media stepped to completion (the job paces itself: a 1 MiB scan takes ~8 ms)."""
    rc = dispatch(fw, Opcode.SCAN_MEDIA, struct.pack("<QQB", dpa, lines, flags))[0]
    assert rc == RetCode.BACKGROUND_COMMAND_STARTED
    while fw.step_background():
        pass
    return RetCode(fw.background_status[3])


def results(fw: Firmware) -> tuple[int, int, int, list[tuple[int, int, int]]]:
    """(restart DPA, restart length, flags, [(dpa, lines, source)]) decoded at the spec's offsets."""
    rc, out = dispatch(fw, Opcode.GET_SCAN_MEDIA_RESULTS, b"")
    assert rc == RetCode.SUCCESS
    restart, restart_len, flags, count = struct.unpack_from("<QQBxH", out, 0)
    assert len(out) == 0x20 + 16 * count
    recs = [struct.unpack_from("<QI", out, 0x20 + 16 * i) for i in range(count)]
    return restart, restart_len, flags, [(a & ~7, n, a & 7) for a, n in recs]


def listed(fw: Firmware) -> list[tuple[int, int, int]]:
    return [(r.dpa, r.length // 64, int(r.source)) for r in fw.poison.records]


def test_capabilities_estimate_half_a_microsecond_per_line(fw: Firmware) -> None:
    def estimate(dpa: int, lines: int) -> tuple[RetCode, bytes]:
        return dispatch(fw, Opcode.GET_SCAN_MEDIA_CAPABILITIES, struct.pack("<QQ", dpa, lines))

    rc, out = estimate(0, CAPACITY // 64)
    assert rc == RetCode.SUCCESS and len(out) == 4
    assert struct.unpack_from("<I", out, 0)[0] == 2097  # 4 Mi lines x 0.5 us
    assert struct.unpack_from("<I", estimate(0, 32 * MIB_LINES)[1], 0)[0] == 262
    assert struct.unpack_from("<I", estimate(0x1000, 1)[1], 0)[0] == 1  # QEMU: at least 1 ms
    assert estimate(0x1001, 1) == (RetCode.INVALID_INPUT, b"")
    assert estimate(0, CAPACITY // 64 + 1) == (RetCode.INVALID_PHYSICAL_ADDRESS, b"")


def test_results_before_any_scan_are_unsupported(fw: Firmware) -> None:
    assert dispatch(fw, Opcode.GET_SCAN_MEDIA_RESULTS, b"") == (RetCode.UNSUPPORTED, b"")


def test_scan_finds_latent_errors_lists_and_logs_them(fw: Firmware) -> None:
    fw.poison.add_latent(0x1000, 2 * 64)
    fw.poison.add_latent(0x8000, 64)
    fw.poison.add_latent(0x20_0000, 64)  # outside the scanned MiB: stays unknown
    assert dispatch(fw, Opcode.INJECT_POISON, struct.pack("<Q", 0x4000))[0] == RetCode.SUCCESS
    assert scan(fw, 0, MIB_LINES) == RetCode.SUCCESS
    assert results(fw) == (0, 0, 0, [(0x1000, 2, INTERNAL), (0x4000, 1, INJECTED), (0x8000, 1, INTERNAL)])
    assert results(fw)[3] == []  # results are consumed as they are returned
    assert listed(fw) == [(0x1000, 2, INTERNAL), (0x4000, 1, INJECTED), (0x8000, 1, INTERNAL)]
    out = dispatch(fw, Opcode.GET_EVENT_RECORDS, bytes([EventLog.FAILURE]))[1]
    assert struct.unpack_from("<H", out, 0x14)[0] == 2  # one per newly found range
    for i, dpa in enumerate((0x1000, 0x8000)):
        rec = out[0x20 + i * 0x80:]
        assert struct.unpack_from("<Q", rec, 0x30)[0] & ~0x3F == dpa
        assert rec[0x3A] == TransactionType.HOST_SCAN_MEDIA


def test_no_event_log_flag_lists_without_logging(fw: Firmware) -> None:
    fw.poison.add_latent(0x3000, 64)
    assert scan(fw, 0, MIB_LINES, flags=0x1) == RetCode.SUCCESS
    assert listed(fw) == [(0x3000, 1, INTERNAL)]
    assert fw.events.counts() == (0, 0, 0, 0, 0)


def test_many_results_page_with_more(fw: Firmware) -> None:
    for i in range(130):
        fw.poison.add_latent(i * 128, 64)  # every other line: 130 separate ranges
    assert scan(fw, 0, MIB_LINES, flags=0x1) == RetCode.SUCCESS
    first, second = results(fw), results(fw)
    assert (first[2], len(first[3])) == (0x1, 126) and (second[2], len(second[3])) == (0x0, 4)
    assert [r[0] for r in first[3] + second[3]] == [i * 128 for i in range(130)]


def test_scan_that_lists_everything_clears_the_overflow(fw: Firmware) -> None:
    for i in range(256):
        dispatch(fw, Opcode.INJECT_POISON, struct.pack("<Q", i * 64))
    assert fw.poison.add(0x10_0000, 64, transaction=None) is False
    assert fw.poison.overflowed
    dispatch(fw, Opcode.CLEAR_POISON, struct.pack("<Q", 0) + bytes(64))  # room for one more
    assert scan(fw, 0x10_0000, 16, flags=0x1) == RetCode.SUCCESS
    assert not fw.poison.overflowed and (0x10_0000, 1, INTERNAL) in listed(fw)
    out = dispatch(fw, Opcode.GET_POISON_LIST, struct.pack("<QQ", 0x10_0000, 1))[1]
    assert out[0] == 0 and struct.unpack_from("<Q", out, 0x02)[0] == 0


def test_scan_checks_its_range(fw: Firmware) -> None:
    assert dispatch(fw, Opcode.SCAN_MEDIA, struct.pack("<QQB", 0x20, 1, 0)) == (RetCode.INVALID_INPUT, b"")
    assert dispatch(fw, Opcode.SCAN_MEDIA, struct.pack("<QQB", 0, CAPACITY // 64 + 1, 0))[0] == \
        RetCode.INVALID_PHYSICAL_ADDRESS
    assert not fw.background_running


def test_busy_while_scanning_then_abort_reports_where_to_restart(served: Any, memdev: Any) -> None:
    """End to end: a whole-device scan runs ~2 s; meanwhile background commands are Busy."""
    md = memdev
    rc, _ = md.send(Opcode.SCAN_MEDIA, struct.pack("<QQB", 0, CAPACITY // 64, 0))
    assert rc == RetCode.BACKGROUND_COMMAND_STARTED
    assert md.send(Opcode.SANITIZE) == (RetCode.BUSY, b"")
    assert md.send(Opcode.SCAN_MEDIA, struct.pack("<QQB", 0, 1, 0)) == (RetCode.BUSY, b"")
    assert md.send(Opcode.GET_SCAN_MEDIA_RESULTS) == (RetCode.BUSY, b"")
    rc, out = md.send(Opcode.GET_POISON_LIST, struct.pack("<QQ", 0, 1))
    assert rc == RetCode.SUCCESS and out[0] & 0x4  # "scan media in progress"
    status = md.background_status()
    assert status.running and status.opcode == Opcode.SCAN_MEDIA and status.percent < 100
    md.abort_background()
    assert md.wait_background() == RetCode.ABORTED
    res = md.scan_media_results()
    assert res.stopped_prematurely and res.restart_length > 0
    assert res.restart_dpa + res.restart_length == CAPACITY and res.restart_dpa % 64 == 0


def test_driver_scan_media_round_trip(served: Any, memdev: Any) -> None:
    served.firmware.poison.add_latent(0x40_0000, 3 * 64)
    assert memdev.scan_media_estimate_ms(0x40_0000, 1 << 20) == 8
    seen: list[int] = []
    res = memdev.scan_media(0x40_0000, 1 << 20, progress=seen.append)
    assert [(r.dpa, r.length, r.source) for r in res.records] == [(0x40_0000, 192, "internal")]
    assert not res.stopped_prematurely and seen[-1] == 100 and seen == sorted(seen)
    assert [(r.dpa, r.length) for r in memdev.get_poison_list().records] == [(0x40_0000, 192)]


def test_a_run_cut_by_slices_is_listed_once(device_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices of 4 lines (and a time scale that makes the scan instant) cut a 10-line run three times."""
    from emulator.commands import scan as scan_module
    from emulator.timing.config import TimingConfig

    monkeypatch.setattr(scan_module, "MAX_LINES_PER_SLICE", 4)
    files = DeviceFiles.create(DeviceConfig(name=device_name, capacity=CAPACITY,
                                            timing=TimingConfig(time_scale=1e-9)))
    f = Firmware(files)
    try:
        f.poison.add_latent(2 * 64, 10 * 64)
        f.poison.add_latent(13 * 64, 64)
        assert scan(f, 0, 64) == RetCode.SUCCESS
        assert listed(f) == [(0x80, 10, INTERNAL), (13 * 64, 1, INTERNAL)]
        assert results(f)[3] == [(0x80, 10, INTERNAL), (13 * 64, 1, INTERNAL)]
        assert f.events.count(EventLog.FAILURE) == 2
    finally:
        f.close()
        files.destroy()
