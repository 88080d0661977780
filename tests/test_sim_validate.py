"""`cxlemu sim validate` on a report whose "measurements" the simulator made itself with a known
step cost: the fit must find that cost and every (mode, level) must come back exactly."""
from __future__ import annotations

from dataclasses import asdict

import pytest

from tools.bench._serve_workload import LevelResult, RequestRecord, WorkloadConfig
from tools.sim import hardware as hw
from tools.sim.engine import EngineConfig, SimEngine, TierConfig
from tools.sim.validate import compare, fit_from_report, points_from_report
from tools.sim.workload import from_bench

MODEL = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 512}
KV_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32
BLOCK = 16
COST = hw.LinearCost(20e6, 0.5e6, 100.0, 1e6)  # 20 ms + 0.5 ms/token + 100 ns/pair + 1 ms/seq
WORKLOAD = WorkloadConfig(system_tokens=64, user_tokens=40, output_tokens=4, turns=3, doc_tokens=100, doc_every=2)
THINK_S, K = 0.3, 200.0
TIER_BYTES = 64 * BLOCK * KV_PER_TOKEN


def _measure(name: str, level: int, kv_blocks: int) -> dict:
    tier = None
    if name == "cxl-smart":
        tier = TierConfig(link=hw.link_params("leo-x16", K), capacity_blocks=TIER_BYTES // (BLOCK * KV_PER_TOKEN),
                          block_bytes=BLOCK * KV_PER_TOKEN, layers=MODEL["layers"], policy="arc", prefetch="layer")
    cfg = EngineConfig(block_tokens=BLOCK, kv_blocks=kv_blocks, max_num_seqs=8, max_num_batched_tokens=256)
    eng = SimEngine(from_bench(WORKLOAD, level, THINK_S), COST, cfg, tier=tier, log_steps=True)
    done = eng.run()
    rid = {id(r): f"c{level}-k{r.client}-t{r.turn}" for r in done}
    records = [RequestRecord(rid[id(r)], r.client, r.kind, r.turn, r.spec.prompt_tokens, r.arrival / 1e9,
                             r.first_token / 1e9, r.finish / 1e9, [5] * r.generated,
                             r.local_hit_tokens + r.tier_hit_tokens, r.preemptions) for r in done]
    steps = [[t0 / 1e9, dt / 1e9, [[rid[id(q)], new, computed] for q, new, computed in batch]]
             for t0, dt, batch in eng.stats.log]
    return {"records": [x.to_dict() for x in records], "steps": steps, "wall_s": eng.env.now / 1e9,
            "tier": {"blocks_loaded": eng.tier.blocks_loaded if eng.tier else 0}}


def synthetic_report() -> dict:
    modes = {"all-resident": 64, "none": 14, "cxl-smart": 14}
    report = {"config": {"model": MODEL, "workload": asdict(WORKLOAD), "block_tokens": BLOCK,
                         "block_bytes": BLOCK * KV_PER_TOKEN, "levels": [1, 3]},
              "time_scale": {"time_scale": K}, "think_s": THINK_S, "modes": {}, "summary": {}}
    for name, kv in modes.items():
        levels = {str(lv): _measure(name, lv, kv) for lv in (1, 3)}
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
