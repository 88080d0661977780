"""Trace replay against independent reference LRU and Belady implementations (the acceptance test)."""
from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from firmware_model.dma import TransferCost
from firmware_model.policies import ONLINE_POLICY_NAMES, POLICY_NAMES
from firmware_model.replay import Access, replay
from tools.cli.main import main
from tools.trace.gen import KINDS
from tools.trace.io import load_trace, write_trace


def reference_lru_hits(keys: list, capacity: int) -> int:
    """LRU by the book: a list, most recent at the end."""
    cache: list = []
    hits = 0
    for k in keys:
        if k in cache:
            hits += 1
            cache.remove(k)
        elif len(cache) == capacity:
            cache.pop(0)
        cache.append(k)
    return hits


def reference_belady_hits(keys: list, capacity: int) -> int:
    """Belady's MIN by the book: on a miss with a full cache, scan ahead for each resident key."""
    cache: set = set()
    hits = 0
    for i, k in enumerate(keys):
        if k in cache:
            hits += 1
            continue
        if len(cache) == capacity:
            def next_use(x, i=i):
                for j in range(i + 1, len(keys)):
                    if keys[j] == x:
                        return j
                return len(keys) + 1
            cache.remove(max(sorted(cache, key=repr), key=next_use))
        cache.add(k)
    return hits


def _trace(keys: list) -> list[Access]:
    return [Access(t=i, block=k) for i, k in enumerate(keys)]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=160), st.integers(1, 10))
def test_replay_matches_reference_lru_and_belady(keys: list[int], capacity: int) -> None:
    """Exact LRU and OPT hits on random traces; no policy beats OPT."""
    trace = _trace(keys)
    lru = replay(trace, "lru", capacity)
    assert lru.hits == reference_lru_hits(keys, capacity)
    assert lru.opt_hits == reference_belady_hits(keys, capacity)
    assert lru.hits + lru.misses == len(keys)
    for name in POLICY_NAMES:
        assert replay(trace, name, capacity).hits <= lru.opt_hits


def test_opt_replays_to_its_own_bound() -> None:
    """Replaying the oracle itself gives exactly opt_hits."""
    keys = [random.Random(3).randint(0, 30) for _ in range(2000)]
    r = replay(_trace(keys), "opt", 8)
    assert r.hits == r.opt_hits == reference_belady_hits(keys, 8)


def test_layer_loop_has_an_online_policy_near_opt() -> None:
    """A KV layer loop larger than the cache: LRU gets nothing, reuse matches OPT."""
    trace = KINDS["loop"](steps=16, layers=4, blocks=4)
    lru, reuse = replay(trace, "lru", 10), replay(trace, "reuse", 10)
    assert lru.opt_hits == reference_belady_hits([a.block for a in trace], 10) == 144
    assert lru.hits == 0 and reuse.hits == 144


def test_stall_time_follows_the_cost_function() -> None:
    """Each demand miss stalls latency + bytes / bandwidth (x time_scale)."""
    cost = TransferCost(read_latency_ns=100, read_bandwidth_gbps=16, block_bytes=4096, time_scale=2.0)
    r = replay(_trace([1, 2, 1, 3, 1]), "lru", 2, cost=cost, compute_ns=50)
    assert (r.hits, r.misses) == (2, 3)
    assert r.stall_ns == 3 * (100 + 256) * 2.0
    assert r.sim_ns == 5 * 50 + r.stall_ns


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("seed", [11, 12])
def test_cli_replay_on_unseen_traces(kind: str, seed: int, tmp_path, capsys) -> None:
    """`cxlemu trace gen` then `trace replay --json`: exact reference LRU and OPT hits."""
    path = tmp_path / f"{kind}.jsonl"
    small = {"multiturn": ["--sessions", "4", "--answer-steps", "6"], "sliding": ["--steps", "40"],
             "heavy": ["--steps", "40"], "loop": ["--steps", "8"], "zipf": ["--accesses", "3000", "--blocks", "300"],
             "scanmix": ["--accesses", "3000", "--blocks", "200", "--scan-blocks", "100", "--scan-every", "1000"]}[kind]
    assert main(["trace", "gen", kind, "--seed", str(seed), "--out", str(path), *small]) == 0
    keys = [a.block for a in load_trace(path)]
    capacity = max(2, len(set(keys)) // 3)
    capsys.readouterr()
    assert main(["trace", "replay", str(path), "--policy", "lru", "--capacity", str(capacity), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["accesses"] == len(keys)
    assert doc["hits"] == reference_lru_hits(keys, capacity)
    assert doc["opt_hits"] == reference_belady_hits(keys, capacity)
    assert doc["events_per_s"] > 0
    for name in ONLINE_POLICY_NAMES:
        assert main(["trace", "replay", str(path), "--policy", name, "--capacity", str(capacity), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["hits"] <= doc["opt_hits"]


def test_cli_replay_reports_stall_with_a_cost_model(tmp_path, capsys) -> None:
    """--latency-ns / --bandwidth-gbps / --block-bytes turn on stall accounting."""
    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        write_trace(_trace(["a", "b", "a", "c"]), f)
    assert main(["trace", "replay", str(path), "--capacity", "2", "--json", "--latency-ns", "10",
                 "--bandwidth-gbps", "1", "--block-bytes", "90"]) == 0
    doc = json.loads(capsys.readouterr().out)
    # each miss: 10 ns + the link model's two whole 64-B transactions (128 B) at 1 B/ns
    assert (doc["hits"], doc["misses"], doc["stall_ns"]) == (1, 3, 3 * 138)


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ('{"t": 1}', 'needs an object with "t" and "block"'),
    ('{"t": "x", "block": 1}', '"t" must be an integer'),
    ('{"t": 1, "block": {"a": 1}}', "cannot be a JSON object"),
])
def test_cli_rejects_malformed_traces(line: str, message: str, tmp_path, capsys) -> None:
    """A bad line is one error naming file:line, exit 2."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 0, "block": 1}\n' + line + "\n")
    assert main(["trace", "replay", str(path), "--capacity", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cxlemu: error: ") and "bad.jsonl:2" in err and message in err


def test_cli_argument_errors(tmp_path, capsys) -> None:
    """Missing file, zero capacity, unknown policy, --prefetch without cost: exit 2."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"t": 0, "block": [1, 2]}\n')
    assert main(["trace", "replay", str(tmp_path / "none"), "--capacity", "2"]) == 2
    assert main(["trace", "replay", str(path), "--capacity", "0"]) == 2
    assert main(["trace", "replay", str(path), "--capacity", "2", "--policy", "mru"]) == 2
    assert main(["trace", "replay", str(path), "--capacity", "2", "--prefetch"]) == 2
    assert "needs a cost model" in capsys.readouterr().err
    assert main(["trace", "replay", str(path), "--capacity", "2", "--prefetch", "--policy", "opt",
                 "--bandwidth-gbps", "1"]) == 2
    assert "without prefetch" in capsys.readouterr().err
