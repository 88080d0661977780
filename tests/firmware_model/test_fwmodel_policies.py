"""Eviction policies: exact victim order on small hand-made sequences, and protocol misuse."""
from __future__ import annotations

from collections.abc import Sequence

import pytest

from firmware_model.policies import (
    ONLINE_POLICY_NAMES,
    POLICY_NAMES,
    ARCPolicy,
    BeladyPolicy,
    DecayedLFUPolicy,
    EvictionPolicy,
    HotnessPolicy,
    LFUPolicy,
    LRUPolicy,
    NoVictimError,
    S3FIFOPolicy,
    make_policy,
    next_use_positions,
)


def _fill(policy: EvictionPolicy, *keys: str) -> None:
    for k in keys:
        policy.insert(k)


def test_lru_evicts_least_recently_used_first() -> None:
    """LRU: a touch moves a key to the young end."""
    p = LRUPolicy(3)
    _fill(p, "a", "b", "c")
    p.touch("a")
    assert p.order() == ["b", "c", "a"]
    assert [p.evict(), p.evict(), p.evict()] == ["b", "c", "a"]
    assert len(p) == 0


def test_lru_skips_protected_keys() -> None:
    """A protected key is passed over, not lost."""
    p = LRUPolicy(3)
    _fill(p, "a", "b", "c")
    assert p.evict(protected={"a", "b"}) == "c"
    assert p.order() == ["a", "b"]


def test_lfu_evicts_least_frequent_then_least_recent() -> None:
    """Plain LFU: fewest accesses goes first; ties go to the least recently used (libCacheSim's order)."""
    p = LFUPolicy(4)
    _fill(p, "a", "b", "c", "d")
    for k in ("a", "a", "b", "d"):
        p.touch(k)
    assert [p.score(k) for k in "abcd"] == [3.0, 2.0, 1.0, 2.0]
    assert [p.evict() for _ in range(4)] == ["c", "b", "d", "a"]


def test_lfu_forgets_a_count_when_its_key_leaves() -> None:
    """A key evicted and inserted again starts from 1, below a key touched once since."""
    p = LFUPolicy(2)
    _fill(p, "a", "b")
    for _ in range(5):
        p.touch("a")
    p.touch("b")
    assert p.evict() == "b"
    p.remove("a")
    _fill(p, "a", "b")
    p.touch("b")
    assert p.evict() == "a"


def test_lfu_decay_forgets_old_popularity() -> None:
    """lfu-decay with half_life=2: three early accesses are worth less than one recent one."""
    p = DecayedLFUPolicy(3, half_life=2)
    assert p.name == "lfu-decay" and isinstance(make_policy("lfu-decay", 3), DecayedLFUPolicy)
    p.insert("a"); p.touch("a"); p.touch("a")  # 2**.5 + 2 + 2**1.5 = 6.24
    p.insert("b"); p.touch("b")  # 4 + 2**2.5 = 9.66
    p.insert("c")  # 8
    assert round(p.score("a"), 4) == round((2 ** 0.5 + 2 + 2 ** 1.5) / 8, 4)
    assert [p.evict() for _ in range(3)] == ["a", "c", "b"]


def _demand(p: EvictionPolicy, keys: Sequence[object], capacity: int) -> list[object]:
    """Demand fill as the replay loop drives a policy; returns the victims in order."""
    victims = []
    for k in keys:
        if k in p:
            p.touch(k)
            continue
        getattr(p, "on_miss", lambda key: None)(k)
        if len(p) >= capacity:
            victims.append(p.evict())
        p.insert(k)
    return victims


def test_arc_adapts_before_it_replaces() -> None:
    """ARC (Fig. 4): a B1 hit raises p before REPLACE, so the victim comes from T2 on that miss."""
    p = ARCPolicy(2)
    assert _demand(p, "abac", 2) == ["b"]  # T1=[c] T2=[a] B1=[b]
    p.on_miss("b")  # case II: p 0 -> 1, b leaves B1
    assert p.p == 1.0 and list(p.b1) == []
    assert p.evict() == "a" and list(p.b2) == ["a"]  # |T1| = 1 is not > p: T2 gives the victim
    p.insert("b")
    assert list(p.t1) == ["c"] and list(p.t2) == ["b"]
    p.on_miss("a")  # case III: p 1 -> 0
    assert p.p == 0.0 and p.evict() == "c"
    p.insert("a")
    assert list(p.t2) == ["b", "a"] and list(p.b1) == ["c"]


def test_arc_ties_go_to_t1_when_the_miss_was_in_b2() -> None:
    """REPLACE's "x in B2 and |T1| == p": the last miss evicts T1's c, not T2's e."""
    p = ARCPolicy(3)
    assert _demand(p, "eaadced", 3) == ["e", "d", "a"]
    assert (p.p, list(p.t1), list(p.t2), list(p.b2)) == (2.0, ["c"], ["e", "d"], ["a"])
    assert _demand(p, "a", 3) == ["c"] and p.p == 1.0


def test_arc_without_the_miss_announced_adapts_at_insert() -> None:
    """An insert nobody announced (a prefetch) still moves p and lands its ghost in T2."""
    p = ARCPolicy(2)
    _demand(p, "eefbb", 2)
    assert (list(p.t1), list(p.t2), list(p.b1)) == ([], ["e", "b"], ["f"])
    assert p.evict() == "e"  # treated as case IV
    p.insert("f")
    assert p.p == 1.0 and list(p.t2) == ["b", "f"] and list(p.b2) == ["e"]


def test_s3fifo_fills_main_until_the_first_eviction() -> None:
    """libCacheSim's S3FIFO: once small holds its share, new keys enter main until the cache is full."""
    p = S3FIFOPolicy(20)  # small 2, main 18, ghost 18
    assert (p.small_target, p.main_target, p.ghost_limit) == (2, 18, 18)
    _fill(p, *"abcd")
    assert list(p.small) == ["a", "b"] and list(p.main) == ["c", "d"]
    v0 = S3FIFOPolicy(20, fill_main_first=False)
    _fill(v0, *"abcd")
    assert list(v0.small) == list("abcd") and not v0.main


def test_s3fifo_promotes_reused_and_ghosts_one_hit_wonders() -> None:
    """S3-FIFO: freq >= 2 in small moves to main; others go to the ghost queue, and back to main."""
    p = S3FIFOPolicy(10, fill_main_first=False)  # small queue target: 1
    _fill(p, "a", "b", "c")
    p.touch("a"); p.touch("a"); p.touch("b")
    assert [p.evict(), p.evict()] == ["b", "c"]
    assert list(p.main) == ["a"] and list(p.ghost) == ["b", "c"]
    assert p.evict() == "a"
    p.on_miss("b")
    assert list(p.ghost) == ["c"]
    p.insert("b")
    assert list(p.main) == ["b"] and list(p.small) == []


def test_s3fifo_main_reinserts_while_frequency_lasts() -> None:
    """Main is CLOCK-like: a key with frequency > 0 goes round again with frequency - 1."""
    p = S3FIFOPolicy(10)
    for k in ("x", "y"):  # ghost them, then bring them back into main
        p.insert(k)
        assert p.evict() == k
        p.insert(k)
    assert list(p.main) == ["x", "y"]
    p.touch("x")
    assert [p.evict(), p.evict()] == ["y", "x"]


def test_s3fifo_evicts_from_main_only_when_main_is_over_its_share() -> None:
    """Small gives the victim while main holds <= 90 %, even when small is under its 10 %."""
    p = S3FIFOPolicy(20)
    _fill(p, *"abcdefghijklmnopqrst")  # small [a, b], main the other 18
    assert p.evict() == "a"
    p.insert("u")  # into small: it has been evicted from
    assert list(p.small) == ["b", "u"] and p.evict() == "b" and p.evict() == "u"
    assert p.evict() == "c"  # small is empty: main


def test_s3fifo_finds_the_unprotected_key_behind_protected_ones() -> None:
    """Main [1 protected, 2 with frequency 1]: 2 goes round once more and leaves (found by the
    conformance kit: the loop used to give up when it met 1 again)."""
    p = S3FIFOPolicy(3)
    _demand(p, [0] * 17 + [1, 2, 2], 3)
    assert (list(p.small), list(p.main), p.freq) == ([0], [1, 2], {0: 3, 1: 0, 2: 1})
    assert p.evict(protected={0, 1}) == 2
    with pytest.raises(NoVictimError):
        p.evict(protected={0, 1})


def test_hotness_keeps_sinks_window_and_heavy_hitters() -> None:
    """Hotness: coldest non-sink outside the window goes; then the window; sinks last."""
    p = HotnessPolicy(4, window=1)
    p.hint_sink("s")
    _fill(p, "s", "a", "b", "c")
    p.touch("a"); p.touch("a"); p.touch("b")
    assert p.evict() == "b"
    assert p.evict(protected={"a"}) == "c"
    assert [p.evict(), p.evict()] == ["a", "s"]


def test_hotness_ties_go_to_most_recently_used() -> None:
    """Equal heat: the key just used is needed furthest ahead in a loop, so it goes first."""
    p = HotnessPolicy(3, window=0)
    _fill(p, "x", "y", "z")
    assert p.evict() == "z"
    p.hint_heat("x", 5)
    assert p.heat("x") == 6 and p.evict() == "y"


def test_hotness_remembers_heat_of_evicted_keys() -> None:
    """A heavy hitter evicted and re-inserted comes back with its heat."""
    p = HotnessPolicy(2, window=0)
    _fill(p, "h", "c")
    p.hint_heat("h", 10)
    assert p.evict(protected={"c"}) == "h"
    p.insert("h")
    assert p.heat("h") == 12 and p.evict() == "c"


def test_hotlist_feed_adds_counts() -> None:
    """Hotness-unit hotlist entries add heat to resident and remembered keys."""
    p = HotnessPolicy(4, window=0)
    _fill(p, 1, 2)
    p.feed_hotlist([(1, 7), (9, 3)])
    assert (p.heat(1), p.heat(2), p.heat(9)) == (8, 1, 3)


def test_belady_evicts_furthest_next_use() -> None:
    """OPT: the key used furthest ahead (or never again) goes."""
    future = ["a", "b", "c", "a", "b", "d", "a"]
    assert next_use_positions(future) == [3, 4, 7, 6, 7, 7, 7]
    p = BeladyPolicy(2, future=future)
    _fill(p, "a", "b")
    assert p.evict() == "b"
    p.insert("c")
    assert p.evict() == "c"  # c is never used again


def test_belady_rejects_a_sequence_other_than_its_future() -> None:
    """Driving OPT with another sequence would score against the wrong future."""
    p = BeladyPolicy(2, future=["a", "b"])
    p.insert("a")
    with pytest.raises(ValueError, match="access 1 is 'c'"):
        p.insert("c")


@pytest.mark.parametrize("name", ONLINE_POLICY_NAMES)
def test_every_policy_refuses_misuse(name: str) -> None:
    """Double insert, touch/remove of a stranger, evict with everything protected."""
    p = make_policy(name, 2)
    assert isinstance(p, EvictionPolicy) and p.name == name
    p.insert("a")
    with pytest.raises(KeyError, match="already resident"):
        p.insert("a")
    with pytest.raises(KeyError, match="not resident"):
        p.touch("zz")
    with pytest.raises(KeyError, match="not resident"):
        p.remove("zz")
    with pytest.raises(NoVictimError):
        p.evict(protected={"a"})
    assert "a" in p and len(p) == 1
    p.remove("a")
    with pytest.raises(LookupError):
        p.evict()


@pytest.mark.parametrize("name", ONLINE_POLICY_NAMES)
def test_every_policy_honours_protected_under_churn(name: str) -> None:
    """Over many evictions, a protected key is never chosen."""
    p = make_policy(name, 8)
    for i in range(8):
        p.insert(i)
    for i in range(8, 200):
        p.touch(3) if i % 3 == 0 else None
        victim = p.evict(protected={3, 5})
        assert victim not in (3, 5) and victim not in p
        p.insert(i)
    assert 3 in p and 5 in p and len(p) == 8


def test_make_policy_errors_name_the_fix() -> None:
    """Unknown names list the known ones; opt without a future says to pass one."""
    assert POLICY_NAMES == ("lru", "lfu", "lfu-decay", "arc", "s3fifo", "hotness", "reuse", "opt")
    with pytest.raises(ValueError, match="choose one of lru, lfu"):
        make_policy("mru", 4)
    with pytest.raises(ValueError, match="future="):
        make_policy("opt", 4)
    with pytest.raises(ValueError, match="positive number of blocks"):
        make_policy("lru", 0)


def test_reuse_evicts_furthest_predicted_use() -> None:
    """Reuse: equal gaps -> the key just used is predicted furthest away; unknown gaps use the mean."""
    from firmware_model.policies import ReusePolicy

    p = ReusePolicy(3)
    _fill(p, "a", "b", "c")  # accesses 1, 2, 3
    p.touch("a"); p.touch("b")  # gaps 3 and 3; now 5
    assert [p.predicted_use(k) for k in "abc"] == [7.0, 8.0, 6.0]
    assert [p.evict(), p.evict()] == ["b", "a"]


def test_reuse_treats_long_silence_as_cold() -> None:
    """A key silent for more than two of its gaps is predicted as far ahead as it was silent."""
    from firmware_model.policies import ReusePolicy

    p = ReusePolicy(2)
    p.insert("x"); p.touch("x")  # gap 1
    p.insert("y")
    for _ in range(4):
        p.touch("y")  # now 7; x silent for 5 > 2 gaps
    assert p.predicted_use("x") == 12.0 and p.predicted_use("y") == 8.0
    assert p.evict() == "x"


def test_reuse_scalar_and_numpy_evictions_choose_alike() -> None:
    """The per-key Python comparison (few residents) and the numpy scan (many) pick the same
    victim on every eviction of random traffic with protected sets, overdue and unseen keys."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from firmware_model.policies import ReusePolicy

    ops = st.lists(st.tuples(st.integers(0, 15), st.sets(st.integers(0, 15), max_size=3)),
                   min_size=1, max_size=300)

    @settings(max_examples=80, deadline=None)
    @given(ops, st.integers(2, 8))
    def run(seq: list[tuple[int, set[int]]], capacity: int) -> None:
        scalar, vector = ReusePolicy(capacity), ReusePolicy(capacity)
        scalar.SCALAR_MAX, vector.SCALAR_MAX = 1 << 30, 0
        for key, protected in seq:
            if key in scalar:
                scalar.touch(key); vector.touch(key)
                continue
            if len(scalar) == capacity:
                if all(k in protected for k in range(16) if k in scalar):
                    protected = set()
                assert scalar.evict(protected) == vector.evict(protected)
            scalar.insert(key); vector.insert(key)

    run()


def test_reuse_capacity_is_a_bound_not_an_allocation() -> None:
    """A capacity far beyond what is ever resident (a KV budget of 10**30 bytes) allocates slot
    arrays for the residents only; arrays grown on demand choose exactly the victims that arrays
    sized to the capacity up front do."""
    import random

    from firmware_model.policies import ReusePolicy

    huge = ReusePolicy(10**30)
    assert len(huge._keys) == ReusePolicy.INITIAL_SLOTS == 64
    for key in range(100):
        huge.insert(key)
    assert len(huge) == 100 and len(huge._keys) == 128
    assert huge.evict() == 99  # never seen twice: the same predicted use, the most recent goes

    grown, upfront = ReusePolicy(200), ReusePolicy(200)
    upfront.INITIAL_SLOTS = 200
    upfront.__init__(200)
    assert (len(grown._keys), len(upfront._keys)) == (64, 200)
    rng = random.Random(5)
    victims: list[tuple[object, object]] = []
    for _ in range(3000):
        key = rng.randrange(260)
        if key in grown:
            grown.touch(key)
            upfront.touch(key)
            continue
        if len(grown) == 200:
            protected = set(rng.sample(range(260), 3))
            victims.append((grown.evict(protected), upfront.evict(protected)))
        grown.insert(key)
        upfront.insert(key)
    assert len(victims) > 100 and all(a == b for a, b in victims)


@pytest.mark.parametrize("name", ONLINE_POLICY_NAMES)
def test_every_policy_tracks_residency_like_a_set(name: str) -> None:
    """Random insert / touch / remove / evict(protected): the policy agrees with a plain set."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    ops = st.lists(st.tuples(st.sampled_from("itre"), st.integers(0, 9), st.sets(st.integers(0, 9), max_size=4)),
                   max_size=80)

    @settings(max_examples=60, deadline=None)
    @given(ops)
    def run(seq: list[tuple[str, int, set[int]]]) -> None:
        p = make_policy(name, 4)
        model: set[int] = set()
        for op, key, protected in seq:
            if op == "i" and key not in model:
                if len(model) >= 4:
                    if not model - protected:
                        with pytest.raises(NoVictimError):
                            p.evict(protected)
                        continue
                    victim = p.evict(protected)
                    assert victim in model and victim not in protected
                    model.discard(victim)
                p.insert(key)
                model.add(key)
            elif op == "t" and key in model:
                p.touch(key)
            elif op == "r" and key in model:
                p.remove(key)
                model.discard(key)
            elif op == "e" and model - protected:
                victim = p.evict(protected)
                assert victim in model and victim not in protected
                model.discard(victim)
            assert len(p) == len(model) and all(k in p for k in model)

    run()
