"""Trace replay with the prefetcher on a simulated clock.

The trace's own progress points — consecutive accesses with the same (step, sequence, layer) —
are the host's schedule: every point is hinted up front with the blocks it reads, and the
replayer reports progress as it reaches each point, so prefetches are issued ``window`` points
ahead (sized by :func:`~firmware_model.prefetch.window_points` unless given: a fixed int, or a
window function of your own, ``"package.module:function"`` or the callable, see
:func:`~firmware_model.prefetch.resolve_window`). Each access costs
``compute_ns``; a block still in flight when needed stalls the compute until it lands (a late
prefetch, counted as a miss); a block neither resident nor in flight is fetched on demand at the
highest DMA priority. The blocks of the current point, and prefetched blocks not used yet, are
protected from eviction (evicting a block just brought in for the next point only wastes it).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from itertools import groupby

import simpy

from firmware_model._replay_types import Access, ReplayResult
from firmware_model.dma import DmaScheduler, TransferCost
from firmware_model.policies import EvictionPolicy
from firmware_model.prefetch import PrefetchQueue, WindowSpec, resolve_window

__all__ = ["replay_with_prefetch"]

_DEMAND = (float("-inf"), 0)  # ahead of every prefetch in the DMA queue


class _Protected:
    """The current point's blocks plus prefetched blocks awaiting their first use."""

    def __init__(self, current: set[Hashable], pq: PrefetchQueue) -> None:
        self.current, self.pq = current, pq

    def __contains__(self, key: object) -> bool:
        return key in self.current or self.pq.landed(key)  # type: ignore[arg-type]


class _Replay:
    """State of one prefetching replay (the simpy process is :meth:`run`)."""

    def __init__(self, trace: Sequence[Access], policy: EvictionPolicy, capacity: int,
                 cost: TransferCost, compute_ns: int, window: int | WindowSpec | None, channels: int) -> None:
        self.env = simpy.Environment()
        self.policy, self.capacity, self.compute_ns = policy, capacity, compute_ns
        self.on_miss = getattr(policy, "on_miss", None)  # see EvictionPolicy's optional hook
        self.groups = [(k, [a.block for a in g]) for k, g in groupby(trace, key=lambda a: (a.t, a.seq, a.layer))]
        self.last_group = {seq: i for i, ((_, seq, _), _) in enumerate(self.groups)}
        layers = max(a.layer for a in trace) + 1
        block_bytes = cost.block_bytes or 1
        if window is None:
            window = "auto"
        if isinstance(window, bool) or not isinstance(window, int):
            size = resolve_window(window)  # type: ignore[arg-type]  # a bool is refused there
            per_point = max(1, len(trace) // max(1, len(self.groups)))
            window = size(cost, per_point * block_bytes, per_point * compute_ns, 64)
        self.dma = DmaScheduler(self.env, cost, channels=channels, queue_depth=1 << 30)
        self.pq = PrefetchQueue(self.dma, block_bytes=block_bytes, window=window, layers=layers,
                                is_resident=policy.__contains__, on_arrival=self._insert)
        self.block_bytes = block_bytes
        self.protected: set[Hashable] = set()
        self.hits = self.evictions = 0
        self.stall = 0.0

    def _insert(self, key: Hashable) -> bool:
        if key in self.policy:
            return True
        if self.on_miss is not None:
            self.on_miss(key, int(self.env.now))
        if len(self.policy) >= self.capacity:
            try:
                victim = self.policy.evict(_Protected(self.protected, self.pq))
            except LookupError:
                return False
            self.evictions += 1
            self.pq.evicted(victim)
        self.policy.insert(key, int(self.env.now))
        return True

    def run(self):  # simpy process
        for (t, seq, layer), keys in self.groups:
            self.pq.hint(seq, t, layer, keys)
        for i, ((t, seq, layer), keys) in enumerate(self.groups):
            self.pq.progress(seq, t, layer)
            self.protected = set(keys)
            for key in keys:
                yield from self._access(key)
                yield self.env.timeout(self.compute_ns)
            if self.last_group[seq] == i:
                self.pq.end_sequence(seq)

    def _access(self, key: Hashable):
        late = self.pq.demand(key)
        if late is None and key in self.policy:
            self.hits += 1
            self.policy.touch(key, int(self.env.now))
            return
        start = self.env.now
        if late is None:
            request = self.dma.submit("read", self.block_bytes, priority=_DEMAND, tag=key)
            yield request.done
            self._insert(key)
        elif not late.done.triggered:
            yield late.done
        self.stall += self.env.now - start


def replay_with_prefetch(trace: Sequence[Access], policy: EvictionPolicy, capacity: int, *,
                         cost: TransferCost, compute_ns: int = 0, window: int | WindowSpec | None = None,
                         channels: int = 1) -> ReplayResult:
    """Replay ``trace`` with prefetching; ``opt_hits`` is left 0 for the caller to fill.

    ``window``: points ahead, an int >= 0; or what sizes it once from the cost model and the
    trace's mean point (``None`` / ``"auto"``: :func:`~firmware_model.prefetch.window_points`;
    ``"package.module:function"`` or a callable ``f(link, bytes_per_point, compute_ns_per_point,
    max_window) -> int``, called with ``max_window=64``)."""
    r = _Replay(trace, policy, capacity, cost, compute_ns, window, channels)
    r.env.process(r.run())
    r.env.run()
    stats = r.pq.stats.to_dict()
    stats["window"] = r.pq.window
    return ReplayResult(policy=policy.name, capacity=capacity, accesses=len(trace), hits=r.hits,
                        misses=len(trace) - r.hits, opt_hits=0, evictions=r.evictions,
                        unique_blocks=len({a.block for a in trace}), stall_ns=round(r.stall),
                        sim_ns=round(r.env.now), prefetch=stats)
