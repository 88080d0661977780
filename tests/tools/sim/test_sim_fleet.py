"""Exact small fleets: routing, hits and timings worked out by hand.

The step cost is 1 ms + 1 us a token (``LinearCost``), so a prefill of n tokens alone takes
1 + n/1000 ms and a decode step of s sequences 1 + s/1000 ms; a KV token is 1000 bytes.
"""
from __future__ import annotations

import pytest

from tools.sim.fleet import Fleet, FleetConfig
from tools.sim.hardware import LinearCost
from tools.sim.mooncake import TraceRequest

COST = LinearCost(1e6, 1e3, 0.0, 0.0)
MS = 1e6


def _req(i: int, t_ms: float, prompt: int, out: int, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(i, t_ms * MS, prompt, out, ids)


# six requests: r2 extends r0's prefix; r3 and r4 extend r1's first block
TRACE = [_req(0, 0, 1024, 2, (1, 2)), _req(1, 0, 600, 2, (3, 4)), _req(2, 100, 1100, 3, (1, 2, 5)),
         _req(3, 100, 1024, 2, (3, 6)), _req(4, 200, 1400, 2, (3, 6, 8)), _req(5, 200, 100, 1, (9,))]
PROMPT = 1024 + 600 + 1100 + 1024 + 1400 + 100


def _run(trace: list[TraceRequest], **kw: object) -> tuple[Fleet, dict]:
    cfg = FleetConfig(**{"instances": 2, "kv_blocks": 1001, "kv_bytes_per_token": 1000, **kw})  # type: ignore[arg-type]
    fleet = Fleet(trace, cfg, COST)
    return fleet, fleet.run()


def _by_request(fleet: Fleet) -> dict[int, tuple[int, float, float | None]]:
    """request -> (instance, TTFT ms, TPOT ms)"""
    out = {}
    for inst in fleet.instances:
        for r in inst.records:
            tpot = (r.finish - r.first_token) / MS / (r.generated - 1) if r.generated > 1 else None
            out[r.tr.index] = (inst.index, (r.first_token - r.arrival) / MS, tpot)
    return out


def test_round_robin_without_a_home() -> None:
    fleet, m = _run(TRACE, router="rr")
    got = _by_request(fleet)
    # r2 finds r0's blocks 1, 2 on instance 0 (1024 tokens, computes 76); r3 finds block 3 on
    # instance 1 (512); r4 lands on instance 0, which has none of its blocks
    want = {0: (0, 2.024, 1.001), 1: (1, 1.6, 1.001), 2: (0, 1.076, 1.001), 3: (1, 1.512, 1.001),
            4: (0, 2.4, 1.001), 5: (1, 1.1, None)}
    for i, (inst, ttft, tpot) in want.items():
        assert got[i][0] == inst
        assert got[i][1] == pytest.approx(ttft, abs=1e-9)
        assert got[i][2] == (None if tpot is None else pytest.approx(tpot, abs=1e-9))
    f = m["fleet"]
    assert f["hit_rate"] == pytest.approx((1024 + 512) / PROMPT) and f["hit_rate_home"] == 0
    assert f["requests"] == 6 and f["output_tokens"] == 12 and f["rejected"] == 0


def test_the_prefix_router_sends_r4_where_its_prefix_is() -> None:
    fleet, m = _run(TRACE, router="prefix")
    got = _by_request(fleet)
    # r1: instance 0 has r0's 1023 tokens queued (600 + 1023 > 600); r4: instance 1 holds blocks
    # 3 and 6 (score 1400 - 1024); r5: instance 1 has r4's 375 tokens queued (100 + 375 > 100)
    assert {i: g[0] for i, g in got.items()} == {0: 0, 1: 1, 2: 0, 3: 1, 4: 1, 5: 0}
    assert got[4][1] == pytest.approx(1.376, abs=1e-9)
    assert m["fleet"]["hit_rate"] == pytest.approx((1024 + 512 + 1024) / PROMPT)


def test_a_shared_cxl_pool_serves_another_instances_blocks() -> None:
    fleet, m = _run(TRACE, router="rr", kv="cxl-pool", cache_tokens=10_000)
    got = _by_request(fleet)
    # r4 on instance 0 finds blocks 3 (r1's) and 6 (r3's) in the pool: 1,024,000 bytes over the
    # beluga-switch link (64 GB/s: 16,000 ns, + 90 ns), loaded before its 376-token prefill
    assert got[4][1] == pytest.approx(0.016090 + 1.376, abs=1e-9)
    f = m["fleet"]
    assert f["hit_rate_home"] == pytest.approx(1024 / PROMPT)
    assert f["hit_rate"] == pytest.approx((1024 + 512 + 1024) / PROMPT)
    assert f["bytes_read"] == 1024 * 1000
    # every prompt block once: r0 1024, r1 600, r2 76 (block 5), r3 512 (6), r4 376 (8), r5 100
    assert f["bytes_written"] == (1024 + 600 + 76 + 512 + 376 + 100) * 1000


def test_per_host_dram_does_not_cross_hosts() -> None:
    _, m = _run(TRACE, router="rr", kv="host", cache_tokens=10_000)
    assert m["fleet"]["hit_rate_home"] == 0  # r4's blocks are in instance 1's DRAM, r4 on instance 0
    assert m["fleet"]["bytes_read"] == 0


def test_an_arrival_cuts_a_decode_window_at_the_next_step() -> None:
    trace = [_req(0, 0, 1024, 10, (1, 2)), _req(1, 5, 600, 2, (3, 4))]
    fleet, _ = _run(trace, instances=1)
    got = _by_request(fleet)
    # r0: prefill to 2.024, decodes of 1.001; r1 arrives at 5: the window ends at 5.027, a mixed
    # step of 601 tokens (1.601) gives r1's first token at 6.628, one step of two decodes (1.002)
    # ends r1 at 7.630, r0's last 4 decodes end at 11.634
    assert got[1][1] == pytest.approx(1.628, abs=1e-9)
    assert got[1][2] == pytest.approx(1.002, abs=1e-9)
    assert got[0][2] == pytest.approx((11.634 - 2.024) / 9, abs=1e-9)
    assert fleet.instances[0].steps == 10


def test_memory_aware_admission_rejects_by_predicted_ttft() -> None:
    fleet, m = _run(TRACE, router="rr", admission="memory-aware", slo_ttft_ms=2.1)
    # r4's prefill of 1400 uncached tokens alone is predicted at 2.4 ms > 2.1: rejected at arrival
    assert [r.tr.index for r in fleet.rejected] == [4]
    f = m["fleet"]
    assert (f["requests"], f["rejected"], f["good_requests"]) == (5, 1, 5)
    assert f["goodput"] == pytest.approx(5 / 0.2011)  # the span ends with r5's token at 201.1 ms


def test_bad_configs_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="unknown router 'nearest': choose from rr, least-loaded, prefix"):
        FleetConfig(instances=2, kv_blocks=100, kv_bytes_per_token=1, router="nearest")
    with pytest.raises(ValueError, match="a request of 1402 tokens needs 88 KV blocks; an instance holds 63"):
        Fleet(TRACE, FleetConfig(instances=1, kv_blocks=64, kv_bytes_per_token=1), COST)


def test_the_cli_names_a_malformed_trace_line(capsys, tmp_path) -> None:
    from cli_support import cli

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 20, "output_length": 2, "hash_ids": [1]}\n'
                     '{"timestamp": 5, "input_length": 20, "output_length": 2, "hash_ids": []}\n')
    code, out, err = cli(capsys, "sim", "fleet", "--trace", str(trace), "--model", "llama-3-8b", "--tp", "1",
                         "--instances", "2")
    assert code == 2 and out == ""
    assert err == (f"cxlemu: error: trace {trace}: line 2: 20 prompt tokens are 1 blocks of 512, but hash_ids "
                   "has 0\n")


def test_the_cli_json_has_the_fleet_and_its_instances(capsys, tmp_path) -> None:
    import json

    from cli_support import cli

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 600, "output_length": 3,
                                         "hash_ids": [1, 2 + i]}) + "\n" for i in range(4)))
    code, out, _ = cli(capsys, "sim", "fleet", "--trace", str(trace), "--model", "llama-3-8b", "--tp", "1",
                       "--instances", "2", "--router", "rr", "--kv", "cxl-pool", "--cache-tokens", "1K", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["home"]["capacity_tokens"] == 1536  # 2 x 1000 tokens: three 512-token blocks
    for key in ("requests", "hit_rate", "ttft_p50_ms", "ttft_p99_ms", "tpot_ms", "throughput_tok_s", "goodput",
                "kv_capacity_tokens", "wall_s", "hit_rate_hbm", "hit_rate_home", "bytes_read",
                "usd_per_m_output_tokens"):
        assert key in doc["fleet"]
    assert [m["requests"] for m in doc["instances"]] == [2, 2]
    # block 1 (512 tokens) hits for r1..r3 (a second apart: r0 is long done): r1 on instance 1 from
    # the pool, r2 and r3 from their instance's HBM
    f = doc["fleet"]
    assert (f["hit_rate"], f["hit_rate_home"]) == (pytest.approx(3 * 512 / 2400), pytest.approx(512 / 2400))


def test_the_rdma_store_pays_its_latency_and_nic_bandwidth() -> None:
    fleet, m = _run(TRACE, router="rr", kv="rdma", cache_tokens=10_000)
    # r4's 1,024,000 bytes: 25 us + 11,770 ns at 87 GB/s (11,494 fs a byte, rounded half up)
    assert _by_request(fleet)[4][1] == pytest.approx(0.036770 + 1.376, abs=1e-9)
    assert m["fleet"]["hit_rate_home"] == pytest.approx(1024 / PROMPT)


def test_least_loaded_breaks_a_tie_by_queued_prefill() -> None:
    trace = [_req(0, 0, 1024, 2, (1, 2)), _req(1, 0, 600, 2, (3, 4)), _req(2, 0, 100, 2, (9,))]
    got = {i: g[0] for i, g in _by_request(_run(trace, router="least-loaded")[0]).items()}
    # r2: one request on each; instance 0 has 1023 prefill tokens queued, instance 1 599
    assert got == {0: 0, 1: 1, 2: 1}
    assert {i: g[0] for i, g in _by_request(_run(trace, router="rr")[0]).items()} == {0: 0, 1: 1, 2: 0}


def test_decode_windows_equal_step_by_step_on_a_random_trace() -> None:
    import random

    from tools.sim.hardware import MODELS, Roofline
    from tools.sim.profile import step_cost

    rng = random.Random(7)
    trace, t = [], 0.0
    for i in range(60):  # conversations of up to 3 turns sharing prefixes, arriving at random
        t += rng.expovariate(1 / 150)
        base = rng.randrange(8) * 100
        n = rng.randint(1, 4)
        trace.append(_req(i, t, n * 512 - rng.randrange(300), rng.randint(2, 60), tuple(base + j for j in range(n))))
    cost = step_cost("roofline", "llama-3-8b", MODELS["llama-3-8b"], "h100")
    assert isinstance(cost, Roofline)
    runs = []
    for windows in (True, False):
        cfg = FleetConfig(instances=2, kv_blocks=4000, kv_bytes_per_token=1000, router="prefix", kv="cxl-pool",
                          cache_tokens=2048, decode_windows=windows)
        fleet = Fleet(trace, cfg, cost)
        m = fleet.run()
        runs.append((fleet, m))
    (fw, mw), (fs, ms) = runs
    assert mw["fleet"]["steps"] == ms["fleet"]["steps"] and mw["fleet"]["hit_rate"] == ms["fleet"]["hit_rate"]
    a, b = _by_request(fw), _by_request(fs)
    assert a.keys() == b.keys() == set(range(60))
    for i in a:
        assert a[i][0] == b[i][0] and a[i][1] == pytest.approx(b[i][1], rel=1e-9)
        assert a[i][2] == (None if b[i][2] is None else pytest.approx(b[i][2], rel=1e-9))
    assert fw.instances[0].steps > 0 and sum(i.version for i in fw.instances) < sum(i.version for i in fs.instances)
