"""The controller's firmware logic, pure: hotness (CHMU), block pool, eviction, prefetch, DMA
scheduling. Time is passed in (a :class:`~firmware_model.clock.Clock` or ``now``);
no I/O, no threads, no wall clock. Imports numpy and simpy, nothing else of cxlemu's.

    clock        Clock protocol, SimpyClock (a simpy environment's time), ManualClock
    hotness      HotnessUnit: CHMU epochs / always-on, threshold, downsampling, hotlist ring
    block_pool   BlockPool: intrusive free list, ref counts, leases, chained block hashes
    policies     EvictionPolicy protocol (optional on_miss hook: ARC adapts there, before the
                 eviction, as the paper's Fig. 4); lru, lfu (plain), lfu-decay, arc, s3fifo,
                 hotness, reuse, opt (Belady); resolve_policy: a user's "pkg.mod:Class" too
    testing      the conformance kit: check_policy(spec) runs every policy's invariants
    link         LinkParams, Link: the one link model (integers; the timed data path's arithmetic)
    dma          DmaScheduler (simpy) over the link model; TransferCost (a link from ns, GB/s)
    prefetch     PrefetchQueue: hints, progress triggers, window sizing, accounting
    replay       trace replay (demand fill) and OPT bound; prefetch_replay with the prefetcher;
                 _fast: the C replay loops (lru, lfu, arc, s3fifo, opt) checked against the
                 Python policies, used by replay(impl="auto"); its trace preparation
                 (dense_ids, next_use_array) is public: a peer simulator's input is made with it
"""
from firmware_model._fast import dense_ids, next_use_array
from firmware_model.block_pool import (
    BlockPool,
    KVBlock,
    NoFreeBlocksError,
    hash_block_tokens,
)
from firmware_model.clock import Clock, ManualClock, SimpyClock
from firmware_model.dma import DmaScheduler, QueueFullError, TransferCost
from firmware_model.hotness import HotnessConfig, HotnessUnit
from firmware_model.link import Link, LinkParams
from firmware_model.policies import POLICY_NAMES, EvictionPolicy, make_policy
from firmware_model.prefetch import PrefetchQueue, PrefetchStats, window_points
from firmware_model.replay import Access, ReplayResult, replay

__all__ = [
    "POLICY_NAMES",
    "Access",
    "BlockPool",
    "Clock",
    "DmaScheduler",
    "EvictionPolicy",
    "HotnessConfig",
    "HotnessUnit",
    "KVBlock",
    "Link",
    "LinkParams",
    "ManualClock",
    "NoFreeBlocksError",
    "PrefetchQueue",
    "PrefetchStats",
    "QueueFullError",
    "ReplayResult",
    "SimpyClock",
    "TransferCost",
    "dense_ids",
    "hash_block_tokens",
    "make_policy",
    "next_use_array",
    "replay",
    "window_points",
]
