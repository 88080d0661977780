"""Chunk bookkeeping of the residency engine: block tables, prefix sharing, transfer plans.

Each layer keeps, per sequence and piece (K or V of one kv head), a table of device chunk ids
by block. Saving a dirty block asks: is there already a chunk with exactly these bytes after
exactly this prefix? The key chains the parent block's key, the layer, the piece, the valid
length and the bytes (so a match implies the whole prefix matched, and is exact by
construction: two keys collide only if blake2b does). A hit takes a reference and writes
nothing; a chunk that others reference, or that is published under a key, is never rewritten:
the writer takes a fresh chunk (copy on write). A key is published in the pool only when its
write has landed; until then it is findable only within this engine, whose loads wait for its
own writes.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from driver.kv._chunks import ChunkPool
from driver.kv._layout import KVLayout
from driver.kv._store import Extent, coalesce

__all__ = ["ChunkTables", "LayerChunks"]


@dataclass
class LayerChunks:
    """Block tables of one layer: ``ids[row, piece, block]`` (-1: none) and their keys."""

    batch: int
    pieces: int
    ids: np.ndarray = field(init=False)
    keys: dict[tuple[int, int, int], bytes] = field(default_factory=dict)
    version: int = 0  # bumped by every change of ids: keys the cached load plan
    plan: tuple[tuple[int, int, int], list[tuple[int, int, int, int]]] | None = None
    extents: tuple[list[tuple[int, int, int, int]], list[Extent]] | None = None  # of ``plan``
    saved: tuple[tuple[int, int, int], list[Extent]] | None = None  # last private save plan
    repeats: tuple[tuple[int, int], bool] | None = None

    def __post_init__(self) -> None:
        self.ids = np.full((self.batch, self.pieces, 0), -1, np.int64)

    def ensure(self, nblk: int) -> None:
        have = self.ids.shape[2]
        if have < nblk:
            grown = np.full((self.batch, self.pieces, max(nblk, 2 * have)), -1, np.int64)
            grown[:, :, :have] = self.ids
            self.ids = grown
            self.version += 1


class ChunkTables:
    """The residency engine's chunk bookkeeping (a part it owns): placing saved blocks in device
    chunks (sharing them by key), publishing keys once written, and planning loads. It counts
    into the engine's ``counters``; the layout and the pool are known at the first update
    (:meth:`configure`)."""

    def __init__(self, *, prefix_sharing: bool, counters: dict[str, int]) -> None:
        self.prefix_sharing = prefix_sharing
        self.counters = counters
        self.layout: KVLayout | None = None
        self.pool: ChunkPool | None = None
        self._pending_key_of: dict[int, bytes] = {}
        self._pending_chunk_of: dict[bytes, int] = {}

    def configure(self, layout: KVLayout, pool: ChunkPool | None) -> None:
        self.layout, self.pool = layout, pool
        # (1, pieces, 1): whether each piece of a block table is a value piece (the pool's map)
        self._is_value = (np.arange(layout.pieces) >= layout.kv_heads)[None, :, None]

    def valid(self, j: int, seq_len: int) -> int:
        """Valid bytes of block ``j`` of a piece holding ``seq_len`` tokens."""
        lay = self.layout
        assert lay is not None
        return min(lay.block_tokens, seq_len - j * lay.block_tokens) * lay.piece_token_bytes

    def save_plan(self, layer: int, chunks: LayerChunks, host: np.ndarray, j0: int, j1: int,
                   seq_len: int) -> tuple[list[Extent], list[tuple[int, bytes]]]:
        """Place blocks ``[j0, j1)`` of every piece from a host image of whole blocks (tokens
        ``[j0 * bt, j1 * bt)``, valid up to ``seq_len``); returns the extents to write and the
        keys they publish."""
        lay = self.layout
        assert lay is not None
        if not self.prefix_sharing:
            return self._private_save_plan(chunks, j0, j1), []
        t0, cap = j0 * lay.block_tokens, (j1 - j0) * lay.block_tokens
        runs: list[tuple[int, int, int]] = []
        for b in range(lay.batch):
            for p in range(lay.pieces):
                for j in range(j0, j1):
                    n = self.valid(j, seq_len)
                    off = lay.image_offset(p, b, j * lay.block_tokens - t0, cap)
                    if self._place(layer, chunks, b, p, j, host[off:off + n]):
                        runs.append((int(chunks.ids[b, p, j]), n, off))
        keys = [(c, self._pending_key_of[c]) for c, _, _ in runs if c in self._pending_key_of]
        return coalesce(runs, lay.chunk_bytes), keys

    def _private_save_plan(self, chunks: LayerChunks, j0: int, j1: int) -> list[Extent]:
        """:meth:`save_plan` without prefix sharing, on the table as a whole: this engine then
        never shares or publishes a chunk, so every chunk it holds has one reference and no
        key (nothing to copy on write) and a block is written where it is. Chunks for blocks
        that have none are taken in one call, in the order :meth:`_place` would take them
        (row, piece, block), so a piece's blocks stay consecutive on the media.

        Blocks move whole, as a block-granular cache moves them (the bytes past the last valid
        token are never read as KV): the image's runs are whole blocks long, so the chunks of
        the dirty tail of every piece, taken together, are one extent, and one descriptor."""
        if chunks.saved is not None and chunks.saved[0] == (chunks.version, j0, j1):
            return chunks.saved[1]  # the same blocks again (a decode step's tail): same chunks
        lay = self.layout
        assert lay is not None
        extents = self.whole_blocks(chunks, j0, j1, j0 * lay.block_tokens, (j1 - j0) * lay.block_tokens)
        chunks.saved = ((chunks.version, j0, j1), extents)
        return extents

    def whole_blocks(self, chunks: LayerChunks, j0: int, j1: int, t0: int, cap: int) -> list[Extent]:
        """Extents writing blocks ``[j0, j1)`` of every piece whole, from an image whose runs hold
        ``cap`` tokens from token ``t0`` (a staging image, or the frame itself); takes chunks for
        the blocks without one (private chunks: see :meth:`_private_save_plan`)."""
        lay, pool = self.layout, self.pool
        assert lay is not None and pool is not None
        ids = chunks.ids[:, :, j0:j1]
        missing = ids < 0
        if missing.any():
            ids[missing] = pool.alloc(int(missing.sum()))
            pool.values[ids[missing]] = np.broadcast_to(self._is_value, ids.shape)[missing]
            chunks.version += 1
        cb = lay.chunk_bytes
        runs: list[tuple[int, int, int]] = []
        for b, rows in enumerate(ids.tolist()):
            for p, row in enumerate(rows):
                base = lay.image_offset(p, b, j0 * lay.block_tokens - t0, cap)
                runs += [(c, cb, base + i * cb) for i, c in enumerate(row)]
        return coalesce(runs, cb)

    def _place(self, layer: int, chunks: LayerChunks, b: int, p: int, j: int, data: np.ndarray) -> bool:
        """Point (row b, piece p, block j) at a device chunk; True when it must be written."""
        pool = self.pool
        assert pool is not None
        cur = int(chunks.ids[b, p, j])
        key = b""
        if self.prefix_sharing:
            parent = chunks.keys.get((b, p, j - 1), b"root") if j else b"root"
            h = hashlib.blake2b(parent, digest_size=16)
            h.update(np.array([layer, p, data.size], np.int64).tobytes())
            h.update(data.data)
            key = h.digest()
            chunks.keys[(b, p, j)] = key
            hit = pool.lookup(key)
            if hit is None:
                hit = self._pending_chunk_of.get(key)
            if hit is not None:
                if hit != cur:
                    pool.incref(hit)
                    if cur >= 0:
                        self.decref(cur)
                    chunks.ids[b, p, j] = hit
                    chunks.version += 1
                    self.counters["shared_chunks"] += 1
                self.counters["dedup_write_bytes"] += data.size
                return False
        if cur >= 0 and (pool.refs(cur) > 1 or pool.hashed(cur)):
            self.counters["cow_copies"] += pool.refs(cur) > 1
            self.decref(cur)
            cur = -1
        if cur < 0:
            cur = pool.alloc(1)[0]
            pool.values[cur] = p >= chunks.pieces // 2
            chunks.ids[b, p, j] = cur
            chunks.version += 1
        if self.prefix_sharing:
            self._forget_pending(cur)
            self._pending_key_of[cur] = key
            self._pending_chunk_of.setdefault(key, cur)
        return True

    def publish(self, keys: list[tuple[int, bytes]]) -> None:
        """A write landed: its chunks become findable by every cache on the device."""
        pool = self.pool
        assert pool is not None
        for chunk, key in keys:
            if self._pending_key_of.get(chunk) != key:
                continue  # rewritten or freed since: that later write publishes it
            self._forget_pending(chunk)
            if pool.refs(chunk) and not pool.hashed(chunk):
                pool.register(chunk, key)

    def decref(self, chunk: int) -> None:
        assert self.pool is not None
        self.pool.decref(chunk)
        if not self.pool.refs(chunk):
            self._forget_pending(chunk)

    def _forget_pending(self, chunk: int) -> None:
        key = self._pending_key_of.pop(chunk, None)
        if key is not None and self._pending_chunk_of.get(key) == chunk:
            del self._pending_chunk_of[key]

    def load_plan(self, chunks: LayerChunks, cap: int, seq_len: int
                   ) -> tuple[list[Extent], dict[int, tuple[int, int]] | None, list[tuple[int, int, int]]]:
        """Extents reading each distinct chunk once into a host image of ``cap`` tokens, and the
        (from, to, bytes) copies serving the sequences that share a chunk. Without sharing the
        runs come from numpy over the block table (this is on every load's path); the per-chunk
        map (``firsts``) is then left to :meth:`chunk_map`, which only fault recovery needs."""
        lay = self.layout
        assert lay is not None
        nblk = lay.blocks(seq_len)
        if self.prefix_sharing and self._has_repeats(chunks, nblk):
            firsts, dups = self.chunk_map(chunks, cap, seq_len)
            runs = [(c, n, off) for c, (off, n) in firsts.items()]
            return coalesce(runs, lay.chunk_bytes), firsts, dups
        return self._extents(chunks, nblk, cap), None, []

    def _extents(self, chunks: LayerChunks, nblk: int, cap: int) -> list[Extent]:
        """The extents of :meth:`_runs`, the last block read whole up to the image's capacity
        (block-granular, like the writes: so the list only changes when a block is added, and
        the store can reuse its descriptors step after step); cached with the runs."""
        runs = self._runs(chunks, nblk, cap)
        if chunks.extents is None or chunks.extents[0] is not runs:
            lay = self.layout
            assert lay is not None
            bt, cb = lay.block_tokens, lay.chunk_bytes
            tail = (min(nblk * bt, cap) - (nblk - 1) * bt) * lay.piece_token_bytes
            chunks.extents = (runs, [Extent(c, n * cb if j + n < nblk else (n - 1) * cb + tail, off)
                                     for c, j, n, off in runs])
        return chunks.extents[1]

    @staticmethod
    def _has_repeats(chunks: LayerChunks, nblk: int) -> bool:
        """Whether a chunk appears twice in the table (sequences sharing a prefix)."""
        key = (chunks.version, nblk)
        if chunks.repeats is None or chunks.repeats[0] != key:
            ids = chunks.ids[:, :, :nblk]
            chunks.repeats = (key, bool(np.unique(ids).size != ids.size))
        return chunks.repeats[1]

    def _runs(self, chunks: LayerChunks, nblk: int, cap: int) -> list[tuple[int, int, int, int]]:
        """(first chunk, first block, blocks, host offset) of each run of consecutive chunk ids
        per piece; cached on the table's version (a decode step rarely changes the table)."""
        key = (chunks.version, nblk, cap)
        if chunks.plan is not None and chunks.plan[0] == key:
            return chunks.plan[1]
        lay = self.layout
        assert lay is not None
        ids = chunks.ids[:, :, :nblk]
        runs: list[tuple[int, int, int, int]] = []
        step = lay.block_tokens * lay.piece_token_bytes
        for b in range(lay.batch):
            for p in range(lay.pieces):
                row = ids[b, p]
                base = lay.image_offset(p, b, 0, cap)
                cuts = [0, *(np.flatnonzero(np.diff(row) != 1) + 1).tolist(), nblk]
                runs += [(int(row[s]), s, e - s, base + s * step) for s, e in zip(cuts[:-1], cuts[1:], strict=True)]
        chunks.plan = (key, runs)
        return runs

    def chunk_map(self, chunks: LayerChunks, cap: int, seq_len: int
                   ) -> tuple[dict[int, tuple[int, int]], list[tuple[int, int, int]]]:
        """Each distinct chunk's first (host offset, bytes), and the copies for its repeats."""
        lay = self.layout
        assert lay is not None
        firsts: dict[int, tuple[int, int]] = {}
        dups: list[tuple[int, int, int]] = []
        for b in range(lay.batch):
            for p in range(lay.pieces):
                for j in range(lay.blocks(seq_len)):
                    c, n = int(chunks.ids[b, p, j]), self.valid(j, seq_len)
                    off = lay.image_offset(p, b, j * lay.block_tokens, cap)
                    if c in firsts:
                        dups.append((firsts[c][0], off, n))
                    else:
                        firsts[c] = (off, n)
        return firsts, dups
