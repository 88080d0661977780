"""One layer's KV as hot-page attention keeps it: pages on the device, a little on the accelerator.

A *page* is ``block_tokens`` tokens of every KV head of every sequence; on the device it is one
chunk per piece (K or V of one head of one sequence), the residency engine's chunks. What stays
on the accelerator, per layer::

    tokens  0 .. S          S .. tail_start                 tail_start .. seq_len
            [ sink pages ]  [ candidates: on the device ]   [ recent window + partial page ]
            resident        metadata resident               resident
            (also written)  (kmin / kmax per page)          (complete pages also written)

Every page is written to the device when it completes (so the device holds the whole KV); its
per-channel key min / max go into the metadata then. The window slides a page at a time: the
``window_pages`` most recent complete pages and the partial one stay; the pages it leaves are read
back only when chosen. The first ``sink_pages`` (attention sinks: StreamingLLM, Quest keep them)
stay too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from driver.kv._chunkio import ChunkTables, LayerChunks
from driver.kv._layout import KVLayout
from driver.kv._store import BlockStore, Extent, Transfer

__all__ = ["LayerPages", "extents", "page_image", "runs"]


def page_image(kv: torch.Tensor, block_tokens: int) -> np.ndarray:
    """Whole pages ``(2, B, H, n * bt, D)`` as the bytes of a page-major ``(B, n, H, 2, bt, D)``
    image, the order their chunks are taken in (a host copy)."""
    two, b, h, t, d = kv.shape
    pages = kv.detach().reshape(two, b, h, t // block_tokens, block_tokens, d).permute(1, 3, 2, 0, 4, 5)
    return pages.to("cpu").contiguous().view(-1).view(torch.uint8).numpy()


def runs(chunks: np.ndarray, chunk_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first chunk, host offset, bytes) of the extents moving ``chunks`` (any shape, in C order)
    to or from consecutive chunk-sized slots of an image: one per run of consecutive chunk ids
    (``coalesce``'s merge, in numpy: this is on every decode step's path)."""
    flat = chunks.ravel().astype(np.int64)
    if not flat.size:
        return flat, flat, flat
    starts = np.flatnonzero(np.diff(flat, prepend=flat[:1] - 2) != 1)
    ends = np.append(starts[1:], flat.size)
    return flat[starts], starts * chunk_bytes, (ends - starts) * chunk_bytes


def extents(arrays: tuple[np.ndarray, np.ndarray, np.ndarray]) -> list[Extent]:
    """(first chunk, host offset, bytes) arrays (:func:`runs`) as a list of ``Extent``."""
    return [Extent(c, n, off) for c, off, n in zip(*(a.tolist() for a in arrays), strict=True)]


@dataclass
class LayerPages:
    """The page state of one layer (see the module docstring); ``update`` appends tokens."""

    lay: KVLayout
    sink_pages: int
    window_pages: int
    chunks: LayerChunks = field(init=False)
    seq_len: int = 0
    written: int = 0  # complete pages whose write was issued
    tail_start: int = 0  # first token of the window (page aligned)
    tail: torch.Tensor | None = None  # (2, B, H, cap, D): tokens [tail_start, seq_len)
    sink: torch.Tensor | None = None  # (2, B, H, S, D): tokens [0, min(S, tail_start))
    kmin: torch.Tensor | None = None  # (B, H, pages cap, D)
    kmax: torch.Tensor | None = None
    writes: list[tuple[Transfer, np.ndarray]] = field(default_factory=list)
    last_choice: np.ndarray | None = None  # the pages chosen at the last decode step (B, H, K)
    predicted: np.ndarray | None = None  # the pages chosen for this step's guessed query
    prefetch: Any = None  # the engine's prefetched read of predicted pages, if any
    heat: Any = None  # the CHMU's counts of the complete pages (a tensor), as of heat_key
    heat_key: tuple[int, int] = (-1, -1)  # (step, complete pages) they were taken at

    def __post_init__(self) -> None:
        self.chunks = LayerChunks(self.lay.batch, self.lay.pieces)

    # ------------------------------------------------------------------------- geometry
    @property
    def complete(self) -> int:
        return self.seq_len // self.lay.block_tokens

    @property
    def sink_end(self) -> int:
        return min(self.sink_pages * self.lay.block_tokens, self.tail_start)

    def candidates(self) -> range:
        """Pages neither in the sink nor in the window: on the device only."""
        return range(self.sink_end // self.lay.block_tokens, self.tail_start // self.lay.block_tokens)

    def resident_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tail, self.sink, self.kmin, self.kmax)
                   if t is not None)

    # ------------------------------------------------------------------------- append
    def update(self, k: torch.Tensor, v: torch.Tensor, store: BlockStore, tables: ChunkTables,
               counters: dict[str, int], layer: int) -> None:
        """Append ``k``, ``v`` ``(B, H, n, D)``: slide the window, keep the sink, write the
        pages that completed and record their metadata."""
        bt = self.lay.block_tokens
        old, new = self.seq_len, self.seq_len + k.shape[2]
        start = self.tail_start  # recent holds tokens [start, new)
        if self.tail is not None and new - start <= self.tail.shape[3]:
            # a decode step: in place, no copy of the window
            self.tail[0, :, :, old - start:new - start] = k
            self.tail[1, :, :, old - start:new - start] = v
            recent = self.tail[:, :, :, :new - start]
        else:
            recent = torch.stack((k, v))
            if self.tail is not None and old > start:
                recent = torch.cat((self.tail[:, :, :, :old - start], recent), dim=3)
        self.seq_len = new
        self._complete_pages(recent, start, store, tables, counters, layer)
        self.tail_start = max(start, (new // bt - self.window_pages) * bt)
        if self.sink_pages and start < self.sink_pages * bt and self.tail_start > start:
            self._keep_sink(recent, start)
        self._set_tail(recent[:, :, :, self.tail_start - start:])

    def _set_tail(self, rest: torch.Tensor) -> None:
        n = rest.shape[3]
        cap = (self.window_pages + 2) * self.lay.block_tokens
        if self.tail is None or self.tail.shape[3] < max(n, cap):
            shape = (*rest.shape[:3], max(n, cap), rest.shape[4])
            self.tail = torch.empty(shape, dtype=rest.dtype, device=rest.device)
        if n and rest.data_ptr() != self.tail.data_ptr():
            if rest.untyped_storage().data_ptr() == self.tail.untyped_storage().data_ptr():
                rest = rest.clone()  # the window slid by a page within the buffer: overlapping
            self.tail[:, :, :, :n] = rest

    def _keep_sink(self, recent: torch.Tensor, start: int) -> None:
        size = self.sink_pages * self.lay.block_tokens
        if self.sink is None:
            shape = (*recent.shape[:3], size, recent.shape[4])
            self.sink = torch.empty(shape, dtype=recent.dtype, device=recent.device)
        end = min(size, self.tail_start)
        self.sink[:, :, :, start:end] = recent[:, :, :, :end - start]

    def _complete_pages(self, recent: torch.Tensor, start: int, store: BlockStore, tables: ChunkTables,
                        counters: dict[str, int], layer: int) -> None:
        """Write pages [written, complete) (their tokens are in ``recent`` from ``start``) and
        record their key min / max. Their chunks are taken page-major, (sequence, page, head,
        K | V): a head's K and V of a page are adjacent on the media, so reading the page back is
        one descriptor (the residency engine's piece-major order suits whole-layer reads)."""
        bt, j0, j1, lay = self.lay.block_tokens, self.written, self.complete, self.lay
        if j1 <= j0:
            return
        pages = recent[:, :, :, j0 * bt - start:j1 * bt - start]  # (2, B, H, n, D)
        self.chunks.ensure(j1)
        assert tables.pool is not None
        fresh = np.array(tables.pool.alloc(lay.batch * (j1 - j0) * lay.pieces), np.int64)
        fresh = fresh.reshape(lay.batch, j1 - j0, lay.kv_heads, 2)
        tables.pool.values[fresh] = np.arange(2) == 1  # K | V: a compressing store codes them apart
        self.chunks.ids[:, :, j0:j1] = fresh.transpose(0, 3, 2, 1).reshape(lay.batch, lay.pieces, j1 - j0)
        self.chunks.version += 1
        image = page_image(pages, bt)
        self.writes.append((store.write(extents(runs(fresh, lay.chunk_bytes)), image), image))
        counters["bytes_offloaded"] += fresh.size * lay.chunk_bytes
        keys = pages[0].reshape(*pages.shape[1:3], j1 - j0, bt, pages.shape[4])
        self._ensure_meta(j1, keys)
        assert self.kmin is not None and self.kmax is not None
        self.kmin[:, :, j0:j1] = keys.amin(3)
        self.kmax[:, :, j0:j1] = keys.amax(3)
        self.written = j1

    def _ensure_meta(self, pages: int, like: torch.Tensor) -> None:
        have = 0 if self.kmin is None else self.kmin.shape[2]
        if have >= pages:
            return
        shape = (like.shape[0], like.shape[1], max(pages, 2 * have), like.shape[-1])
        grown = [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(2)]
        if self.kmin is not None and self.kmax is not None:
            grown[0][:, :, :have], grown[1][:, :, :have] = self.kmin, self.kmax
        self.kmin, self.kmax = grown

    def wait_writes(self) -> None:
        """The writes issued so far have landed (a read of their pages must see them)."""
        for transfer, _ in self.writes:
            transfer.wait()
        self.writes.clear()

    def reap_writes(self) -> None:
        """Drop the writes that completed (non-blocking)."""
        if self.writes and all(t.done() for t, _ in self.writes):
            self.wait_writes()

    # ------------------------------------------------------------------------- read back
    def release(self, tables: ChunkTables) -> None:
        """Drop every device chunk reference (the engine closes)."""
        self.wait_writes()
        ids = self.chunks.ids
        for c in ids[ids >= 0].tolist():
            tables.decref(int(c))
        ids[:] = -1
        self.chunks.version += 1
