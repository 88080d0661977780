"""`cxlemu sim sweep`: the grid, the cost arithmetic, a real Dask sweep and the plots (the
concurrency syntax and the argument errors: tests/tools/cli/test_sim_sweep_cli.py)."""
from __future__ import annotations

import json
import math

import pytest

from tools.sim.grid import WORKLOADS, SweepError, expand, sort_key
from tools.sim.modes import SIM_MODES as MODES
from tools.sim.plots import write_plots
from tools.sim.pricing import Prices, cost_per_token
from tools.sim.run import Point
from tools.sim.sweep import _run_point, run_sweep

TINY = {"kind": "fixed", "context": 512, "output_tokens": 16, "requests": 2}


# --------------------------------------------------------------------------- expand


def test_expand_collapses_pool_and_policy_where_they_do_not_apply():
    grid = {"models": ["llama-2-7b", "llama-3-8b"], "accelerators": ["h100"], "pool_gb": [256, 1024],
            "policies": ["arc", "lru", "s3fifo"], "workloads": ["fixed"], "modes": list(MODES),
            "concurrency": [1, 4]}
    points = expand(grid)
    # per model: none 2 + host-lru 2 + cxl-lru 2 pools x 2 + cxl-smart 2 pools x 3 policies x 2 = 20
    assert len(points) == 2 * (2 + 2 + 4 + 12)
    by_mode = {m: [p for p in points if p.mode == m] for m in MODES}
    assert {p.pool_gb for p in by_mode["none"]} == {256.0}  # the first value
    assert {p.smart_policy for p in by_mode["cxl-lru"]} == {"arc"}
    assert {(p.pool_gb, p.smart_policy) for p in by_mode["cxl-smart"]} == {
        (g, pol) for g in (256.0, 1024.0) for pol in ("arc", "lru", "s3fifo")}
    assert len({json.dumps(p.to_dict(), sort_keys=True) for p in points}) == len(points)


def test_expand_dedups_repeated_values_and_applies_presets():
    points = expand({"models": ["llama-2-7b", "llama-2-7b"], "accelerators": ["h100"], "pool_gb": [512],
                     "policies": ["arc"], "workloads": ["fixed", "sessions", "fixed"], "modes": ["none"],
                     "concurrency": [2, 2, 8], "context": 1024})
    assert len(points) == 2 * 2  # (fixed, sessions) x (2, 8)
    fixed = [p for p in points if p.workload["kind"] == "fixed"]
    assert fixed[0].workload == dict(WORKLOADS["fixed"], context=1024)
    sessions = [p for p in points if p.workload["kind"] == "sessions"]
    assert sessions[0].workload == WORKLOADS["sessions"]


def test_expand_context_list_and_workload_dicts():
    points = expand({"workloads": ["fixed", TINY], "modes": ["none"], "concurrency": [1], "context": [1024, 2048]})
    assert [p.workload.get("context") for p in points] == [1024, 2048, 512]


@pytest.mark.parametrize(("key", "value", "needle"), [
    ("models", ["gpt-9"], "unknown model 'gpt-9'"),
    ("accelerators", ["tpu"], "unknown accelerator 'tpu'"),
    ("modes", ["cxl"], "unknown mode 'cxl'"),
    ("workloads", ["chat"], "unknown workload 'chat'"),
    ("policies", ["fifo9"], "unknown eviction policy 'fifo9'"),
    ("pool_gb", [0], "pool_gb must be"),
    ("concurrency", [0], "concurrency must be"),
    ("models", [], "no models given"),
])
def test_expand_names_the_bad_key(key, value, needle):
    with pytest.raises(SweepError, match=needle) as e:
        expand({key: value})
    assert e.value.key == key
    assert isinstance(e.value, ValueError)


# --------------------------------------------------------------------------- cost


def test_cost_per_token_arithmetic():
    rows = [
        {"accelerator": "h100", "mode": "none", "pool_gb": "-", "host_gb": "-", "output_tokens_per_s": 1000.0},
        {"accelerator": "h100", "mode": "cxl-smart", "pool_gb": 1000.0, "host_gb": "-",
         "output_tokens_per_s": 2000.0},
        {"accelerator": "a100-80gb", "mode": "host-lru", "pool_gb": "-", "host_gb": 256.0,
         "output_tokens_per_s": 500.0},
        {"accelerator": "h200", "mode": "none", "pool_gb": "-", "host_gb": "-", "output_tokens_per_s": 10.0},
        {"accelerator": "h100", "mode": "none", "pool_gb": "-", "host_gb": "-", "error": "boom"},
    ]
    out = cost_per_token(rows, Prices(accelerator={"h100": 3.6, "a100-80gb": 1.6}, pool_gb_hour=0.0036,
                                      host_gb_hour=0.00125))
    assert out is rows
    assert rows[0]["usd_per_million_tokens"] == pytest.approx(3.6 / (1000 * 3600) * 1e6)  # 1.0
    assert rows[0]["usd_per_million_tokens"] == pytest.approx(1.0)
    assert rows[1]["usd_per_million_tokens"] == pytest.approx((3.6 + 3.6) / (2000 * 3600) * 1e6)  # 1.0
    assert rows[2]["usd_per_million_tokens"] == pytest.approx((1.6 + 0.32) / (500 * 3600) * 1e6)
    assert "usd_per_million_tokens" not in rows[3]  # no price for h200
    assert rows[4]["usd_per_million_tokens"] is None


# --------------------------------------------------------------------------- a real sweep


def test_run_point_turns_an_exception_into_an_error_row():
    row = _run_point(Point(workload={**TINY, "bogus": 1}))
    assert "error" in row and "bogus" in row["error"]
    assert row["mode"] == "none" and row["pool_gb"] == "-" and row["policy"] == "-"


def test_real_sweep_on_a_local_cluster_and_plots(tmp_path):
    points = expand({"workloads": [TINY], "modes": ["none", "cxl-lru", "cxl-smart"], "policies": ["arc", "lru"],
                     "concurrency": [1, 2]})
    assert len(points) == 8
    seen = []
    rows = run_sweep(points, workers=2, progress=lambda done, total, row: seen.append((done, total)))
    assert seen[-1] == (8, 8)
    assert len(rows) == 8
    assert all("error" not in r for r in rows), [r.get("error") for r in rows]
    assert rows == sorted(rows, key=sort_key)
    assert [r["mode"] for r in rows[:2]] == ["none", "none"]
    for r in rows:
        assert r["output_tokens_per_s"] > 0 and math.isfinite(r["ttft_p99_ms"])
        assert r["workload"] == "fixed(context=512,output_tokens=16,requests=2)"
    cost_per_token(rows, Prices(accelerator={"h100": 2.5}, pool_gb_hour=0.001))
    paths = write_plots(rows, tmp_path / "plots" / "sw")
    assert sorted(p.name for p in paths) == [
        "sw-llama-2-7b-h100-fixed_context=512_output_tokens=16_requests=2-pool1024-arc.png",
        "sw-llama-2-7b-h100-fixed_context=512_output_tokens=16_requests=2-pool1024-lru.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
