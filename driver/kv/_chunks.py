"""Device chunk ownership: reference counts and the chained-hash index for prefix sharing.

A chunk id names ``chunk_bytes`` of device media. Several sequences (of one batch, or of later
generations on the same device) may point at one chunk when their KV there is identical; the
chunk is freed when the last reference goes. Free ids are handed out lowest first, so the chunks
of one layer of one sequence, allocated together, are consecutive and move as one extent.
"""
from __future__ import annotations

import heapq

from emulator.spec.errors import CxlemuError

__all__ = ["ChunkPool", "DeviceFull"]


class DeviceFull(CxlemuError):
    """Every chunk of the device is referenced: the KV of this run does not fit its capacity."""


class ChunkPool:
    """Reference-counted chunk ids with a hash -> chunk index."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a chunk pool needs at least one chunk, got {capacity}")
        self.capacity = capacity
        self._free = list(range(capacity))  # already a heap
        self._refs: dict[int, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}

    def alloc(self, n: int) -> list[int]:
        """``n`` fresh chunks with one reference each (lowest ids first)."""
        if n > len(self._free):
            raise DeviceFull(f"device KV space exhausted: need {n} more chunks, {len(self._free)} of "
                             f"{self.capacity} free; use a larger device or fewer tokens")
        out = [heapq.heappop(self._free) for _ in range(n)]
        for c in out:
            self._refs[c] = 1
        return out

    def incref(self, chunk: int) -> None:
        self._refs[chunk] += 1

    def decref(self, chunk: int) -> None:
        """Drop one reference; the last one frees the chunk and forgets its hash."""
        left = self._refs[chunk] - 1
        if left:
            self._refs[chunk] = left
            return
        del self._refs[chunk]
        self.unregister(chunk)
        heapq.heappush(self._free, chunk)

    def refs(self, chunk: int) -> int:
        return self._refs.get(chunk, 0)

    def lookup(self, key: bytes) -> int | None:
        return self._by_hash.get(key)

    def register(self, chunk: int, key: bytes) -> None:
        """Publish ``chunk`` under ``key``; a chunk is registered under one key at most."""
        assert chunk not in self._hash_of, f"chunk {chunk} already has a hash"
        self._hash_of[chunk] = key
        self._by_hash.setdefault(key, chunk)

    def unregister(self, chunk: int) -> None:
        key = self._hash_of.pop(chunk, None)
        if key is not None and self._by_hash.get(key) == chunk:
            del self._by_hash[key]

    def hashed(self, chunk: int) -> bool:
        return chunk in self._hash_of

    @property
    def used(self) -> int:
        return len(self._refs)

    @property
    def shared(self) -> int:
        """Chunks referenced more than once (the prefix-sharing saving, in chunks)."""
        return sum(1 for r in self._refs.values() if r > 1)
