"""The fleet sweep's grid, its comparisons and the pool's break-even price, on rows worked by hand."""
from __future__ import annotations

import pytest

from tools.sim.fleet_point import FleetPoint
from tools.sim.fleet_sweep import break_even, expand_fleet, fleet_row, goals


def test_the_default_grid_has_over_200_fleets_and_collapses_what_does_not_apply() -> None:
    points = expand_fleet(FleetPoint(trace="t.jsonl"), {})
    # 3 speeds x 2 sizes x 3 routers x 2 admissions x (none + 3 homes x 2 home sizes)
    assert len(points) == 3 * 2 * 3 * 2 * 7 == 252
    assert {p.cache_tokens for p in points if p.kv == "none"} == {0}
    two = expand_fleet(FleetPoint(trace="t.jsonl"), {"kv": ["host", "cxl-pool"], "policies": ["lru", "arc"],
                                                      "speeds": [1], "instances": [8], "routers": ["rr"],
                                                      "admissions": ["fcfs"], "cache_tokens": [3_000_000]})
    assert [(p.kv, p.policy) for p in two] == [("host", "lru"), ("cxl-pool", "lru"), ("cxl-pool", "arc")]


def _row(kv: str, **kw: object) -> dict:
    base = {"speed": 1.0, "instances": 8, "router": "rr", "admission": "fcfs", "cache_tokens": 3_000_000,
            "policy": "lru" if kv == "cxl-pool" else "-", "kv": kv, "tp": 8, "sim_s": 3600.0, "home_gb": 0.0}
    return {**base, **kw}


ROWS = [_row("none", cache_tokens=0, hit_rate=0.1, ttft_p99_ms=900.0, goodput=2.0, good_tokens=1_000_000),
        _row("host", hit_rate=0.15, ttft_p99_ms=800.0, goodput=2.5, good_tokens=1_000_000, home_gb=100.0),
        _row("rdma", hit_rate=0.36, ttft_p99_ms=700.0, goodput=2.8, good_tokens=1_100_000, home_gb=100.0),
        _row("cxl-pool", hit_rate=0.36, ttft_p99_ms=350.0, goodput=3.0, good_tokens=1_250_000, home_gb=100.0)]


def test_goals_set_the_pool_beside_host_rdma_and_none() -> None:
    (g,) = goals(ROWS)
    assert (g["hit_vs_host"], g["ttft_p99_vs_rdma"], g["goodput_vs_none_fcfs"]) == \
        (pytest.approx(2.4), pytest.approx(0.5), pytest.approx(1.5))


def test_break_even_prices() -> None:
    (b,) = break_even(ROWS, accelerator_hour=2.0, host_gb_hour=0.01)
    a = 8 * 8 * 2.0  # 128 USD/h of accelerators
    # vs host: (128 + 100 p) / 1.25M = (128 + 1) / 1M  ->  p = (129 x 1.25 - 128) / 100
    assert b["vs_host"] == pytest.approx((129 * 1.25 - a) / 100)
    assert b["vs_none"] == pytest.approx((a * 1.25 - a) / 100)


def test_a_failed_point_is_a_row_with_its_error() -> None:
    row = fleet_row(FleetPoint(trace="/nonexistent.jsonl", tp=1, model="llama-3-8b"))
    assert row["kv"] == "none" and row["error"].startswith("FileNotFoundError")


@pytest.mark.parametrize("argv, message", [
    (["--speeds", "1,0"], "--speeds: must be > 0, got '0'"),
    (["--kv", "host,nvme"], "--kv: unknown 'nvme': choose from none, host, rdma, cxl-pool"),
    (["--cache-tokens", "3Q"], "--cache-tokens: malformed token count '3Q'"),
    (["--routers", ""], "--routers: give at least one value"),
])
def test_fleet_sweep_bad_lists_are_one_line_exit_2(capsys, tmp_path, argv, message) -> None:
    from cli_support import cli

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 20, "output_length": 2, "hash_ids": [1]}\n')
    code, out, err = cli(capsys, "sim", "fleet-sweep", "--trace", str(trace), *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"cxlemu: error: {message}") and err.count("\n") == 1
