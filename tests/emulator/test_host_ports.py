"""The firmware of a device with several host ports: one BAR each, booted alike, every port's
doorbell served each pass (one command per port), the command's port known to its handler."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from mbox_support import firmware

from emulator import liveness
from emulator.device import DeviceConfig, DeviceFiles, load_config
from emulator.device_dir import bar_name, host_lock_name, mbox_lock_name
from emulator.firmware import Firmware
from emulator.spec import registers as R
from emulator.spec.errors import ConfigError, NoSuchHost
from emulator.spec.retcodes import RetCode
from emulator.telemetry import TelemetryReader


@pytest.fixture
def fw3(device_name: str) -> Iterator[Firmware]:
    """A device of three host ports and its firmware, no runner (the test serves the doorbells)."""
    with firmware(capacity=256 << 20, name=device_name, hosts=3) as fw:
        yield fw


def _ring(regs, opcode: int) -> None:
    regs.set(R.MB_CMD, R.MB_CMD.f("OPCODE").put(0, opcode))
    regs.set_field(R.MB_CTRL, "DOORBELL", 1)


def test_the_names_of_a_ports_files_have_one_home() -> None:
    assert [bar_name(h) for h in range(3)] == ["bar", "bar.h1", "bar.h2"]
    assert [mbox_lock_name(h) for h in range(3)] == ["mbox.lock", "mbox.h1.lock", "mbox.h2.lock"]
    assert host_lock_name(2) == "host.2.lock"


def test_every_port_boots_alike_with_its_own_bar(fw3: Firmware) -> None:
    path = fw3.files.path
    assert sorted(p.name for p in path.glob("bar*")) == ["bar", "bar.h1", "bar.h2"]
    assert sorted(p.name for p in path.glob("mbox*.lock")) == ["mbox.h1.lock", "mbox.h2.lock", "mbox.lock"]
    words = {p.state[0] for p in fw3.ports}
    assert words == {liveness.serving_word(fw3.generation, media=True)}
    for p in fw3.ports:
        assert p.regs.get_field(R.MEMDEV_STATUS, "MBOX_READY") == 1
        assert p.regs.get_field(R.MEMDEV_STATUS, "MEDIA_STATUS") == R.MEDIA_READY
        assert p.regs.read(0, 2) == fw3.ports[0].regs.read(0, 2)  # the capability array header
    fw3.telemetry.publish(fw3.clock.now_ns())
    pages = [TelemetryReader(p.bar).snapshot().firmware for p in fw3.ports]
    assert {page.capacity_bytes for page in pages} == {256 << 20}


def test_one_pass_serves_each_ports_doorbell_with_that_port_current(fw3: Firmware) -> None:
    seen: list[int] = []
    from emulator import mailbox

    def probe(fw: Firmware, payload: memoryview) -> tuple[RetCode, bytes]:
        seen.append(fw.port.host)
        return RetCode.SUCCESS, bytes([fw.port.host]) * 4 + bytes([fw.regs is fw.port.regs])

    opcode = 0x00FE
    mailbox.COMMANDS[opcode] = mailbox.Command(opcode, "probe", probe, in_len=0)
    try:
        for p in (fw3.ports[2], fw3.ports[0]):  # port 1 idle
            _ring(p.regs, opcode)
        assert fw3.service_mailbox()
        assert seen == [0, 2]  # both in one pass, port order
        for h in (0, 2):
            regs = fw3.ports[h].regs
            assert regs.get_field(R.MB_CTRL, "DOORBELL") == 0
            assert bytes(regs.region(R.MB_PAYLOAD_OFFSET, regs.get_field(R.MB_CMD, "LENGTH"))) == bytes([h]) * 4 + b"\1"
        assert fw3.port is fw3.ports[0]  # between commands
        assert not fw3.service_mailbox()
    finally:
        del mailbox.COMMANDS[opcode]


def test_media_disabled_is_seen_in_every_ports_registers_and_state_word(fw3: Firmware) -> None:
    fw3.media_disabled = True
    assert {p.regs.get_field(R.MEMDEV_STATUS, "MEDIA_STATUS") for p in fw3.ports} == {R.MEDIA_DISABLED}
    assert {p.state[0] & liveness.MEDIA for p in fw3.ports} == {0}
    fw3.media_disabled = False
    assert {p.state[0] & liveness.MEDIA for p in fw3.ports} == {liveness.MEDIA}


def test_a_records_raised_reaches_every_port_and_clearing_is_per_port(fw3: Firmware) -> None:
    handle = fw3.events.general_media(2, 0x40)
    assert [p.events.count(2) for p in fw3.ports] == [1, 1, 1]
    assert fw3.ports[1].events.clear(2, [handle]) == RetCode.SUCCESS
    assert [p.events.count(2) for p in fw3.ports] == [1, 0, 1]
    fw3.events.discard_all()
    assert [p.events.count(2) for p in fw3.ports] == [0, 0, 0]


def test_hosts_is_checked_stored_and_an_older_config_loads_as_one(device_name: str) -> None:
    for bad in (0, 9, True, "2"):
        with pytest.raises(ConfigError, match=r"hosts .* must be an integer from 1 to 8"):
            DeviceConfig(name="x", hosts=bad)
    files = DeviceFiles.create(DeviceConfig(name=device_name, capacity=256 << 20, hosts=2))
    try:
        cfg = files.path / "config.json"
        assert json.loads(cfg.read_text())["hosts"] == 2
        older = json.loads(cfg.read_text())
        del older["hosts"]
        cfg.write_text(json.dumps(older))
        assert load_config(device_name).hosts == 1
        with pytest.raises(NoSuchHost):
            DeviceFiles.open(device_name, host=1)
    finally:
        files.destroy()
    assert not Path(files.path).exists()
