"""The firmware's saved state (emulator/persist.py) when its file is damaged or cannot be written
(issue 24, items 2 and 3): nothing is lost, the poison list and the bitmap agree after every
restart, and nothing unsaved is acknowledged as saved."""
from __future__ import annotations

import json
import logging
import shutil
import struct
import time
from collections.abc import Iterator

import pytest
from mbox_support import ring

from driver import MemDev, PoisonError
from emulator.device import DeviceConfig, DeviceFiles, device_path, serve
from emulator.firmware import Firmware
from emulator.persist import STATE_FILE, StateError
from emulator.spec import payloads_memdev as P
from emulator.spec.opcodes import Opcode
from emulator.spec.payloads_poison import PoisonSource
from emulator.spec.retcodes import RetCode
from emulator.telemetry import TelemetryReader

MiB = 1 << 20
DAMAGE = {
    "truncated": b'{"fwslots": {"active": 1, "crc32": [12',
    "garbage": bytes(range(256)),
    "wrong types": b'{"version":1,"poison":{"records":"x"},"fwslots":[1]}',
    "bad record": b'{"version":1,"poison":{"records":[[64, 64]],"overflowed":false,"overflow_ns":0},"fwslots":{}}',
}
WHY = {"truncated": "Expecting ',' delimiter", "garbage": "Expecting value: line 1 column 1", "wrong types": "poison.records is not a list",
       "bad record": "poison.records holds other than [dpa, length, source] integers"}


@pytest.fixture
def files(device_name: str) -> Iterator[DeviceFiles]:
    files = DeviceFiles.create(DeviceConfig(name=device_name, capacity=256 * MiB))
    yield files
    files.destroy()


def inject(fw: Firmware, dpa: int) -> int:
    return ring(fw, Opcode.INJECT_POISON, struct.pack("<Q", dpa))[0]


def listed(fw: Firmware) -> list[tuple[int, int, PoisonSource]]:
    return [(r.dpa, r.length, r.source) for r in fw.poison.records]


def bitmap_runs(fw: Firmware) -> list[tuple[int, int]]:
    return [(lo, hi - lo) for lo, hi in fw.poison.bad_runs(0, fw.config.capacity)]


def health_status(fw: Firmware) -> int:
    rc, out = ring(fw, Opcode.GET_HEALTH_INFO, b"")
    assert rc == RetCode.SUCCESS
    return P.HEALTH_INFO.unpack(out)["health_status"]


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_state_file_is_moved_aside_and_the_list_rebuilt_from_the_bitmap(files, damage, caplog):
    fw = Firmware(files)
    for dpa in (0x1000, 0x2000, 0x2040):
        assert inject(fw, dpa) == RetCode.SUCCESS
    fw.close()
    (files.path / STATE_FILE).write_bytes(DAMAGE[damage])
    with caplog.at_level(logging.INFO, logger="emulator.persist"):
        fw = Firmware(files)
    try:
        # the list is the bitmap's runs (adjacent lines one range); where they came from was lost
        assert listed(fw) == [(0x1000, 64, PoisonSource.UNKNOWN), (0x2000, 128, PoisonSource.UNKNOWN)]
        assert [(r.dpa, r.length) for r in fw.poison.records] == bitmap_runs(fw)
        (bad,) = files.path.glob(f"{STATE_FILE}.bad-*")
        assert bad.read_bytes() == DAMAGE[damage]  # kept as it was
        saved = json.loads((files.path / STATE_FILE).read_text())  # the rebuilt list, saved at once
        assert saved["poison"]["records"] == [[0x1000, 64, 0], [0x2000, 128, 0]]
        (rec,) = caplog.records
        assert rec.levelno == logging.ERROR and rec.exc_info is None
        message = rec.getMessage()
        assert f"{STATE_FILE} was damaged (" in message and WHY[damage] in message
        assert f"kept as {bad.name}: poison list rebuilt from the bitmap (2 records)" in message
        assert "not enough values" not in message
    finally:
        fw.close()


def test_the_list_and_the_bitmap_agree_after_a_restart_over_a_damaged_state(device_name):
    """Inject poison, damage state.json, serve again: Get Poison List is what the bitmap holds."""
    config = DeviceConfig(name=device_name, capacity=256 * MiB)
    with serve(config, keep=True):
        with MemDev.open(device_name) as md:
            for dpa in (0x40, 0x10_0000, 0x10_0040, 0x10_0080):
                md.inject_poison(dpa)
    (device_path(device_name) / STATE_FILE).write_text('{"version": 1, "poison": ')
    with serve(config) as served:
        with MemDev.open(device_name) as md:
            got = [(r.dpa, r.length, r.source) for r in md.get_poison_list().records]
        assert got == [(0x40, 64, "unknown"), (0x10_0000, 192, "unknown")]
        assert [(dpa, length) for dpa, length, _ in got] == bitmap_runs(served.firmware)
        with MemDev.open(device_name) as md:
            with pytest.raises(PoisonError):
                md.read(0x10_0040, 64)


def test_a_damaged_state_that_cannot_be_moved_aside_stops_the_boot(files, monkeypatch):
    (files.path / STATE_FILE).write_bytes(b"{")

    def denied(src: object, dst: object) -> None:  # a folder the firmware may not rename in
        raise PermissionError(13, "Permission denied", str(src))

    monkeypatch.setattr("emulator.persist.os.replace", denied)
    with pytest.raises(StateError, match=rf"{STATE_FILE} is damaged \(Expecting property name .*\) and cannot "
                                         rf"be moved aside \(Permission denied\): move it away, or serve "
                                         rf"'{files.name}' with --fresh to start it empty"):
        Firmware(files)
    assert (files.path / STATE_FILE).read_bytes() == b"{"  # untouched


def _unsavable(files: DeviceFiles) -> None:
    """state.json made a directory (a file inside, so a rename cannot replace it either)."""
    path = files.path / STATE_FILE
    path.unlink()
    path.mkdir()
    (path / "x").write_text("in the way")


def test_an_unsaved_change_is_not_acknowledged_and_the_failure_is_logged_once_and_flagged(files, caplog):
    fw = Firmware(files)
    try:
        _unsavable(files)
        with caplog.at_level(logging.INFO, logger="emulator.persist"):
            # the first command after the store broke: refused before it changes anything (it
            # answered Internal Error with the line poisoned: a host told it failed found it applied)
            assert inject(fw, 0x40) == RetCode.INTERNAL_ERROR and not fw.poison.is_poisoned(0x40)
            # while saving fails, a command that would change the saved state does not run
            assert inject(fw, 0x80) == RetCode.INTERNAL_ERROR and not fw.poison.is_poisoned(0x80)
            assert listed(fw) == []
            assert ring(fw, Opcode.GET_TIMESTAMP, b"")[0] == RetCode.SUCCESS  # the rest works
            assert health_status(fw) & P.HEALTH_MAINTENANCE_NEEDED
            # ten seconds of the runner's timer (it calls every few ms): tries at 0, 1.6 and 4.8 s,
            # each waiting 0.2 s x 2**failures (the two commands failed the 1st and 2nd time)
            for now in range(0, 10 * 10**9, 10**7):
                fw.persist.service(now)
            assert fw.persist.failures == 5
            fw.telemetry.publish(time.monotonic_ns())
            page = TelemetryReader(fw.files.bar).snapshot().firmware
            assert page is not None and page.state_save_failures == 5 and page.health_status & 1
            (rec,) = caplog.records  # one line for the whole spell, no traceback
            assert rec.levelno == logging.ERROR and rec.exc_info is None
            assert rec.getMessage() == (f"{files.name}: cannot save the device state in {files.path} (Is a "
                                        f"directory): poison and firmware-slot commands are refused with "
                                        f"Internal Error until it can; retrying")
            shutil.rmtree(files.path / STATE_FILE)  # the operator fixes it
            assert inject(fw, 0x80) == RetCode.SUCCESS  # the refusal's own try saves
        assert fw.persist.failures == 0 and not health_status(fw) & P.HEALTH_MAINTENANCE_NEEDED
        assert caplog.records[-1].getMessage() == f"{files.name}: device state saved again after 5 failed tries"
        saved = json.loads((files.path / STATE_FILE).read_text())
        assert saved["poison"]["records"] == [[0x80, 64, 3]]  # the one acknowledged
    finally:
        fw.close()


def test_a_background_operation_whose_change_cannot_be_saved_ends_in_internal_error(files):
    """Sanitize wipes the poison; unsaved, the next boot would poison the lines again."""
    fw = Firmware(files)
    try:
        assert inject(fw, 0x40) == RetCode.SUCCESS
        assert ring(fw, Opcode.SANITIZE, b"")[0] == RetCode.BACKGROUND_COMMAND_STARTED
        _unsavable(files)  # the store breaks while it runs
        while fw.step_background():
            pass
        assert fw.background_status[3] == RetCode.INTERNAL_ERROR
        assert fw.persist.error is not None and fw.internal_errors == 0
    finally:
        fw.close()


def test_relisting_joins_runs_across_slices_and_sets_overflow_past_the_limit(files):
    fw = Firmware(files)
    try:
        fw.poison.add_latent(0x3C0, 0x80)   # lines 15 and 16: across the border of 16-line slices
        fw.poison.add_latent(0x1000, 0x40)
        fw.poison.add_latent(0x8000, 0x40)
        assert fw.poison.relist_from_bitmap(chunk_lines=16) == 3
        assert listed(fw) == [(0x3C0, 0x80, PoisonSource.UNKNOWN), (0x1000, 0x40, PoisonSource.UNKNOWN),
                              (0x8000, 0x40, PoisonSource.UNKNOWN)]
        assert not fw.poison.overflowed
        fw.poison.limit = 2
        assert fw.poison.relist_from_bitmap(chunk_lines=16) == 2
        assert [r.dpa for r in fw.poison.records] == [0x3C0, 0x1000] and fw.poison.overflowed
    finally:
        fw.close()
