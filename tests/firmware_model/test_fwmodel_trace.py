"""Trace generators, JSON-lines and binary round trips, and the attention recorder (seeded random tiny Llama)."""
from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from firmware_model.replay import Access
from tools.cli.main import main
from tools.trace.gen import KINDS, heavy, loop, multiturn, scanmix, sliding, zipf
from tools.trace.io import (
    TraceFormatError,
    is_binary,
    load_columns,
    load_trace,
    read_trace,
    save_binary,
    write_trace,
)


@pytest.mark.slow
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


def test_binary_round_trip_keeps_every_key_kind(tmp_path) -> None:
    """Integer keys as they are, tuple and string keys as ids with a JSON key table."""
    tr = [Access(0, (1, "sys", 2), seq=3, layer=1), Access(1, "x"), Access(2, (1, "sys", 2), seq="s"),
          Access(3, 7, seq=3, layer=2)]
    path = tmp_path / "t.npz"
    assert save_binary(tr, path) == 4 and is_binary(path)
    assert load_trace(path) == tr
    cols = load_columns(path)
    assert cols.block.tolist() == [0, 1, 0, 2] and cols.block_keys == [(1, "sys", 2), "x", 7]
    assert cols.seq.tolist() == [0, 1, 2, 0] and cols.seq_keys == [3, 0, "s"]
    ints = [Access(t, 10 * t % 7, seq=1) for t in range(5)]
    save_binary(ints, path)
    cols = load_columns(path)
    assert cols.block.tolist() == [0, 3, 6, 2, 5] and cols.block_keys is None and load_trace(path) == ints


def test_jsonl_columns_equal_the_records(tmp_path) -> None:
    """JSON lines read straight into columns give the records' columns; a bad line is still named."""
    path = tmp_path / "t.jsonl"
    path.write_text('# a comment\n{"t":0,"block":[1,"sys",2],"seq":3,"layer":1}\n\n{"t":1,"block":"x"}\n'
                    '{"t":2,"block":[1,"sys",2],"seq":"s"}\n{"t":3,"block":7,"seq":3,"layer":2}\n')
    cols = load_columns(path)
    assert cols.accesses() == load_trace(path) and cols.block.tolist() == [0, 1, 0, 2]
    assert cols.block_keys == [(1, "sys", 2), "x", 7] and cols.seq_keys == [3, 0, "s"]
    path.write_text('{"t":0,"block":1}\n{"t":true,"block":2}\n')
    with pytest.raises(TraceFormatError, match=r"t.jsonl:2: \"t\" must be an integer step"):
        load_columns(path)


def test_binary_trace_errors_name_the_fault(tmp_path) -> None:
    """A .npy of block ids is a trace; a missing column or a non-integer one is refused by name."""
    npy = tmp_path / "b.npy"
    np.save(npy, np.array([4, 2, 4]))
    assert [a.block for a in load_trace(npy)] == [4, 2, 4] and load_columns(npy).t.tolist() == [0, 1, 2]
    np.save(npy, np.zeros((2, 2)))
    with pytest.raises(TraceFormatError, match="one integer array of block keys"):
        load_columns(npy)
    bad = tmp_path / "bad.npz"
    np.savez(bad, t=np.arange(3), block=np.arange(3), seq=np.zeros(3, dtype=int))
    with pytest.raises(TraceFormatError, match="missing layer"):
        load_columns(bad)
    np.savez(bad, t=np.arange(3), block=np.ones(3), seq=np.zeros(3, dtype=int), layer=np.zeros(3, dtype=int))
    with pytest.raises(TraceFormatError, match="column 'block' must be 3 integers"):
        load_columns(bad)
    np.savez(bad, t=np.arange(2), block=np.array([0, 5]), seq=np.zeros(2, dtype=int),
             layer=np.zeros(2, dtype=int), block_keys=np.array(['"a"']))
    with pytest.raises(TraceFormatError, match="outside its block_keys table of 1"):
        load_columns(bad)


def test_cli_gen_binary_then_replay_equals_jsonl(tmp_path, capsys) -> None:
    """`trace gen ... --out X.npz` writes the binary format; replaying it or the JSON lines gives one answer."""
    npz, jsonl = tmp_path / "z.npz", tmp_path / "z.jsonl"
    for out in (npz, jsonl):
        assert main(["trace", "gen", "zipf", "--accesses", "3000", "--blocks", "400", "--out", str(out)]) == 0
    assert is_binary(npz) and not is_binary(jsonl) and load_trace(npz) == load_trace(jsonl)
    capsys.readouterr()
    docs = []
    for path in (npz, jsonl):
        for policy in ("arc", "lfu"):
            assert main(["trace", "replay", str(path), "--policy", policy, "--capacity", "50", "--json"]) == 0
            doc = json.loads(capsys.readouterr().out)
            docs.append({k: doc[k] for k in ("policy", "hits", "opt_hits", "evictions", "unique_blocks")})
    assert docs[:2] == docs[2:] and docs[0]["hits"] <= docs[0]["opt_hits"]


# Keys of every kind a JSON line holds: integers past 64 bits (orjson would round them to floats),
# strings, lists of them; sequence ids likewise.
_SCALAR_KEYS = st.one_of(st.integers(min_value=-(2 ** 70), max_value=2 ** 70), st.text(max_size=3))
_KEYS = st.one_of(_SCALAR_KEYS, st.lists(_SCALAR_KEYS, max_size=3).map(tuple))
_ACCESSES = st.lists(st.builds(Access, t=st.integers(0, 2 ** 40), block=_KEYS, seq=_KEYS,
                               layer=st.integers(0, 64)), max_size=30)


@settings(max_examples=60, deadline=None)
@given(trace=_ACCESSES)
def test_jsonl_reads_back_exactly_with_or_without_a_comment(trace: list[Access]) -> None:
    """JSON lines read back as written, by the fast pass (orjson) and the careful one (a comment line
    sends the file there): big integers stay exact integers."""
    buf = io.StringIO()
    write_trace(trace, buf)
    assert read_trace(io.StringIO(buf.getvalue())) == trace
    assert read_trace(io.StringIO("# careful\n" + buf.getvalue())) == trace


def test_convert_round_trips_jsonl_and_binary_exactly(tmp_path: Path, capsys) -> None:
    """`trace convert` to .npz and back gives the same accesses and the same JSON lines, byte for byte;
    the binary and JSON-lines columns of a generated trace are equal."""
    trace = [Access(0, (1, "sys", 2), seq=3, layer=1), Access(1, 2 ** 70), Access(2, -5, seq="s"),
             Access(2, (1, "sys", 2), seq=3, layer=1), Access(3, "x", seq=2 ** 64, layer=2)]
    jsonl, npz, back = tmp_path / "t.jsonl", tmp_path / "t.npz", tmp_path / "back.jsonl"
    with open(jsonl, "w") as f:
        write_trace(trace, f)
    assert main(["trace", "convert", str(jsonl), "--out", str(npz)]) == 0
    assert main(["trace", "convert", str(npz), "--out", str(back)]) == 0
    assert capsys.readouterr().err == f"wrote 5 accesses to {npz}\nwrote 5 accesses to {back}\n"
    assert is_binary(npz) and load_trace(npz) == trace and back.read_bytes() == jsonl.read_bytes()
    assert main(["trace", "gen", "zipf", "--accesses", "5000", "--blocks", "700", "--out", str(jsonl)]) == 0
    assert main(["trace", "convert", str(jsonl), "--out", str(npz)]) == 0
    from_jsonl, from_npz = load_columns(jsonl), load_columns(npz)
    assert len(from_jsonl) == 5000 and from_jsonl.block_keys is None and from_npz.block_keys is None
    assert all(np.array_equal(getattr(from_jsonl, c), getattr(from_npz, c)) for c in ("t", "block", "seq", "layer"))


def test_a_binary_file_given_as_jsonl_is_one_error_naming_it(tmp_path: Path, capsys) -> None:
    """Binary data where JSON lines are expected, or a damaged .npz: a TraceFormatError naming the
    file, which the CLI prints as one line (exit 2)."""
    gz = tmp_path / "t.jsonl"
    gz.write_bytes(gzip.compress(b'{"t":0,"block":1}\n' * 10))
    message = f"{gz}:1: binary data, not JSON lines; a trace is JSON lines or a binary .npz/.npy file"
    with pytest.raises(TraceFormatError) as exc:
        load_columns(gz)
    assert str(exc.value) == message
    assert main(["trace", "replay", str(gz), "--capacity", "4"]) == 2
    assert capsys.readouterr() == ("", f"cxlemu: error: {message}\n")
    npz = tmp_path / "cut.npz"
    save_binary([Access(t, t % 7) for t in range(100)], npz)
    npz.write_bytes(npz.read_bytes()[:300])
    assert main(["trace", "convert", str(npz), "--out", str(tmp_path / "x.jsonl")]) == 2
    assert capsys.readouterr() == ("", f"cxlemu: error: {npz}: not a trace numpy can read without pickles "
                                       "(File is not a zip file)\n")


def test_zipf_and_scanmix_shapes() -> None:
    """zipf: integer ids, the most popular far above the median; scanmix: scans of unseen ids in order."""
    z = [a.block for a in zipf(accesses=20_000, blocks=1000, seed=1)]
    counts = np.bincount(z, minlength=1000)
    assert len(z) == 20_000 and counts.max() > 50 * np.median(counts) and z == [a.block for a in zipf(
        accesses=20_000, blocks=1000, seed=1)]
    m = [a.block for a in scanmix(accesses=3000, blocks=100, scan_blocks=50, scan_every=1000)]
    assert m[1000:1050] == list(range(100, 150)) and max(m[:1000]) < 100 and len(m) == 3000


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

    from tools.cli.bench.kv import render_fwmodel as render
    from tools.trace.bench import FwmodelBenchResult, measure_hotness, measure_policies

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
