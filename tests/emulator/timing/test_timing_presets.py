"""Presets (shipped TOML, each citing a source; relative ones scaled by local memory), the
`cxlemu presets` command, local-memory caching and NUMA binding on this machine."""
from __future__ import annotations

import json
import mmap

import pytest

from emulator import numa, presets
from emulator.spec.errors import ConfigError
from emulator.timing import TimingConfig
from emulator.timing.localmem import local_memory
from tools.cli.main import main


@pytest.fixture(autouse=True)
def fixed_local_memory(monkeypatch):
    """Relative presets see a known host: 100 ns local latency, 10 GB/s copy bandwidth."""
    monkeypatch.setenv("CXLEMU_LOCAL_MEMORY", "100,10")


def test_shipped_presets_and_their_numbers():
    assert {"qemu-cdat", "asic", "fpga", "leo-x16", "none"} <= set(presets.names())
    assert presets.load("qemu-cdat").timing == TimingConfig(
        read_latency_ns=150, write_latency_ns=250, read_bandwidth_gbps=16, write_bandwidth_gbps=16)
    assert presets.load("none").timing.untimed
    leo = presets.load("leo-x16").timing
    assert (leo.read_bandwidth_gbps, leo.read_latency_ns) == (50, 90)


@pytest.mark.parametrize(("name", "added_ns", "gbps"), [("asic", 118.0, 8.25), ("fpga", 188.0, 5.7)])
def test_relative_presets_scale_local_memory(name, added_ns, gbps):
    p = presets.load(name)
    assert (p.timing.read_latency_ns, p.timing.write_latency_ns) == (added_ns, added_ns)
    assert (p.timing.read_bandwidth_gbps, p.timing.write_bandwidth_gbps) == (gbps, gbps)
    assert "local 100.0 ns, 10.00 GB/s (env)" in p.derived_from


def test_every_preset_cites_a_source():
    for p in presets.load_all():
        assert p.source and p.description and p.name in presets.names()


def test_unknown_preset_is_a_config_error_and_a_key_error():
    with pytest.raises(presets.UnknownPreset, match="choose one of asic, beluga-switch, fpga") as exc:
        presets.load("hbm9")
    assert isinstance(exc.value, ConfigError) and isinstance(exc.value, KeyError)


@pytest.mark.parametrize(("text", "message"), [
    ('name="x"\ndescription="d"\n', "'source' must be a non-empty string"),
    ('name="x"\ndescription="d"\nsource="s"\ncolour="red"\n', "unknown key"),
    ('name="x"\ndescription="d"\nsource="s"\n[timing]\nread_latency_ns=-5\n', "read_latency_ns must be >= 0"),
    ('name="x"\ndescription="d"\nsource="s"\n[relative]\nlatency_factor=0.5\nbandwidth_fraction=1\n',
     "latency_factor must be >= 1"),
    ("name = \n", "not valid TOML"),
])
def test_bad_preset_files_are_refused(tmp_path, text, message):
    path = tmp_path / "mine.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        presets.load(str(path))


def test_local_memory_env_override_is_validated(monkeypatch):
    assert (local_memory().latency_ns, local_memory().source) == (100.0, "env")
    monkeypatch.setenv("CXLEMU_LOCAL_MEMORY", "fast")
    with pytest.raises(ConfigError, match="LATENCY_NS,BANDWIDTH_GBPS"):
        local_memory()


def test_local_memory_measures_once_then_uses_the_cache(monkeypatch, tmp_path):
    """Measured values are cached per host; the second call reads them back unchanged."""
    monkeypatch.delenv("CXLEMU_LOCAL_MEMORY")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    import emulator.timing.localmem as lm

    monkeypatch.setattr(lm, "measure_latency_ns", lambda: (87.5, "measured"))
    monkeypatch.setattr(lm, "measure_bandwidth_gbps", lambda: 12.25)
    first = lm.local_memory()
    monkeypatch.setattr(lm, "measure_latency_ns", lambda: pytest.fail("measured twice"))
    second = lm.local_memory()
    assert (first.latency_ns, first.source) == (87.5, "measured")
    assert (second.latency_ns, second.bandwidth_gbps, second.source) == (87.5, 12.25, "cached")
    assert json.loads((tmp_path / "cxlemu/local-memory.json").read_text())["latency_ns"] == 87.5


def test_cli_presets_json(capsys):
    assert main(["presets", "qemu-cdat", "asic", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in out] == ["qemu-cdat", "asic"]
    assert out[0]["timing"]["write_latency_ns"] == 250 and out[1]["timing"]["read_latency_ns"] == 118.0


def test_cli_presets_table_lists_numbers_and_sources():
    from rich.console import Console

    from tools.cli.cmd_presets import record, render

    console = Console(record=True, width=160)
    console.print(render([record(presets.load("qemu-cdat"))]))
    text = console.export_text()
    assert "qemu-cdat" in text and "150" in text and "250" in text and "16" in text
    assert "ct3_build_cdat_entries_for_mr" in text


def test_cli_unknown_preset_is_one_line_exit_2(capsys):
    assert main(["presets", "hbm9"]) == 2
    assert capsys.readouterr().err.startswith("cxlemu: error: unknown preset 'hbm9'")


# -- NUMA -------------------------------------------------------------------------------------
def test_numa_bind_falls_back_with_a_notice_on_one_node():
    m = mmap.mmap(-1, 1 << 16)
    try:
        assert numa.bind(m, None) is None
        if numa.node_count() == 1:
            only = numa.online_nodes()[0]
            assert numa.bind(m, only) is None
            notice = numa.bind(m, only + 1)
            assert notice is not None and "one NUMA node" in notice and "\n" not in notice
        m[0] = 1
        assert numa.numa_node_of(m) in numa.online_nodes()
    finally:
        m.close()


def test_numa_bad_node_is_refused():
    with pytest.raises(ConfigError, match="int >= 0"):
        numa.bind(bytearray(4096), -1)


def test_online_nodes_parses_ranges(monkeypatch, tmp_path):
    f = tmp_path / "online"
    f.write_text("0-2,5\n")
    monkeypatch.setattr(numa, "_NODE_ONLINE", f)
    assert numa.online_nodes() == [0, 1, 2, 5]
    with pytest.raises(ConfigError, match="not online"):
        numa.bind(bytearray(4096), 4)
