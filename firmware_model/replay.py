"""Replay a block-access trace through an eviction policy (and optionally the prefetcher).

Demand fill: an access hits when its block is resident; a miss makes it resident, evicting the
policy's victim first when the cache is full. Belady's OPT replays the same accesses for the
``opt_hits`` bound. With a :class:`~firmware_model.dma.TransferCost`, every miss stalls for one
block transfer on the simulated clock; ``compute_ns`` per access is the work that overlaps it.

Pure: the caller loads the trace and times the run (events per second is a wall-clock figure
and belongs to the tool, not to the model).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from firmware_model.dma import TransferCost
from firmware_model.policies import EvictionPolicy, make_policy
from firmware_model.policies.base import check_capacity

__all__ = ["Access", "ReplayResult", "count_hits", "opt_hit_count", "replay"]


@dataclass(frozen=True, slots=True)
class Access:
    """One trace record: at step ``t`` sequence ``seq`` reads ``block`` while computing ``layer``."""

    t: int
    block: Hashable
    seq: Hashable = 0
    layer: int = 0


@dataclass(kw_only=True)
class ReplayResult:
    """What one replay measured; ``to_dict()`` is the ``--json`` document."""

    policy: str
    capacity: int
    accesses: int
    hits: int
    misses: int
    opt_hits: int
    evictions: int
    unique_blocks: int
    stall_ns: int = 0
    sim_ns: int = 0
    prefetch: dict[str, int] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def opt_ratio(self) -> float:
        """Hits relative to OPT's (1.0 = as good as the oracle)."""
        return self.hits / self.opt_hits if self.opt_hits else 1.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["hit_ratio"] = round(self.hit_ratio, 6)
        out["opt_ratio"] = round(self.opt_ratio, 6)
        return out


def count_hits(policy: EvictionPolicy, keys: Sequence[Hashable], capacity: int) -> tuple[int, int]:
    """Demand-fill ``keys`` through ``policy`` at ``capacity``; returns ``(hits, evictions)``."""
    hits = evictions = 0
    resident = policy.__contains__
    for now, key in enumerate(keys):
        if resident(key):
            hits += 1
            policy.touch(key, now)
            continue
        if len(policy) >= capacity:
            policy.evict()
            evictions += 1
        policy.insert(key, now)
    return hits, evictions


def opt_hit_count(keys: Sequence[Hashable], capacity: int) -> int:
    """Belady's demand-fill hits on ``keys`` at ``capacity``: the bound every policy is scored by."""
    return count_hits(make_policy("opt", capacity, future=keys), keys, capacity)[0]


def replay(trace: Sequence[Access], policy: str, capacity: int, *,
           cost: TransferCost | None = None, compute_ns: int = 0, prefetch: bool = False,
           policy_kwargs: dict[str, Any] | None = None, with_opt: bool = True) -> ReplayResult:
    """Replay ``trace`` under ``policy`` with ``capacity`` resident blocks.

    ``prefetch`` needs ``cost``: the replayer then feeds the host hints of the trace's own
    (step, sequence, layer) progress points to a :class:`~firmware_model.prefetch.PrefetchQueue`
    (see :func:`firmware_model.prefetch_replay.replay_with_prefetch`). ``with_opt=False`` skips
    the OPT pass (``opt_hits`` stays 0), e.g. to time the policy alone.
    """
    check_capacity(capacity)
    keys = [a.block for a in trace]
    opt_hits = opt_hit_count(keys, capacity) if with_opt else 0
    if prefetch:
        if policy == "opt":
            raise ValueError("policy 'opt' scores demand fill (it needs the exact access sequence): "
                             "replay it without prefetch")
        if cost is None:
            raise ValueError("prefetch replay needs a transfer cost model (cost=TransferCost(...))")
        from firmware_model.prefetch_replay import replay_with_prefetch

        result = replay_with_prefetch(trace, make_policy(policy, capacity, **(policy_kwargs or {})),
                                      capacity, cost=cost, compute_ns=compute_ns)
        result.opt_hits = opt_hits
        return result
    kwargs = dict(policy_kwargs or {})
    if policy == "opt":
        kwargs.setdefault("future", keys)
    pol = make_policy(policy, capacity, **kwargs)
    hits, evictions = count_hits(pol, keys, capacity)
    misses = len(keys) - hits
    miss_ns = cost.read_ns(cost.block_bytes) if cost is not None else 0
    stall = round(misses * miss_ns)
    return ReplayResult(policy=policy, capacity=capacity, accesses=len(keys), hits=hits,
                        misses=misses, opt_hits=opt_hits, evictions=evictions,
                        unique_blocks=len(set(keys)), stall_ns=stall,
                        sim_ns=len(keys) * compute_ns + stall)
