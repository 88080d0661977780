"""Device chunk ownership on the firmware model's block pool: references and prefix sharing.

A chunk id names ``chunk_bytes`` of device media and is a block of
``firmware_model.block_pool.BlockPool`` (vLLM's design: ref counts, an intrusive free queue,
a chained-hash prefix cache whose freed blocks stay findable until reused). Several sequences,
of one batch or of later generations on the same device, point at one chunk when their KV there
is identical; a chunk with a hash is never rewritten (the writer takes a fresh chunk: copy on
write), so a hash always describes the bytes under it. A fresh pool hands out ids in order, so
the chunks of one layer of one sequence, allocated together, are consecutive on the media and
move as one DMA extent.
"""
from __future__ import annotations

import numpy as np

from emulator.spec.errors import CxlemuError
from firmware_model.block_pool import BlockHash, BlockPool, NoFreeBlocksError

__all__ = ["ChunkPool", "DeviceFull"]


class DeviceFull(CxlemuError):
    """Every chunk of the device is referenced: the KV of this run does not fit its capacity."""


class ChunkPool:
    """Chunk ids over a ``BlockPool``."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise DeviceFull("the device holds no KV chunk: chunk larger than its capacity")
        self.pool = BlockPool(capacity)
        self.capacity = capacity
        #: chunk i holds a value piece (else a key piece): set by the chunk tables when they place
        #: a block, read by a compressing store (int4 quantizes keys and values differently)
        self.values = np.zeros(capacity, bool)

    def alloc(self, n: int) -> list[int]:
        """``n`` fresh chunks with one reference each."""
        try:
            return [b.block_id for b in self.pool.get_new_blocks(n)]
        except NoFreeBlocksError as exc:
            raise DeviceFull(f"device KV space exhausted ({exc}); use a larger device or fewer "
                             "tokens") from None

    def incref(self, chunk: int) -> None:
        self.pool.touch([self.pool.blocks[chunk]])

    def decref(self, chunk: int) -> None:
        """Drop one reference; at zero the chunk is free but stays findable by its hash."""
        self.pool.free_blocks([self.pool.blocks[chunk]])

    def refs(self, chunk: int) -> int:
        return self.pool.blocks[chunk].ref_cnt

    def lookup(self, key: bytes) -> int | None:
        block = self.pool.get_cached_block(BlockHash(key))
        return None if block is None else block.block_id

    def register(self, chunk: int, key: bytes) -> int:
        """Publish ``chunk`` under ``key``; returns the chunk that holds the key afterwards."""
        return self.pool.cache_full_block(self.pool.blocks[chunk], BlockHash(key)).block_id

    def hashed(self, chunk: int) -> bool:
        return self.pool.blocks[chunk].block_hash is not None

    @property
    def used(self) -> int:
        """Chunks with at least one reference."""
        return self.pool.get_num_used_blocks()

    @property
    def shared(self) -> int:
        """Chunks referenced more than once (the prefix-sharing saving, in chunks)."""
        return sum(1 for b in self.pool.blocks if b.ref_cnt > 1)
