"""`cxlemu bench pool --sim`: the bench's workload as a Mooncake trace and the fleet simulator's
hit rates on it, against the bench's measured ones (issue 27, item 9)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_support import cli

from tools.bench import pool_sim
from tools.bench.pool_serve import PoolBenchConfig, default_trace, load_trace, trace_workload
from tools.sim.mooncake import read

LINES = [{"hash_ids": ids} for ids in ([0, 1, 2], [0, 3], [0, 1, 2, 4], [0, 3, 5], [0, 6], [0, 1, 7])]
needs_trace = pytest.mark.skipif(default_trace() is None, reason="the Mooncake trace is not beside the checkout")


def test_the_workload_as_a_mooncake_trace() -> None:
    """Each kept id a 512-token block again, the tail (16 of 128 tokens) a fresh last block of 64,
    arrivals a minute apart; the simulator's own reader takes it."""
    cfg = PoolBenchConfig(requests=4)
    lines = pool_sim.to_mooncake(trace_workload(LINES, cfg), cfg)
    assert lines == [{"timestamp": 0, "input_length": 3 * 512 + 64, "output_length": 16, "hash_ids": [0, 1, 2, 6]},
                     {"timestamp": 60_000, "input_length": 2 * 512 + 64, "output_length": 16, "hash_ids": [0, 3, 7]},
                     {"timestamp": 120_000, "input_length": 4 * 512 + 64, "output_length": 16,
                      "hash_ids": [0, 1, 2, 4, 8]},
                     {"timestamp": 180_000, "input_length": 3 * 512 + 64, "output_length": 16,
                      "hash_ids": [0, 3, 5, 9]}]
    assert [r.input_length for r in read(json.dumps(x) for x in lines)] == [1600, 1088, 2112, 1600]


def test_the_fleet_stands_for_the_engines() -> None:
    """11 vLLM blocks of 128 (one null) are 10 x 32 + 1 blocks of 16; private tiers 256 blocks of
    512 trace tokens each, the pool twice that."""
    cfg = PoolBenchConfig()
    fc = {m: pool_sim.sim_config(cfg, m) for m in pool_sim.HOME}
    assert cfg.kv_blocks == 11 and {f.kv_blocks for f in fc.values()} == {321}
    assert [(f.kv, f.cache_tokens, f.router, f.instances) for f in fc.values()] == [
        ("none", 0, "rr", 2), ("host", 256 * 512, "rr", 2), ("cxl-pool", 256 * 512, "rr", 2)]


@needs_trace
def test_the_simulated_hit_rates_on_the_benchs_workload() -> None:
    """The documented 41 requests (303 blocks, 146 distinct); blocks hit: 39 (HBM), 98 (+ private
    tiers), 157 (+ the pool) of 303, each within 10 % of the measured rate."""
    out = pool_sim.run(PoolBenchConfig())
    assert (out["requests"], out["blocks"], out["distinct"]) == (41, 303, 146)
    m = out["modes"]
    assert {k: v["hit_tokens"] for k, v in m.items()} == {"alone": 39 * 512, "private": 98 * 512, "shared": 157 * 512}
    assert {v["whole_tokens"] for v in m.values()} == {303 * 512}
    assert [v["hbm_hit_rate"] for v in m.values()] == [39 / 303] * 3
    assert [(r["mode"], r["measured"], r["within_goal"]) for r in out["rows"]] == [
        ("alone", 0.129, True), ("private", 0.323, True), ("shared", 0.515, True)]
    assert out["rows"][2]["ratio"] == pytest.approx(157 / 303 / 0.515)


@needs_trace
def test_the_cli_table_the_trace_and_bad_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, doc, err = cli(capsys, "bench", "pool", "--sim", "--json", "--export", str(tmp_path / "t.jsonl")).parsed
    assert rc == 0 and [r["within_goal"] for r in doc["rows"]] == [True, True, True]
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 41
    for argv, message in ((["--requests", "20"], "--sim: the recorded figures are the default bench's (40 requests, "
                           "window 3000, 8 blocks, 512 tier blocks; 2 or 3 engines); for another one give its saved "
                           "report: --measured PATH"),
                          (["--measured", str(tmp_path / "no.json")],
                           f"--measured: cannot read {tmp_path / 'no.json'}: No such file or directory")):
        assert cli(capsys, "bench", "pool", "--sim", *argv) == (2, "", f"cxlemu: error: {message}\n")



@needs_trace
def test_a_saved_report_it_misses_fails_the_check(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``--measured`` reads a `bench pool --save` report (here: engines that hit nothing): exit 1."""
    cfg = PoolBenchConfig()
    workload = trace_workload(load_trace(str(default_trace()), cfg.window), cfg)
    results = [{"cached": 0, "ttft_s": 0.1, "tokens": [1]} for _ in workload]
    report = {"config": {"engines": 2, "tokens_per_hash": 128},
              "workload": [{"hash_ids": list(r.hash_ids), "parent": r.parent} for r in workload],
              "modes": {m: {"results": results, "tier": [{}, {}]} for m in ("alone", "private", "shared")}}
    (tmp_path / "pool.json").write_text(json.dumps(report))
    rc, doc, err = cli(capsys, "bench", "pool", "--sim", "--json", "--measured", str(tmp_path / "pool.json")).parsed
    assert (rc, err) == (1, "")
    assert [(r["measured"], r["ratio"], r["within_goal"]) for r in doc["rows"]] == [(0.0, None, False)] * 3
    (tmp_path / "bad.json").write_text("[]")
    rc, out, err = cli(capsys, "bench", "pool", "--sim", "--measured", str(tmp_path / "bad.json"))
    assert (rc, out) == (2, "") and err.startswith(f"cxlemu: error: --measured: {tmp_path / 'bad.json'} is not a ")
