"""Trace generators, JSON-lines round trip, and the attention recorder (seeded random tiny Llama)."""
from __future__ import annotations

import io
import json

import pytest

from firmware_model.replay import Access
from tools.cli.main import main
from tools.trace.gen import KINDS, heavy, loop, multiturn, sliding
from tools.trace.io import load_trace, read_trace, write_trace


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_generators_are_deterministic_per_seed(kind: str) -> None:
    a, b, c = KINDS[kind](seed=1), KINDS[kind](seed=1), KINDS[kind](seed=2)
    assert a == b and len(a) > 0
    if kind != "loop":
        assert a != c


def test_sliding_window_reads_sinks_and_the_last_blocks() -> None:
    """Each step, each layer: the sink block plus the `window` newest blocks."""
    tr = sliding(seqs=1, steps=9, sinks=1, window=3, block_steps=4, layers=2, seed=0)
    step0 = sorted({a.block[2] for a in tr if a.t == 0 and a.layer == 1})
    step8 = sorted({a.block[2] for a in tr if a.t == 8 and a.layer == 1})
    n0 = len(step0)  # prompt blocks at step 0 decide the start
    assert step0[0] == 0 and step8[0] == 0
    assert step8[1:] == [b + 2 for b in step0[-3:]]  # two new blocks after 8 steps
    assert {a.layer for a in tr} == {0, 1} and n0 <= 4


def test_multiturn_sessions_share_the_system_prompt() -> None:
    tr = multiturn(sessions=3, turns=2, batch=2, system_blocks=2, layers=1, seed=0)
    sys_users = {a.seq for a in tr if a.block[1] == "sys"}
    assert sys_users == {0, 1, 2}
    assert {a.block for a in tr if a.block[1] == "sys"} == {(0, "sys", 0), (0, "sys", 1)}


def test_heavy_hitters_recur_across_steps() -> None:
    """The top-scoring old blocks are read at every step once they exist."""
    tr = heavy(seqs=1, steps=40, sinks=1, window=2, hitters=2, noise_permille=0, prompt_blocks=8,
               block_steps=100, layers=1, seed=3)
    per_step = [{a.block for a in tr if a.t == t} for t in range(40)]
    assert all(s == per_step[0] for s in per_step) and len(per_step[0]) == 5


def test_loop_is_a_fixed_cycle() -> None:
    assert [a.block for a in loop(steps=2, layers=2, blocks=2)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)] * 2


def test_jsonl_round_trip_keeps_tuple_keys() -> None:
    tr = [Access(0, (1, "sys", 2), seq=3, layer=1), Access(1, "x"), Access(2, 7, seq="s")]
    buf = io.StringIO()
    assert write_trace(tr, buf) == 3
    assert buf.getvalue().splitlines()[0] == '{"t":0,"block":[1,"sys",2],"seq":3,"layer":1}'
    assert read_trace(io.StringIO(buf.getvalue())) == tr


def test_cli_gen_writes_a_loadable_trace(tmp_path) -> None:
    out = tmp_path / "loop.jsonl"
    assert main(["trace", "gen", "loop", "--steps", "3", "--layers", "2", "--blocks", "2", "--out", str(out)]) == 0
    assert load_trace(out) == loop(steps=3, layers=2, blocks=2)
    assert main(["trace", "gen", "loop", "--steps", "0", "--out", str(out)]) == 2


SMALL = {"seqs": 2, "prompt_tokens": 16, "steps": 4, "block_tokens": 4, "layers": 2, "hidden": 32,
         "heads": 2, "kv_heads": 1, "vocab": 64}


def test_recorder_is_seeded_and_reads_attention_blocks() -> None:
    """Same seed, same trace; every step reads the block being appended; keys are (seq, layer, block)."""
    pytest.importorskip("transformers")
    from tools.trace.record import RecordSpec, record

    a = record(RecordSpec(**SMALL))
    assert a == record(RecordSpec(**SMALL))
    assert a != record(RecordSpec(**SMALL, seed=1))
    for t in range(4):
        for s in range(2):
            for layer in range(2):
                blocks = [x.block for x in a if (x.t, x.seq, x.layer) == (t, s, layer)]
                assert blocks and all(b[:2] == (s, layer) for b in blocks)
                assert blocks[-1][2] == (16 + t) // 4  # the new token's block
    sparse = record(RecordSpec(**SMALL, threshold=0.5))
    assert set(sparse) <= set(a) and len(sparse) < len(a)


def test_cli_record_then_replay(tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "attn.jsonl"
    args = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    assert main(["trace", "record", "--out", str(out), *args]) == 0
    capsys.readouterr()
    assert main(["trace", "replay", str(out), "--policy", "reuse", "--capacity", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["accesses"] == len(load_trace(out)) and doc["hits"] <= doc["opt_hits"]
    assert main(["trace", "record", "--threshold", "2", "--out", str(out)]) == 2


def test_bench_rows_score_policies_against_opt() -> None:
    """The fwmodel bench: exact ratios on a loop (LRU 0, reuse 1), rows render, hotness measured."""
    from rich.console import Console

    from tools.trace.bench import (
        FwmodelBenchResult,
        measure_hotness,
        measure_policies,
        render,
    )

    rows = measure_policies({"loop": loop(steps=8, layers=4, blocks=4)}, fractions=(0.5,), policies=("lru", "reuse"))
    by = {r["policy"]: r for r in rows}
    assert by["lru"]["capacity"] == 8 and by["lru"]["opt_hits"] == by["reuse"]["hits"] == 56
    assert (by["lru"]["opt_ratio"], by["reuse"]["opt_ratio"]) == (0.0, 1.0)
    hot = measure_hotness(batch=1 << 12, reps=1, capacity=1 << 30)
    assert [h["mode"] for h in hot] == ["epoch", "always_on"] and all(h["accesses_per_s"] > 0 for h in hot)
    console = Console(record=True, width=120)
    console.print(render(FwmodelBenchResult(policies=rows, hotness=hot)))
    text = console.export_text()
    assert "reuse" in text and "8/16" in text and "1.000" in text
