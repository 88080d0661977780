"""The C replay loops (firmware_model._fastreplay_c) against their twins, the Python policies.

Driver: demand fill of a trace; monitor: hit or miss per access; model: the Python policy under
:func:`firmware_model.replay.count_hits`; checker: the two hit sequences equal, access by access.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from firmware_model import _fast
from firmware_model.policies import make_policy
from firmware_model.replay import count_hits, opt_hit_count, replay_keys

pytestmark = pytest.mark.skipif(not _fast.AVAILABLE, reason="C replay not built: python -m firmware_model._fast_build")


def _python_hit_sequence(policy: str, keys: list[int], capacity: int, **kwargs: object) -> list[int]:
    """The Python policy's hit (1) or miss (0) per access, driven as count_hits drives it."""
    if policy == "opt":
        kwargs["future"] = keys
    p = make_policy(policy, capacity, **kwargs)
    out = []
    for now, key in enumerate(keys):
        if key in p:
            p.touch(key, now)
            out.append(1)
            continue
        if hasattr(p, "on_miss"):
            p.on_miss(key, now)
        if len(p) >= capacity:
            p.evict()
        p.insert(key, now)
        out.append(0)
    return out


traces = st.lists(st.integers(0, 40), min_size=0, max_size=400)


@pytest.mark.parametrize("policy", _fast.FAST_POLICIES)
def test_c_replay_hits_exactly_where_the_python_policy_does(policy: str) -> None:
    """Every access of random traces: the same hit or miss, the same evictions."""

    @settings(max_examples=150, deadline=None)
    @given(traces, st.integers(1, 30))
    def run(keys: list[int], capacity: int) -> None:
        hits, evictions, seq = _fast.fast_hits(policy, np.array(keys, dtype=np.int64), capacity, hit_sequence=True)
        expected = _python_hit_sequence(policy, keys, capacity)
        assert seq is not None and seq.tolist() == expected
        assert hits == sum(expected)
        assert evictions == count_hits(make_policy(policy, capacity, **({"future": keys} if policy == "opt" else {})),
                                       keys, capacity)[1]

    run()


def test_c_s3fifo_takes_the_python_options() -> None:
    """small_ratio, ghost_ratio and the v0 fill order reach the C loop."""

    @settings(max_examples=80, deadline=None)
    @given(traces, st.integers(2, 30), st.sampled_from([0.1, 0.25, 0.5]), st.sampled_from([0.0, 0.5, 0.9, 2.0]),
           st.booleans())
    def run(keys: list[int], capacity: int, small: float, ghost: float, fill_main_first: bool) -> None:
        kw = {"small_ratio": small, "ghost_ratio": ghost, "fill_main_first": fill_main_first}
        _, _, seq = _fast.fast_hits("s3fifo", keys, capacity, hit_sequence=True, **kw)
        assert seq is not None and seq.tolist() == _python_hit_sequence("s3fifo", keys, capacity, **kw)

    run()


def test_any_keys_map_to_dense_ids() -> None:
    """Tuples, strings and sparse or negative integers replay as their dense ids do."""
    rng = np.random.default_rng(9)
    wide = rng.integers(-(2**62), 2**62, 500)[rng.integers(0, 500, 20_000)]
    ids, n_ids = _fast.dense_ids(wide)
    pairs = set(zip(wide.tolist(), ids.tolist()))  # one id per key and one key per id
    assert n_ids == len(np.unique(wide)) == len(pairs) and set(ids.tolist()) == set(range(n_ids))
    keys = [(0, "a"), "b", (0, "a"), 7, "b", 7, (1, "x")]
    ids, n_ids = _fast.dense_ids(keys)
    assert ids.tolist() == [0, 1, 0, 2, 1, 2, 3] and n_ids == 4
    sparse = np.array([10**12, -5, 10**12, 3], dtype=np.int64)
    ids, n_ids = _fast.dense_ids(sparse)
    assert ids.tolist() == [0, 1, 0, 2] and n_ids == 3  # C hash map: order of first appearance
    small = np.array([5, 0, 5], dtype=np.int32)
    ids, n_ids = _fast.dense_ids(small)
    assert ids.tolist() == [5, 0, 5] and n_ids == 6 and ids.dtype == np.int64
    assert _fast.next_use_array(np.array([1, 2, 1, 1, 2])).tolist() == [2, 4, 3, 5, 5]


def test_replay_chooses_c_or_python_and_both_agree() -> None:
    """impl='c' and impl='py' give the same result document; unknown impls and policies say why."""
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 300, 5000)
    for policy in ("lru", "arc", "s3fifo", "opt"):
        c = replay_keys(keys, policy, 60, impl="c").to_dict()
        py = replay_keys(keys.tolist(), policy, 60, impl="py").to_dict()
        assert c == py and c["unique_blocks"] == 300
    assert opt_hit_count(keys, 60, impl="c") == opt_hit_count(keys.tolist(), 60, impl="py")
    with pytest.raises(ValueError, match="impl must be one of auto, c, py"):
        replay_keys(keys, "lru", 60, impl="fast")
    with pytest.raises(ValueError, match="no C replay for policy 'reuse'"):
        replay_keys(keys, "reuse", 60, impl="c")
    assert replay_keys(keys, "reuse", 60).accesses == 5000  # auto: Python for the rest
