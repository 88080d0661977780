"""Dynamic Capacity regions in a device's configuration and on disk: they follow the static
capacity in DPA order, the media holds both, each host port has an access bitmap."""
from __future__ import annotations

import json

import pytest

from emulator.device import DeviceConfig, DeviceFiles, load_config
from emulator.device_dir import access_bitmap_size, access_name, provision
from emulator.spec.errors import ConfigError
from emulator.spec.payloads_dcd import DC_BLOCK, region_bases

M256 = 256 << 20


def test_regions_follow_the_static_capacity_and_the_media_holds_both() -> None:
    cfg = DeviceConfig(name="d", capacity=M256, dc_regions=(2 * M256, M256))
    assert cfg.dc_base == M256
    assert cfg.dc_total == 3 * M256
    assert cfg.media_bytes == 4 * M256
    assert cfg.dc_blocks == 3 * M256 // DC_BLOCK == 384
    assert access_bitmap_size(cfg) == 48
    assert region_bases(cfg.capacity, cfg.dc_regions) == [M256, 3 * M256]
    assert DeviceConfig(name="d", capacity=M256).media_bytes == M256


@pytest.mark.parametrize("regions", [(M256 + DC_BLOCK,), (0,), (M256,) * 9, (-M256,)])
def test_bad_regions_are_refused(regions: tuple[int, ...]) -> None:
    with pytest.raises(ConfigError, match="dc_regions"):
        DeviceConfig(name="d", capacity=M256, dc_regions=regions)


def test_an_older_config_has_no_regions_and_json_round_trips() -> None:
    cfg = DeviceConfig(name="d", capacity=M256, dc_regions=(M256,))
    data = json.loads(cfg.to_json())
    assert data["dc_regions"] == [M256]
    assert DeviceConfig.from_json(cfg.to_json()) == cfg
    del data["dc_regions"]
    assert DeviceConfig.from_json(json.dumps(data)).dc_regions == ()


def test_files_hold_static_plus_dc_and_one_zeroed_bitmap_per_port(device_name: str) -> None:
    files = DeviceFiles.create(DeviceConfig(name=device_name, capacity=M256, hosts=2, dc_regions=(M256,)))
    try:
        assert (files.path / "media").stat().st_size == 2 * M256
        assert len(files.media) == 2 * M256
        for h in range(2):
            assert (files.path / access_name(h)).read_bytes() == bytes(16)
        assert files.access_bits(1)[:] == bytes(16)
    finally:
        files.destroy()


def test_changing_regions_of_a_stored_device_needs_reconfigure(device_name: str) -> None:
    DeviceFiles.create(DeviceConfig(name=device_name, capacity=M256)).close()
    wanted = DeviceConfig(name=device_name, capacity=M256, dc_regions=(M256,))
    with pytest.raises(ConfigError, match=r"dc_regions: \[\] -> \['256 MiB'\]"):
        provision(wanted)
    files = provision(wanted, reconfigure=True)
    try:
        assert load_config(device_name).dc_regions == (M256,)
        assert (files.path / "media").stat().st_size == 2 * M256
        assert (files.path / "access.h0").stat().st_size == 16
    finally:
        files.destroy()
