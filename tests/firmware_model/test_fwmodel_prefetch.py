"""Prefetch queue bound to compute progress, and its replay."""
from __future__ import annotations

import simpy

from firmware_model.dma import DmaScheduler, TransferCost
from firmware_model.prefetch import PrefetchQueue, window_points
from firmware_model.replay import Access, replay

# 500 ns per block on an idle link: 116 ns latency + 384 ns on the link (6 transactions of 64 B);
# a block queued behind another starts when the first one's bytes are through (latency pipelines)
COST = TransferCost(read_latency_ns=116, read_bandwidth_gbps=1, block_bytes=384)


class Harness:
    """A prefetch queue over a DMA engine and a plain resident set, recording arrival times."""

    def __init__(self, window: int = 1, channels: int = 1) -> None:
        self.env = simpy.Environment()
        self.dma = DmaScheduler(self.env, COST, channels=channels)
        self.resident: set = set()
        self.arrivals: list[tuple[str, float]] = []
        self.pq = PrefetchQueue(self.dma, block_bytes=384, window=window, layers=4,
                                is_resident=self.resident.__contains__, on_arrival=self._arrive)

    def _arrive(self, key) -> bool:
        self.resident.add(key)
        self.arrivals.append((key, self.env.now))
        return True

    def at(self, t: float, fn) -> None:
        def proc():
            yield self.env.timeout(t - self.env.now)
            fn()
        self.env.process(proc())


def test_window_is_transfer_time_over_compute_time() -> None:
    """ceil((latency + occupancy of whole transactions) / compute), at least 1, capped."""
    assert window_points(COST, 384, 200) == 3  # 500 / 200
    assert window_points(COST, 384, 500) == 1
    assert window_points(COST, 385, 500) == 2  # 385 B touch 7 transactions: 116 + 448 ns
    assert window_points(COST, 384, 10_000) == 1
    assert window_points(COST, 4000, 10, max_window=8) == 8
    assert window_points(COST, 384, 0, max_window=5) == 5


def test_prefetch_issued_at_a_progress_point_completes_at_the_asserted_time() -> None:
    """Hint for layer 2; reaching layer 1 (window 1) at t=1000 issues it; it lands at 1500."""
    h = Harness(window=1)
    h.pq.hint("s", step=0, layer=2, blocks=["k"])
    h.at(300, lambda: h.pq.progress("s", 0, 0))
    h.at(1000, lambda: h.pq.progress("s", 0, 1))
    h.env.run()
    assert h.arrivals == [("k", 1500)] and h.env.now == 1500
    assert h.pq.stats.issued == 1
    assert h.pq.demand("k") is None and h.pq.stats.useful == 1


def test_progress_of_another_sequence_does_not_trigger() -> None:
    """Triggers are per sequence: progress of t does not issue s's hints."""
    h = Harness(window=2)
    h.pq.hint("s", step=1, layer=0, blocks=["k"])  # point 4
    h.pq.progress("t", 5, 3)
    h.pq.progress("s", 0, 1)  # point 1: 4 > 1 + 2
    assert h.pq.stats.issued == 0
    h.pq.progress("s", 0, 2)
    assert h.pq.stats.issued == 1


def test_cancelled_prefetch_never_completes() -> None:
    """Sequence end: the queued transfer is cancelled, the in-flight one lands as wasted."""
    h = Harness(window=0)
    h.pq.hint("s", 0, 0, ["a", "b"])
    h.pq.progress("s", 0, 0)
    h.at(100, lambda: h.pq.end_sequence("s"))
    h.env.run()
    assert h.env.now == 500 and h.arrivals == []
    s = h.pq.stats
    assert (s.issued, s.cancelled, s.wasted, s.useful) == (2, 1, 1, 0)
    assert h.pq.outstanding() == 0


def test_late_prefetch_is_counted_late_once() -> None:
    """Needed while in flight: late (the caller waits on the request); not useful afterwards."""
    h = Harness(window=0)
    h.pq.hint("s", 0, 0, ["a"])
    h.pq.progress("s", 0, 0)
    waited: list[float] = []

    def compute():
        yield h.env.timeout(200)
        req = h.pq.demand("a")
        assert req is not None and h.pq.demand("a") is req
        yield req.done
        waited.append(h.env.now)

    h.env.process(compute())
    h.env.run()
    assert waited == [500] and h.arrivals == [("a", 500)]
    assert (h.pq.stats.late, h.pq.stats.useful) == (1, 0) and h.pq.outstanding() == 0


def test_duplicates_priorities_and_waste_on_eviction() -> None:
    """Resident or pending blocks are not re-issued; lower priority first; evicted unused = wasted."""
    h = Harness(window=0)
    h.resident.add("r")
    h.pq.hint("s", 0, 0, ["x"], priority=2)
    h.pq.hint("s", 0, 0, ["y", "r"], priority=1)
    h.pq.hint("s", 0, 0, ["x"], priority=0)
    h.pq.progress("s", 0, 0)
    h.env.run()
    assert h.arrivals == [("x", 500), ("y", 1000)]  # priority 0 x first, then y; r and the 2nd x dropped
    assert (h.pq.stats.issued, h.pq.stats.deduplicated) == (2, 2)
    h.pq.evicted("y")
    assert h.pq.stats.wasted == 1 and h.pq.demand("y") is None and h.pq.stats.useful == 0


def test_prefetch_replay_on_a_hand_computed_trace() -> None:
    """Window 2 (1000 ns transfer / 500 ns compute): both first reads are late, both re-reads hit."""
    cost = TransferCost(read_bandwidth_gbps=1.024, block_bytes=1024)  # 1024 B in 1000 ns
    trace = [Access(0, "a", 0, 0), Access(0, "b", 0, 1), Access(1, "a", 0, 0), Access(1, "b", 0, 1)]
    r = replay(trace, "lru", 4, cost=cost, compute_ns=500, prefetch=True)
    assert (r.hits, r.misses, r.stall_ns, r.sim_ns) == (2, 2, 1500, 3500)
    assert r.prefetch == {"issued": 2, "useful": 0, "late": 2, "wasted": 0, "cancelled": 0,
                          "deduplicated": 2, "window": 2}
    demand = replay(trace, "lru", 4, cost=cost, compute_ns=500)
    assert (demand.hits, demand.stall_ns, demand.sim_ns) == (2, 2000, 4000)


def test_prefetch_replay_hides_transfers_behind_compute() -> None:
    """With compute long enough, every block after the first few arrives before it is needed."""
    cost = TransferCost(read_latency_ns=50, read_bandwidth_gbps=10.24, block_bytes=1024)  # 50 + 100 ns
    trace = [Access(t, ("blk", t, layer), 0, layer) for t in range(10) for layer in range(4)]
    r = replay(trace, "lru", 8, cost=cost, compute_ns=200, prefetch=True)
    assert r.prefetch["late"] == 1 and r.prefetch["useful"] == 39 and r.stall_ns == 150
    assert r.hits == 39 and r.opt_hits == 0  # all-new blocks: demand fill cannot hit at all


def test_a_shared_block_survives_the_end_of_one_sequence() -> None:
    """Two sequences hint one prefix block: the first one's end does not cancel it."""
    h = Harness(window=0)
    h.pq.hint("s", 0, 0, ["a", "sys"])
    h.pq.hint("t", 0, 0, ["sys"])
    h.pq.progress("s", 0, 0)
    h.pq.progress("t", 0, 0)  # "sys" deduplicated, now wanted by s and t
    h.pq.end_sequence("s")  # "a" in flight: orphaned; "sys" queued but still wanted by t
    h.env.run()
    assert h.arrivals == [("sys", 1000)]
    s = h.pq.stats
    assert (s.issued, s.deduplicated, s.cancelled, s.wasted) == (2, 1, 0, 1)
    h.pq.end_sequence("t")
    assert h.pq.stats.wasted == 2 and h.pq.outstanding() == 0
