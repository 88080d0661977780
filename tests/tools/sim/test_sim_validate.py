"""`cxlemu sim validate` on a report whose "measurements" the simulator made itself with a known
step cost: the fit must find that cost and every (mode, level) must come back exactly."""
from __future__ import annotations

from dataclasses import asdict

import pytest

from tools.sim.metrics import LevelResult, RequestRecord
from tools.sim.workload import WorkloadConfig
from tools.sim import hardware as hw
from tools.sim.engine import EngineConfig, SimEngine, TierConfig
from tools.sim.validate import (
    compare,
    fit_from_report,
    link_check,
    mode_factors,
    points_from_report,
)
from tools.sim.workload import from_bench

MODEL = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512}
KV_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32
BLOCK = 16
COST = hw.LinearCost(20e6, 0.5e6, 100.0, 1e6)  # 20 ms + 0.5 ms/token + 100 ns/pair + 1 ms/seq
WORKLOAD = WorkloadConfig(system_tokens=64, user_tokens=40, output_tokens=4, turns=3, doc_tokens=100, doc_every=2)
THINK_S, K = 0.3, 200.0
TIER_BYTES = 64 * BLOCK * KV_PER_TOKEN


def _measure(name: str, level: int, kv_blocks: int, cost: hw.LinearCost = COST) -> dict:
    tier = None
    if name == "cxl-smart":
        tier = TierConfig(link=hw.link_params("leo-x16", K), capacity_blocks=TIER_BYTES // (BLOCK * KV_PER_TOKEN),
                          block_bytes=BLOCK * KV_PER_TOKEN, layers=MODEL["layers"], policy="arc", prefetch="layer")
    cfg = EngineConfig(block_tokens=BLOCK, kv_blocks=kv_blocks, max_num_seqs=8, max_num_batched_tokens=256)
    eng = SimEngine(from_bench(WORKLOAD, level, THINK_S), cost, cfg, tier=tier, log_steps=True)
    done = eng.run()
    rid = {id(r): f"c{level}-k{r.client}-t{r.turn}" for r in done}
    records = [RequestRecord(rid[id(r)], r.client, r.kind, r.turn, r.spec.prompt_tokens, r.arrival / 1e9,
                             r.first_token / 1e9, r.finish / 1e9, [5] * r.generated,
                             r.local_hit_tokens + r.tier_hit_tokens, r.preemptions) for r in done]
    steps = [[t0 / 1e9, dt / 1e9, [[rid[id(q)], new, computed] for q, new, computed in batch]]
             for t0, dt, batch in eng.stats.log]
    return {"records": [x.to_dict() for x in records], "steps": steps, "wall_s": eng.env.now / 1e9,
            "tier": {"blocks_loaded": eng.tier.blocks_loaded if eng.tier else 0}}


def _scaled(cost: hw.LinearCost, f: float) -> hw.LinearCost:
    return hw.LinearCost(cost.a_ns * f, cost.b_ns_per_token * f, cost.c_ns_per_pair * f, cost.d_ns_per_seq * f)


def synthetic_report(slower: dict[str, float] | None = None) -> dict:
    """Every mode "measured" by the simulator with COST; a mode in ``slower`` with COST times
    its factor (its steps ran slower, as a tier mode's can on a host the emulated device shares)."""
    slower = slower or {}
    modes = {"all-resident": 64, "none": 14, "cxl-smart": 14}
    report = {"config": {"model": MODEL, "workload": asdict(WORKLOAD), "block_tokens": BLOCK,
                         "block_bytes": BLOCK * KV_PER_TOKEN, "levels": [1, 3]},
              "time_scale": {"time_scale": K}, "think_s": THINK_S, "modes": {}, "summary": {}}
    for name, kv in modes.items():
        levels = {str(lv): _measure(name, lv, kv, _scaled(COST, slower.get(name, 1.0))) for lv in (1, 3)}
        report["modes"][name] = {
            "num_gpu_blocks": kv, "levels": levels,
            "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256, "long_prefill_token_threshold": 0},
            "mode": {"kv_blocks": kv, "tier_bytes": TIER_BYTES if name == "cxl-smart" else 0}}
        report["summary"][name] = {
            lv: LevelResult(name, int(lv), [RequestRecord(**r) for r in d["records"]], {}, BLOCK, d["wall_s"]).summary()
            for lv, d in levels.items()}
    return report


def test_fit_finds_the_cost_the_steps_were_made_with():
    c = fit_from_report(synthetic_report())
    assert (c.a_ns, c.b_ns_per_token, c.c_ns_per_pair, c.d_ns_per_seq) == pytest.approx((20e6, 0.5e6, 100.0, 1e6),
                                                                                         rel=1e-6)


def test_points_are_configured_as_the_run():
    report = synthetic_report()
    pts = {(m, lv): p for m, lv, p in points_from_report(report, fit_from_report(report))}
    assert sorted(pts) == [("all-resident", 1), ("all-resident", 3), ("cxl-smart", 1), ("cxl-smart", 3),
                           ("none", 1), ("none", 3)]
    p = pts[("cxl-smart", 3)]
    assert (p.mode, p.policy, p.prefetch, p.kv_blocks, p.tier_blocks, p.time_scale) == \
        ("cxl-smart", "arc", "layer", 14, 64, K)
    assert (p.block_tokens, p.max_num_seqs, p.max_num_batched_tokens) == (16, 8, 256)
    assert p.shape().kv_bytes_per_token == KV_PER_TOKEN
    assert pts[("all-resident", 1)].kv_blocks == 64 and pts[("none", 1)].tier_blocks == 0


def test_compare_reproduces_every_mode_and_level():
    out = compare(synthetic_report())
    assert out["all_within"] and len(out["rows"]) == 6
    for row in out["rows"]:
        for key in ("ttft_p50_s", "output_tokens_per_s", "ttft_p99_s"):
            assert row[key]["error"] == pytest.approx(0.0, abs=1e-6), (row["mode"], row["level"], key)
    smart3 = next(r for r in out["rows"] if (r["mode"], r["level"]) == ("cxl-smart", 3))
    assert smart3["tier_tokens"]["sim"] > 0  # the tier served something: the check is not vacuous


def test_mode_factors_are_one_where_every_mode_ran_the_fitted_cost():
    """cxl-smart's layer-wise stalls are in its first-hit steps, which the factor leaves out."""
    report = synthetic_report()
    assert mode_factors(report, fit_from_report(report)) == pytest.approx(
        {"all-resident": 1.0, "none": 1.0, "cxl-smart": 1.0}, rel=1e-9)


def test_a_mode_whose_steps_ran_slower_is_simulated_at_its_own_cost():
    """cxl-smart "measured" at 1.25 x the cost the no-tier modes ran: the fit (on those) finds
    COST, the factor 1.25, the point's step cost is COST x 1.25, and every pair comes back."""
    report = synthetic_report({"cxl-smart": 1.25})
    cost = fit_from_report(report)
    assert (cost.a_ns, cost.b_ns_per_token) == pytest.approx((20e6, 0.5e6), rel=1e-6)
    factors = mode_factors(report, cost)
    assert factors == pytest.approx({"all-resident": 1.0, "none": 1.0, "cxl-smart": 1.25}, rel=1e-9)
    pts = {(m, lv): p for m, lv, p in points_from_report(report, cost, factors)}
    assert pts[("cxl-smart", 3)].cost().step_ns(_one_token()) == pytest.approx(1.25 * COST.step_ns(_one_token()))
    assert pts[("none", 3)].cost().step_ns(_one_token()) == pytest.approx(COST.step_ns(_one_token()))
    out = compare(report)
    assert out["fits"][0]["mode_factors"]["cxl-smart"] == pytest.approx(1.25)
    assert out["all_within"]
    smart = [r for r in out["rows"] if r["mode"] == "cxl-smart"]
    assert all(r["ttft_p50_s"]["error"] == pytest.approx(0.0, abs=1e-6) for r in smart)


def _one_token() -> hw.Batch:
    b = hw.Batch()
    b.add(1, 10, True)
    return b


def test_repeated_runs_are_each_simulated_as_themselves():
    """Two runs of one experiment on a host whose speed moved (the second 20 % slower in every
    mode): each is fitted and simulated as itself, and the mean of the simulations is the mean
    of the runs (one fit of both would sit between them and miss the queueing of each)."""
    fast, slow = synthetic_report(), synthetic_report(dict.fromkeys(("all-resident", "none", "cxl-smart"), 1.2))
    out = compare([fast, slow])
    assert [f["step_cost"]["a_ns"] for f in out["fits"]] == pytest.approx([20e6, 24e6], rel=1e-6)
    assert out["bench_runs"] == 2 and out["all_within"]
    for r in out["rows"]:
        assert r["ttft_p50_s"]["error"] == pytest.approx(0.0, abs=1e-6)
        assert r["ttft_p50_s"]["bench_min"] < r["ttft_p50_s"]["bench_max"]


def test_link_check_replays_the_recorded_jobs_on_the_link_model():
    """leo-x16 at k = 1000: 90 us of latency, 1 MiB in 20.97152 ms. Two 1-MiB loads submitted at
    0 and 10 ms: the second waits for the first, so the model gives 21.06152 ms and
    (41.94304 + 0.09 - 10) ms; a 2-MiB store beside them, on the other direction, 42.03304 ms."""
    jobs = [[0.0, "load", 1, 0.022, 0.030, True], [0.01, "load", 1, 0.033, 0.040, True],
            [0.0, "store", 2, 0.043, 0.050, True]]
    report = {"config": {"block_bytes": 1 << 20}, "time_scale": {"time_scale": 1000.0},
              "modes": {"cxl-lru": {"mode": {"preset": "leo-x16"}, "levels": {"1": {"jobs": jobs}}},
                        "cxl-smart": {"mode": {"preset": "leo-x16", "prefetch": "layer"},
                                      "levels": {"1": {"jobs": jobs[:2]}}},  # layer-wise loads: not held
                        "none": {"mode": {"preset": None}, "levels": {"1": {}}}}}
    assert link_check(report) == {"cxl-lru": pytest.approx(
        {"jobs": 3, "loads": 2, "load_s": 0.055, "load_model_s": 0.02106152 + 0.03203304, "store_s": 0.043,
         "store_model_s": 0.04203304, "load_heard_after_s": 0.0075}, rel=1e-9)}
