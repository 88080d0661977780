"""CHMU register block: host configuration through registers, device epochs, hotlist publication, CLI."""
from __future__ import annotations

import json

import numpy as np
import pytest

from driver.chmu import ChmuRegs
from emulator.chmu import CHMU_OFFSET, CHMU_SIZE, ChmuDevice, decode_config
from emulator.spec.chmu import encode_epoch
from emulator.spec.errors import ConfigError
from tools.cli.main import main

GiB = 1 << 30


@pytest.fixture
def pair() -> tuple[ChmuDevice, ChmuRegs]:
    region = memoryview(bytearray(CHMU_SIZE))
    return ChmuDevice(region, GiB), ChmuRegs(region)


def _dpas(*units: int, unit: int = 4096) -> np.ndarray:
    return np.array([u * unit for u in units], dtype=np.uint64)


def test_reset_layout_advertises_the_rfc_defaults(pair) -> None:
    """Capabilities: one instance, 1024-entry hotlist, 256 B..2 MiB units, epoch and always-on."""
    _, host = pair
    caps = host.capabilities()
    assert (caps["instances"], caps["hotlist_size"], caps["epoch_min_ns"]) == (1, 1024, 100_000)
    assert caps["unit_sizes"][0] == 256 and caps["unit_sizes"][-1] == 2 << 20
    assert caps["epoch"] and caps["always_on"] and caps["randomized"]
    st = host.status()
    assert not st.enabled and st.counter_width == 16 and (st.head, st.tail) == (0, 0)
    assert host.config()["granules"] == [0, 1, 2, 3]


def test_epochs_end_at_exact_device_times_and_publish_the_hotlist(pair) -> None:
    """Epoch 1 ms from t=1000: nothing before 1_001_000, the hot units exactly at it."""
    dev, host = pair
    host.configure(threshold=2, epoch_ns=1_000_000)
    assert host.busy
    dev.service(1000)
    assert not host.busy and host.status().enabled
    dev.record(_dpas(5, 5, 5, 9, 9, 0))
    dev.service(1_000_999)
    assert host.status().tail == 0
    dev.service(1_001_000)
    assert dev.unit.status.epochs == 1
    assert host.read_hotlist() == [(5 * 4096, 3), (9 * 4096, 2)]
    assert host.status().head == 2
    dev.service(1_001_001)
    assert dev.unit.hotlist.head == 2 and host.read_hotlist() == []


def test_always_on_and_range_bitmap_and_write_only(pair) -> None:
    """Always-on, track writes only, granule 1 only: only tracked writes reach the hotlist."""
    dev, host = pair
    host.configure(threshold=1, mode="always_on", track="w", granules=[1], unit_size=1 << 20)
    dev.service(0)
    g1 = 256 << 20
    dev.record(np.array([0, g1, g1 + (3 << 20)], dtype=np.uint64), np.array([True, True, False]))
    dev.service(10)
    assert host.read_hotlist() == [(g1, 1)]


def test_overflow_status_and_host_clear(pair) -> None:
    """More hot units than ring slots: overflow set in STATUS; the host clears it."""
    dev, host = pair
    host.configure(threshold=1, mode="always_on")
    dev.service(0)
    dev.record(_dpas(*range(1100)))
    dev.service(1)
    st = host.status()
    assert st.overflow and st.entries == 1023 and dev.interrupts == 1
    host.clear_status(overflow=True)
    dev.service(2)
    assert not host.status().overflow and not dev.unit.status.overflow


def test_ring_wraps_through_the_registers(pair) -> None:
    """Consume, refill past the end: entries come back in order across the wrap."""
    dev, host = pair
    host.configure(threshold=1, mode="always_on")
    dev.service(0)
    dev.record(_dpas(*range(1000)))
    dev.service(1)
    assert len(host.read_hotlist()) == 1000
    dev.service(2)
    dev.record(_dpas(*range(2000, 2050)))
    dev.service(3)
    st = host.status()
    assert (st.head, st.tail) == (1000, 26)
    assert [d // 4096 for d, _ in host.read_hotlist()] == list(range(2000, 2050))


def test_invalid_register_values_leave_the_unit_disabled(pair) -> None:
    """A reserved mode written directly: the device refuses it and says why."""
    dev, host = pair
    host.configure()
    dev.regs.set_q(0x10 + 0x48, dev.regs.q(0x10 + 0x48) | 7 << 40)
    dev.service(0)
    assert not host.status().enabled and "mode=7 is reserved" in dev.last_error
    with pytest.raises(ValueError, match="reserved"):
        decode_config(0, 12, 0, np.zeros(1, np.uint8), GiB)


def test_host_side_validation_names_the_fix(pair) -> None:
    _, host = pair
    with pytest.raises(ConfigError, match="power of two from 256 B"):
        host.configure(unit_size=3000)
    with pytest.raises(ConfigError, match="multiple of 100 us"):
        host.configure(epoch_ns=150_000)
    assert encode_epoch(150_000_000) == (1, 1500)  # the finest scale that fits 12 bits
    assert encode_epoch(100_000_000_000) == (4, 1000) and encode_epoch(100_000) == (1, 1)


def test_cli_configures_and_shows_the_hotlist(runtime_dir, device_name, capsys) -> None:
    """`cxlemu chmu NAME --threshold ...` programs the BAR; `--json --consume` reads it back."""
    from emulator.device import DeviceConfig, DeviceFiles

    files = DeviceFiles.create(DeviceConfig(name=device_name, capacity=256 << 20))
    dev = ChmuDevice(memoryview(files.bar)[CHMU_OFFSET:CHMU_OFFSET + CHMU_SIZE], 256 << 20)
    assert main(["chmu", device_name, "--threshold", "2", "--epoch-ms", "0.5", "--no-wait"]) == 0
    dev.service(0)
    dev.record(_dpas(7, 7, 7, 8))
    dev.service(500_000)
    capsys.readouterr()
    assert main(["chmu", device_name, "--json", "--consume"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["config"]["threshold"] == 2 and doc["config"]["epoch_ns"] == 500_000
    assert doc["status"]["enabled"] and doc["hotlist"] == [{"dpa": 7 * 4096, "count": 3}]
    assert main(["chmu", device_name]) == 0
    assert "CHMU enabled, epoch 0.5 ms, unit 4096 B, threshold 2" in capsys.readouterr().out
    assert main(["chmu", device_name, "--unit-size", "3K", "--no-wait"]) == 2
    assert main(["chmu", "no-such-device"]) == 2
    assert "no device named" in capsys.readouterr().err
