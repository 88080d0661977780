"""The controller's firmware logic, pure: hotness (CHMU), block pool, eviction, prefetch, DMA
scheduling, telemetry. Time is passed in (a :class:`~firmware_model.clock.Clock` or ``now``);
no I/O, no threads, no wall clock. Imports numpy and simpy, nothing else of cxlemu's.

    clock        Clock protocol, SimClock (simpy), ManualClock
    hotness      HotnessUnit: CHMU epochs / always-on, threshold, downsampling, hotlist ring
    block_pool   BlockPool: intrusive free list, ref counts, leases, chained block hashes
    kv_manager   KVCacheManager: prefix sharing, fork, copy-on-write over a BlockPool
    policies     EvictionPolicy protocol; lru, lfu, arc, s3fifo, hotness, reuse, opt (Belady)
    dma          TransferCost (the timed data path's cost function), DmaScheduler (simpy)
    prefetch     PrefetchQueue: hints, progress triggers, window sizing, accounting
    telemetry    Counters, TelemetrySnapshot
    replay       trace replay (demand fill) and OPT bound; prefetch_replay with the prefetcher
"""
from firmware_model.block_pool import (
    BlockPool,
    KVBlock,
    NoFreeBlocksError,
    hash_block_tokens,
)
from firmware_model.clock import Clock, ManualClock, SimClock
from firmware_model.dma import DmaScheduler, QueueFullError, TransferCost
from firmware_model.hotness import HotnessConfig, HotnessUnit
from firmware_model.kv_manager import KVCacheManager
from firmware_model.policies import POLICY_NAMES, EvictionPolicy, make_policy
from firmware_model.prefetch import PrefetchQueue, PrefetchStats, window_points
from firmware_model.replay import Access, ReplayResult, replay
from firmware_model.telemetry import Counters, TelemetrySnapshot

__all__ = [
    "POLICY_NAMES",
    "Access",
    "BlockPool",
    "Clock",
    "Counters",
    "DmaScheduler",
    "EvictionPolicy",
    "HotnessConfig",
    "HotnessUnit",
    "KVBlock",
    "KVCacheManager",
    "ManualClock",
    "NoFreeBlocksError",
    "PrefetchQueue",
    "PrefetchStats",
    "QueueFullError",
    "ReplayResult",
    "SimClock",
    "TelemetrySnapshot",
    "TransferCost",
    "hash_block_tokens",
    "make_policy",
    "replay",
    "window_points",
]
