"""Hotness unit with CHMU semantics: epochs at exact simulated times, hotlist ring, interrupts."""
from __future__ import annotations

import numpy as np
import pytest
import simpy

from firmware_model.hotness import (
    RANGE_GRANULE,
    HotlistRing,
    HotnessConfig,
    HotnessUnit,
)

KiB = 1024


def _dpas(*units: int, unit_size: int = 4 * KiB) -> np.ndarray:
    return np.array([u * unit_size + 8 for u in units], dtype=np.uint64)


def test_epochs_end_at_exact_simulated_times() -> None:
    """Epoch mode on simpy: hotlist after each epoch end, counters zeroed, env.now exact."""
    env = simpy.Environment()
    unit = HotnessUnit(1 << 20, HotnessConfig(threshold=2, epoch_ns=100))
    ends: list[float] = []

    def traffic():
        yield env.timeout(30)
        unit.record(_dpas(5, 5, 5, 7, 7, 9))
        yield env.timeout(100)  # t = 130: second epoch
        unit.record(_dpas(9, 9))
        yield env.timeout(60)
        ends.append(env.now)

    env.process(unit.run(env))
    env.process(traffic())
    env.run(until=250)
    assert env.now == 250 and ends == [190]
    assert unit.status.epochs == 2 and unit.epoch_start == 200
    assert unit.hotlist.peek() == [(5, 3), (7, 2), (9, 2)]
    assert not unit.counters.any()


def test_advance_ends_every_elapsed_epoch() -> None:
    """Driven by `now` instead of simpy: each epoch that ended by `now` is closed in order."""
    unit = HotnessUnit(1 << 20, HotnessConfig(threshold=1, epoch_ns=1000))
    unit.record(_dpas(1), now=10)
    unit.record(_dpas(2), now=999)
    assert unit.advance(999) == 0
    unit.record(_dpas(3, 3), now=2500)  # closes epochs [0,1000) and [1000,2000) first
    assert unit.status.epochs == 2 and unit.epoch_start == 2000
    assert unit.hotlist.consume() == [(1, 1), (2, 1)]
    assert unit.advance(3000) == 1 and unit.hotlist.consume() == [(3, 2)]


def test_hotlist_holds_exactly_the_units_at_or_above_threshold() -> None:
    """Hottest first, ties in unit order; units below threshold never appear."""
    unit = HotnessUnit(1 << 20, HotnessConfig(threshold=3, epoch_ns=10))
    counts = {0: 2, 4: 3, 8: 7, 12: 3, 200: 1}
    unit.record(np.concatenate([_dpas(*[u] * c) for u, c in counts.items()]))
    unit.end_epoch()
    assert unit.hotlist.peek() == [(8, 7), (4, 3), (12, 3)]


def test_ring_empty_full_and_wrap() -> None:
    """N slots hold N-1 entries; head == tail is empty; indices wrap."""
    ring = HotlistRing(4, counter_width=16)
    assert len(ring) == 0 and not ring.full
    assert [ring.push(u, 1) for u in (1, 2, 3, 4)] == [True, True, True, False]
    assert ring.full and (ring.head, ring.tail) == (0, 3)
    assert ring.consume(2) == [(1, 1), (2, 1)]
    assert ring.push(5, 70000) and ring.push(6, 2)  # count saturates at 16 bits
    assert (ring.head, ring.tail) == (2, 1) and ring.full
    assert ring.peek() == [(3, 1), (5, 65535), (6, 2)]
    assert int(ring.entries[3]) == (5 << 16) | 0xFFFF
    ring.set_head(1)
    assert len(ring) == 0
    with pytest.raises(ValueError, match="outside the filled part"):
        ring.set_head(3)


def test_overflow_interrupt_fires_once_and_clears() -> None:
    """Entries past a full ring are dropped, counted, and raise one overflow interrupt."""
    fired: list[str] = []
    unit = HotnessUnit(1 << 20, HotnessConfig(threshold=1, epoch_ns=10, hotlist_size=4), fired.append)
    unit.record(_dpas(1, 2, 3, 4, 5))
    unit.end_epoch()
    assert len(unit.hotlist) == 3 and unit.status.dropped == 2
    assert fired == ["overflow"] and unit.status.overflow
    unit.record(_dpas(6))
    unit.end_epoch()
    assert fired == ["overflow"] and unit.status.dropped == 3
    unit.clear_status(overflow=True)
    assert not unit.status.overflow


def test_fill_threshold_raises_the_level_interrupt() -> None:
    """Reaching the notification fill threshold raises the level interrupt."""
    fired: list[str] = []
    cfg = HotnessConfig(threshold=1, mode="always_on", fill_threshold=3, hotlist_size=16)
    unit = HotnessUnit(1 << 20, cfg, fired.append)
    unit.record(_dpas(1, 2))
    assert fired == [] and not unit.status.level
    unit.record(_dpas(3))
    assert fired == ["level"] and unit.status.level


def test_always_on_reports_on_crossing_and_clears_the_counter() -> None:
    """A unit is listed as soon as it reaches the threshold, then counts again from zero."""
    unit = HotnessUnit(1 << 20, HotnessConfig(threshold=3, mode="always_on"))
    unit.record(_dpas(7, 7))
    assert len(unit.hotlist) == 0 and unit.counters[7] == 2
    unit.record(_dpas(2, 7, 2, 2, 2))  # within a batch: in order of first access
    assert unit.hotlist.consume() == [(2, 4), (7, 3)]
    assert unit.counters[7] == 0 and unit.counters[2] == 0
    unit.record(_dpas(7, 7, 7))
    assert unit.hotlist.consume() == [(7, 3)]


def test_ordered_downsampling_counts_one_in_n_across_batches() -> None:
    """Factor 4: accesses 0, 4, 8, ... of the whole stream are counted."""
    unit = HotnessUnit(1 << 20, HotnessConfig(downsampling=4))
    assert unit.record(_dpas(*range(6))) == 2  # accesses 0 and 4
    assert unit.record(_dpas(*range(10, 16))) == 1  # access 8 of the stream: unit 12
    assert np.flatnonzero(unit.counters).tolist() == [0, 4, 12]
    assert unit.record(_dpas(*range(20, 24))) == 1  # access 12: unit 20
    assert unit.status.counted == 4 and unit.counters[20] == 1


def test_randomized_downsampling_is_seeded() -> None:
    """Same seed, same counts; a different seed, different counts; about 1 in N counted."""
    dpas = _dpas(*np.arange(20000) % 64)
    runs = []
    for seed in (1, 1, 2):
        unit = HotnessUnit(1 << 20, HotnessConfig(downsampling=8, randomized=True, seed=seed))
        unit.record(dpas)
        runs.append(unit.counters.copy())
    assert (runs[0] == runs[1]).all() and not (runs[0] == runs[2]).all()
    assert 2000 < runs[0].sum() < 3000


def test_range_bitmap_and_request_type_filter() -> None:
    """Only tracked 256 MiB granules and the selected request type are counted."""
    cfg = HotnessConfig(unit_size=1 << 20, range_bitmap=(1,), count_reads=False)
    unit = HotnessUnit(4 * RANGE_GRANULE, cfg)
    dpas = np.array([0, RANGE_GRANULE, RANGE_GRANULE + 5, 3 * RANGE_GRANULE, 4 * RANGE_GRANULE], dtype=np.uint64)
    writes = np.array([True, True, False, True, True])
    assert unit.record(dpas, writes) == 1
    assert np.flatnonzero(unit.counters).tolist() == [256]


def test_counters_saturate_at_counter_width() -> None:
    """A 4-bit counter stops at 15."""
    unit = HotnessUnit(1 << 20, HotnessConfig(counter_width=4, epoch_ns=1))
    unit.record(_dpas(*[3] * 40))
    unit.end_epoch()
    assert unit.hotlist.peek() == [(3, 15)]


@pytest.mark.parametrize("kwargs, message", [
    ({"unit_size": 1000}, "power of two >= 256"),
    ({"mode": "sometimes"}, "mode must be one of"),
    ({"downsampling": 3}, "power of two >= 1"),
    ({"hotlist_size": 70000}, "16-bit head/tail"),
    ({"threshold": 0}, "u32"),
    ({"fill_threshold": 9, "hotlist_size": 8}, "fill_threshold"),
])
def test_bad_configuration_says_what_to_change(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HotnessConfig(**kwargs)


def test_hotlist_feeds_the_hotness_policy() -> None:
    """End to end: block-sized units, the epoch's hotlist as heat; the hot block outlives the cold ones."""
    from firmware_model.policies import HotnessPolicy

    block = 64 * KiB
    unit = HotnessUnit(1 << 30, HotnessConfig(unit_size=block, threshold=4, epoch_ns=1000))
    policy = HotnessPolicy(4, window=0)
    for b in range(4):
        policy.insert(b)
    unit.record(_dpas(*[2] * 9, 1, 3, unit_size=block), now=10)
    unit.advance(1000)
    entries = unit.hotlist.consume()
    assert entries == [(2, 9)]
    policy.feed_hotlist(entries)  # unit index == block id: unit size is the block size
    assert [policy.evict() for _ in range(3)] == [3, 1, 0] and 2 in policy
