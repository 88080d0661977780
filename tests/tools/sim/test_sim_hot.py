"""Hot-page attention in the serving simulator (tools/sim/hot.py): the arithmetic by hand on a tiny
model, what the KV space admits dense and hot, the link's bytes, and `cxlemu sim serve --attention`."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import simpy
from cli_support import cli

from firmware_model.link import LinkParams
from tools.sim.hot import SINK_PAGES, WINDOW_PAGES, HotAttention, HotConfig, HotTier, piece_bytes, quality_rows
from tools.sim.run import Point, simulate

# 4 layers, 2 KV heads of 16 channels, fp16: a token's KV is 2 x 4 x 2 x 16 x 2 = 512 B; 4-token pages
TINY = {"name": "tiny", "layers": 4, "hidden": 32, "heads": 2, "kv_heads": 2, "intermediate": 64, "vocab": 64}
TINY_HOT = HotAttention(page_budget=0.25, block_tokens=4, layers=4, kv_heads=2, head_dim=16)


def test_piece_bytes_follow_the_codec_layout():
    # Llama-2-7B's page (16 tokens x 128 channels) of one head's K or V
    assert piece_bytes("native", 16, 128, 2) == 4096
    assert piece_bytes("int8", 16, 128, 2) == 2 * 16 + 16 * 128  # an fp16 scale a token, a code an element
    assert piece_bytes("int4", 16, 128, 2) == 4 + 4 * 128 + 16 * 128 // 2  # header, 128 (scale, zero), nibbles
    assert piece_bytes("int4", 4, 16, 2) == 4 + 4 * 16 + 32  # max(16 channels, 4 x 16 / 16 groups) entries
    with pytest.raises(ValueError, match="head_dim must be even"):
        piece_bytes("int4", 16, 5, 2)
    with pytest.raises(ValueError, match="kv_format 'int2'"):
        piece_bytes("int2", 16, 128, 2)


def test_the_working_set_and_the_pages_read_by_hand():
    a = TINY_HOT
    # 253 tokens: 64 pages, 63 complete; the window starts at page 61, the sink is page 0: 60 candidates
    assert (a.pages(253), a.candidates(253)) == (64, 60)
    # the budget's ceil(0.25 x 64) = 16 pages less the 4 resident (sink, 2 window pages, the partial one)
    assert a.pages_read(253) == 12
    # HBM: 4 layers x (metadata 2 x 2 heads x 64 pages x 16 x 2 B = 8192 + (1 + 2 + 2) x 4 tokens x 128 B
    # = 2560) + 2 layers x 64 chosen tokens x 128 B = 59392 B: 29 blocks of 4 tokens x 512 B (dense: 64)
    assert a.resident_bytes(253) == 4 * (8192 + 2560) + 2 * 64 * 128 == 59392
    assert a.decode(253) == (29, 253 - (60 - 12) * 4 + 60, 4 * 12 * 512)
    # a sequence whose whole KV is no bigger than its working set stays dense and reads nothing
    assert a.decode(40) == (10, 40, 0)
    assert HotAttention(page_budget=1.0, block_tokens=4, layers=4, kv_heads=2, head_dim=16).decode(253)[1:] == \
        (253, 4 * 60 * 512)  # every page: the dense tokens, no metadata scored
    with pytest.raises(ValueError, match="page_budget must be in"):
        HotAttention(page_budget=0, layers=1, kv_heads=1, head_dim=2)


def _tiny(**kw):
    # 6 clients of one 256-token request (252 prompt + 4 output), all at t = 0, on a KV space of 202
    # blocks (and the null block): a prefill takes 63, a dense decode 64, a hot one 29
    return Point(model_shape=TINY, model="", accelerator="h100", block_tokens=4, kv_blocks=203, concurrency=6,
                 workload={"kind": "fixed", "context": 256, "output_tokens": 4, "requests": 1, "stagger": 0}, **kw)


def test_dense_admits_three_hot_five():
    dense = simulate(_tiny())
    # step 1 admits 3 prefills (189 blocks); each then grows to 64 and 10 blocks stay free
    assert dense["max_concurrency"] == 3 and dense["preemptions"] == 0
    hot = simulate(_tiny(attention="hot", page_budget=0.25, hot_predicted=1.0))
    # step 2: the 3 shrink to 29 (115 free), a 4th prefill takes 63; step 3: it shrinks, a 5th takes 63
    # (23 free); step 4: 145 held, 57 free: the 6th waits until the first 3 finish
    assert hot["max_concurrency"] == 5 and hot["preemptions"] == 0
    assert hot["output_tokens"] == dense["output_tokens"] == 6 * 4
    # each request decodes 3 steps (253, 254, 255 tokens) of 12 pages x 4 layers x 512 B, and writes its
    # prompt's 63 pages; the step with 5 decoding reads the most
    assert hot["link_bytes_read"] == 6 * 3 * 4 * 12 * 512
    assert hot["link_bytes_written"] == 6 * 63 * 4 * 512
    assert hot["link_max_step_read"] == 5 * 4 * 12 * 512
    int4 = simulate(_tiny(attention="hot", page_budget=0.25, kv_format="int4", hot_predicted=1.0))
    assert int4["link_bytes_read"] == 6 * 3 * 4 * 12 * 2 * 2 * 100  # a piece of 4 x 16 is 100 B in int4
    assert int4["max_concurrency"] == 5


def test_hot_when_full_goes_hot_only_to_make_room():
    full = simulate(_tiny(attention="hot", page_budget=0.25, hot_when="full", hot_predicted=1.0))
    # step 2: r0-r2 grow to 64 blocks (10 free); the 4th prefill needs 63: the last running, r2, then r1 go
    # hot (29 kept, 35 freed each) and r3 is admitted (17 free); for r4, r0 alone cannot make room (52 < 63):
    # it stays dense. Step 3: r3 grows to 64 (16 free); r3, then r0 go hot and r4 is admitted (23 free).
    # Step 4: r4 grows (22 free); r5 would need r4 too, 22 + 35 < 63: r4 stays dense, r5 waits for r0-r2
    assert full["max_concurrency"] == 5 and full["preemptions"] == 0
    assert full["hot_demotions"] == 4
    # request-steps read hot: step 2 r1, r2; step 3 r0-r3; step 4 r0-r3; step 5 r3 (r4, r5 stay dense)
    assert full["link_bytes_read"] == (2 + 4 + 4 + 1) * 4 * 12 * 512
    assert full["link_bytes_written"] == 6 * 63 * 4 * 512  # every prompt's pages, written as they fill
    assert _tiny(attention="hot", hot_when="full").label == "none hot 0.1 native when full"


def _tier_step(predicted: float) -> tuple[float, HotTier]:
    # 4 layers; a link of 100 ns and 1 ns a byte; a step of 4 us compute whose chosen pages take 1024 B a layer
    env = simpy.Environment()
    link = LinkParams(lat_ns=(100, 100), fs_per_byte=(1_000_000, 1_000_000))
    tier = HotTier(env, HotConfig(attention=TINY_HOT, link=link, capacity_bytes=1 << 30, predicted=predicted))
    env.process(tier.step(4 * 1024, 4000))
    env.run()
    return env.now, tier


def test_a_step_reads_the_unpredicted_pages_on_demand_by_hand():
    # p = 0.75: each layer prefetches 1024 B (768 chosen, 256 not) and reads 256 B on demand once it landed.
    # Layer 0's prefetch lands at 100 + 1024 = 1124; its demand read 1124 -> 1124 + 100 + 256 = 1480; then
    # layer 1's prefetch is issued (lands 2604) and layer 0 computes 1000 ns (to 2480). Each later layer
    # waits for its prefetch, then 356 ns of demand: 2604 -> 2960 -> 4084 -> 4440 -> 5564 -> 5920 + 1000
    now, tier = _tier_step(0.75)
    assert now == 6920
    c = tier.counters()
    assert c["link_bytes_read"] == 4 * (1024 + 256) == (2 - 0.75) * 4096
    assert c["link_chosen_bytes_per_step"] == 4096
    assert c["demand_stall_s"] * 1e9 == pytest.approx(4 * 356) and c["demand_stall_ms_per_step"] == pytest.approx(
        4 * 356 / 1e6)
    assert c["stall_s"] * 1e9 == pytest.approx(6920 - 4000)


def test_exact_prediction_is_the_layer_ahead_prefetch_alone():
    # p = 1: layer l + 1's 1024 B (1124 ns) are issued when layer l starts computing (1000 ns): each layer waits
    # 124 ns, the last computes from 4496 to 5496; nothing read on demand
    now, tier = _tier_step(1.0)
    assert now == 5496
    assert tier.counters()["link_bytes_read"] == 4096 and tier.demand_ns == 0


def test_exact_prediction_reproduces_the_figures_before_prediction_was_modelled():
    # simulate()'s figures for these points before hot_predicted existed (every chosen page prefetched)
    cases = [({}, 16011789.000375, 442368), ({"hot_when": "full"}, 16013415.525748125, 270336),
             ({"kv_format": "int4"}, 16009612.000374998, 345600)]
    for kw, sim_ns, read in cases:
        r = simulate(_tiny(attention="hot", page_budget=0.25, hot_predicted=1.0, **kw))
        assert (r["sim_s"] * 1e9, r["link_bytes_read"], r["demand_stall_s"]) == (pytest.approx(sim_ns, abs=1e-6),
                                                                                 read, 0.0)


def test_one_request_waits_for_its_unpredicted_pages_every_layer():
    # one client, 3 decode steps of 12 pages x 512 B a layer on leo-x16 (90 ns, 20000 fs/B): at p = 0.5 each
    # layer reads 3072 B on demand, 90 + 61 ns (3072 x 20000 fs, rounded) after its prefetch, hidden before
    one = {"attention": "hot", "page_budget": 0.25}
    exact, half = (simulate(replace(_tiny(hot_predicted=p, **one), concurrency=1)) for p in (1.0, 0.5))
    assert round((half["sim_s"] - exact["sim_s"]) * 1e9) == 3 * 4 * (90 + 61)
    assert round(half["demand_stall_s"] * 1e9) == 3 * 4 * 151
    assert half["link_bytes_read"] == 3 * 4 * (12 * 512 + 3072) and exact["link_bytes_read"] == 3 * 4 * 12 * 512
    assert half["hot_predicted"] == 0.5 and half["link_chosen_bytes_per_step"] == 4 * 12 * 512


def test_hot_points_refuse_what_they_cannot_mean():
    with pytest.raises(ValueError, match="runs in mode 'none' with recompute"):
        Point(attention="hot", mode="cxl-lru")
    with pytest.raises(ValueError, match="dense attention keeps its KV in HBM"):
        Point(kv_format="int8")
    with pytest.raises(ValueError, match="give a larger pool"):
        simulate(_tiny(attention="hot", pool_gb=1e-6))
    for bad in (0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"predicted share of the chosen pages must be in \(0, 1\]"):
            Point(attention="hot", hot_predicted=bad)


def test_quality_rows_are_matched_never_combined():
    rows = [{"mode": "hot", "page_budget": 0.1, "kv_format": "native", "context": 2048, "needle_acc": 1.0},
            {"mode": "int4", "page_budget": None, "kv_format": "int4", "context": 2048, "needle_acc": 0.9},
            {"mode": "dense", "page_budget": None, "kv_format": "native", "context": 2048, "needle_acc": 1.0}]
    assert quality_rows(rows, "hot", 0.1, "native") == {"measured": [rows[0]], "parts": []}
    assert quality_rows(rows, "hot", 0.1, "int4") == {"measured": [], "parts": [rows[0], rows[1]]}
    assert quality_rows(rows, "hot", 0.2, "native") == {"measured": [], "parts": []}
    assert quality_rows(rows, "dense", 0.1, "native")["measured"] == [rows[2]]
    assert quality_rows(None, "hot", 0.1, "native") == {"measured": [], "parts": []}


def test_sim_serve_hot_beside_none_and_unlimited_hbm(capsys):
    code, out, _ = cli(capsys, "sim", "serve", "--context", "1024", "--output-tokens", "8", "--requests", "1",
                       "--concurrency", "2", "--offload", "none", "--attention", "dense,hot", "--kv-format",
                       "native,int4", "--hbm", "fit,unlimited", "--json")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["label"] for r in rows] == ["none", "all-resident", "none hot 0.1 native", "none hot 0.1 int4"]
    for r in rows[2:]:
        assert r["max_concurrency"] == 2 and r["output_tokens_per_s"] > 0
        assert r["link_read_bytes_per_step"] > 0 and r["quality"] == {"measured": [], "parts": []}
    assert rows[3]["link_bytes_read"] < rows[2]["link_bytes_read"]
    assert rows[1]["kv_blocks"] == 1 + 2 * 1024 // 16


def test_sim_serve_hot_table_prints_quality_not_measured(capsys, tmp_path):
    q = tmp_path / "q.json"
    q.write_text(json.dumps([{"mode": "hot", "page_budget": 0.1, "kv_format": "native", "context": 2048,
                              "needle_acc": 1.0, "recall_acc": 0.98, "perplexity": 3.1}]))
    code, out, _ = cli(capsys, "sim", "serve", "--context", "1024", "--output-tokens", "8", "--requests", "1",
                       "--concurrency", "2", "--offload", "none", "--attention", "dense,hot", "--kv-format",
                       "native,int8", "--hbm", "fit,unlimited", "--quality", str(q))
    assert code == 0
    text = " ".join(out.split())
    assert "none hot 0.1 native at c = 2: 2 running at most; 1.00x none's 2" in text
    assert "% against all-resident's" in text and "GB read a decode step" in text
    # 1024 tokens: 64 complete pages, 3 resident (sink, 2 window): ceil(6.4) = 7 less 3 = 4 pages read a layer.
    # HBM: 32 layers x (metadata 2 x 32 x 64 x 128 x 2 B + 80 kept tokens x 16 KiB) + 2 layers x 112 chosen
    # tokens x 16 KiB = 79167488 B: 10 blocks of 16 x 512 KiB
    assert 32 * (2 * 32 * 64 * 128 * 2 + 80 * 16384) + 2 * 112 * 16384 == 79167488
    assert "a decoding 1024-token sequence holds 10 blocks (against 64" in text
    assert f"4 pages x 32 layers over the link: {4 * 32 * 262144 / 1e6:.0f} MB native, " \
           f"{4 * 32 * 133120 / 1e6:.0f} MB int8" in text
    assert "hot native at 2048: needle 1.0, recall 0.98, perplexity 3.1" in text
    assert "not measured for hot 0.1 int8; measured for its parts, separately: hot native at 2048" in text


@pytest.mark.parametrize(("args", "message"), [
    (["--kv-format", "int8"], "--kv-format, --hot-when and --hot-predicted apply to hot-page attention"),
    (["--hot-when", "full"], "--kv-format, --hot-when and --hot-predicted apply to hot-page attention"),
    (["--attention", "hot", "--offload", "cxl-lru"], "--offload applies to dense"),
    (["--attention", "sparse"], "unknown attention 'sparse'"),
    (["--attention", "hot", "--page-budget", "1.5"], "must be in (0, 1]"),
    (["--attention", "hot", "--hot-predicted", "1.01"], "argument --hot-predicted: must be in (0, 1], got '1.01'"),
    (["--attention", "hot", "--hot-predicted", "0"], "argument --hot-predicted: must be > 0, got '0'"),
    (["--hot-predicted", "0.5"], "--hot-predicted apply to hot-page attention: give --attention hot"),
    (["--attention", "hot", "--hbm", "unlimited,huge"], "unknown hbm 'huge'"),
])
def test_sim_serve_attention_errors_are_one_line(capsys, args, message):
    code, _, err = cli(capsys, "sim", "serve", "--context", "1024", "--concurrency", "1", *args)
    assert code == 2
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
