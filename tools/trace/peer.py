"""The same trace through libCacheSim (``pip install -e '.[peer]'``), the independent peer.

libCacheSim's Python binding runs its C simulator over a trace file; the trace is written in its
``oracleGeneral`` binary format (per access: u32 timestamp, u64 object id, u32 size, i64 the
access index of the object's next request, -1 for none; 24 bytes packed), every object of size 1,
so a cache of ``capacity`` bytes holds ``capacity`` blocks. The next-request column is what its
Belady reads.

cxlemu's policy names map onto libCacheSim's: ``lru`` LRU, ``lfu`` LFU, ``arc`` ARC, ``s3fifo``
S3FIFO, ``opt`` Belady. Known difference: libCacheSim's S3FIFO refuses every object while its
small queue (10 % of the capacity) holds fewer than 2 blocks, so it caches nothing below 20 blocks.
"""
from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from firmware_model import dense_ids, next_use_array

__all__ = ["PEER_NAMES", "PeerRun", "available", "peer_hits", "peer_replay", "write_oracle_general"]

PEER_NAMES = {"lru": "LRU", "lfu": "LFU", "arc": "ARC", "s3fifo": "S3FIFO", "opt": "Belady"}
ORACLE_GENERAL = np.dtype([("t", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])
HASHPOWER = 16  # 2**16 hash buckets: what the figures used; the default (24) costs 128 MiB


def available() -> bool:
    """Whether libCacheSim's Python binding imports."""
    try:
        import libcachesim  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        return False
    return True


def write_oracle_general(keys: Sequence[Hashable] | np.ndarray, path: str) -> int:
    """Write ``keys`` as an oracleGeneral trace; returns the number of distinct keys."""
    ids, _ = dense_ids(keys)
    n = len(ids)
    nxt = next_use_array(ids)
    rec = np.zeros(n, dtype=ORACLE_GENERAL)
    rec["t"] = np.arange(n, dtype=np.uint32)
    rec["id"] = ids.astype(np.uint64) + 1
    rec["size"] = 1
    rec["next"] = np.where(nxt < n, nxt, -1)
    rec.tofile(path)
    return int(np.count_nonzero(np.bincount(ids))) if n else 0


@dataclass(frozen=True)
class PeerRun:
    policy: str
    capacity: int
    hits: int
    seconds: float  # libCacheSim's process_trace: its C loop, reading the trace file


def peer_replay(path: str, accesses: int, policy: str, capacity: int) -> PeerRun:
    """Run libCacheSim's ``policy`` over the oracleGeneral trace at ``path`` (``accesses`` long)."""
    import libcachesim as lcs  # type: ignore[import-untyped]

    reader = lcs.TraceReader(path, lcs.TraceType.ORACLE_GENERAL_TRACE)
    cache = getattr(lcs, PEER_NAMES[policy])(capacity, hashpower=HASHPOWER)
    start = time.perf_counter()
    miss_ratio, _ = cache.process_trace(reader)
    seconds = time.perf_counter() - start
    return PeerRun(policy, capacity, round((1.0 - miss_ratio) * accesses), seconds)


def peer_hits(keys: Sequence[Hashable] | np.ndarray, policies: Sequence[str], capacity: int) -> dict[str, int]:
    """libCacheSim's hits for each of ``policies`` on ``keys`` at ``capacity`` (a temporary file)."""
    fd, path = tempfile.mkstemp(suffix=".oracleGeneral")
    os.close(fd)
    try:
        write_oracle_general(keys, path)
        return {p: peer_replay(path, len(keys), p, capacity).hits for p in policies}
    finally:
        os.unlink(path)
