"""The vLLM tier's configuration, checked without vLLM (driver.vllm imports vLLM only when vLLM
asks for its classes)."""
from __future__ import annotations

import pytest

from driver.vllm import kv_transfer_config, parse_extra_config
from emulator.spec.errors import ConfigError


def test_bad_extra_config_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"\['policy'\]: unknown eviction policy 'mru'"):
        parse_extra_config({"policy": "mru", "cxl_bytes_to_use": 1 << 20})
    with pytest.raises(ConfigError, match=r"\['cxl_bytes_to_use'\] is required"):
        parse_extra_config({"policy": "lru"})
    with pytest.raises(ConfigError, match="unknown key"):
        parse_extra_config({"cxl_bytes": 1, "cxl_bytes_to_use": 1})
    with pytest.raises(ConfigError, match="prefetch"):
        parse_extra_config({"cxl_bytes_to_use": 1, "prefetch": "eager"})
    with pytest.raises(ConfigError, match=r"\['window'\]"):
        parse_extra_config({"cxl_bytes_to_use": 1, "window": "no_such_module:fn"})
    with pytest.raises(ConfigError, match=r"\['staging'\] must be true, false or absent"):
        parse_extra_config({"cxl_bytes_to_use": 1, "staging": "yes"})
    with pytest.raises(ConfigError, match=r"\['staging_bytes'\] must be an int >= 1"):
        parse_extra_config({"cxl_bytes_to_use": 1, "staging_bytes": 0})
    assert parse_extra_config({"cxl_bytes_to_use": 5}).policy == "lru"
    assert parse_extra_config({"cxl_bytes_to_use": 5}).staging is None
    assert parse_extra_config({"cxl_bytes_to_use": 5, "staging": True, "staging_bytes": 4096}).staging_bytes == 4096
    assert parse_extra_config({"cxl_bytes_to_use": 5, "window": "auto"}).window == "auto"


def test_kv_transfer_config_is_vllms_shape() -> None:
    cfg = kv_transfer_config(device="mem0", policy="arc", prefetch="layer", cxl_bytes_to_use=1 << 30)
    assert cfg == {"kv_connector": "CxlConnector", "kv_connector_module_path": "driver.vllm",
                   "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                   "kv_connector_extra_config": {"device": "mem0", "policy": "arc", "prefetch": "layer",
                                                 "cxl_bytes_to_use": 1 << 30}}
    assert "device" not in kv_transfer_config(cxl_bytes_to_use=1)["kv_connector_extra_config"]


def test_importing_driver_vllm_does_not_import_vllm() -> None:
    import subprocess
    import sys

    code = "import sys, driver.vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_manager_counters_reach_a_reader_in_another_process_through_the_device_dir() -> None:
    """The scheduler's counters for a worker elsewhere: nothing before the device's directory
    exists or before the first write; a new writer clears an earlier run's; a reader in another
    process reads the writer's words."""
    import os
    import subprocess
    import sys

    from driver.vllm import ManagerCounters
    from emulator.device import DeviceConfig, serve

    name = f"mc{os.getpid() % 100000}"
    early = ManagerCounters(name, writer=True)
    early.write({"lookups": 1, "hits": 1, "evictions": 0, "chunks_in_use": 1})  # no directory yet: dropped
    with serve(DeviceConfig(name=name, capacity=256 << 20)):
        reader = ManagerCounters(name, writer=False)
        assert reader.read() is None
        w = ManagerCounters(name, writer=True)
        assert reader.read() is None  # made, not written
        w.write({"lookups": 10, "hits": 7, "evictions": 2, "chunks_in_use": 5})
        assert reader.read() == {"lookups": 10, "hits": 7, "evictions": 2, "chunks_in_use": 5}
        code = (f"from driver.vllm import ManagerCounters; r = ManagerCounters({name!r}, writer=False).read(); "
                "print(r['hits'], r['lookups'])")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.split() == ["7", "10"]
        ManagerCounters(name, writer=True)  # the next run's manager: the old counts are gone
        assert reader.read() is None
        for c in (w, reader, early):
            c.close()


def test_the_chmu_unit_is_the_largest_power_of_two_dividing_a_page() -> None:
    """No unit straddles two chunks' pages (the layer-major layout puts page boundaries at
    multiples of the page), and the unit stays within a CHMU's 256 B to 2 MiB."""
    from driver.vllm._config import chunk_of_dpa, hotlist_unit

    assert hotlist_unit(64 << 10) == 64 << 10
    assert hotlist_unit(48 << 10) == 16 << 10  # a 3 x 16 KiB page
    assert hotlist_unit(64) == 256  # below the smallest unit: units may then span pages
    assert hotlist_unit(8 << 20) == 2 << 20
    page, chunks = 48 << 10, 10
    unit = hotlist_unit(page)
    for dpa in range(0, 3 * chunks * page, unit):  # three layers' regions
        assert {chunk_of_dpa(b, page, chunks) for b in (dpa, dpa + unit - 1)} == {chunk_of_dpa(dpa, page, chunks)}
    for bad in (0, -4096, 1.5, True):
        with pytest.raises(ValueError, match="page must be an int > 0 bytes"):
            hotlist_unit(bad)  # type: ignore[arg-type]


def test_kv_format_is_checked_naming_the_allowed_values() -> None:
    with pytest.raises(ConfigError, match=r"\['kv_format'\] must be one of 'native', 'int8', 'int4'.*got 'fp8'"):
        kv_transfer_config(cxl_bytes_to_use=1 << 20, kv_format="fp8")
    with pytest.raises(ConfigError, match="staged KV .CUDA. is moved native"):
        parse_extra_config({"cxl_bytes_to_use": 1, "kv_format": "int4", "staging": True})
    cfg = kv_transfer_config(cxl_bytes_to_use=1 << 20, kv_format="int8")
    assert cfg["kv_connector_extra_config"]["kv_format"] == "int8"
    assert parse_extra_config(cfg["kv_connector_extra_config"]).kv_format == "int8"
    assert parse_extra_config({"cxl_bytes_to_use": 1}).kv_format == "native"


def test_a_vllm_cpu_page_is_coded_as_key_and_value_pieces_per_head() -> None:
    """[kv_heads][2 x block][head]: piece 2h the keys of head h (per channel), 2h+1 its values."""
    import numpy as np

    from driver.vllm._codec import PageCodec
    from firmware_model.kv_codec import PieceCodec, encode_elements

    codec = PieceCodec("int4", 4, 8, "f32")
    pages = PageCodec(codec, [2 * 2 * codec.native_bytes])  # 2 kv heads
    assert pages.pieces == [4] and pages.device_pages == [4 * codec.encoded_bytes]
    assert PageCodec.block_bytes(codec, 3 * 4 * codec.native_bytes) == 12 * codec.encoded_bytes
    raw = encode_elements(np.arange(3 * 4 * 32, dtype=np.float32).reshape(3, -1) % 7, "f32").view(np.uint8)
    enc = pages.encode(0, raw).reshape(3, 4, codec.encoded_bytes)
    modes = enc[:, :, 2:4].copy().view(np.uint16)[:, :, 0]
    assert modes.tolist() == [[1, 0, 1, 0]] * 3  # keys per channel, values per token
    assert pages.decode(0, enc.reshape(3, -1)).shape == (3, 4 * codec.native_bytes)
    with pytest.raises(ConfigError, match="not a whole number of .key, value. pieces"):
        PageCodec(codec, [3 * codec.native_bytes])


def test_a_shared_pool_takes_a_served_device_and_a_host_port() -> None:
    cfg = kv_transfer_config(device="pool0", shared=True, host=1, cxl_bytes_to_use=1 << 20)
    extra = cfg["kv_connector_extra_config"]
    assert extra == {"device": "pool0", "policy": "lru", "prefetch": "forward", "cxl_bytes_to_use": 1 << 20,
                     "shared": True, "host": 1}
    tier = parse_extra_config(extra)
    assert (tier.shared, tier.host) == (True, 1)
    assert (parse_extra_config({"cxl_bytes_to_use": 1}).shared, parse_extra_config({"cxl_bytes_to_use": 1}).host) \
        == (False, 0)
    with pytest.raises(ConfigError, match=r"\['shared'\]: a pool is shared on a served device"):
        parse_extra_config({"cxl_bytes_to_use": 1, "shared": True})
    with pytest.raises(ConfigError, match=r"\['shared'\] must be true or false, got 'yes'"):
        parse_extra_config({"device": "pool0", "cxl_bytes_to_use": 1, "shared": "yes"})
    with pytest.raises(ConfigError, match=r"\['host'\] must be an int >= 0, got -1"):
        parse_extra_config({"device": "pool0", "cxl_bytes_to_use": 1, "host": -1})
    with pytest.raises(ConfigError, match=r"\['host'\] must be an int >= 0, got True"):
        parse_extra_config({"device": "pool0", "cxl_bytes_to_use": 1, "host": True})


def test_each_host_port_gets_its_own_part_of_the_static_capacity() -> None:
    from driver.vllm._config import tier_region

    assert tier_region(256 << 20, 1, 0) == (0, 256 << 20)
    assert tier_region(512 << 20, 2, 1) == (256 << 20, 256 << 20)
    assert tier_region(256 << 20, 3, 2) == (2 * (85 << 20), 85 << 20)  # 1 MiB-aligned thirds
    with pytest.raises(ConfigError, match=r"\['host'\] must be a host port of the device: 0 to 1, got 2"):
        tier_region(512 << 20, 2, 2)


def test_the_tiers_layer_regions_follow_each_other_from_its_base() -> None:
    from driver.vllm._pool import layer_offsets

    assert layer_offsets(256 << 20, 4, [1024, 1024, 2048]) == [256 << 20, (256 << 20) + 4096, (256 << 20) + 8192]


def test_a_shared_pool_keeps_native_blocks() -> None:
    """Every engine on the pool reads a block as its own bytes: a compressed tier is not shared."""
    with pytest.raises(ConfigError, match=r"\['kv_format'\]='int8' with 'shared'"):
        parse_extra_config({"device": "pool0", "cxl_bytes_to_use": 1, "shared": True, "kv_format": "int8"})
