"""`cxlemu sim serve`, `cxlemu sim validate`, `cxlemu trace gen sessions`, `cxlemu bench sim`: as a user runs them."""
from __future__ import annotations

import json

import pytest
from cli_support import cli


def test_sim_serve_json_one_object_per_mode_and_level(capsys):
    code, out, _ = cli(capsys, "sim", "serve", "--model", "llama-3-8b", "--accelerator", "a100-80gb", "--context", "1024",
                       "--output-tokens", "16", "--requests", "2", "--concurrency", "1,4", "--offload",
                       "none,cxl-smart", "--json")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["mode"], r["concurrency"]) for r in rows] == [("none", 1), ("cxl-smart", 1), ("none", 4),
                                                             ("cxl-smart", 4)]
    for r in rows:
        for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_ms", "output_tokens_per_s", "preemptions",
                    "tier_hit_tokens", "max_concurrency"):
            assert key in r
        assert r["output_tokens"] == r["concurrency"] * 2 * 16


def test_sim_serve_table_shows_the_arithmetic(capsys, tmp_path):
    png = tmp_path / "s.png"
    code, out, _ = cli(capsys, "sim", "serve", "--context", "2048", "--output-tokens", "16", "--requests", "1",
                       "--concurrency", "1..2", "--plot", str(png))
    assert code == 0
    assert "6.74 B parameters, 13.5 GB of weights; KV 512 KiB/token" in out
    assert "whole sequences at once" in out and "max concurrency" in out
    assert png.stat().st_size > 10_000


def test_sim_serve_splits_llama3_70b_over_four_h100s(capsys):
    code, out, _ = cli(capsys, "sim", "serve", "--model", "llama-3-70b", "--tp", "4", "--context", "1024",
                       "--output-tokens", "8", "--requests", "1", "--concurrency", "2", "--offload", "none")
    assert code == 0
    assert "4 x h100, each: 80 GB x 0.90 = 72.0 GB - weights (1/4) 35.3 - activations 0.9 - reserve 1.1 = KV " \
           "34.7 GB = 424,149 tokens (80 KiB of each token's KV on each" in " ".join(out.split())
    assert "sim serve: llama-3-70b on 4 x h100" in out


def test_sim_serve_on_a_session_trace(capsys, tmp_path):
    trace = tmp_path / "t.jsonl"
    assert cli(capsys, "trace", "gen", "sessions", "--sessions", "6", "--concurrency", "3", "--turns", "2",
               "--system-tokens", "128", "--user-tokens", "32", "--output-tokens", "8", "--out", str(trace))[0] == 0
    assert len(trace.read_text().splitlines()) == 12
    code, out, _ = cli(capsys, "sim", "serve", "--workload", "trace", "--trace", str(trace), "--offload", "cxl-lru",
                       "--json")
    assert code == 0
    (row,) = [json.loads(line) for line in out.splitlines()]  # one run: the trace's own 3 clients
    assert (row["concurrency"], row["requests"]) == (3, 12) and row["prefix_hit_tokens"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt-5"], "unknown model 'gpt-5'"),
    (["--accelerator", "tpu"], "unknown accelerator 'tpu'"),
    (["--offload", "none,swapless"], "unknown mode 'swapless'"),
    (["--concurrency", "0"], "concurrency"),
    (["--context", "-4"], "must be > 0"),
    (["--mfu", "1.5"], "must be in (0, 1]"),
    (["--context", "100", "--output-tokens", "100"], "--output-tokens (100) must be < --context (100)"),
    (["--workload", "trace"], "--workload trace needs --trace FILE"),
    (["--workload", "trace", "--trace", "/nonexistent/t.jsonl"], "cannot read trace /nonexistent/t.jsonl"),
    (["--model", "llama-3-70b", "--tp", "3"], "--tp: model llama-3-70b does not split over 3 accelerators"),
    (["--tp", "0"], "must be > 0"),
    (["--model", "llama-3-70b", "--concurrency", "1"], "llama-3-70b leaves no KV space on h100 (0.0 GB): split it"),
])
def test_sim_serve_bad_arguments_are_one_line_exit_2(capsys, argv, message):
    code, out, err = cli(capsys, "sim", "serve", *argv)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and out == ""


def test_trace_gen_sessions_bad_arguments(capsys, tmp_path):
    code, _, err = cli(capsys, "trace", "gen", "sessions", "--turns", "0")
    assert code == 2 and "turns must be >= 1" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"client": "a", "turn": 0}\n')
    code, _, err = cli(capsys, "sim", "serve", "--workload", "trace", "--trace", str(bad))
    assert code == 2 and "line 1: needs client" in err


def test_sim_validate_refuses_what_is_not_a_bench_report(capsys, tmp_path):
    f = tmp_path / "r.json"
    f.write_text("[1, 2]")
    code, _, err = cli(capsys, "sim", "validate", str(f))
    assert code == 2 and "is not a `cxlemu bench serve --save` report" in err
    f.write_text("{nope")
    assert cli(capsys, "sim", "validate", str(f))[0] == 2
    f.write_text(json.dumps({"config": {}, "modes": {"none": {"levels": {}}}, "summary": {}}))
    code, _, err = cli(capsys, "sim", "validate", str(f))
    assert code == 2 and "holds no recorded steps" in err


def test_bench_sim_small_sizes(capsys):
    code, out, _ = cli(capsys, "bench", "sim", "--sessions", "20,60", "--concurrency", "8", "--json")
    assert code == 0
    doc = json.loads(out)
    assert [r["sessions"] for r in doc["rows"]] == [20, 60]
    assert [r["requests"] for r in doc["rows"]] == [80, 240]
    assert doc["checks"] == []  # no 10,000-session size asked for
    assert cli(capsys, "bench", "sim", "--sessions", "x")[0] == 2


def test_sim_validate_refuses_runs_of_different_experiments(capsys, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"config": {"c0": 4}, "modes": {}, "summary": {}}))
    b.write_text(json.dumps({"config": {"c0": 2}, "modes": {}, "summary": {}}))
    code, _, err = cli(capsys, "sim", "validate", str(a), str(b))
    assert code == 2 and "report 2 is another experiment than report 1: its c0 differ" in err
    assert cli(capsys, "sim", "validate", str(a), "--runs", "0")[0] == 2
