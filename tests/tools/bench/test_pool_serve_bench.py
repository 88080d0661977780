"""`cxlemu bench pool`'s pure parts: the workload cut from the Mooncake trace, the prompts, the
per-mode figures and goals. The engines themselves run in tests/driver/vllm/test_vllm_pool.py."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from cli_support import cli

from tools.bench.pool_serve import TAIL_TOKENS, PoolBenchConfig, Request, analyse, prompt_ids, trace_workload

LINES = [{"hash_ids": ids} for ids in ([0, 1, 2], [0, 3], [0, 1, 2, 4], [0, 3, 5], [0, 6], [0, 1, 7])]


def test_the_workload_keeps_reusers_with_the_request_they_reuse() -> None:
    """Line 2 reuses 3 blocks of line 0; line 3 two of line 1; line 4 only the common first
    block (not a reuser); line 5 two blocks last held by line 2."""
    cfg = PoolBenchConfig(requests=4)
    assert trace_workload(LINES, cfg) == [Request(0, (0, 1, 2), None, 0), Request(1, (0, 3), None, 0),
                                          Request(2, (0, 1, 2, 4), 0, 3), Request(3, (0, 3, 5), 1, 2)]
    six = trace_workload(LINES, replace(cfg, requests=6))
    assert [r.index for r in six] == [0, 1, 2, 3, 5] and six[-1] == Request(5, (0, 1, 7), 2, 2)
    cut = trace_workload(LINES, replace(cfg, requests=6, max_blocks=2))  # line 2 is (0, 1): 2 blocks reused
    assert cut[2] == Request(2, (0, 1), 0, 2) and [r.index for r in cut] == [0, 1, 2, 3, 5]


def test_requests_sharing_trace_blocks_share_tokens() -> None:
    a, b, c = (prompt_ids(Request(i, ids, None, 0), 128, 2048) for i, ids in
               ((0, (0, 1, 2)), (2, (0, 1, 2, 4)), (1, (0, 3))))
    assert len(a) == 3 * 128 + TAIL_TOKENS and len(b) == 4 * 128 + TAIL_TOKENS
    assert a[:384] == b[:384] and a[384:] != b[384:512]  # the tail is each prompt's own
    assert a[:128] == c[:128] and a[128:256] != c[128:256]
    assert all(4 <= t < 2048 for t in a + b + c)


def _report(cached: dict[str, list[int]], ttft: dict[str, list[float]], tokens: dict[str, list[list[int]]]) -> dict:
    workload = [{"hash_ids": [0, 1], "parent": None}, {"hash_ids": [0, 2], "parent": None},
                {"hash_ids": [0, 2, 3], "parent": 1}, {"hash_ids": [0, 1, 4], "parent": 0},
                {"hash_ids": [0, 2, 3, 5], "parent": 2}]  # 2 engines, round-robin: requests 2 and 3 cross
    modes = {m: {"results": [{"cached": c, "ttft_s": t, "tokens": k} for c, t, k in zip(cached[m], ttft[m], tokens[m])],
                 "tier": [{"pool_hits": 2 if m == "shared" else 0}, {"pool_hits": 3 if m == "shared" else 0}]}
             for m in cached}
    return {"config": {"engines": 2, "tokens_per_hash": 10}, "workload": workload, "modes": modes}


def test_the_figures_and_goals_per_mode() -> None:
    same = [[1], [2], [3], [4], [5]]
    report = _report(cached={"alone": [0, 0, 0, 0, 0], "private": [0, 0, 10, 5, 30], "shared": [0, 10, 30, 15, 30]},
                     ttft={"alone": [0.3, 0.3, 0.4, 0.5, 0.5], "private": [0.3, 0.3, 0.4, 0.4, 0.1],
                           "shared": [0.3, 0.2, 0.1, 0.1, 0.1]},
                     tokens={"alone": same, "private": same, "shared": [[1], [2], [3], [4], [9]]})
    out = analyse(report)
    assert (out["requests"], out["cross_requests"]) == (5, 2)
    private, shared = out["modes"]["private"], out["modes"]["shared"]
    assert private["hit_rate"] == 45 / 140 and shared["hit_rate"] == 85 / 140
    assert private["cross_hit_rate"] == 0.25 and shared["cross_hit_rate"] == 0.75
    assert shared["cross_ttft_p50_ms"] == 100.0 and out["modes"]["alone"]["cross_ttft_p50_ms"] == 450.0
    assert shared["ttft_p50_ms"] == 100.0 and shared["pool_hits"] == 5
    assert [m["tokens_equal"] for m in out["modes"].values()] == [True, True, False]
    g = out["goals"]
    assert g["cross_hit_rate_ratio"] == 3.0 and g["cross_hit_rate_goal_met"]
    assert g["cross_ttft_over_recompute"] == 100 / 450 and g["cross_ttft_goal_met"] and not g["tokens_equal"]


def test_bad_arguments_are_one_line_each(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for argv, message in ((["--engines", "4"], "--engines must be 2 or 3 (each a vLLM-CPU engine on this host's "
                                                "cores), got 4"),
                          (["--engines", "1"], "--engines must be >= 2, got 1"),
                          (["--max-blocks", "1"], "--max-blocks must be >= 2, got 1"),
                          (["--trace", str(tmp_path / "none.jsonl")],
                           f"--trace: no Mooncake trace at {tmp_path / 'none.jsonl'}")):
        rc, out, err = cli(capsys, "bench", "pool", *argv)
        assert (rc, out, err) == (2, "", f"cxlemu: error: {message}\n")


def test_the_prefill_cost_per_token_is_the_median_over_what_was_computed() -> None:
    from tools.bench.pool_serve import compute_s_per_token

    results = [{"ttft_s": 0.25, "cached": 0}, {"ttft_s": 0.5, "cached": 128}, {"ttft_s": 1.0, "cached": 0}]
    assert compute_s_per_token(results, [[1] * 250, [1] * 378, [1] * 250]) == 0.002  # 0.001, 0.002, 0.004
