"""The serving simulator's pieces on the simulated clock, with values worked out by hand."""
from __future__ import annotations

import io
import json

import pytest

from firmware_model.link import LinkParams
from tools.sim import hardware as hw
from tools.sim.engine import EngineConfig, SimEngine, TierConfig
from tools.sim.run import Point, simulate
from tools.sim.workload import (
    REST,
    ClientScript,
    TraceError,
    Turn,
    fixed,
    from_bench,
    load_trace,
    sessions,
    write_trace,
)

MS = 1_000_000  # ns


def const_cost(ms: float = 1.0) -> hw.LinearCost:
    return hw.LinearCost(ms * MS, 0.0, 0.0, 0.0)


# --- the roofline ------------------------------------------------------------------------------
def test_llama_2_7b_shape_from_its_config():
    m = hw.MODELS["llama-2-7b"]
    # per layer: q,o 2 x 4096^2 + k,v 2 x 4096 x 4096 + MLP 3 x 4096 x 11008 + 2 norms x 4096
    assert m.layer_params == 2 * 4096**2 + 2 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096 == 202_383_360
    assert m.params == 32 * 202_383_360 + 4096 + 2 * 32000 * 4096 == 6_738_415_616
    assert m.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 == 512 * 1024
    assert hw.MODELS["llama-3-8b"].kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # GQA: 8 KV heads
    assert hw.MODELS["llama-3-70b"].kv_bytes_per_token == 2 * 80 * 8 * 128 * 2


def test_prefill_step_is_compute_bound_by_hand():
    r = hw.Roofline(hw.MODELS["llama-2-7b"], hw.ACCELERATORS["a100-80gb"], mfu=0.5, mbu=0.8, overhead_us=2000)
    b = hw.Batch()
    b.add(4096, 0, True)  # a 4096-token prompt, first token sampled
    assert (b.tokens, b.pairs, b.context, b.seqs, b.sampled) == (4096, 4096 * 4097 / 2, 4096, 1, 1)
    flops = 2 * 6_476_271_616 * 4096 + 4 * 32 * 4096 * 8_390_656 + 2 * 4096 * 32000
    assert r.flops(b) == flops == 57_452_999_475_200
    # 57.45 TFLOP at 312 TFLOP/s x 0.5 = 368.29 ms, far above the bytes' 9.6 ms; + 2 ms overhead
    assert r.step_ns(b) == pytest.approx(flops / 156e12 * 1e9 + 2 * MS, rel=1e-12)
    assert r.step_ns(b) == pytest.approx(370_288_458.17, abs=0.01)


def test_decode_step_is_memory_bound_by_hand():
    r = hw.Roofline(hw.MODELS["llama-2-7b"], hw.ACCELERATORS["a100-80gb"], mfu=0.5, mbu=0.8, overhead_us=2000)
    b = hw.Batch()
    for _ in range(32):
        b.add(1, 4000, True)
    # weights 13,476,831,232 B + KV of 32 x 4001 tokens x 512 KiB, at 2039 GB/s x 0.8
    nbytes = 13_476_831_232 + 32 * 4001 * 524_288
    assert r.bytes(b) == nbytes == 80_602_472_448
    assert r.step_ns(b) == pytest.approx(nbytes / 1631.2e9 * 1e9 + 2 * MS, rel=1e-12)
    assert r.step_ns(hw.Batch()) == 0.0


def test_kv_capacity_arithmetic():
    cap = hw.kv_capacity(hw.MODELS["llama-2-7b"], hw.ACCELERATORS["a100-80gb"], max_num_batched_tokens=8192)
    act = 8192 * (4 * 4096 + 2 * 11008) * 2 + 8192 * 32000 * 4 / 8
    kv = 80e9 * 0.9 - 13_476_831_232 - act - (1 << 30)
    assert cap["kv_bytes"] == pytest.approx(kv)
    assert cap["kv_tokens"] == pytest.approx(kv / 524_288)
    assert int(cap["kv_tokens"]) // 4096 == 26  # whole 4096-token sequences that fit


def test_padded_pairs_tile_prefills_to_the_longest():
    b = hw.Batch()
    b.add(696, 0, True)  # a document prompt
    b.add(120, 256, True)  # a session's new turn after a 256-token hit
    b.add(1, 500, True)  # a decode: not a prefill
    assert (b.prefills, b.max_query, b.max_context, b.decode_context) == (2, 696, 696, 501)
    assert b.padded_pairs == 2 * 696 * 696
    assert b.pairs == 696 * 697 / 2 + 120 * (256 + 121 / 2) + 1 * (500 + 1)


def test_fit_linear_recovers_known_coefficients():
    samples = []
    shapes = [[(1, 100)], [(512, 0)], [(1, 300)] * 8, [(128, 128), (128, 0)], [(16, 900)] * 4, [(1, 0)] * 3,
              [(696, 0), (120, 256)], [(376, 0), (120, 256), (120, 256)], [(1, 50), (300, 0)]]
    for seqs in shapes:
        b = hw.Batch()
        for new, computed in seqs:
            b.add(new, computed, True)
        samples.append(((2e-3 + 1e-6 * b.tokens + 3e-9 * b.pairs + 5e-5 * b.seqs + 1e-10 * b.padded_pairs
                         + 2e-8 * b.decode_context), b))
    c = hw.fit_linear(samples)
    assert (c.a_ns, c.b_ns_per_token, c.c_ns_per_pair, c.d_ns_per_seq, c.e_ns_per_padded_pair,
            c.f_ns_per_decode_context) == pytest.approx((2e6, 1e3, 3.0, 5e4, 0.1, 20.0), rel=1e-6)
    assert c.fit["median_abs_rel_error"] < 1e-9 and c.fit["rel_sigma"] < 1e-9


def test_fit_linear_keeps_coefficients_non_negative():
    samples = []
    for t in range(1, 9):
        b = hw.Batch()
        b.add(t, 0, True)
        samples.append((1e-3 + (1e-6 * t if t % 2 else 0.0), b))  # noisy: an unconstrained fit goes negative
    c = hw.fit_linear(samples)
    assert min(c.coefficients().values()) >= 0
    with pytest.raises(ValueError, match=">= 6 steps"):
        hw.fit_linear(samples[:2])


# --- the engine: a preemption sequence ---------------------------------------------------------
def two_clients_engine(**tier_kw) -> SimEngine:
    cfg = EngineConfig(block_tokens=4, kv_blocks=6, max_num_seqs=8, max_num_batched_tokens=64,
                       enable_prefix_caching=not tier_kw)
    tier = TierConfig(**tier_kw) if tier_kw else None
    return SimEngine(fixed(clients=2, context=10, output_tokens=3, requests=1), const_cost(), cfg, tier=tier)


def test_preemption_by_recompute_sequence():
    """Two 7-token prompts, 3 output tokens each, 4-token blocks, 5 blocks (and vLLM's null
    block), 1 ms a step:
    step 1 prefills both (2 + 2 blocks), step 2 decodes both (8 tokens: still 2 blocks each),
    step 3 needs a third block for each: request 0 takes the last one, request 1 (the last
    running) is preempted; request 0 finishes at 3 ms; step 4 resumes request 1 from its two
    cached blocks (8 prefix-hit tokens) and computes 1 token: it finishes at 4 ms."""
    eng = two_clients_engine()
    done = eng.run()
    by = {r.client: r for r in done}
    assert [r.client for r in done] == [0, 1]
    assert (by[0].first_token, by[0].finish, by[0].preemptions) == (1 * MS, 3 * MS, 0)
    assert (by[1].first_token, by[1].finish, by[1].preemptions) == (1 * MS, 4 * MS, 1)
    assert (by[1].local_hit_tokens, by[1].generated) == (8, 3)
    assert (eng.stats.steps, eng.stats.max_running, eng.stats.preemptions) == (4, 2, 1)
    assert eng.env.now == 4 * MS


def test_preemption_by_swap_pays_the_link_both_ways():
    """As above without a prefix cache: request 1's two blocks (8 KiB) go to the host when it is
    preempted at 2 ms (1 GB/s, 1 us latency: landed 9.192 us later), and the step waits for that
    write before it runs, as vLLM's offload worker flushes a preempted request's stores; so
    request 0 finishes at 3.009192 ms. Request 1's blocks come back before its step: the load
    starts then, lands 9.192 us later, and the 1-ms step ends at 4.018384 ms."""
    link = LinkParams.from_rates(read_latency_ns=1000, write_latency_ns=1000, read_bandwidth_gbps=1,
                                 write_bandwidth_gbps=1)
    eng = two_clients_engine(link=link, capacity_blocks=100, block_bytes=4096, layers=1, store="preempted")
    done = eng.run()
    by = {r.client: r for r in done}
    assert by[0].finish == 3 * MS + 9_192
    assert by[1].finish == 4 * MS + 2 * 9_192
    assert (by[1].tier_hit_tokens, by[1].local_hit_tokens, by[1].preemptions) == (8, 0, 1)
    assert eng.stats.fence_ns == 9_192
    c = eng.tier.counters()
    assert (c["blocks_stored"], c["blocks_loaded"], c["bytes_stored"]) == (2, 2, 8192)


def test_a_step_reusing_a_block_waits_for_its_store():
    """A 2-block prompt stored at 1 GB/s with 1 ms of write latency: the request finishes at
    1 ms (its write lands at 2.008192 ms); the next client's prompt takes the freed blocks at
    1 ms (no prefix cache, the tier's copy not landed), so its step waits for the write: its
    first token comes at 3.008192 ms, not 2 ms."""
    link = LinkParams.from_rates(write_latency_ns=1_000_000, read_bandwidth_gbps=1, write_bandwidth_gbps=1)
    segs0, segs1 = ((("a", 0), REST),), ((("b", 0), REST),)
    scripts = [ClientScript("a", "fixed", (Turn(segs0, 8, 1, 0.0),)),
               ClientScript("b", "fixed", (Turn(segs1, 8, 1, 0.5e-3),))]
    cfg = EngineConfig(block_tokens=4, kv_blocks=4, enable_prefix_caching=False)  # 3 blocks + the null one
    tier = TierConfig(link=link, capacity_blocks=100, block_bytes=4096, layers=1)
    eng = SimEngine(scripts, const_cost(), cfg, tier=tier)
    a, b = eng.run()
    assert a.finish == 1 * MS
    assert b.first_token == 3 * MS + 8192
    assert eng.stats.fence_ns == 1 * MS + 8192


def test_layerwise_load_overlaps_the_forward():
    """A session's second turn finds its first 8 tokens in the tier (stored at 1 ms, landed
    8.192 us later); it arrives at 2 ms and loads them layer by layer inside a 1-ms step of 2
    layers: layer 0's 4 KiB lands at 2.004096 ms (the stall), layer 1's is issued when layer 0
    starts and lands long before it is needed: the step ends at 3.004096 ms."""
    segs = ((("s", 0), REST),)
    script = ClientScript("s0", "session", (Turn(segs, 8, 1, 0.0), Turn(segs, 12, 1, 1e-3)))
    link = LinkParams.from_rates(read_bandwidth_gbps=1, write_bandwidth_gbps=1)
    cfg = EngineConfig(block_tokens=4, kv_blocks=8, enable_prefix_caching=False)
    tier = TierConfig(link=link, capacity_blocks=100, block_bytes=4096, layers=2, prefetch="layer")
    eng = SimEngine([script], const_cost(), cfg, tier=tier)
    first, second = eng.run()
    assert first.finish == 1 * MS
    assert (second.arrival, second.first_token) == (2 * MS, 3 * MS + 4096)
    assert second.tier_hit_tokens == 8
    assert eng.tier.stall_ns == 4096


def test_forward_load_waits_then_schedules():
    """The same with loads before the forward: the load (8 KiB at 1 GB/s) lands 8.192 us after
    2 ms, then the 1-ms step runs."""
    segs = ((("s", 0), REST),)
    script = ClientScript("s0", "session", (Turn(segs, 8, 1, 0.0), Turn(segs, 12, 1, 1e-3)))
    link = LinkParams.from_rates(read_bandwidth_gbps=1, write_bandwidth_gbps=1)
    cfg = EngineConfig(block_tokens=4, kv_blocks=8, enable_prefix_caching=False)
    tier = TierConfig(link=link, capacity_blocks=100, block_bytes=4096, layers=2, prefetch="forward")
    _, second = SimEngine([script], const_cost(), cfg, tier=tier).run()
    assert second.first_token == 3 * MS + 8192


def test_forward_load_starts_when_the_step_that_admitted_it_ends():
    """vLLM starts an asynchronous load after the forward of the step that admitted it.
    Step 1 (0-1 ms) runs "a"'s prompt (4 tokens) and "b"'s first turn (8); b is done at 1 ms,
    and the prompts' 3 blocks are written by 1.012288 ms (4.096 us each at 1 GB/s). a's decode
    reuses a block of b's being written, so its steps run from 1.012288 ms, 1 ms each. b's
    second turn arrives at 2.5 ms and is admitted with 8 tier tokens at 3.012288 ms; its load
    starts when that step ends (4.012288 ms: not at admission, which would put b's first token
    a step earlier), lands 8.192 us later, is seen when the step running then ends
    (5.012288 ms), and b computes its last 4 tokens in the next step."""
    link = LinkParams.from_rates(read_bandwidth_gbps=1, write_bandwidth_gbps=1)
    scripts = [ClientScript("a", "fixed", (Turn(((("a", 0), REST),), 4, 10, 0.0),)),
               ClientScript("b", "session", (Turn(((("b", 0), REST),), 8, 1, 0.0),
                                             Turn(((("b", 0), REST),), 12, 1, 1.5e-3)))]
    cfg = EngineConfig(block_tokens=4, kv_blocks=10, enable_prefix_caching=False)
    tier = TierConfig(link=link, capacity_blocks=100, block_bytes=4096, layers=2, prefetch="forward")
    eng = SimEngine(scripts, const_cost(), cfg, tier=tier)
    done = {(r.client, r.turn): r for r in eng.run()}
    second = done[(1, 1)]
    assert (second.arrival, second.first_token, second.tier_hit_tokens) == (2.5 * MS, 6 * MS + 12288, 8)
    assert done[(0, 0)].finish == 10 * MS + 12288
    assert eng.stats.fence_ns == 12288


def test_tier_evicts_by_its_policy():
    """A 2-block LRU tier: three stores, the oldest block leaves."""
    import simpy

    from tools.sim.engine import Tier

    env = simpy.Environment()
    t = Tier(env, TierConfig(link=LinkParams(), capacity_blocks=2, block_bytes=64, layers=1))
    for k in ("a", "b", "c"):
        t.store([k])
        env.run()
    assert ("a" in t, "b" in t, "c" in t) == (False, True, True)
    assert (t.evictions, t.blocks_stored) == (1, 3)


def test_chunked_prefill_and_budget():
    """A 20-token prompt under a 8-token budget takes three steps (8, 8, 4): TTFT 3 ms."""
    cfg = EngineConfig(block_tokens=4, kv_blocks=16, max_num_batched_tokens=8)
    (r,) = SimEngine(fixed(clients=1, context=21, output_tokens=1, requests=1), const_cost(), cfg).run()
    assert (r.first_token, r.finish) == (3 * MS, 3 * MS)


def test_prefix_cache_shares_a_system_prompt():
    """Two sessions with one 8-token system prompt: the second one's prefill finds it."""
    scripts = sessions(sessions=2, concurrency=2, turns=1, system_tokens=8, system_prompts=1, user_tokens=4,
                       output_tokens=1, think_s=0.0)
    cfg = EngineConfig(block_tokens=4, kv_blocks=16, max_num_batched_tokens=12)
    done = SimEngine(scripts, const_cost(), cfg).run()
    assert sorted(r.local_hit_tokens for r in done) == [0, 8]


def test_request_larger_than_kv_space_is_refused():
    with pytest.raises(ValueError, match=r"needs 3 KV blocks; the KV space holds 2 \(and vLLM's null block\)"):
        SimEngine(fixed(clients=1, context=12, output_tokens=1), const_cost(), EngineConfig(block_tokens=4, kv_blocks=3))
    with pytest.raises(ValueError, match="kv_blocks must be >= 2"):
        EngineConfig(kv_blocks=1)


# --- workloads ---------------------------------------------------------------------------------
def test_trace_round_trip_and_errors():
    scripts = sessions(sessions=5, concurrency=2, turns=3, seed=3)
    f = io.StringIO()
    assert write_trace(scripts, f) == 15
    f.seek(0)
    assert load_trace(f) == scripts
    bad = io.StringIO('{"client": "a", "turn": 1, "prompt_tokens": 4, "output_tokens": 1, "segments": [["x", 9]]}\n')
    with pytest.raises(TraceError, match="line 1: client a's turn 1 follows turn -1"):
        load_trace(bad)
    with pytest.raises(TraceError, match="line 2: not JSON"):
        load_trace(io.StringIO(json.dumps({"client": "a", "turn": 0, "prompt_tokens": 4, "output_tokens": 1,
                                           "segments": [["x", 9]]}) + "\n{oops\n"))
    with pytest.raises(TraceError, match="needs client"):
        load_trace(io.StringIO('{"turn": 0}\n'))


def test_from_bench_matches_the_bench_clients():
    from tools.sim.workload import WorkloadConfig, clients

    wc = WorkloadConfig()
    scripts = from_bench(wc, 4, think_s=2.0)
    real = clients(wc, 4)
    assert [s.kind for s in scripts] == [c.kind for c in real] == ["session", "session", "session", "doc"]
    outputs = [[0] * wc.output_tokens] * wc.turns
    for s, c in zip(scripts, real, strict=True):
        assert [t.prompt_tokens for t in s.turns] == [len(c.prompt(k, outputs)) for k in range(c.turns)]
        assert [t.think_s for t in s.turns] == [c.arrival_after(k, 2.0) for k in range(c.turns)]


def test_point_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown mode 'x'"):
        Point(mode="x")
    with pytest.raises(ValueError, match="unknown accelerator 'tpu'"):
        Point(accelerator="tpu")
    with pytest.raises(ValueError, match="unknown model"):
        Point(model="gpt")


def test_simulate_a_small_point_end_to_end():
    p = Point(mode="cxl-smart", concurrency=4, accelerator="h100",
              workload={"kind": "sessions", "sessions": 8, "turns": 3, "system_tokens": 256, "system_prompts": 1,
                        "user_tokens": 64, "output_tokens": 16, "think_s": 0.5})
    r = simulate(p)
    assert r["requests"] == 24 and r["output_tokens"] == 24 * 16
    assert r["prefix_hit_tokens"] > 0 and r["output_tokens_per_s"] > 0
    assert r["max_concurrency"] <= 4


def test_fixed_clients_are_staggered_over_a_request_lifetime():
    from tools.sim.run import build_scripts, request_lifetime_s

    # a 7-token prompt in 4-token chunks (2 steps) and 3 decode steps, 1 ms each
    assert request_lifetime_s(const_cost(), context=10, output_tokens=3, concurrency=4,
                              max_num_batched_tokens=4) == pytest.approx(5e-3)
    scripts = fixed(clients=4, context=10, output_tokens=3, requests=2, stagger_s=1.0)
    assert [s.turns[0].think_s for s in scripts] == [0.0, 0.25, 0.5, 0.75]
    assert {s.turns[1].think_s for s in scripts} == {0.0}
    p = Point(concurrency=4, step_cost={"a_ns": 1e6, "b_ns_per_token": 0, "c_ns_per_pair": 0, "d_ns_per_seq": 0},
              max_num_batched_tokens=4, workload={"kind": "fixed", "context": 10, "output_tokens": 3, "requests": 1})
    assert [s.turns[0].think_s for s in build_scripts(p.workload, 4, p)] == pytest.approx([0, 1.25e-3, 2.5e-3, 3.75e-3])
    with pytest.raises(ValueError, match="stagger_s must be >= 0"):
        fixed(clients=1, context=10, output_tokens=3, stagger_s=-1)


def test_jitter_scatters_steps_around_the_cost_and_repeats_by_seed():
    def run(jitter, seed):
        cfg = EngineConfig(block_tokens=4, kv_blocks=64, jitter=jitter, seed=seed)
        eng = SimEngine(fixed(clients=4, context=40, output_tokens=30, requests=5), const_cost(), cfg)
        eng.run()
        return eng.stats.busy_ns / eng.stats.steps

    assert run(0.0, 0) == 1 * MS
    a, b = run(0.1, 1), run(0.1, 2)
    assert a == run(0.1, 1) and a != b  # the same seed repeats, another one differs
    assert a == pytest.approx(1 * MS, rel=0.05) and b == pytest.approx(1 * MS, rel=0.05)  # mean-one noise
    with pytest.raises(ValueError, match="jitter must be in"):
        EngineConfig(jitter=1.5)


def test_hotness_tier_is_fed_by_its_chmu():
    """policy "hotness": the tier's CHMU counts loads and stores per block slot; at the 100-ms
    epoch's end its hotlist adds those counts to the policy's heat, so a block loaded three times
    is hotter than one only stored."""
    import simpy

    from tools.sim.engine import Tier

    env = simpy.Environment()
    t = Tier(env, TierConfig(link=LinkParams(), capacity_blocks=4, block_bytes=4096, layers=1, policy="hotness"))
    for k in ("a", "b"):
        t.store([k])
    env.run()
    for _ in range(3):
        t.load(["a"])
        env.run()
    assert t.chmu is not None and t.chmu.fed == 0  # the epoch has not ended
    env.run(until=150_000_000)
    t.load(["b"])  # the first access after the epoch's end publishes its hotlist
    env.run()
    assert t.chmu.fed == 2
    assert t.policy.heat("a") > t.policy.heat("b") > 0
